"""EAGLE heads in their published formats (SafeAILab EAGLE-1/2 and EAGLE-3): loading and checking them
against the target (issue 11); the head in PyTorch is heads/eagle_torch.py's.

A folder holds `config.json` (a Llama config of one layer) and `pytorch_model.bin` or
`model.safetensors`. The version is read from the keys, not from the config:

  EAGLE-1 (EAGLE-2 uses the same heads): `fc.weight` [H, 2H] (+ `fc.bias` unless "bias": false) on
    concat(token embedding, feature) with the embedding first; one decoder layer `layers.0.*` without
    its input norm; no final norm; logits through the target's lm_head. The feature is the target's
    final post-norm hidden state.
  EAGLE-3: `fc.weight` [H, 3H] (no bias) on the concatenated inputs of three target layers (2, N//2,
    N-3, or `eagle_config.eagle_aux_hidden_state_layer_ids`); `midlayer.*`: attention whose q/k/v read
    concat(input_layernorm(embedding), hidden_norm(hidden)) [2H], then the usual MLP block; `norm`;
    its own `lm_head` [Vd, H] over a draft vocabulary, `d2t` [Vd] (target id = draft id + d2t[id]) and
    `t2d` [V] bool.

Embeddings always come from the target. RoPE uses the head's own config (rope_theta 10000 when it
is missing).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "post_attention_layernorm.weight")


@dataclass(frozen=True)
class EagleWeights:
    version: int                      # 1 (EAGLE-1/2) or 3
    config: dict
    tensors: dict                     # name -> torch tensor (float32; d2t int64, t2d bool)
    aux_layers: tuple[int, ...]       # EAGLE-3: the target layers whose inputs are the features; () for 1
    path: Path

    @property
    def draft_vocab(self) -> int | None:
        return int(self.tensors["lm_head.weight"].shape[0]) if self.version == 3 else None

    def target_ids(self) -> np.ndarray | None:
        """EAGLE-3: the target id of each draft id (draft id + d2t[draft id])."""
        if self.version != 3:
            return None
        return np.arange(self.draft_vocab) + self.tensors["d2t"].numpy().astype(np.int64)


def load_eagle(path, *, hidden_size: int, vocab_size: int, num_layers: int) -> EagleWeights:
    """Read an EAGLE head folder and check it against the target (hidden size, vocabulary, layers)."""
    path = Path(path)
    where = f"eagle.path: {path}"
    config_file = path / "config.json"
    if not config_file.is_file():
        raise SpecexportError(f"{where} has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise SpecexportError(f"{where}/config.json: not JSON ({err})") from None
    tensors = _read_weights(path, where)
    if "midlayer.self_attn.q_proj.weight" in tensors:
        version = 3
    elif "layers.0.self_attn.q_proj.weight" in tensors and "fc.weight" in tensors:
        version = 1
    else:
        raise SpecexportError(f"{where}: neither an EAGLE-1 head (fc.*, layers.0.*) nor an EAGLE-3 head "
                              f"(fc.*, midlayer.*); keys found: {sorted(tensors)[:6]}")
    h = hidden_size
    if version == 1:
        need = {"fc.weight": (h, 2 * h), **{f"layers.0.{k}": None for k in LAYER_KEYS}}
        if config.get("bias", True):
            need["fc.bias"] = (h,)
        aux = ()
    else:
        need = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": None, "d2t": None,
                "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
                **{f"midlayer.{k}": None for k in LAYER_KEYS}}
        aux = eagle3_layers(config, num_layers, where)
    missing = [k for k in need if k not in tensors]
    if missing:
        raise SpecexportError(f"{where}: an EAGLE-{version} head needs {missing} (keys found: {sorted(tensors)[:8]})")
    for key, shape in need.items():
        if shape is not None and tuple(tensors[key].shape) != shape:
            raise SpecexportError(f"{where}: {key} is {list(tensors[key].shape)}; expected {list(shape)} for a target "
                                  f"of hidden size {h}")
    weights = EagleWeights(version=version, config=config, tensors=tensors, aux_layers=aux, path=path)
    if version == 3:
        ids = weights.target_ids()
        if tensors["lm_head.weight"].shape[1] != h or tensors["d2t"].shape != (weights.draft_vocab,):
            raise SpecexportError(f"{where}: lm_head.weight {list(tensors['lm_head.weight'].shape)} and d2t "
                                  f"{list(tensors['d2t'].shape)} do not describe one draft vocabulary of width {h}")
        if ids.min() < 0 or ids.max() >= vocab_size or len(np.unique(ids)) != len(ids):
            raise SpecexportError(f"{where}: d2t maps draft ids outside the target's vocabulary (0..{vocab_size - 1}) "
                                  f"or two draft ids onto one target id")
    return weights


def eagle3_layers(config: dict, num_layers: int, where: str = "eagle") -> tuple[int, ...]:
    """The target layers whose inputs EAGLE-3 concatenates, in that order (fc's columns follow it): the
    checkpoint's eagle_config.eagle_aux_hidden_state_layer_ids, else 2, N//2, N-3 (as EAGLE-3 trains
    them), low to high: the published code collects them while walking the layers in order. A target so
    shallow that these coincide still gives three features: a repeated layer repeats its input (the
    published code would collect it once and fail on fc's width)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(sorted(int(i) for i in ids) if ids else sorted((2, num_layers // 2, num_layers - 3)))
    if len(layers) != 3 or not all(0 <= i < num_layers for i in layers):
        raise SpecexportError(f"{where}: EAGLE-3 reads three target layers in 0..{num_layers - 1}; got {list(layers)}")
    return layers


def rope_frequencies(config: dict, head_dim: int, where: str = "eagle.path") -> tuple[np.ndarray, float]:
    """(inv_freq [D/2] float32, attention scaling) of the head's RoPE, from its own config: rope_theta
    (10000 when missing), and the scaling the config names (linear, llama3, yarn: transformers'
    ROPE_INIT_FUNCTIONS, the same code the target's graph uses)."""
    transformers = require("transformers")
    # a deep copy: transformers writes rope_theta into the nested rope_scaling dict it is given
    fields = copy.deepcopy({k: v for k, v in config.items() if k not in ("architectures", "model_type", "auto_map")})
    fields.setdefault("rope_theta", 10000.0)
    try:
        cfg = transformers.LlamaConfig(**fields)
    except Exception as err:                     # transformers validates rope fields its own way
        raise SpecexportError(f"{where}/config.json: its RoPE settings are not valid ({err})") from None
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    theta = float(rope.get("rope_theta") or fields["rope_theta"])
    if kind == "default":
        return (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(np.float32), 1.0
    from specexport.export.arch import STATIC_ROPE_TYPES
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in STATIC_ROPE_TYPES:
        raise SpecexportError(f"{where}/config.json: rope type {kind!r} is not supported for a head; supported: "
                              f"{', '.join(STATIC_ROPE_TYPES)}")
    cfg.head_dim = head_dim
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    return inv_freq.float().numpy(), float(scale)


def _read_weights(path: Path, where: str) -> dict:
    torch = require("torch")
    for name in WEIGHT_FILES:
        file = path / name
        if not file.is_file():
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            raw = load_file(str(file))
        else:
            raw = torch.load(file, map_location="cpu", weights_only=True)
        return {k: (v if v.dtype in (torch.int64, torch.bool) else v.float()) for k, v in raw.items()}
    raise SpecexportError(f"{where} has no weights ({' or '.join(WEIGHT_FILES)})")
