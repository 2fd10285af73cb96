"""The precisions a build makes and how each quantized one can be made: the `quantization:` schemes with
their options, the quality gates, and the validation of those model.yaml sections (quant/quantize.py
makes the graphs; this table is what a model.yaml may ask for)."""
from __future__ import annotations

from specexport.errors import SpecexportError, shown

PRECISIONS = ("fp32", "int8", "int4", "fp16", "fp8", "int8_sq", "gguf")   # gguf: a GGUF file's own blocks
QUANTIZED = PRECISIONS[1:]               # checked against fp32 by a quality gate (quant/quality.py)
GPU_PRECISIONS = ("fp16", "fp8", "int8_sq")   # on ONNX Runtime CPU an accuracy path only: no speed claims

# Quality gates of the quantized graphs against the fp32 graph, on held-out text: the share of positions
# whose argmax agrees (min_top1) and the mean KL(p_fp32 || p_quant) of the next-token distribution (max_kl).
DEFAULT_QUALITY_GATES = {"int8": {"min_top1": 0.90, "max_kl": 0.05}, "int4": {"min_top1": 0.80, "max_kl": 0.20},
                         "fp16": {"min_top1": 0.98, "max_kl": 0.005}, "fp8": {"min_top1": 0.90, "max_kl": 0.05},
                         "int8_sq": {"min_top1": 0.90, "max_kl": 0.05},
                         # gguf is gated by parity with the file's dequantized weights (accuracy_level 0);
                         # this gate bounds what accuracy_level 4's int8 activations change
                         "gguf": {"min_top1": 0.80, "max_kl": 0.20}}
GATE_KEYS = ("min_top1", "max_kl")
# How each quantized precision can be made (quant/quantize.py does it): the model.yaml's
# `quantization: {int8: {scheme: ..., option: value}}` is checked against this table.
ALPHAS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# scheme -> (precisions it can make, {option: (default, allowed values or a type)})
SCHEMES = {
    "matmulnbits": (("int8", "int4"), {"block_size": (32, (16, 32, 64, 128, 256)), "accuracy_level": (4, (0, 1, 2, 3, 4))}),
    "static_qdq": (("int8",), {"smooth_alpha": (0.0, ALPHAS),
                               "calibrate": ("minmax", ("minmax", "percentile", "entropy")),
                               "lm_head": ("int8", ("int8", "fp32"))}),
    "dynamic": (("int8",), {}),
    "cast": (("fp16",), {}),
    "modelopt": (("fp8",), {"calibrate": ("max", ("max", "entropy")), "lm_head": ("fp32", ("fp32", "quantized")),
                            "smooth_alpha": (0.0, ALPHAS), "keep": ("none", ("none", "mlp_down"))}),
    "smoothquant": (("int8_sq",), {"smooth_alpha": (0.5, ALPHAS), "calibrate": ("max", ("max", "entropy")),
                                   "lm_head": ("fp32", ("fp32", "quantized")), "keep": ("none", ("none", "mlp_down"))}),
    # the GGUF file's blocks as they are (quant/gguf_blocks.py); accuracy_level 4 multiplies in int8 with
    # activations quantized per block (as llama.cpp does), 0 in fp32 (exactly the file's weights). kernels:
    # auto = specexport's CPU kernels where they build here, else ONNX Runtime's ops; ours = fail without
    # them; stock = ONNX Runtime's ops (a graph for machines that cannot compile ours). layout (our kernels
    # only): the weights as the file lays them out, or r8 (the same bytes, eight rows interleaved, written
    # once); auto = r8 where this CPU's one-row kernels have an r8 kernel of their own (plugins/cpu)
    "gguf": (("gguf",), {"accuracy_level": (4, (0, 4)), "kernels": ("auto", ("auto", "ours", "stock")),
                         "layout": ("auto", ("auto", "file", "r8"))}),
    # a checkpoint quantized into ggml blocks as llama-quantize does (int8 Q8_0, int4 Q4_K_M), written as a
    # GGUF file beside a graph on those blocks (builder/stages/blocks.py); kernels as for gguf
    # (mix: llama-quantize's type: q8_0 for int8; q4_k_m, q4_1 or q4_0 for int4; auto: q8_0 / q4_k_m;
    # importance: imatrix = errors weighed by calibration activations, as llama-quantize --imatrix)
    "blocks": (("int8", "int4"), {"kernels": ("auto", ("auto", "ours", "stock")),
                                  "layout": ("auto", ("auto", "file", "r8")),
                                  "mix": ("auto", ("auto", "q8_0", "q4_k_m", "q4_1", "q4_0")),
                                  "importance": ("none", ("none", "imatrix"))}),
}
DEFAULT_SCHEMES = {"int8": "blocks", "int4": "blocks",      # matmulnbits where blocks cannot be made (plan.py)
                    "fp16": "cast", "fp8": "modelopt",
                   "int8_sq": "smoothquant", "gguf": "gguf"}


def default_scheme(precision: str, name: str | None = None) -> dict:
    """Scheme `name` (default: the precision's) with its default options."""
    name = name or DEFAULT_SCHEMES[precision]
    return {"scheme": name, **{k: d for k, (d, _) in SCHEMES[name][1].items()}}


def quality_gates(raw) -> dict:
    """DEFAULT_QUALITY_GATES with the YAML's overrides, e.g. {int4: {min_top1: 0.7}}."""
    gates = {p: dict(g) for p, g in DEFAULT_QUALITY_GATES.items()}
    if raw is None:
        return gates
    if not isinstance(raw, dict):
        raise SpecexportError(f"quality_gates: expected a mapping like {{int8: {{min_top1: 0.9, max_kl: 0.05}}}}, "
                              f"got {raw!r}")
    for precision, gate in raw.items():
        if precision not in QUANTIZED:
            why = " (fp32 is gated against PyTorch by parity_tolerance)" if precision == "fp32" else ""
            raise SpecexportError(f"quality_gates.{shown(precision)}: unknown key; allowed: {', '.join(QUANTIZED)}{why}")
        if not isinstance(gate, dict):
            raise SpecexportError(f"quality_gates.{precision}: expected a mapping like {{min_top1: 0.9, "
                                  f"max_kl: 0.05}}, got {gate!r}")
        for key, value in gate.items():
            where = f"quality_gates.{precision}.{shown(key)}"
            if key not in GATE_KEYS:
                raise SpecexportError(f"{where}: unknown key; allowed: {', '.join(GATE_KEYS)}")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key == "min_top1" and not (number and 0 <= value <= 1):
                raise SpecexportError(f"{where}: expected a number in 0..1 (a share of positions), got {value!r}")
            if key == "max_kl" and not (number and value >= 0):
                raise SpecexportError(f"{where}: expected a number >= 0 (nats), got {value!r}")
            gates[precision][key] = float(value)
    return gates


def quantization_settings(raw, where: str, defaults: dict | None) -> dict:
    """{int8: {scheme, options...}, int4: {...}}: `defaults` (or each scheme's own) with the YAML's choices."""
    out = {p: dict(s) for p, s in (defaults or {p: default_scheme(p) for p in QUANTIZED}).items()}
    if raw is None:
        return out
    if not isinstance(raw, dict):
        raise SpecexportError(f"{where}: expected a mapping like {{int8: {{scheme: static_qdq}}}}, got {raw!r}")
    for precision, choice in raw.items():
        if precision not in QUANTIZED:
            raise SpecexportError(f"{where}.{shown(precision)}: unknown key; allowed: {', '.join(QUANTIZED)}")
        if not isinstance(choice, dict):
            raise SpecexportError(f"{where}.{precision}: expected a mapping like {{scheme: matmulnbits, "
                                  f"block_size: 32}}, got {choice!r}")
        scheme = choice.get("scheme", out[precision]["scheme"])
        if scheme not in SCHEMES or precision not in SCHEMES[scheme][0]:
            ok = [k for k, (ps, _) in SCHEMES.items() if precision in ps]
            raise SpecexportError(f"{where}.{precision}.scheme: {scheme!r} cannot make {precision}; supported: "
                                  f"{', '.join(ok)}")
        options = SCHEMES[scheme][1]
        settings = {"scheme": scheme, **{k: (out[precision].get(k, d) if scheme == out[precision]["scheme"] else d)
                                          for k, (d, _) in options.items()}}
        for key, value in choice.items():
            if key == "scheme":
                continue
            if key not in options:
                allowed = ", ".join(["scheme", *options]) or "scheme"
                raise SpecexportError(f"{where}.{precision}.{shown(key)}: unknown key for scheme {scheme}; "
                                      f"allowed: {allowed}")
            if value not in options[key][1] or isinstance(value, bool):
                raise SpecexportError(f"{where}.{precision}.{key}: expected one of "
                                      f"{', '.join(map(str, options[key][1]))}, got {value!r}")
            settings[key] = value
        out[precision] = settings
    return out
