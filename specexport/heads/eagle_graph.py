"""An EAGLE head as an ONNX graph with a KV cache of its own (EagleIO in io_spec.py), and its check
against the published head in PyTorch (heads/eagle_torch.py's `make_head`).

    input_ids [B,T]   features [B,T,F]   draft_hidden [B,T,H]   position_ids [B,T]   attention_mask [B,T,P+T]
        |                  |                    |                     |                      |
    embed (target's)       |                    |               RoPE (the head's)     bias 0 / min
    EAGLE-1:  hidden = x = fc(concat(emb, features + draft_hidden))
    EAGLE-3:  hidden = fc(features) + draft_hidden ;  x = concat(input_norm(emb), hidden_norm(hidden))  [2H]
        q, k, v (x) -> RoPE -> GroupQueryAttention(cache past_key.0 / past_value.0, the mask) ; h = hidden + o_proj
        out = h + mlp(post_norm(h))                                   -> hidden_states [B,T,H]
        rows logits_rows -> EAGLE-1: target lm_head(out) ; EAGLE-3: lm_head(norm(out))
        -> log_softmax -> top-K                                       -> topk_ids, topk_logprobs [B,R,K]

A row reads either the target's feature or the head's own state, never both: the other input is zero
(fc has no bias in EAGLE-3, and EAGLE-1 adds the two before fc), so one graph serves the rows that
catch up on the target's features and the draft levels that continue from the head's own state,
without an If node. What it costs: the EAGLE-3 fc matmul also runs on the draft levels' zero rows
(a tenth of the head's weights). The cache is updated in place like the target's (gqa.py), and the
mask covers every cached row, so a draft level sees exactly its ancestors among earlier levels.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.heads.eagle import EagleWeights, rope_frequencies
from specexport.heads.eagle_torch import make_head
from specexport.io_spec import (
    DYNAMIC_AXES,
    HIDDEN_STATES,
    TOPK_IDS,
    TOPK_LOGPROBS,
    EagleIO,
)


def graph_module(w: EagleWeights, embed: np.ndarray, lm_head: np.ndarray | None, top_k: int):
    """The head as an nn.Module with EagleIO's inputs and outputs (what is exported). embed [V, H] is
    the target's embedding; lm_head [V, H] the target's (EAGLE-1 only)."""
    torch = require("torch")
    from specexport.export.gqa import group_query_attention, lengths

    nn, F, onnx_ops = torch.nn, torch.nn.functional, torch.onnx.ops
    cfg = w.config

    class EagleGraph(nn.Module):
        def __init__(self):
            super().__init__()
            self.version = w.version
            self.heads = int(cfg["num_attention_heads"])
            self.kv_heads = int(cfg.get("num_key_value_heads") or self.heads)
            self.head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // self.heads)
            self.eps = float(cfg.get("rms_norm_eps", 1e-6))
            inv_freq, scale = rope_frequencies(cfg, self.head_dim)
            self.rope_scale = scale
            self.register_buffer("inv_freq", torch.from_numpy(inv_freq), persistent=False)
            def frozen(a):
                return nn.Parameter(torch.as_tensor(np.ascontiguousarray(a), dtype=torch.float32),
                                    requires_grad=False)

            self.embed = frozen(embed)                                        # [V, H]
            if w.version == 1:                                                # tied: one tensor, not two
                self.lm_head = self.embed if lm_head is embed else frozen(lm_head)
            prefix = "layers.0." if w.version == 1 else "midlayer."
            self.t = nn.ParameterDict({k.replace(".", "_"): frozen(v.numpy()) for k, v in w.tensors.items()
                                       if v.dtype == torch.float32 and k != "t2d"})
            self.prefix = prefix.replace(".", "_")

        def p(self, key):                       # a weight by its published key, None when absent
            return self.t[key.replace(".", "_")] if key.replace(".", "_") in self.t else None

        def layer(self, key):
            return self.p(self.prefix + key.replace(".", "_"))

        def norm(self, x, weight):
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

        def forward(self, input_ids, position_ids, attention_mask, logits_rows, features, draft_hidden,
                    cache_k, cache_v):
            emb = F.embedding(input_ids, self.embed)                           # [B, T, H] (a Gather)
            if self.version == 1:
                hidden = F.linear(torch.cat([emb, features + draft_hidden], -1), self.p("fc.weight"),
                                  self.p("fc.bias"))
                x = hidden
            else:
                hidden = F.linear(features, self.p("fc.weight")) + draft_hidden
                x = torch.cat([self.norm(emb, self.layer("input_layernorm.weight")),
                               self.norm(hidden, self.layer("hidden_norm.weight"))], -1)       # [B, T, 2H]
            q = F.linear(x, self.layer("self_attn.q_proj.weight"), self.layer("self_attn.q_proj.bias"))
            k = F.linear(x, self.layer("self_attn.k_proj.weight"), self.layer("self_attn.k_proj.bias"))
            v = F.linear(x, self.layer("self_attn.v_proj.weight"), self.layer("self_attn.v_proj.bias"))
            angles = position_ids.float().unsqueeze(-1) * self.inv_freq                       # [B, T, D/2]
            cos, sin = angles.cos() * self.rope_scale, angles.sin() * self.rope_scale
            q = onnx_ops.rotary_embedding(q, cos, sin, num_heads=self.heads)
            k = onnx_ops.rotary_embedding(k, cos, sin, num_heads=self.kv_heads)
            zero = torch.zeros((), dtype=torch.float32)
            bias = torch.where(attention_mask, zero, torch.finfo(torch.float32).min).unsqueeze(1)   # [B,1,T,P+T]
            seqlens_k, total = lengths(attention_mask)
            attn, cache_k, cache_v = group_query_attention(q, k, v, cache_k, cache_v, seqlens_k, total, bias,
                                                           self.heads, self.kv_heads, 1.0 / math.sqrt(self.head_dim))
            h = hidden + F.linear(attn, self.layer("self_attn.o_proj.weight"))
            y = self.norm(h, self.layer("post_attention_layernorm.weight"))
            y = F.linear(F.silu(F.linear(y, self.layer("mlp.gate_proj.weight"))) * F.linear(y, self.layer("mlp.up_proj.weight")),
                         self.layer("mlp.down_proj.weight"))
            out = h + y                                                        # [B, T, H]
            rows = torch.gather(out, 1, logits_rows.unsqueeze(-1).expand(-1, -1, out.shape[-1]))   # [B, R, H]
            logits = F.linear(rows, self.lm_head) if self.version == 1 else \
                F.linear(self.norm(rows, self.p("norm.weight")), self.p("lm_head.weight"))
            values, ids = torch.topk(torch.log_softmax(logits, -1), top_k, dim=-1)                # [B, R, K]
            return ids, values, out, cache_k, cache_v

    return EagleGraph().eval()


def io_for(w: EagleWeights, *, target_hidden: int, top_k: int) -> EagleIO:
    cfg = w.config
    heads = int(cfg["num_attention_heads"])
    return EagleIO(version=w.version, hidden_size=target_hidden,
                   feature_width=target_hidden * (3 if w.version == 3 else 1),
                   num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads), top_k=top_k)


def export_head(w: EagleWeights, embed: np.ndarray, lm_head, *, io: EagleIO, onnx_path: Path) -> list[Path]:
    """The head's ONNX graph (+ external data) with the EagleIO contract; returns the files written."""
    torch = require("torch")
    from specexport.export import gqa
    from specexport.export.to_onnx import OPSET, check_graph_io, quiet_exporter

    module = graph_module(w, embed, lm_head, io.top_k)
    B, T, P, R, C = 2, 3, 4, 2, 16             # every dynamic size >= 2 and distinct (to_onnx.example_inputs)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, T, P + T, dtype=torch.bool)
    mask[:, :, P:] = torch.tril(torch.ones(T, T, dtype=torch.bool))
    kv = (B, io.num_kv_heads, C, io.head_dim)
    args = (torch.randint(0, embed.shape[0], (B, T), generator=g), (torch.arange(T) + P).expand(B, T).contiguous(),
            mask, torch.arange(T - R, T).expand(B, R).contiguous(),
            torch.randn(B, T, io.feature_width, generator=g), torch.randn(B, T, io.hidden_size, generator=g),
            torch.randn(kv, generator=g), torch.randn(kv, generator=g))
    dims = {s: torch.export.Dim(s, min=1) for s in DYNAMIC_AXES}
    shapes = tuple({i: dims[a] for i, a in enumerate(t.axes) if isinstance(a, str)} for t in io.inputs)
    with torch.no_grad(), quiet_exporter():
        torch.onnx.export(module, args, str(onnx_path), input_names=io.input_names, output_names=io.output_names,
                          dynamic_shapes=shapes, dynamo=True, opset_version=OPSET, external_data=True,
                          verbose=False, optimize=True, custom_translation_table=gqa.translation_table())
    check_graph_io(onnx_path, io)
    return [p for p in (onnx_path, onnx_path.with_name(onnx_path.name + ".data")) if p.exists()]


# -- the check against the published head ------------------------------------------------------------

def head_parity(w: EagleWeights, embed: np.ndarray, lm_head, *, io: EagleIO, onnx_path: Path, tokens: np.ndarray,
                features: np.ndarray, session=None) -> dict:
    """The graph in ONNX Runtime against `make_head` in PyTorch.

    tokens [S + 1] and the target's features [S, F] at positions 0..S-1 (its own, from the target
    graph): head row j reads token j + 1 with feature j. Phases: the rows in two calls (a prefill, then
    the rest after it in the cache), then three draft levels of a small tree grown from the last row,
    each level in one call whose mask shows every row its ancestors among the earlier levels' cached
    rows. Each row's reference is `make_head` on the committed rows plus the row's own path.
    Compared: the top-K log-probs (at the graph's ids, and the reference's own top K) and the output
    hidden state, relative to their largest magnitude. Returns {max_rel_error, per_phase, rows}."""
    if session is None:
        from specexport.runtime.backends.ort import base_options

        ort = require("onnxruntime")
        opts = base_options()
        opts.add_session_config_entry("session.disable_prepacking", "1")
        session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    check = _Parity(w, embed, lm_head, io, session)
    S = len(features)
    rows = np.asarray(tokens[1:S + 1], np.int64)                                # [S] row j reads token j + 1
    ref_lp, ref_h = check.reference(rows, features, np.zeros((0, io.hidden_size), np.float32))
    split = max(1, S // 2)
    check.run(rows[:split], features[:split], None, np.arange(split), None, "prefill",
              list(zip(ref_lp[:split], ref_h[:split])))
    ids, _ = check.run(rows[split:], features[split:], None, np.arange(split, S), None, "catch_up",
                       list(zip(ref_lp[split:], ref_h[split:])))
    check.tree(rows, features, ids[-1], ref_h[-1])
    return {"max_rel_error": max(check.errors.values()), "per_phase": check.errors, "rows": check.count}


class _Parity:
    """head_parity's two sides: the graph's session with its caches, and make_head's reference; the worst
    relative error per phase."""

    def __init__(self, w: EagleWeights, embed: np.ndarray, lm_head, io: EagleIO, session):
        self.torch = torch = require("torch")
        self.w, self.io, self.session, self.head = w, io, session, make_head(w)
        self.embed = torch.from_numpy(np.ascontiguousarray(embed))
        self.lm = None if lm_head is None else torch.from_numpy(np.ascontiguousarray(lm_head))
        self.past = io.empty_caches()
        self.errors, self.count = {}, 0

    def reference(self, row_tokens, feats, own):
        """make_head over a chain of rows: feats [n, F] target features for the first rows, then own
        hidden states [m, H] (EAGLE-3: fc skipped; EAGLE-1: they are the features)."""
        torch, head = self.torch, self.head
        with torch.no_grad():
            f = torch.from_numpy(np.asarray(feats, np.float32))
            if self.w.version == 3:
                f = head.fc(f)
            f = torch.cat([f, torch.from_numpy(np.asarray(own, np.float32).reshape(-1, f.shape[-1]))])
            n = len(row_tokens)
            logits, hidden = head(self.embed[torch.from_numpy(np.asarray(row_tokens))][None], f[None],
                                  torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), self.lm, own_hidden=True)
            return torch.log_softmax(logits[0], -1).numpy(), hidden[0].numpy()

    def run(self, toks, feats, own, positions, mask, phase, refs):
        """One graph call, its caches kept; each row compared with its reference (log-probs, hidden)."""
        io = self.io
        outs = dict(zip(io.output_names, self.session.run(None, io.feeds(
            toks, features=feats, draft_hidden=own, positions=positions, mask=mask, past=self.past))))
        self.past = [outs[n] for n in io.present_names(0)]
        ids, values, hidden = outs[TOPK_IDS][0], outs[TOPK_LOGPROBS][0], outs[HIDDEN_STATES][0]
        for r, (ref_lp, ref_hidden) in enumerate(refs):
            at_ids = ref_lp[ids[r]]
            top = -np.sort(-ref_lp)[:io.top_k]
            scale_lp = max(float(np.abs(top).max()), 1e-30)
            scale_h = max(float(np.abs(ref_hidden).max()), 1e-30)
            err = max(float(np.abs(at_ids - values[r]).max()) / scale_lp, float(np.abs(top - values[r]).max()) / scale_lp,
                      float(np.abs(ref_hidden - hidden[r]).max()) / scale_h)
            self.errors[phase] = max(self.errors.get(phase, 0.0), err)
            self.count += 1
        return ids, hidden

    def tree(self, rows, features, root_ids, root_hidden):
        """Three draft levels grown from the last row: 2 children, then 2 + 1, then 1 each; a node is
        (token, own hidden input, ancestors), its ancestors' cache rows visible and nothing else."""
        S = len(features)
        level = [_Node(int(t), root_hidden, ()) for t in root_ids[:2]]
        for depth in range(1, 4):
            P = self.past[0].shape[2]
            mask = np.zeros((len(level), P + len(level)), bool)
            mask[:, :S] = True
            refs = []
            for i, node in enumerate(level):
                node.row = P + i
                mask[i, [a.row for a in node.ancestors]] = True
                mask[i, P + i] = True
                chain = (*node.ancestors, node)
                lp, hid = self.reference(np.concatenate([rows, [a.token for a in chain]]), features,
                                         np.stack([a.own for a in chain]))
                node.hidden = hid[-1]
                refs.append((lp[-1], hid[-1]))
            ids, _ = self.run(np.array([n.token for n in level]), None, np.stack([n.own for n in level]),
                              np.full(len(level), S + depth - 1), mask, "tree", refs)
            widths = [2, 1] if depth == 1 else [1] * len(level)
            level = [_Node(int(ids[i][c]), node.hidden, (*node.ancestors, node))
                     for i, node in enumerate(level) for c in range(widths[i] if i < len(widths) else 1)]


class _Node:
    """A draft-tree node in head_parity: its token, the hidden state it reads (its parent's output),
    its ancestors, and once run, its cache row and reference output state."""

    def __init__(self, token: int, own: np.ndarray, ancestors: tuple):
        self.token, self.own, self.ancestors = token, own, ancestors
        self.row, self.hidden = -1, None
