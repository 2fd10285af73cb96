"""A GGUF file's tensors by the Hugging Face parameter names transformers gives them, one at a time.

transformers loads a GGUF by dequantizing every tensor at once (the 1.5B: about three fp32 copies of
the model in memory). Here the name map and the per-tensor processing are transformers' own
(`get_gguf_hf_weights_map`, the architecture's TensorProcessor: llama's q/k rows unpermuted, ...),
applied to one tensor when it is asked for, so a caller holds one tensor in memory, not the model:
the checkpoint conversion (export/gguf.py), the lean build's graph filling (quant/gguf_fill.fill)
and the layer-by-layer parity reference (export/gguf_reference.py).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specexport._optional import require
from specexport.errors import SpecexportError

CHUNK_ROWS = 4096


def _weights_map(gguf, get_map, skeleton, processor) -> dict:
    """transformers' GGUF name map, with gguf.get_tensor_name_map memoized while it runs: transformers builds
    that table again for every submodule it recurses into (397 times, ~20 ms each, for a 30-layer model),
    and the table depends on the architecture and the layer count alone."""
    import functools

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        return get_map(skeleton, processor)
    finally:
        gguf.get_tensor_name_map = original


class GgufWeights:
    """`names`: HF parameter name -> GGUF tensor name, for every tensor of the file the model has."""

    def __init__(self, path: Path, config, reader=None):
        """reader: the file's gguf.GGUFReader when the caller has one (parsing a file's fields takes seconds)."""
        torch, transformers, gguf = require("torch"), require("transformers"), require("gguf")
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.path, self.config = Path(path), config
        with torch.device("meta"):                     # the HF parameter names and shapes, no weights
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        self.model_class = type(skeleton).__name__
        self.shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
        self.processor = TENSOR_PROCESSORS.get(config.model_type, TensorProcessor)(config=config.to_dict())
        by_gguf = _weights_map(gguf, get_gguf_hf_weights_map, skeleton, self.processor)
        reader = reader or gguf.GGUFReader(str(self.path))
        self.tensors = {t.name: t for t in reader.tensors}                             # memory-mapped
        self._map = getattr(getattr(reader, "data", None), "_mmap", None)
        self.names = {hf: name for name, hf in by_gguf.items() if hf in self.shapes and name in self.tensors}
        self._gguf = gguf

    def release(self) -> None:
        """Drop the file's pages this process has read from its resident memory (they stay in the page
        cache, and come back when read again). Why: a mapped page read once counts in the process's RSS
        until the mapping goes, so a build that read the whole file, then opens a session of the graph,
        held both (Qwen2.5-Coder-1.5B: 1 GB of the build's 2.8 GiB peak)."""
        import contextlib
        import mmap

        if self._map is not None and hasattr(mmap, "MADV_DONTNEED"):
            with contextlib.suppress(OSError, ValueError):      # a closed or unusual mapping: nothing to drop
                self._map.madvise(mmap.MADV_DONTNEED)

    def missing(self) -> list[str]:
        """The model's parameters the file does not hold (a tied lm_head is the embedding)."""
        tied = getattr(self.config, "tie_word_embeddings", False)
        return [k for k in self.shapes if k not in self.names and not (k == "lm_head.weight" and tied)]

    def source(self, hf_name: str) -> str:
        """The GGUF tensor behind a parameter (a tied lm_head: the embedding's)."""
        if hf_name not in self.names and hf_name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
            hf_name = "model.embed_tokens.weight"
        if hf_name not in self.names:
            raise SpecexportError(f"{self.path.name}: no tensor of the file is the model's {hf_name}")
        return self.names[hf_name]

    def tensor(self, hf_name: str):
        """The file's tensor behind a parameter (the gguf package's ReaderTensor: name, type, raw blocks)."""
        return self.tensors[self.source(hf_name)]

    def get(self, hf_name: str) -> np.ndarray:
        """The parameter in float32, dequantized and in the HF order (one tensor's memory: rows are
        dequantized CHUNK_ROWS at a time into the result, as the gguf package's dequantization holds
        several float temporaries of its input's size, gigabytes for a large vocabulary's embedding)."""
        name = self.source(hf_name)
        t = self.tensors[name]
        shape = self.shapes[hf_name]
        data = t.data
        if data.ndim == 2 and len(shape) == 2 and data.shape[0] == shape[0]:
            w = np.empty(shape, np.float32)
            for r in range(0, shape[0], CHUNK_ROWS):
                w[r:r + CHUNK_ROWS] = self._gguf.dequantize(data[r:r + CHUNK_ROWS], t.tensor_type).reshape(-1, shape[1])
        else:
            w = self._gguf.dequantize(data, t.tensor_type).astype(np.float32).reshape(shape)
        return np.ascontiguousarray(self.processor.process(w, name).weights, dtype=np.float32)

    def get_rows(self, hf_name: str, rows) -> np.ndarray:
        """Some rows of a 2-D parameter whose rows the processor keeps in place (an embedding, a head),
        dequantized alone: [len(rows), K] float32."""
        if self.rows(hf_name) is not None:
            raise ValueError(f"{hf_name}: its rows are reordered when loaded; read it whole")
        name = self.source(hf_name)
        t = self.tensors[name]
        K = int(t.shape[0])
        part = self._gguf.dequantize(np.asarray(t.data[np.asarray(rows, np.int64)]), t.tensor_type)
        return np.ascontiguousarray(self.processor.process(part.reshape(-1, K), name).weights, dtype=np.float32)

    def rows(self, hf_name: str):
        """The HF row order of a 2-D parameter against the file's (None: unchanged)."""
        name = self.source(hf_name)
        return row_order(self.processor, name, int(self.tensors[name].shape[1]))


def row_order(processor, name: str, n: int):
    """The row order transformers' `processor` gives the n-row GGUF tensor `name` when it loads it (None:
    unchanged): a function of the name and row count, found by processing the row indices."""
    order = processor.process(np.arange(n).reshape(n, 1), name).weights[:, 0]
    return None if np.array_equal(order, np.arange(n)) else np.asarray(order)
