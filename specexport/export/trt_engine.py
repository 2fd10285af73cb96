"""TensorRT engines from the plugin graphs (trt.onnx, plugins/graph.py), with two optimisation profiles
from the tensor table: prefill chunks and decode/verify passes.

UNVERIFIED: written against TensorRT 11's documented Python API (Builder, OnnxParser,
create_optimization_profile, build_serialized_network; networks are always strongly typed in 11, so
the precision is the graph's: fp16 casts, FP8/INT8 Q/DQ). TensorRT cannot be installed on the machines
this was written on; `profiles()` is tested here, nothing else has run. The engine takes the plugin
graph's plain-run caches (each call's present is past + the new rows); the in-place KV update into a
fixed-capacity buffer (TensorRT's KV-cache-update layer, or an aliased plugin output) and the runtime
backend that drives engines are not written yet, so `specexport build` does not call this (the
`tensorrt` backend is refused in one line) and it is reached only by calling it.
"""
from __future__ import annotations

from pathlib import Path

from specexport.errors import SpecexportError
from specexport.io_spec import ModelIO

PREFILL_OPT = 64            # the prefill profile's optimum chunk (the runtime prefills in chunks of PREFILL_CHUNK)
VERIFY_OPT = 5              # the decode/verify profile's optimum: a γ = 4 chain


def profiles(io: ModelIO, *, max_seq_len: int, prefill_tokens: int, verify_tokens: int) -> dict[str, dict]:
    """{"prefill": {input: (min, opt, max)}, "decode_verify": {...}} for the plugin graph's inputs, from the
    tensor table's axes: tokens T, rows R <= T, past rows P (the caches' capacity axis in the plain-run
    form: 0 at the first call) and total = P + T <= max_seq_len."""
    def sizes(t: int, p: int, r: int) -> dict:
        return {"batch": 1, "tokens": t, "rows": r, "capacity": p, "total": p + t}

    out = {}
    for name, top, opt_t, opt_r in (("prefill", prefill_tokens, min(PREFILL_OPT, prefill_tokens), 1),
                                    ("decode_verify", verify_tokens, min(VERIFY_OPT, verify_tokens),
                                     min(VERIFY_OPT, verify_tokens))):
        lo, opt, hi = sizes(1, 0, 1), sizes(opt_t, max_seq_len // 2, opt_r), sizes(top, max_seq_len - 1, top)
        if top > max_seq_len:
            raise SpecexportError(f"{name} profile: {top} tokens exceed max_seq_len {max_seq_len}")
        hi["total"] = max_seq_len
        out[name] = {t.name: (t.shape(**lo), t.shape(**opt), t.shape(**hi)) for t in io.inputs}
    return out


def build_engine(graph: Path, dest: Path, io: ModelIO, *, max_seq_len: int, prefill_tokens: int, verify_tokens: int,
                 workspace_gib: float = 4.0) -> dict:
    """Build `dest` (a serialized engine) from the plugin graph `graph`; returns its manifest entry."""
    from specexport._tensorrt import require_tensorrt
    from specexport.plugins import trt_plugin

    trt = require_tensorrt(f"engine {dest.name}")
    plugin = trt_plugin.register()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)          # TensorRT 11: always strongly typed
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SpecexportError(f"{graph}: TensorRT's ONNX parser refused it: {errors[:500]}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * 2**30))
    shapes = profiles(io, max_seq_len=max_seq_len, prefill_tokens=prefill_tokens, verify_tokens=verify_tokens)
    for ranges in shapes.values():
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in ranges.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SpecexportError(f"{graph}: TensorRT could not build an engine (its log above says why)")
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(bytes(serialized))
    partial.replace(dest)                          # never a half-written engine under the final name
    return {"file": dest.name, "tensorrt": trt.__version__, "cuda": _cuda_version(), "arch": trt_plugin.gpu_arch(),
            "plugin": plugin, "profiles": {k: {n: [list(s) for s in v] for n, v in r.items()} for k, r in shapes.items()},
            "made_from": graph.name}


def _cuda_version() -> str | None:
    try:
        import torch

        return torch.version.cuda
    except ImportError:
        return None
