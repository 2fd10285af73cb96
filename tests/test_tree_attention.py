"""The verify step's tree-attention kernel (specexport/plugins/tree_attention.py): in Triton's
interpreter against torch's scaled_dot_product_attention (an independent implementation) on masks
from random trees over a committed prefix, and its PTX for every listed GPU architecture."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from specexport.errors import SpecexportError
from specexport.runtime.tree import Tree

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")
ta = pytest.importorskip("specexport.plugins.tree_attention")


def tree_mask(rng, size: int, prefix: int) -> np.ndarray:
    """[T, P + T]: every tree token sees the committed prefix, its ancestors and itself."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, size)]
    return np.concatenate([np.ones((size, prefix), bool), Tree(np.array(parents)).mask], axis=1)


def sdpa(q, k, v, mask, scale=None):
    """torch's attention with GQA on [T, H, D] arrays (float64)."""
    tq, tk, tv = (torch.from_numpy(a.astype(np.float64)).transpose(0, 1)[None] for a in (q, k, v))   # [1, H, *, D]
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(mask)[None, None],
                                                           scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).numpy()


CASES = [  # (T, Hq, Hkv, D, committed prefix, dtype)
    (1, 4, 4, 32, 0, np.float32),       # decode, no prefix, MHA
    (6, 9, 3, 64, 45, np.float32),      # SmolLM2's heads, S = 51: not a multiple of the block
    (16, 8, 2, 64, 70, np.float16),     # a 16-token tree, fp16
    (11, 6, 1, 48, 21, np.float32),     # MQA, head_dim not a power of two
    (3, 4, 2, 16, 100, np.float16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}/{c[2]}-D{c[3]}-P{c[4]}-{np.dtype(c[5]).name}")
def test_kernel_matches_torch_attention_on_tree_masks(case):
    t, hq, hkv, d, prefix, dtype = case
    rng = np.random.default_rng(t * 100 + prefix)
    s = prefix + t
    q, k, v = (rng.standard_normal(shape).astype(dtype) for shape in ((t, hq, d), (s, hkv, d), (s, hkv, d)))
    mask = tree_mask(rng, t, prefix)
    expected = sdpa(q, k, v, mask)
    tol = 2e-3 if dtype == np.float16 else 2e-5
    got = ta.run(q, k, v, mask)
    assert got.dtype == dtype and got.shape == (t, hq, d)
    assert np.abs(got.astype(np.float64) - expected).max() < tol
    assert np.abs(ta.reference(q, k, v, mask).astype(np.float64) - expected).max() < tol
    # the mask matters: attending to everything gives another answer (unless the tree is a full chain
    # with no prefix at T = 1)
    if mask.sum() < mask.size:
        assert np.abs(ta.run(q, k, v, np.ones_like(mask)).astype(np.float64) - expected).max() > 10 * tol


def test_scale_and_a_row_with_nothing_to_attend_to():
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((4, 2, 16), (9, 2, 16), (9, 2, 16)))
    mask = tree_mask(rng, 4, 5)
    assert np.abs(ta.run(q, k, v, mask, scale=0.3) - sdpa(q, k, v, mask, scale=0.3)).max() < 2e-5
    mask[2] = False
    out = ta.run(q, k, v, mask)
    assert (out[2] == 0).all() and (ta.reference(q, k, v, mask)[2] == 0).all()


def test_bad_inputs_name_what_was_expected():
    q = np.zeros((2, 4, 8), np.float32)
    kv = np.zeros((5, 3, 8), np.float32)
    with pytest.raises(SpecexportError, match="multiple of Hkv"):
        ta.run(q, kv, kv, np.ones((2, 5), bool))
    kv = np.zeros((5, 2, 8), np.float32)
    with pytest.raises(SpecexportError, match=r"mask: expected \[T, S\] = \[2, 5\]"):
        ta.run(q, kv, kv, np.ones((2, 4), bool))
    with pytest.raises(SpecexportError, match="fp16 or fp32"):
        ta.run(q.astype(np.float64), kv, kv, np.ones((2, 5), bool))
    with pytest.raises(SpecexportError, match="arch"):
        ta.compile_ptx("hopper")


def test_ptx_compiles_for_every_listed_architecture():
    """In one child process without the interpreter (compile_ptx would start one per call here)."""
    import json
    import os

    code = ("import json; from specexport.plugins import tree_attention as ta; "
            "out = {a: ta.compile_ptx(a) for a in ta.ARCHS}; "
            "out['fp32'] = ta.compile_kernel('sm_87', dtype='fp32', num_q_heads=8, num_kv_heads=8, head_dim=128, "
            "scale=0.1); print(json.dumps(out))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for arch in ta.ARCHS:
        assert f".target {arch}" in out[arch] and ".entry tree_attention_kernel" in out[arch], arch
    info = out["fp32"]
    assert ".target sm_87" in info["ptx"] and info["num_warps"] == ta.NUM_WARPS and info["block_m"] == ta.BLOCK_M
    assert ".entry tree_attention_kernel" in ta.compile_ptx("sm_89")     # and through the child-process path


def test_importing_the_module_needs_no_triton():
    code = ("import sys; import specexport.plugins.tree_attention as t; "
            "assert 'triton' not in sys.modules, 'triton imported'; print(t.ARCHS)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_tensorrt_plugin_is_lazy():
    """The plugin module imports neither TensorRT nor triton; the ONNX node it parses from carries the
    namespace, aot and the attributes (and, without TensorRT, register() says so in one line: below)."""
    code = ("import sys; import specexport.plugins.trt_plugin as p; "
            "assert not {'tensorrt', 'triton'} & set(sys.modules), 'imported at module import'; "
            "node = p.plugin_node(['q', 'k', 'v', 'm'], ['o'], num_kv_heads=3, scale=0.125); "
            "attrs = {a.name: a for a in node.attribute}; "
            "assert node.op_type == 'tree_attention' and attrs['plugin_namespace'].s == b'specexport'; "
            "assert attrs['aot'].i == 1 and attrs['num_kv_heads'].i == 3 and attrs['scale'].f == 0.125")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.no_trt
def test_tensorrt_plugin_registration_fails_in_one_line_without_tensorrt():
    from specexport.plugins import trt_plugin

    with pytest.raises(SpecexportError, match="tree-attention plugin: TensorRT is not installed here") as err:
        trt_plugin.register()
    assert "\n" not in str(err.value)


@pytest.mark.no_trt
def test_loading_a_build_on_tensorrt_fails_in_one_line_naming_it(built_llama):
    import specexport

    with pytest.raises(SpecexportError, match=r"backend tensorrt: TensorRT is not installed here") as err:
        specexport.load(built_llama, backend="tensorrt")
    assert "\n" not in str(err.value)


@pytest.mark.no_gpu
def test_gpu_check_says_there_is_no_gpu_and_exits_2():
    """benchmarks/gpu_check.py is the script a GPU machine runs; here it must stop at once and say why."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr, done.stderr[-500:]


@pytest.mark.gpu
def test_gpu_check_passes_on_a_gpu(tmp_path):
    """Where there is a GPU, the prepared GPU script's quick run passes (the kernel compiled for it, not
    interpreted, against torch's attention; ONNX Runtime CUDA where installed)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path / "gpu_check.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.no_ort_cuda
def test_device_cuda_without_onnxruntime_gpu_fails_in_one_line(built_llama, capsys):
    from specexport.cli import main

    capsys.readouterr()
    assert main(["generate", str(built_llama), "def f():", "--device", "cuda", "--max-new-tokens", "2"]) == 1
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "CUDAExecutionProvider" in err[0] and "onnxruntime-gpu" in err[0], err
    assert main(["generate", str(built_llama), "def f():", "--device", "gpu"]) == 1
    assert "device: expected cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err


@pytest.mark.no_trt
def test_engine_profiles_come_from_the_tensor_table_and_the_builder_needs_tensorrt(tmp_path):
    from specexport.errors import SpecexportError
    from specexport.trt.engine import build_engine, profiles
    from specexport.io_spec import ModelIO

    io = ModelIO(num_layers=2, num_kv_heads=2, head_dim=16, hidden_size=64, vocab_size=384)
    shapes = profiles(io, max_seq_len=128, prefill_tokens=64, verify_tokens=16)
    assert set(shapes) == {"prefill", "decode_verify"}
    for name, top in (("prefill", 64), ("decode_verify", 16)):
        ranges = shapes[name]
        assert list(ranges) == io.input_names                     # every input, in the table's order
        lo, opt, hi = ranges["input_ids"]
        assert lo == (1, 1) and hi == (1, top) and lo <= opt <= hi
        assert ranges["past_key.0"][0] == (1, 2, 0, 16) and ranges["past_key.1"][2] == (1, 2, 127, 16)
        assert ranges["attention_mask"][2] == (1, top, 128)       # past + new never beyond max_seq_len
    with pytest.raises(SpecexportError, match=r"^engine model\.plan: TensorRT is not installed here"):
        build_engine(tmp_path / "trt.onnx", tmp_path / "model.plan", io, max_seq_len=128, prefill_tokens=64,
                     verify_tokens=16)
    assert not list(tmp_path.iterdir())
