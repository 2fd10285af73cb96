"""TensorRT engines and their backend (trt/graph.py, trt/engine.py, runtime/backends/trt.py),
everything short of TensorRT itself:

- the in-place engine graph (TRT_KVCacheUpdate + TRT_Attention, or + the tree-attention plugin) passes the
  PyTorch parity gate on CPU with the custom ops computed by numpy references, and fails it with a
  planted write at the wrong rows or an unmasked cache tail;
- the optimisation profiles come from the tensor table with the fixed-capacity caches;
- without TensorRT, build_engine / engine_stage / open_trt_backend fail in one line naming it, and the
  modules import neither tensorrt nor torch;
- with a FAKE `tensorrt` (sys.modules, STYLE.md: the only way to exercise these paths here) whose engine
  is the engine graph run in ONNX Runtime: the build calls the API in the documented order, the backend
  binds one device address per cache as input and output, chooses the profile by T, pads to
  min_tokens, moves tree rows like OrtBackend, and engine_stage's self-check passes, or fails on a
  planted backend bug.
"""
from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest

from specexport import _tensorrt
from specexport.errors import ParityError, SpecexportError
from specexport.trt import graph as trt_graph
from specexport.export.validate import ancestor_mask, compare, onnx_logits, parity_case, reference_logits
from specexport.io_spec import ModelIO
from specexport.manifest import read_manifest
from close import assert_close

pytest.importorskip("onnxruntime_extensions")
MAX_SEQ_LEN, VERIFY = 128, 16


@pytest.fixture(scope="module")
def fp32(built_llama, tiny_checkpoints, tmp_path_factory):
    """(folder with a copy of the target's fp32 graph, its io, a parity case, PyTorch's logits for it)."""
    from specexport.export.to_onnx import load_hf_model

    entry = read_manifest(built_llama)["models"]["target"]
    folder = tmp_path_factory.mktemp("trt") / "fp32"
    shutil.copytree(built_llama / entry["precisions"]["fp32"]["dir"], folder)
    io = ModelIO.from_dict(entry["io"])
    case = parity_case(io, max_seq_len=MAX_SEQ_LEN, max_verify_tokens=VERIFY)
    return folder, io, case, reference_logits(load_hf_model(tiny_checkpoints["llama"]), case)


def _engine_graph(fp32, attention: str, name: str | None = None) -> Path:
    folder, io, _, _ = fp32
    return trt_graph.write_engine_graph(folder / "model.onnx", folder / (name or f"engine-{attention}.onnx"),
                                        head_dim=io.head_dim, kv_capacity=MAX_SEQ_LEN, attention=attention)


# -- the engine graph on CPU -----------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["native", "plugin"])
def test_engine_graph_passes_the_parity_gate_against_pytorch(fp32, attention):
    folder, io, case, reference = fp32
    path = _engine_graph(fp32, attention)
    assert path.stat().st_size < (folder / "model.onnx").stat().st_size + 8192      # weights shared, not copied
    got = trt_graph.engine_graph_logits(trt_graph.cpu_session(path), io, case, kv_capacity=MAX_SEQ_LEN)
    report = compare(reference, got)
    assert report.max_rel_error < 1e-4 and set(report.per_phase) == {"prefill", "prefill_last", "decode", "tree"}

    # what TensorRT's KV-cache-update layer needs: each cache a graph input with a static capacity, updated
    # by one node straight into the graph output of the same shape (the engine binds both to one buffer)
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    dims = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in (*g.input, *g.output)}
    ops = [n.op_type for n in g.node]
    assert "GroupQueryAttention" not in ops and ops.count("TRT_KVCacheUpdate") == 2 * io.num_layers
    assert ops.count("TRT_Attention" if attention == "native" else "tree_attention") == io.num_layers
    updates = {n.output[0]: n for n in g.node if n.op_type == "TRT_KVCacheUpdate"}
    for i in range(io.num_layers):
        for past, present in zip(io.past_names(i), io.present_names(i)):
            assert dims[past] == dims[present] == ["batch", io.num_kv_heads, MAX_SEQ_LEN, io.head_dim]
            node = updates[present]
            assert node.input[0] == past and node.domain == "trt"
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs == {"update_form": b"padded_bhnd", "mode": b"linear", "axis": -2}
    assert [i.name for i in g.input] == io.input_names and [o.name for o in g.output] == io.output_names
    assert ("trt", 1) in {(o.domain, o.version) for o in model.opset_import}
    if attention == "native":
        attn = next(n for n in g.node if n.op_type == "TRT_Attention")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in attn.attribute}
        assert attrs["causal_kind"] == b"none" and attrs["TRT_decomposable"] == 1
        assert list(attn.input[1:3]) == ["present_key.0", "present_value.0"]     # reads the updated cache


def _planted(path: Path, bug: str) -> onnx.ModelProto:
    """The engine graph at `path` with one wiring bug."""
    model = onnx.load(str(path))
    h, nodes = onnx.helper, list(model.graph.node)
    if bug == "write_at_wrong_rows":                # the new K/V land one row late
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int32), "one"))
        at = next(i for i, n in enumerate(nodes) if n.output[0] == "/engine/write_index")
        nodes.insert(at + 1, h.make_node("Add", ["/engine/write_index", "one"], ["late_index"]))
        for n in nodes:
            if n.op_type == "TRT_KVCacheUpdate":
                n.input[2] = "late_index"
    elif bug == "unmasked_cache_tail":              # the rows beyond P + T padded as visible
        pad = next(n for n in nodes if n.op_type == "ConstantOfShape")
        pad.attribute[0].CopyFrom(h.make_attribute("value", h.make_tensor("t", onnx.TensorProto.BOOL, [1], [True])))
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    return model


@pytest.mark.parametrize("attention, bug", [("native", "write_at_wrong_rows"), ("plugin", "write_at_wrong_rows"),
                                            ("native", "unmasked_cache_tail")])
def test_a_planted_wiring_bug_fails_the_parity_gate(fp32, attention, bug):
    _, io, case, reference = fp32
    session = trt_graph.cpu_session(_planted(_engine_graph(fp32, attention), bug))
    got = trt_graph.engine_graph_logits(session, io, case, kv_capacity=MAX_SEQ_LEN)
    assert compare(reference, got).max_rel_error > 1e-2


def test_the_reference_ops_against_worked_examples_and_torch():
    torch = pytest.importorskip("torch")
    out = trt_graph.kv_cache_update_reference(np.zeros((1, 1, 4, 1)), np.array([[[[7.0], [8.0]]]]), np.array([1]))
    assert out[0, 0, :, 0].tolist() == [0, 7, 8, 0]
    with pytest.raises(SpecexportError, match=r"rows 3\.\.4 outside the cache's 4 rows"):
        trt_graph.kv_cache_update_reference(np.zeros((1, 1, 4, 1)), np.ones((1, 1, 2, 1)), np.array([3]))
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((1, 4, 3, 8), (1, 2, 10, 8), (1, 2, 10, 8)))
    mask = np.zeros((1, 1, 3, 10), bool)
    mask[..., :5] = True
    mask[0, 0, :, 5:8] = ancestor_mask(np.array([-1, 0, 0]))
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a.astype(np.float64)) for a in (q, k, v)), attn_mask=torch.from_numpy(mask), scale=1.0,
        enable_gqa=True).numpy()
    assert np.abs(trt_graph.attention_reference(q, k, v, mask=mask) - expected).max() < 1e-5


# -- profiles, missing TensorRT, import hygiene --------------------------------------------------------

def test_profiles_for_fixed_capacity_caches_come_from_the_tensor_table():
    from specexport.trt.engine import profiles

    io = ModelIO(num_layers=2, num_kv_heads=2, head_dim=16, hidden_size=64, vocab_size=384)
    shapes = profiles(io, max_seq_len=127, prefill_tokens=64, verify_tokens=16, kv_capacity=128)
    assert list(shapes) == ["prefill", "decode_verify"]
    for name, top in (("prefill", 64), ("decode_verify", 16)):
        ranges = shapes[name]
        assert list(ranges) == io.input_names
        for lo, opt, hi in ranges.values():
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi))
        assert ranges["input_ids"][0] == (1, 1) and ranges["input_ids"][2] == (1, top)
        assert ranges["logits_rows"][2] == (1, top)
        assert ranges["attention_mask"][0] == (1, 1, 1) and ranges["attention_mask"][2] == (1, top, 128)
        for cache in io.past_input_names:                   # static capacity: the same shape everywhere
            assert set(ranges[cache]) == {(1, 2, 128, 16)}
    with pytest.raises(SpecexportError, match="prefill profile: 200 tokens exceed the KV capacity 128"):
        profiles(io, max_seq_len=128, prefill_tokens=200, verify_tokens=16, kv_capacity=128)


@pytest.mark.no_trt
def test_without_tensorrt_each_entry_point_fails_in_one_line_naming_it(fp32, tmp_path):
    from specexport.trt.engine import build_engine, engine_stage
    from specexport.runtime.backends.trt import open_trt_backend

    folder, io, _, _ = fp32
    stage = tmp_path / "stage"
    shutil.copytree(folder, stage)
    before = sorted(p.name for p in stage.iterdir())
    calls = [
        ("fp16 engine", lambda: engine_stage(stage, io=io, precision="fp16", fp32_graph=folder / "model.onnx",
                                             max_seq_len=MAX_SEQ_LEN, max_verify_tokens=VERIFY)),
        ("engine model.plan", lambda: build_engine(stage / "engine.onnx", stage / "model.plan", io,
                                                   max_seq_len=MAX_SEQ_LEN, prefill_tokens=64, verify_tokens=VERIFY,
                                                   kv_capacity=MAX_SEQ_LEN, attention="native")),
        ("backend tensorrt", lambda: open_trt_backend(stage, io=io, capacity=MAX_SEQ_LEN, max_tokens=64)),
    ]
    for where, call in calls:
        with pytest.raises(SpecexportError, match=rf"^{where}: TensorRT is not installed here") as err:
            call()
        assert "\n" not in str(err.value)
    assert sorted(p.name for p in stage.iterdir()) == before              # nothing written


def test_the_tensorrt_modules_import_neither_tensorrt_nor_torch():
    code = ("import sys, specexport.runtime.backends.trt, specexport.trt.engine, specexport.trt.graph; "
            "bad = {'tensorrt', 'torch', 'onnx', 'triton'} & set(sys.modules); assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-1000:]


# -- a fake tensorrt: its engine is the engine graph in ONNX Runtime --------------------------------

def _host_view(address: int, shape, dtype) -> np.ndarray:
    """The memory at `address` (a CPU torch tensor's data_ptr in these tests) as an array."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = (ctypes.c_byte * (count * dtype.itemsize)).from_address(address)
    return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)


def make_fake_tensorrt(calls: list) -> types.ModuleType:
    """A `tensorrt` module with the calls specexport makes (TensorRT 11's names and argument orders, from
    its pyCore.cpp / pyOnnx.cpp), recording them in `calls`. The builder serializes the parsed graph's path
    and the profiles; the runtime's engine runs that graph with trt_graph.cpu_session, reading its inputs
    from and writing its outputs to the addresses bound on the context, and refuses an aliased output
    bound elsewhere than its input (what TensorRT documents for the KV-cache-update layer)."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "11.1.0"
    trt.DataType = types.SimpleNamespace(FLOAT="FLOAT", INT64="INT64", BOOL="BOOL", INT32="INT32")
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    dtypes = {onnx.TensorProto.FLOAT: ("FLOAT", np.float32), onnx.TensorProto.INT64: ("INT64", np.int64),
              onnx.TensorProto.BOOL: ("BOOL", np.bool_)}

    class Logger:
        WARNING = "WARNING"

        def __init__(self, severity):
            calls.append(("Logger", severity))

    class Network:
        graph = None

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            calls.append(("set_shape", name))
            self.shapes[name] = [list(lo), list(opt), list(hi)]

    class Config:
        def __init__(self):
            self.profiles = []

        def set_memory_pool_limit(self, pool, size):
            calls.append(("set_memory_pool_limit", pool, size))

        def add_optimization_profile(self, profile):
            calls.append(("add_optimization_profile",))
            self.profiles.append(profile.shapes)
            return len(self.profiles) - 1

        def set_flag(self, flag):
            calls.append(("set_flag", flag))

    class Builder:
        def __init__(self, logger):
            calls.append(("Builder",))

        def create_network(self, flags=0):
            network = Network()
            calls.append(("create_network", flags, network))
            return network

        def create_builder_config(self):
            calls.append(("create_builder_config",))
            return Config()

        def create_optimization_profile(self):
            calls.append(("create_optimization_profile",))
            return Profile()

        def build_serialized_network(self, network, config):
            calls.append(("build_serialized_network", network))
            return json.dumps({"graph": network.graph, "profiles": config.profiles}).encode()

    class OnnxParser:
        num_errors = 0

        def __init__(self, network, logger):
            calls.append(("OnnxParser", network))
            self.network = network

        def parse_from_file(self, path):
            calls.append(("parse_from_file", path))
            self.network.graph = path
            return Path(path).is_file()

    class Engine:
        def __init__(self, blob: dict):
            model = onnx.load(blob["graph"], load_external_data=False)
            self.profiles = blob["profiles"]
            self.io = {}                                     # name -> (mode, shape with -1 dynamic, (trt, numpy) dtype)
            for mode, values in (("INPUT", model.graph.input), ("OUTPUT", model.graph.output)):
                for v in values:
                    t = v.type.tensor_type
                    self.io[v.name] = (mode, tuple(d.dim_value or -1 for d in t.shape.dim), dtypes[t.elem_type])
            self.aliases = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "TRT_KVCacheUpdate"}
            self.session = trt_graph.cpu_session(blob["graph"])
            self.num_io_tensors = len(self.io)
            self.num_optimization_profiles = len(self.profiles)

        def get_tensor_name(self, index):
            return list(self.io)[index]

        def get_tensor_shape(self, name):
            return self.io[name][1]

        def get_tensor_dtype(self, name):
            return self.io[name][2][0]

        def get_tensor_profile_shape(self, name, profile_index):
            return [tuple(s) for s in self.profiles[profile_index][name]]

        def get_aliased_input_tensor(self, name):
            return self.aliases.get(name)

        def create_execution_context(self):
            return Context(self)

    class Context:
        def __init__(self, engine):
            self.engine, self.profile, self.addresses, self.shapes = engine, 0, {}, {}

        def set_optimization_profile_async(self, profile_index, stream_handle):
            calls.append(("set_optimization_profile_async", profile_index))
            self.profile, self.addresses, self.shapes = profile_index, {}, {}      # bindings invalidated
            return True

        def set_input_shape(self, name, shape):
            lo, _, hi = self.engine.get_tensor_profile_shape(name, self.profile)
            assert all(a <= s <= b for a, s, b in zip(lo, shape, hi)), (name, shape, "outside profile", self.profile)
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name, memory):
            self.addresses[name] = memory
            return True

        def execute_async_v3(self, stream_handle):
            calls.append(("execute_async_v3", self.profile, self.shapes["input_ids"][1]))
            engine = self.engine
            feeds = {n: _host_view(self.addresses[n], self.shapes[n], engine.io[n][2][1]).copy()
                     for n, (mode, _, _) in engine.io.items() if mode == "INPUT"}
            names = [n for n, (mode, _, _) in engine.io.items() if mode == "OUTPUT"]
            for name, value in zip(names, engine.session.run(names, feeds)):
                past = engine.aliases.get(name)
                if past is not None and self.addresses[name] != self.addresses[past]:
                    raise RuntimeError(f"API error: {name} must share {past}'s device memory")
                _host_view(self.addresses[name], value.shape, engine.io[name][2][1])[...] = value
            return True

    class Runtime:
        def __init__(self, logger):
            calls.append(("Runtime",))

        def deserialize_cuda_engine(self, serialized_engine):
            return Engine(json.loads(bytes(serialized_engine)))

    trt.Logger, trt.Builder, trt.OnnxParser, trt.Runtime = Logger, Builder, OnnxParser, Runtime
    return trt


@pytest.fixture
def fake_trt(monkeypatch):
    """The fake in sys.modules, a GPU architecture to report, the plugin registration counted."""
    from specexport.plugins import trt_plugin

    calls: list = []
    monkeypatch.setitem(sys.modules, "tensorrt", make_fake_tensorrt(calls))
    monkeypatch.setattr(_tensorrt, "gpu_arch", lambda: "sm_90")
    monkeypatch.setattr(trt_plugin, "register", lambda: calls.append(("register_plugin",)) or trt_plugin.PLUGIN_ID)
    return calls


@pytest.mark.parametrize("attention", ["native", "plugin"])
def test_engine_build_calls_tensorrt_in_the_documented_order(fp32, fake_trt, attention, monkeypatch):
    from specexport.trt.engine import build_engine, profiles

    folder, io, _, _ = fp32
    graph = _engine_graph(fp32, attention, name="engine.onnx")
    renames = []
    real_replace = Path.replace
    monkeypatch.setattr(Path, "replace", lambda self, target: renames.append((self.name, Path(target).name))
                        or real_replace(self, target))
    entry = build_engine(graph, folder / "model.plan", io, max_seq_len=MAX_SEQ_LEN, prefill_tokens=64,
                         verify_tokens=VERIFY, kv_capacity=MAX_SEQ_LEN, attention=attention)
    names = [c[0] for c in fake_trt]
    head = ["Logger", "Builder", "create_network", "OnnxParser", "parse_from_file", "create_builder_config",
            "set_memory_pool_limit"]
    assert names[:len(head) + (attention == "plugin")] == (["register_plugin"] if attention == "plugin" else []) + head
    assert names.count("register_plugin") == (attention == "plugin")       # the plugin only when chosen
    _, flags, network = next(c for c in fake_trt if c[0] == "create_network")
    assert flags == 0 and "set_flag" not in names                            # strongly typed: no precision flags
    assert next(c[1] for c in fake_trt if c[0] == "OnnxParser") is network    # the parser fills that network,
    assert next(c[1] for c in fake_trt if c[0] == "build_serialized_network") is network   # which is built
    assert next(c[1] for c in fake_trt if c[0] == "parse_from_file") == str(graph)
    per_profile = len(io.input_names) + 2
    tail = names[len(head) + (attention == "plugin"):]
    assert tail == (["create_optimization_profile", *["set_shape"] * len(io.input_names), "add_optimization_profile"]
                    * 2 + ["build_serialized_network"]) and len(tail) == 2 * per_profile + 1
    blob = json.loads((folder / "model.plan").read_bytes())                # what the fake serialized
    expected = profiles(io, max_seq_len=MAX_SEQ_LEN, prefill_tokens=64, verify_tokens=VERIFY, kv_capacity=MAX_SEQ_LEN)
    assert blob["profiles"] == [{n: [list(s) for s in r] for n, r in p.items()} for p in expected.values()]
    assert renames == [("model.plan.partial", "model.plan")] and not (folder / "model.plan.partial").exists()
    assert entry["attention"] == attention and entry["kv_capacity"] == MAX_SEQ_LEN and entry["arch"] == "sm_90"
    assert entry["tensorrt"] == "11.1.0" and (entry["plugin"] is not None) == (attention == "plugin")
    assert list(entry["profiles"]) == ["prefill", "decode_verify"]


def test_a_failed_engine_build_leaves_the_previous_engine(fp32, fake_trt, monkeypatch):
    import tensorrt

    from specexport.trt.engine import build_engine

    folder, io, _, _ = fp32
    graph = _engine_graph(fp32, "native", name="engine.onnx")
    (folder / "old.plan").write_bytes(b"previous engine")
    monkeypatch.setattr(tensorrt.Builder, "build_serialized_network", lambda self, network, config: None)
    with pytest.raises(SpecexportError, match="TensorRT could not build an engine"):
        build_engine(graph, folder / "old.plan", io, max_seq_len=MAX_SEQ_LEN, prefill_tokens=64, verify_tokens=VERIFY,
                     kv_capacity=MAX_SEQ_LEN, attention="native")
    assert (folder / "old.plan").read_bytes() == b"previous engine" and not (folder / "old.plan.partial").exists()


@pytest.fixture
def fake_engine(fp32, fake_trt):
    """(folder with engine.onnx + model.plan built through the fake, io, calls)."""
    from specexport.trt.engine import build_engine

    folder, io, _, _ = fp32
    graph = _engine_graph(fp32, "native", name="engine.onnx")
    build_engine(graph, folder / "model.plan", io, max_seq_len=MAX_SEQ_LEN, prefill_tokens=64, verify_tokens=VERIFY,
                 kv_capacity=MAX_SEQ_LEN, attention="native")
    return folder, io, fake_trt


def _open(folder, io, capacity=MAX_SEQ_LEN, **options):
    from specexport.runtime.backends.trt import open_trt_backend

    return open_trt_backend(folder, io=io, capacity=capacity, max_tokens=64, device="cpu", threads=2, **options)


def test_the_backend_binds_one_address_per_cache_as_input_and_output(fake_engine):
    folder, io, _ = fake_engine
    with _open(folder, io) as backend:
        bound = backend.context.addresses
        ptrs = []
        for i in range(io.num_layers):
            for j, (past, present) in enumerate(zip(io.past_names(i), io.present_names(i))):
                assert bound[past] == bound[present] == backend.kv[2 * i + j].data_ptr()
                ptrs.append(bound[past])
        assert len(set(ptrs)) == 2 * io.num_layers
        backend.forward(np.array([3, 4, 5]))
        backend.commit(3)
        assert np.abs(backend.kv[:, :, :, :3].numpy()).max() > 0 and not backend.kv[:, :, :, 3:].numpy().any()
        # the fake enforces TensorRT's rule: an aliased output bound elsewhere is an API error
        backend.context.set_tensor_address("present_key.0", backend._logits_d.data_ptr())
        with pytest.raises(RuntimeError, match="must share past_key.0"):
            backend.forward(np.array([6]))


def test_the_backend_runs_each_call_on_the_profile_that_covers_it(fake_engine):
    folder, io, calls = fake_engine
    with _open(folder, io) as backend:
        calls.clear()
        backend.forward(np.arange(1, 41), phase="prefill")           # 40 tokens: beyond decode/verify's 16
        backend.commit(40)
        backend.forward(np.array([7]))
        backend.commit(1)
        backend.forward(np.array([8, 9, 10]))
    runs = [(c[1], c[2]) for c in calls if c[0] == "execute_async_v3"]
    assert runs == [(0, 40), (1, 1), (1, 3)]
    assert [c[1] for c in calls if c[0] == "set_optimization_profile_async"] == [0, 1]
    with pytest.raises(SpecexportError, match="the engine's KV caches hold 128 rows; this runtime needs max_seq_len "
                                              "128 \\+ 1 padding rows"):
        _open(folder, io, min_tokens=2)
    with _open(folder, io, capacity=127, min_tokens=2) as backend:   # one-row calls padded, as OrtBackend does
        calls.clear()
        out = backend.forward(np.array([5]))
        assert out.logits.shape == (1, io.vocab_size)
    assert [c[2] for c in calls if c[0] == "execute_async_v3"] == [2]


def test_the_backend_matches_pytorch_and_onnx_runtime_through_tree_commits(fp32, fake_engine):
    """backend_logits (the self-check's driver) on the fake engine against PyTorch; then a tree whose
    committed path is not a prefix (rows move on the device) against OrtBackend doing the same."""
    from specexport.trt.engine import backend_logits
    from specexport.runtime.backends.ort import OrtBackend

    _, _, case, reference = fp32
    folder, io, _ = fake_engine
    ort = OrtBackend(folder, io=io, capacity=MAX_SEQ_LEN, max_tokens=64)
    assert compare(onnx_logits(folder / "model.onnx", io, case), backend_logits(ort, case)).max_rel_error < 1e-6
    with _open(folder, io) as backend:
        assert compare(reference, backend_logits(backend, case)).max_rel_error < 1e-4
        parents = np.array([-1, 0, 0, 2, 1])
        tokens, mask = np.array([11, 12, 13, 14, 15]), ancestor_mask(parents)
        for b in (backend, ort):
            b.reset()
            b.forward(case.seq[:10])
            b.commit(10)
            b.forward(tokens, depths=mask.sum(1) - 1, tree_mask=mask)
            b.commit(np.array([0, 2, 3]))                            # rows 10, 12, 13 -> 10, 11, 12
        assert_close(backend.kv[:, 0, :, :13].numpy(),
                     np.stack([c[0, :, :13] for pair in zip(ort.k, ort.v) for c in pair]), rel=1e-6,
                     why="TensorRT's KV rows vs ONNX Runtime's: the same projections, other kernels")
        assert_close(backend.forward(np.array([16])).logits, ort.forward(np.array([16])).logits, rel=1e-5,
                     why="TensorRT vs ONNX Runtime after a tree commit: fp32, other kernels")


def test_engine_stage_builds_and_self_checks_through_the_fake(fp32, fake_trt, tmp_path, monkeypatch):
    from specexport.trt.engine import engine_stage
    from specexport.runtime.backends.trt import TrtBackend

    folder, io, _, _ = fp32
    stage = tmp_path / "fp32"
    shutil.copytree(folder, stage, ignore=shutil.ignore_patterns("engine*", "*.plan"))
    kwargs = dict(io=io, precision="fp32", fp32_graph=folder / "model.onnx", max_seq_len=MAX_SEQ_LEN,
                  max_verify_tokens=VERIFY, device="cpu")
    entry = engine_stage(stage, **kwargs)
    assert entry["files"] == ["engine.onnx", "model.plan"] and all((stage / f).is_file() for f in entry["files"])
    assert entry["attention"] == "native" and entry["kv_capacity"] == MAX_SEQ_LEN and entry["plugin"] is None
    assert entry["rewrite_check_fp32_max_rel_error"] < 1e-5
    check = entry["selfcheck"]
    assert check["max_rel_error"] < 1e-5 and check["top1_agreement"] == 1.0 and check["cases"] == 2
    assert all(run["equal"] for run in check["speculative"]) and sum(r["proposed"] for r in check["speculative"]) > 0
    assert check["tree_commit_rel_error"] < 1e-5 and ("register_plugin",) not in fake_trt

    # backend bugs the self-check must catch: tree commits that move no KV rows ...
    with monkeypatch.context() as patch:
        patch.setattr(TrtBackend, "_move_rows", lambda self, keep: None)
        with pytest.raises(ParityError, match=r"^fp32 engine: self-check failed: tree commit: "):
            engine_stage(stage, **kwargs)

    # ... and new tokens that see each other whatever the mask says
    real = TrtBackend._small_inputs

    def unmasked(self, *args):
        tokens, positions, mask, rows = real(self, *args)
        mask[...] = True
        return tokens, positions, mask, rows

    monkeypatch.setattr(TrtBackend, "_small_inputs", unmasked)
    with pytest.raises(ParityError, match=r"^fp32 engine: self-check failed: logits against fp32: relative"):
        engine_stage(stage, **kwargs)


def test_with_tensorrt_present_engines_need_version_11_and_a_gpu(fake_trt, monkeypatch):
    import tensorrt

    from specexport import _tensorrt

    assert _tensorrt.require_engines("backends: tensorrt") is tensorrt
    monkeypatch.setattr(tensorrt, "__version__", "10.13.3")
    with pytest.raises(SpecexportError, match=r"^backends: tensorrt: TensorRT 10\.13\.3 is installed; engines need "
                                              r"TensorRT 11 or later") as err:
        _tensorrt.require_engines("backends: tensorrt")
    assert "\n" not in str(err.value)
    monkeypatch.setattr(tensorrt, "__version__", "11.4.0")

    def no_gpu():
        raise SpecexportError("tree-attention plugin: no NVIDIA GPU found (neither torch.cuda nor nvidia-smi)")

    monkeypatch.setattr(_tensorrt, "gpu_arch", no_gpu)
    with pytest.raises(SpecexportError, match=r"^backends: tensorrt: TensorRT 11\.4\.0 is installed, but no NVIDIA "
                                              r"GPU found"):
        _tensorrt.require_engines("backends: tensorrt")
