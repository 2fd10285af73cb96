"""The tree-attention kernel as a TensorRT Python plugin ("quickly deployable plugin", tensorrt.plugin).

UNVERIFIED: written against TensorRT 11's documented `tensorrt.plugin` API (register, aot_impl,
KernelLaunchParams, SymIntExprs); TensorRT cannot be installed on the machines this was written on,
so it has never run. What feeds it is tested: the kernel (tree_attention.run against torch's
attention in Triton's interpreter) and its PTX (compile_ptx for every listed architecture).

The plugin has only an ahead-of-time implementation: at engine build time `aot_impl` compiles the
Triton kernel to PTX for the GPU the engine is built on, with the head counts, head_dim and softmax
scale folded in as constants, so the engine runs with no Python (trtexec or the C++ runtime load it
like any plugin). Its inputs are q [T, Hq, D], k and v [S, Hkv, D] and mask [T, S] bool; its output
has q's shape and dtype. An ONNX node reaches it with op_type `tree_attention`, attributes
`plugin_namespace = "specexport"`, `aot = 1`, `num_kv_heads` and `scale` (see plugin_node). Both
attributes are read at build time and compiled into the kernel (AOT kernels take int scalars only).

Nothing here imports TensorRT at module import; `register()` does, and fails with one line naming
what is missing.
"""
from __future__ import annotations

import functools

from specexport import _tensorrt
from specexport.errors import SpecexportError

NAMESPACE, NAME = "specexport", "tree_attention"
PLUGIN_ID = f"{NAMESPACE}::{NAME}"


def plugin_node(inputs, outputs, *, num_kv_heads: int, scale: float, name: str | None = None, domain: str = ""):
    """The ONNX node that TensorRT's ONNX parser hands to this plugin (onnx only; no TensorRT)."""
    import onnx

    return onnx.helper.make_node(NAME, list(inputs), list(outputs), name=name, domain=domain,
                                 plugin_namespace=NAMESPACE, aot=1, num_kv_heads=int(num_kv_heads),
                                 scale=float(scale))


@functools.cache
def register() -> str:
    """Register specexport::tree_attention with TensorRT's plugin registry (once per process); returns
    the plugin id. Call before parsing an ONNX graph that contains plugin nodes."""
    trt = _tensorrt.require_tensorrt("tree-attention plugin")
    import tensorrt.plugin as trtp

    from specexport.plugins import tree_attention as kernel

    @trtp.register(PLUGIN_ID)
    def tree_attention_desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, mask: trtp.TensorDesc,
                            num_kv_heads: int, scale: float) -> trtp.TensorDesc:
        return q.like()

    @trtp.aot_impl(PLUGIN_ID)
    def tree_attention_aot(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, mask: trtp.TensorDesc,
                           num_kv_heads: int, scale: float, outputs: tuple[trtp.TensorDesc], tactic: int):
        hq, d = (_constant(q.shape_expr[i], f"q dim {i}") for i in (1, 2))
        dtype = {trt.float16: "fp16", trt.float32: "fp32"}.get(q.dtype)
        if dtype is None:
            raise SpecexportError(f"tree-attention plugin: q is {q.dtype}; expected float16 or float32")
        info = kernel.compile_kernel(_tensorrt.gpu_arch(), dtype=dtype, num_q_heads=hq, num_kv_heads=num_kv_heads, head_dim=d,
                                     scale=scale)
        t, s = q.shape_expr[0], k.shape_expr[0]
        launch = trtp.KernelLaunchParams()
        launch.grid_x = num_kv_heads
        launch.grid_y = trtp.cdiv(t * (hq // num_kv_heads), info["block_m"])
        launch.block_x = info["num_warps"] * 32
        launch.shared_mem = info["shared"]
        extra = trtp.SymIntExprs(2)          # the kernel's (T, S), between its input and output pointers
        extra[0] = trtp.SymInt32(t)
        extra[1] = trtp.SymInt32(s)
        return info["name"], info["ptx"], launch, extra

    return PLUGIN_ID


def _constant(expr, what: str) -> int:
    if not expr.is_constant:
        raise SpecexportError(f"tree-attention plugin: {what} must be static at engine build time")
    return int(expr.constant_value)
