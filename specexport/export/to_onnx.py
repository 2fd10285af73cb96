"""Checkpoint -> ONNX graph with the io_spec contract (torch.onnx dynamo exporter, opset 23)."""
from __future__ import annotations

import contextlib
import io as io_module
import logging
import warnings
from pathlib import Path

from specexport._optional import require
from specexport.errors import SpecexportError
from specexport.io_spec import DYNAMIC_AXES, ModelIO

OPSET = 23          # RotaryEmbedding (torch.onnx.ops), RMSNorm -> RMSNormalization (ENVIRONMENT.md); attention: gqa.py


def load_hf_model(path: Path):
    """The HF causal LM in float32, eval mode, on CPU."""
    torch = require("torch")
    transformers = require("transformers")
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as err:   # transformers, safetensors and torch raise many types; -v shows the traceback
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise SpecexportError(f"{path}: cannot be loaded as a Hugging Face checkpoint by transformers "
                              f"{transformers.__version__}: {first}") from err
    return model.eval()


def example_inputs(io: ModelIO, *, batch: int = 2, tokens: int = 3, past: int = 4, capacity: int = 16, seed: int = 0):
    """Inputs to trace with. Every dynamic size is >= 2 and they all differ, so the exporter keeps each
    axis dynamic and its own."""
    torch = require("torch")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, io.vocab_size, (batch, tokens), generator=gen)
    pos = (torch.arange(tokens) + past).expand(batch, tokens).contiguous()
    mask = torch.ones(batch, tokens, past + tokens, dtype=torch.bool)
    mask[:, :, past:] = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool))
    rows = torch.arange(tokens - 2, tokens).expand(batch, 2).contiguous()       # R = 2 < T: stays its own axis
    kv_shape = (batch, io.num_kv_heads, capacity, io.head_dim)
    caches = tuple(torch.randn(kv_shape, generator=gen) for _ in range(2 * io.num_layers))
    return ids, pos, mask, rows, caches


def dynamic_shapes(io: ModelIO):
    """torch.export dynamic_shapes derived from the IO table: one Dim per symbol, shared by all inputs."""
    torch = require("torch")
    dims = {s: torch.export.Dim(s, min=1) for s in DYNAMIC_AXES}
    per_input = [{i: dims[a] for i, a in enumerate(t.axes) if isinstance(a, str)} for t in io.inputs]
    return (*per_input[:4], tuple(per_input[4:]))      # forward(input_ids, position_ids, attention_mask, logits_rows, *caches)


def onnx_from_module(module, io: ModelIO, onnx_path: Path) -> list[Path]:
    """Export `module` (a StaticKVDecoder) to `onnx_path` plus its external-data file.

    Returns the files written. Raises SpecexportError if an axis the table declares dynamic came out
    fixed (the exporter specializes sizes 0 and 1, so we trace with sizes >= 2 and check).
    """
    torch = require("torch")
    from specexport.export import gqa

    ids, pos, mask, rows, caches = example_inputs(io)
    with torch.no_grad(), quiet_exporter():
        torch.onnx.export(
            module, (ids, pos, mask, rows, *caches), str(onnx_path),
            input_names=io.input_names, output_names=io.output_names,
            dynamic_shapes=dynamic_shapes(io), dynamo=True, opset_version=OPSET,
            external_data=True, verbose=False, optimize=True, custom_translation_table=gqa.translation_table(),
        )
    check_graph_io(onnx_path, io)
    return [p for p in (onnx_path, onnx_path.with_name(onnx_path.name + ".data")) if p.exists()]


@contextlib.contextmanager
def quiet_exporter():
    """The exporter logs every step and warns about optional torchvision ops; our stages report progress."""
    names = ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")
    levels = {n: logging.getLogger(n).level for n in names}
    try:
        for n in names:
            logging.getLogger(n).setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io_module.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


def check_graph_io(onnx_path: Path, io: ModelIO) -> None:
    """The exported graph's names, dtypes and axes must be exactly the IO table's."""
    onnx = require("onnx")
    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    for kind, values, specs in (("input", graph.input, io.inputs), ("output", graph.output, io.outputs)):
        got = [v.name for v in values]
        if got != [t.name for t in specs]:
            raise SpecexportError(f"{onnx_path}: graph {kind}s {got} differ from the IO table {[t.name for t in specs]}")
        for v, spec in zip(values, specs):
            dims = tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name
            if dims != tuple(spec.axes) or dtype != spec.dtype:
                raise SpecexportError(
                    f"{onnx_path}: {kind} {spec.name} is {dtype}{list(dims)}, the IO table says "
                    f"{spec.dtype}{list(spec.axes)} (an axis the exporter fixed is no longer dynamic)"
                )
