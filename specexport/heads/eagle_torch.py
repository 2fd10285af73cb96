"""The EAGLE head in PyTorch (EAGLE-1 and EAGLE-3), one module for all its uses: the published head the
graph is checked against (`make_head`: a folder's weights loaded into it), the head train-heads trains
(`trainable_head`: fresh weights), and the training-time-test unroll (issue 11).

The parameters carry the published key names (heads/eagle.py), so `state_dict()` is the checkpoint.

Glossary (one sequence x_0 .. x_n of the target, its features f_0 .. f_n):
    row i      the head's input at position i: token x_{i+1}, feature f_i (EAGLE-1: the target's final
               post-norm state; EAGLE-3: the inputs of three target layers, concatenated) -> it predicts
               x_{i+2}, whose true distribution is the target's at position i + 1.
    step s     training-time test (EAGLE-3 paper): the head run on its own outputs. At step s >= 1 row i
               (valid for i >= s) takes the head's output hidden of row i-1 at step s-1 in place of f_i
               (EAGLE-3: as its own hidden, fc skipped; EAGLE-1: as the feature fc reads), the same token
               x_{i+1} and position i. Row i at step s is the s-th draft level of a chain rooted at
               step-0 row i-s, so it attends to step-0 rows 0..i-s, to its ancestors (step t row i-s+t,
               t = 1..s-1) and to itself: what the head's KV holds at inference (`ttt_mask`).

    ttt_mask(T=4, s=1), keys = [step 0 rows 0..3 | step 1 rows 0..3]:
        row 0: . . . .  X . . .      (row 0 is not valid at step 1: it sees itself only)
        row 1: X . . .  . X . .
        row 2: X X . .  . . X .
        row 3: X X X .  . . . X
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.heads.eagle import EagleWeights, rope_frequencies

torch = require("torch")                 # build and training time only: the runtime never imports heads/
nn, f = torch.nn, torch.nn.functional


@dataclass(frozen=True)
class HeadShape:
    """The sizes and biases a head config names."""
    version: int                 # 1 or 3
    hidden: int                  # H, the target's width
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int                   # V, the target's vocabulary
    draft_vocab: int             # Vd (EAGLE-3; EAGLE-1: V, logits through the target's lm_head)
    eps: float
    fc_bias: bool                # EAGLE-1's fc.bias (its config's "bias", default true); EAGLE-3: none
    qkv_bias: bool = False       # q/k/v biases (heads of targets whose attention has them)

    @classmethod
    def from_config(cls, cfg: dict, version: int, *, qkv_bias: bool = False) -> "HeadShape":
        heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        return cls(version=version, hidden=hidden, heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate=int(cfg["intermediate_size"]),
                   vocab=int(cfg["vocab_size"]), draft_vocab=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
                   eps=float(cfg.get("rms_norm_eps", 1e-6)), fc_bias=version == 1 and bool(cfg.get("bias", True)),
                   qkv_bias=qkv_bias)


def ttt_mask(T: int, s: int, device=None):
    """[T, (s+1)T] bool: which keys (steps 0..s, T rows each) row i of step s sees (module docstring)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None]
    blocks = [j <= i - s] + [j == i - s + t for t in range(1, s + 1)]
    return torch.cat(blocks, 1)


def make_head(weights: EagleWeights):
    """The published head as loaded (heads/eagle.py's load_eagle), in eval mode: the reference the head
    graph is checked against. Keys the module has no use for (an EAGLE-1 head's input norm or embedding)
    are left out; a parameter the weights lack is an error."""
    w = weights
    prefix = "midlayer." if w.version == 3 else "layers.0."
    config = {**w.config, "draft_vocab_size": w.draft_vocab} if w.version == 3 else w.config
    head = EagleHead(config, w.version, lm_head=None, ids=w.target_ids(), seed=0, init_std=0.0,
                     qkv_bias=f"{prefix}self_attn.q_proj.bias" in w.tensors)
    params = dict(head.named_parameters())          # d2t and t2d: made from target_ids() above
    missing = [k for k in params if k not in w.tensors]
    if missing:
        raise SpecexportError(f"eagle.path: {w.path}: no {missing} for an EAGLE-{w.version} head")
    head.load_state_dict({k: w.tensors[k] for k in params}, strict=False)
    return head.eval()


def trainable_head(config: dict, version: int, *, lm_head=None, ids=None, seed: int = 0, init_std: float = 0.02):
    """A fresh head for `config` (head_config's): linear weights ~ N(0, init_std) (seeded), norms at one,
    fc.bias at zero; EAGLE-3's lm_head a copy of `lm_head` [V, H] (the target's), its rows `ids` (the
    draft vocabulary, sorted) when given."""
    return EagleHead(config, version, lm_head=lm_head, ids=ids, seed=seed, init_std=init_std)


class Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


def linear(n_in, n_out, bias=False):
    return nn.Linear(n_in, n_out, bias=bias)


class Layer(nn.Module):                      # names as in the published checkpoints
    def __init__(self, s: HeadShape, width_in: int, eagle3: bool):
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.q_proj = linear(width_in, s.heads * s.head_dim, s.qkv_bias)
        self.self_attn.k_proj = linear(width_in, s.kv_heads * s.head_dim, s.qkv_bias)
        self.self_attn.v_proj = linear(width_in, s.kv_heads * s.head_dim, s.qkv_bias)
        self.self_attn.o_proj = linear(s.heads * s.head_dim, s.hidden)
        self.mlp = nn.Module()
        self.mlp.gate_proj = linear(s.hidden, s.intermediate)
        self.mlp.up_proj = linear(s.hidden, s.intermediate)
        self.mlp.down_proj = linear(s.intermediate, s.hidden)
        self.post_attention_layernorm = Norm(s.hidden)
        if eagle3:
            self.hidden_norm = Norm(s.hidden)
            self.input_layernorm = Norm(s.hidden)


class EagleHead(nn.Module):
    """forward(embeds [B, T, H], features [B, T, F], positions [T], mask [T, T] bool, lm_head [V, H]
    (EAGLE-1: the target's), own_hidden) -> (logits [B, T, V | Vd], hidden [B, T, H]). `features` are
    the target's (EAGLE-1: final post-norm state; EAGLE-3: its three aux inputs, concatenated) at the
    position before each token, or the head's own previous `hidden` when it drafts further (EAGLE-3
    then skips fc: own_hidden=True). unroll(...) runs the training-time test over all rows at once."""

    def __init__(self, config: dict, version: int, *, lm_head, ids, seed, init_std, qkv_bias=False):
        super().__init__()
        self.shape = s = HeadShape.from_config(config, version, qkv_bias=qkv_bias)
        inv_freq, self.rope_scale = rope_frequencies(copy.deepcopy(config), s.head_dim)
        self.register_buffer("inv_freq", torch.from_numpy(inv_freq), persistent=False)   # [D/2]
        H = s.hidden
        if s.version == 3:
            self.fc = linear(3 * H, H)
            self.midlayer = Layer(s, 2 * H, eagle3=True)
            self.norm = Norm(H)
            self.lm_head = linear(H, s.draft_vocab)
            # without ids: the full vocabulary, or (a reduced one) placeholders for load_state_dict
            ids_t = torch.arange(s.draft_vocab) if ids is None else torch.as_tensor(ids, dtype=torch.long)
            assert len(ids_t) == s.draft_vocab, (len(ids_t), s.draft_vocab)
            self.register_buffer("d2t", ids_t - torch.arange(len(ids_t)))                # [Vd] int64
            self.register_buffer("t2d", torch.isin(torch.arange(s.vocab), ids_t))       # [V] bool
        else:
            self.fc = linear(2 * H, H, bias=s.fc_bias)
            self.layers = nn.ModuleList([Layer(s, H, eagle3=False)])
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name == "fc.bias" or name.endswith("_proj.bias"):
                    p.zero_()
                elif name == "lm_head.weight" and lm_head is not None:
                    p.copy_(lm_head.detach().float().cpu()[ids_t])
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * init_std)

    @property
    def layer(self):
        return self.midlayer if self.shape.version == 3 else self.layers[0]

    def target_ids(self):
        """[Vq] the target id of each logit's column."""
        if self.shape.version == 1:
            return torch.arange(self.shape.vocab, device=self.fc.weight.device)
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    # -- the arithmetic, in pieces ---------------------------------------------------------

    def _norm(self, x, weight):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.shape.eps))

    def _rope(self, x, positions):                                  # x [B, heads, T, D]
        d = self.shape.head_dim
        ang = positions.float()[:, None] * self.inv_freq[None]      # [T, D/2]
        cos = torch.cat([ang, ang], -1).cos() * self.rope_scale
        sin = torch.cat([ang, ang], -1).sin() * self.rope_scale
        half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + half * sin

    def _inputs(self, embeds, features, own_hidden):
        """-> (hidden [B, T, H], the attention's input x [B, T, H | 2H])."""
        if self.shape.version == 1:
            hidden = self.fc(torch.cat([embeds, features], -1))
            return hidden, hidden                                   # no input norm
        hidden = features if own_hidden else self.fc(features)
        layer = self.layer
        return hidden, torch.cat([self._norm(embeds, layer.input_layernorm.weight),
                                  self._norm(hidden, layer.hidden_norm.weight)], -1)

    def _project(self, x, positions):
        """-> q [B, heads, T, D], k and v [B, kv_heads, T, D], RoPE applied to q and k."""
        s, attn = self.shape, self.layer.self_attn
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, n, s.head_dim).transpose(1, 2)
                   for proj, n in ((attn.q_proj, s.heads), (attn.k_proj, s.kv_heads), (attn.v_proj, s.kv_heads)))
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(self, hidden, q, k, *, v, mask):
        """hidden [B, T, H], q [B, heads, T, D], k/v [B, kv, K, D], mask [T, K] -> out [B, T, H]."""
        s, layer = self.shape, self.layer
        b, _, t, _ = q.shape
        g = s.heads // s.kv_heads
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(s.head_dim)
        scores = scores.masked_fill(~mask[None, None], float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, s.heads * s.head_dim)
        h = hidden + layer.self_attn.o_proj(attn)
        y = self._norm(h, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        return h + mlp.down_proj(f.silu(mlp.gate_proj(y)) * mlp.up_proj(y))

    def _logits(self, out, lm_head):
        if self.shape.version == 1:
            return f.linear(out, lm_head)
        return self.lm_head(self._norm(out, self.norm.weight))

    def forward(self, embeds, features, positions, mask, lm_head=None, own_hidden: bool = False):
        hidden, x = self._inputs(embeds, features, own_hidden)
        q, k, v = self._project(x, positions)
        out = self._attend(hidden, q, k, v=v, mask=mask)
        return self._logits(out, lm_head), out

    def unroll(self, embeds, features, steps: int, *, lm_head=None, embed_next=None):
        """The training-time test over all T rows at once: embeds [B, T, H] of x_1..x_T, features
        [B, T, F] f_0..f_{T-1} -> [(logits [B, T, Vq], hidden [B, T, H]) for step 0..steps-1].

        Every step's K/V are kept and concatenated; `ttt_mask` gives each row its chain. With
        `embed_next` (logits [B, T, Vq] -> embeds [B, T, H] of the tokens they draft) a step's row i
        reads the token that row i-1 drafted at the step before: greedy chain drafting from every
        root at once (evaluation); without it the true tokens (teacher forcing, training)."""
        T = embeds.shape[1]
        positions = torch.arange(T, device=embeds.device)
        keys, values, results = [], [], []
        emb, feat = embeds, features
        for s in range(steps):
            hidden, x = self._inputs(emb, feat, own_hidden=s > 0)
            q, k, v = self._project(x, positions)
            keys.append(k)
            values.append(v)
            out = self._attend(hidden, q, torch.cat(keys, 2), v=torch.cat(values, 2),
                               mask=ttt_mask(T, s, embeds.device))
            logits = self._logits(out, lm_head)
            results.append((logits, out))
            feat = _shift(out)                                      # row i reads row i-1's output
            if embed_next is not None:
                emb = _shift(embed_next(logits))
        return results


def _shift(x):                                                     # [B, T, ...] one row down
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
