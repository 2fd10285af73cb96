"""EAGLE heads in their published formats (SafeAILab EAGLE-1/2 and EAGLE-3): loading, and a PyTorch
implementation of the published head that the head graph will be checked against (issue 11).

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
is missing). `EagleHead.forward` runs the head over T positions at once under a [T, T] mask (causal
for a chain, the ancestor mask for a tree), from positions P..P+T-1.

Not yet built on this (the rest of issue 11): the head graph with its own static KV, dynamic trees,
the runtime proposer, train-heads --kind eagle3.
"""
from __future__ import annotations

import copy
import json
import math
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


# -- the published head in PyTorch (the parity reference) ----------------------------------------

def make_head(weights: EagleWeights):
    """An nn.Module computing the published head (see EagleHead)."""
    return _head_class()(weights)


def _head_class():
    torch = require("torch")
    nn = torch.nn

    class EagleHead(nn.Module):
        """forward(embeds [B, T, H], features [B, T, H or 3H], positions [T], mask [T, T] bool,
        lm_head [V, H] (EAGLE-1: the target's)) -> (logits [B, T, V or Vd], hidden [B, T, H]).

        `features` are the target's (EAGLE-1: final post-norm state; EAGLE-3: its three aux inputs,
        concatenated) at the position before each token, or the head's own previous `hidden` when it
        drafts further (EAGLE-3 then skips fc: pass `own_hidden=True`)."""

        def __init__(self, w: EagleWeights):
            super().__init__()
            self.version, cfg = w.version, w.config
            self.heads = int(cfg["num_attention_heads"])
            self.kv_heads = int(cfg.get("num_key_value_heads") or self.heads)
            self.hidden = int(cfg["hidden_size"])
            self.head_dim = int(cfg.get("head_dim") or self.hidden // self.heads)
            inv_freq, self.rope_scale = rope_frequencies(cfg, self.head_dim)
            self.inv_freq = torch.from_numpy(inv_freq)
            self.eps = float(cfg.get("rms_norm_eps", 1e-6))
            prefix = "layers.0." if w.version == 1 else "midlayer."
            self.t = {k: v for k, v in w.tensors.items()}
            self.prefix = prefix

        def _w(self, key):
            return self.t[self.prefix + key]

        def _norm(self, x, weight):
            x32 = x.float()
            return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))

        def _rope(self, x, positions):                       # x [B, heads, T, D]
            d = self.head_dim
            ang = positions.float()[:, None] * self.inv_freq[None]      # [T, D/2]
            cos = torch.cat([ang, ang], -1).cos() * self.rope_scale
            sin = torch.cat([ang, ang], -1).sin() * self.rope_scale
            half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
            return x * cos + half * sin

        def forward(self, embeds, features, positions, mask, lm_head=None, own_hidden: bool = False):
            f = nn.functional
            if self.version == 1:
                hidden = f.linear(torch.cat([embeds, features], -1), self.t["fc.weight"], self.t.get("fc.bias"))
                x = hidden                                   # no input norm
            else:
                hidden = features if own_hidden else f.linear(features, self.t["fc.weight"])
                x = torch.cat([self._norm(embeds, self._w("input_layernorm.weight")),
                               self._norm(hidden, self._w("hidden_norm.weight"))], -1)
            b, t, _ = x.shape
            q = f.linear(x, self._w("self_attn.q_proj.weight"), self.t.get(self.prefix + "self_attn.q_proj.bias"))
            k = f.linear(x, self._w("self_attn.k_proj.weight"), self.t.get(self.prefix + "self_attn.k_proj.bias"))
            v = f.linear(x, self._w("self_attn.v_proj.weight"), self.t.get(self.prefix + "self_attn.v_proj.bias"))
            q, k, v = (z.view(b, t, n, self.head_dim).transpose(1, 2)
                       for z, n in ((q, self.heads), (k, self.kv_heads), (v, self.kv_heads)))
            q, k = self._rope(q, positions), self._rope(k, positions)
            g = self.heads // self.kv_heads
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
            scores = scores.masked_fill(~mask[None, None], float("-inf"))
            attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
            h = hidden + f.linear(attn, self._w("self_attn.o_proj.weight"))
            y = self._norm(h, self._w("post_attention_layernorm.weight"))
            y = f.linear(f.silu(f.linear(y, self._w("mlp.gate_proj.weight"))) * f.linear(y, self._w("mlp.up_proj.weight")),
                         self._w("mlp.down_proj.weight"))
            out = h + y
            if self.version == 1:
                return f.linear(out, lm_head), out
            return f.linear(self._norm(out, self.t["norm.weight"]), self.t["lm_head.weight"]), out

    return EagleHead
