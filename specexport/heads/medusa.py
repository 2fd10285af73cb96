"""Medusa heads: the published formats, the published math in PyTorch, and the heads' ONNX graph.

Formats (ANCHORS.md "On-disk formats"), all read by key, never by `medusa_num_heads` (wrong in
published configs):
  medusa-1   medusa_lm_head.safetensors or medusa_lm_head.pt: per head h, residual blocks
             `{h}.{l}.linear.weight` [H, H] and `.bias` [H] for l < L, then `{h}.{L}.weight` [V, H]
  v2         the same without `{h}.{L}.weight`: the head reuses the target's lm_head
  medusa-2   a full model whose checkpoint holds the heads under the prefix `medusa_head.`
Head h maps the target's final post-norm hidden state x at position i to the distribution of token
i + 2 + h:  x -> x + SiLU(W_l x + b_l) for each block -> projection.

`MedusaReference` is that math as Medusa writes it (nn.Sequential of residual blocks and a Linear,
loaded with the published keys); `MedusaGraph` is what is exported (all heads at once, batched
matmuls, top-k in the graph, so the runtime reads N x K ids instead of N x V logits). The build
checks one against the other on the target's own hidden states.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.io_spec import HIDDEN_STATES, HeadsIO

HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
FULL_MODEL_PREFIX = "medusa_head."
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


@dataclass(frozen=True)
class MedusaWeights:
    file: Path                       # the file the heads were read from
    format: str                      # "medusa-1" | "medusa-2"
    blocks: tuple                    # per head: ((W [H, H], b [H]), ...) float32 numpy, L blocks each
    projections: tuple               # per head: [V, H], or None when the head reuses the target's lm_head
    config_num_heads: int | None     # what config.json claims (for the record; not used)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    @property
    def num_layers(self) -> int:
        return len(self.blocks[0])

    @property
    def lm_head(self) -> str:
        return "target" if self.projections[0] is None else "own"


def find_head_file(path: Path) -> tuple[Path, str, str]:
    """(file, format, key prefix) of the heads in a folder; raises naming what was looked for."""
    for name in HEAD_FILES:
        if (path / name).is_file():
            return path / name, "medusa-1", ""
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("pytorch_model*.bin")):
        if any(k.startswith(FULL_MODEL_PREFIX) for k in _keys(f)):
            return f, "medusa-2", FULL_MODEL_PREFIX
    raise SpecexportError(f"medusa.path: {path} holds no Medusa heads (looked for {' or '.join(HEAD_FILES)}, and "
                          f"for keys '{FULL_MODEL_PREFIX}*' in its *.safetensors / pytorch_model*.bin)")


def load_medusa(path: Path, *, hidden_size: int, vocab_size: int) -> MedusaWeights:
    """Read and check the heads in `path` against the target's hidden size and vocabulary."""
    path = Path(path)
    file, fmt, prefix = find_head_file(path)
    tensors = {k[len(prefix):]: v for k, v in _read(file, prefix).items()}
    where = f"medusa.path: {file.name}"
    parts: dict[int, dict[int, dict[str, np.ndarray]]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if not m:
            raise SpecexportError(f"{where}: unexpected key {key!r} (Medusa heads have '{{head}}.{{layer}}.linear."
                                  f"weight', '.linear.bias' and '{{head}}.{{L}}.weight')")
        parts.setdefault(int(m[1]), {}).setdefault(int(m[2]), {})[m[3]] = value
    if sorted(parts) != list(range(len(parts))) or not parts:
        raise SpecexportError(f"{where}: head indices {sorted(parts)} are not 0..N-1")
    blocks, projections = [], []
    for h in range(len(parts)):
        layers = parts[h]
        n_blocks = sum(1 for d in layers.values() if "linear.weight" in d)
        if sorted(layers) not in (list(range(n_blocks)), list(range(n_blocks + 1))):
            raise SpecexportError(f"{where}: head {h} has layers {sorted(layers)}; expected residual blocks "
                                  f"0..L-1 and optionally the projection L")
        head = []
        for j in range(n_blocks):
            w, b = layers[j].get("linear.weight"), layers[j].get("linear.bias")
            _shape(where, f"{h}.{j}.linear.weight", w, (hidden_size, hidden_size))
            _shape(where, f"{h}.{j}.linear.bias", b, (hidden_size,))
            head.append((w, b))
        blocks.append(tuple(head))
        proj = layers.get(n_blocks, {}).get("weight")
        if proj is not None:
            _shape(where, f"{h}.{n_blocks}.weight", proj, (vocab_size, hidden_size))
        projections.append(proj)
    if len({len(b) for b in blocks}) != 1 or len({p is None for p in projections}) != 1:
        raise SpecexportError(f"{where}: heads differ in their layers (blocks per head {[len(b) for b in blocks]}, "
                              f"own projection {[p is not None for p in projections]})")
    config = {}
    if (path / "config.json").is_file():
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            config = {}
    claimed = config.get("medusa_num_heads") if isinstance(config, dict) else None
    return MedusaWeights(file, fmt, tuple(blocks), tuple(projections),
                         claimed if isinstance(claimed, int) else None)


def _shape(where, key, value, expected) -> None:
    if value is None:
        raise SpecexportError(f"{where}: missing key {key!r}")
    if tuple(value.shape) != expected:
        raise SpecexportError(f"{where}: {key} has shape {list(value.shape)}, expected {list(expected)} "
                              f"(the target's hidden size / vocabulary)")


def _keys(file: Path) -> list[str]:
    if file.suffix == ".safetensors":
        with require("safetensors").safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    return list(_torch_load(file))


def _read(file: Path, prefix: str) -> dict[str, np.ndarray]:
    """The tensors under `prefix` as float32 numpy (bf16/fp16 checkpoints are upcast)."""
    if file.suffix == ".safetensors":
        with require("safetensors").safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k).float().numpy() for k in f.keys() if k.startswith(prefix)}
    return {k: v.float().numpy() for k, v in _torch_load(file).items() if k.startswith(prefix)}


def _torch_load(file: Path) -> dict:
    torch = require("torch")
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:                    # pickle errors, zip errors, unsupported objects
        raise SpecexportError(f"medusa.path: {file} could not be read as a PyTorch state dict ({err})") from None
    if not isinstance(state, dict):
        raise SpecexportError(f"medusa.path: {file} holds a {type(state).__name__}, expected a state dict")
    return state


# -- PyTorch: the published math, and the graph we export --------------------------------------------
def reference_module(weights: MedusaWeights, lm_head: np.ndarray | None):
    """Medusa's own head structure (ResBlock = x + SiLU(Linear(x)); nn.Sequential per head), loaded
    with the published keys: the reference the exported graph is checked against."""
    torch = require("torch")
    nn = torch.nn

    class ResBlock(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.linear = nn.Linear(h, h)
            self.act = nn.SiLU()

        def forward(self, x):
            return x + self.act(self.linear(x))

    V, H = (lm_head if lm_head is not None else weights.projections[0]).shape
    heads = nn.ModuleList([nn.Sequential(*[ResBlock(H) for _ in range(weights.num_layers)],
                                         nn.Linear(H, V, bias=False)) for _ in range(weights.num_heads)])
    state = {}
    for h, (blocks, proj) in enumerate(zip(weights.blocks, weights.projections)):
        for j, (w, b) in enumerate(blocks):
            state[f"{h}.{j}.linear.weight"], state[f"{h}.{j}.linear.bias"] = torch.from_numpy(w), torch.from_numpy(b)
        state[f"{h}.{weights.num_layers}.weight"] = torch.from_numpy(lm_head if proj is None else proj)
    heads.load_state_dict(state)
    return heads.eval()


def graph_module(weights: MedusaWeights, lm_head: np.ndarray | None, top_k: int):
    """All heads in one module: hidden [B, T, H] -> (ids [B, T, N, K], log-probs [B, T, N, K]). Each
    head's Linear is a MatMul of its own 2-D weight (not one batched [N, H, H] product), so the graph's
    weights are matrices quant/graph_blocks.py can put on our kernels."""
    torch = require("torch")
    nn, F = torch.nn, torch.nn.functional

    def frozen(a):
        return nn.Parameter(torch.from_numpy(np.ascontiguousarray(a, np.float32)), requires_grad=False)

    class MedusaGraph(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.ParameterList([frozen(w) for blocks in weights.blocks for w, _ in blocks])     # [H, H] each
            self.b = nn.ParameterList([frozen(b) for blocks in weights.blocks for _, b in blocks])
            self.shared = weights.projections[0] is None          # the target's lm_head for every head
            self.proj = nn.ParameterList([frozen(lm_head)] if self.shared else [frozen(p) for p in weights.projections])

        def forward(self, hidden):
            L, outs = weights.num_layers, []
            for h in range(weights.num_heads):
                x = hidden
                for j in range(L):
                    x = x + F.silu(F.linear(x, self.w[h * L + j], self.b[h * L + j]))
                outs.append(x if self.shared else F.linear(x, self.proj[h]))
            logits = F.linear(torch.stack(outs, 2), self.proj[0]) if self.shared else torch.stack(outs, 2)
            values, ids = torch.topk(torch.log_softmax(logits, dim=-1), top_k, dim=-1)          # [B, T, N, K]
            return ids, values

    return MedusaGraph().eval()


def export_heads(weights: MedusaWeights, lm_head: np.ndarray | None, io: HeadsIO, *, onnx_path: Path) -> list[Path]:
    """The heads' ONNX graph (+ external data) with the HeadsIO contract; returns the files written."""
    torch = require("torch")
    from specexport.export.to_onnx import OPSET, quiet_exporter, check_graph_io

    module = graph_module(weights, lm_head, io.top_k)
    hidden = torch.randn(2, 3, io.hidden_size, generator=torch.Generator().manual_seed(0))
    dims = {0: torch.export.Dim("batch", min=1), 1: torch.export.Dim("tokens", min=1)}
    with torch.no_grad(), quiet_exporter():
        torch.onnx.export(module, (hidden,), str(onnx_path), input_names=io.input_names,
                          output_names=io.output_names, dynamic_shapes=(dims,), dynamo=True, opset_version=OPSET,
                          external_data=True, verbose=False, optimize=True)
    check_graph_io(onnx_path, io)
    return [p for p in (onnx_path, onnx_path.with_name(onnx_path.name + ".data")) if p.exists()]


def heads_parity(weights: MedusaWeights, lm_head: np.ndarray | None, io: HeadsIO, *, onnx_path: Path,
                 hidden: np.ndarray, session=None) -> dict:
    """The graph in ONNX Runtime against the reference on hidden states [S, H]: the graph's log-probs
    must equal the reference's at the ids the graph chose, and the reference's own top-K values (so
    the ids are a true top-K up to ties). Returns {max_rel_error, max_abs_error, rows}."""
    torch = require("torch")
    ort = require("onnxruntime")
    with torch.no_grad():
        ref = torch.log_softmax(torch.stack([head(torch.from_numpy(hidden)) for head in
                                             reference_module(weights, lm_head)], dim=1), -1).numpy()   # [S, N, V]
    if session is None:
        from specexport.runtime.backends.ort import base_options

        session = ort.InferenceSession(str(onnx_path), base_options(), providers=["CPUExecutionProvider"])
    ids, values = session.run(None, {HIDDEN_STATES: hidden[None].astype(np.float32)})
    ids, values = ids[0], values[0]                                            # [S, N, K]
    at_ids = np.take_along_axis(ref, ids, axis=-1)
    ref_top = -np.sort(-ref, axis=-1)[..., :io.top_k]
    error = max(float(np.abs(at_ids - values).max()), float(np.abs(ref_top - values).max()))
    scale = max(float(np.abs(ref_top).max()), 1e-30)
    return {"max_rel_error": error / scale, "max_abs_error": error, "rows": int(hidden.shape[0])}


def target_states(session, io, tokens: np.ndarray, *, outputs=(HIDDEN_STATES,)) -> list[np.ndarray]:
    """The target graph's `outputs` (an open ORT session) over `tokens`, one causal prefill without
    past, batch row 0: hidden_states [S, H], logits [S, V]."""
    return [out[0] for out in session.run(list(outputs), io.feeds(np.asarray(tokens)[None]))]


def save_medusa_1(path: Path, blocks, projections, *, base_model: str = "", dtype=np.float32) -> list[Path]:
    """Write heads in the published Medusa-1 layout: medusa_lm_head.safetensors with the keys
    `{h}.{l}.linear.weight/bias` and `{h}.{L}.weight` (omitted for heads that reuse the target's
    lm_head: projections None, the "version 2" layout) + config.json. Returns the files written."""
    save_file = require("safetensors.numpy").save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for h, head in enumerate(blocks):
        for j, (w, b) in enumerate(head):
            tensors[f"{h}.{j}.linear.weight"] = np.ascontiguousarray(w, dtype)
            tensors[f"{h}.{j}.linear.bias"] = np.ascontiguousarray(b, dtype)
        if projections[h] is not None:
            tensors[f"{h}.{len(head)}.weight"] = np.ascontiguousarray(projections[h], dtype)
    save_file(tensors, str(path / HEAD_FILES[0]))
    config = {"medusa_num_heads": len(blocks), "medusa_num_layers": len(blocks[0]),
              "base_model_name_or_path": base_model, "version": "2" if projections[0] is None else "1"}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [path / HEAD_FILES[0], path / "config.json"]
