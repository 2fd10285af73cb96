"""The parity reference of a lean build: the Hugging Face model computed one decoder layer at a time,
each layer's weights dequantized from the GGUF file when it is reached and dropped after.

What it checks is what the fp32 route's PyTorch check covers, without an fp32 model in memory: the
exported structure (wrapper, exporter, ONNX Runtime), which file tensor went where (names, row orders,
transposes, a tied head) and the in-graph block decoding (quant/gguf_graph.py), all against
transformers' own modules with transformers' own GGUF name map and processing (export/gguf_weights.py).
Memory: one layer in fp32 (the 3B: 0.3 GB), the embedding rows of the sequences' tokens, the head a
block of HEAD_ROWS rows at a time, and the activations.

The sequences of a parity case run together through each layer (validate.case_logits), so the file is
dequantized once per check, not once per sequence.
"""
from __future__ import annotations

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError


HEAD_ROWS = 16384


def layerwise_logits(weights, sequences, *, vocab_rows=None) -> list[np.ndarray]:
    """Each token sequence's logits [S, V] (V: len(vocab_rows) when given) from the GGUF model
    `weights` (GgufWeights), as the HF model computes them in float32."""
    torch, transformers = require("torch"), require("transformers")
    config = weights.config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    inner = model.model
    expected = {"embed_tokens", "layers", "norm", "rotary_emb"}
    if set(dict(inner.named_children())) != expected:          # a model with more parts than the loop below
        raise SpecexportError(f"{type(model).__name__}: the layer-by-layer reference runs {sorted(expected)}; "
                              f"this model has {sorted(dict(inner.named_children()))}")
    rotary = type(inner.rotary_emb)(config=config)

    def tensor(name):
        return torch.from_numpy(weights.get(name))

    with torch.no_grad():
        vocab = np.unique(np.concatenate([np.asarray(s, np.int64) for s in sequences]))
        embed = torch.from_numpy(weights.get_rows("model.embed_tokens.weight", vocab))         # those rows only
        hidden = [embed[torch.as_tensor(np.searchsorted(vocab, s))][None] for s in sequences]  # [1, S, H]
        del embed
        extras = []
        for h in hidden:
            n = h.shape[1]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]      # causal
            extras.append((pos, mask, rotary(h, pos)))
        for i, layer in enumerate(inner.layers):
            _materialize(layer, f"model.layers.{i}.", tensor)
            for j, (pos, mask, rope) in enumerate(extras):
                out = layer(hidden[j], attention_mask=mask, position_ids=pos, position_embeddings=rope)
                hidden[j] = out[0] if isinstance(out, tuple) else out
            layer.to("meta")                                    # this layer's weights go
            weights.release()                                   # and the file's pages read for them
        _materialize(inner.norm, "model.norm.", tensor)
        states = [inner.norm(h)[0] for h in hidden]                                # [S, H] each
        rows = np.arange(config.vocab_size) if vocab_rows is None else np.asarray(vocab_rows, np.int64)
        out = [np.empty((len(x), len(rows)), np.float32) for x in states]
        bias = tensor("lm_head.bias").numpy()[rows] if getattr(model.lm_head, "bias", None) is not None else None
        for r in range(0, len(rows), HEAD_ROWS):                                   # the head, a block at a time
            block = torch.from_numpy(weights.get_rows("lm_head.weight", rows[r:r + HEAD_ROWS]))
            for x, o in zip(states, out):
                o[:, r:r + HEAD_ROWS] = (x @ block.T).numpy()
            weights.release()
        if bias is not None:
            out = [o + bias for o in out]
        return out


def _materialize(module, prefix: str, tensor) -> None:
    """Give a meta-device module its weights from the file (strict: every parameter found)."""
    buffers = [k for k, _ in module.named_buffers()]             # none in the supported decoder layers
    if buffers:
        raise SpecexportError(f"{prefix}{buffers[0]}: a buffer the layer-by-layer reference cannot fill")
    module.to_empty(device="cpu")
    module.load_state_dict({k: tensor(prefix + k) for k, _ in module.named_parameters()}, strict=True)
