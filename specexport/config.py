"""model.yaml -> BuildConfig (frozen), validated whole before any work starts.

Every error names the key path and what was expected, e.g. `draft.path: models/d has no config.json`.
Relative paths resolve against the YAML file's folder.

    name: demo                        # output goes to engines/<name> unless `output` is given
    target: {path: models/target}     # HF directory: config.json, weights, tokenizer files; or a .gguf file
    draft: {path: models/draft}       # optional; same tokenizer and vocabulary as the target
    max_seq_len: 1024                 # capacity of the static KV buffers (prompt + generated)
    precisions: [fp32, int8, int4]    # fp32 is always built: the reference and the source of the others;
                                      #   for GPUs: fp16, fp8, int8_sq (Q/DQ graphs, quant/); gguf: a GGUF
                                      #   model path's own quantized blocks (quant/gguf_graph.py). A GGUF
                                      #   model with precisions: [gguf] alone builds lean, without fp32
    backends: [onnxruntime]
    output: engines/demo              # optional
    max_verify_tokens: 16             # optional: most tokens one verification pass takes (tree size)
    parity_tolerance: 1.0e-4          # optional: max|Δlogits| / max|logits| gate for fp32
    eval_text: data/heldout.txt       # optional: held-out text for the quantized graphs' quality gate
    calibration_text: data/calib.txt  # optional: text that calibrates the Q/DQ graphs' activation ranges
    quality_gates: {int4: {min_top1: 0.8, max_kl: 0.2}}   # optional: per quantized precision
    quantization: {int8: {scheme: static_qdq}}   # optional: how int8/int4 are made (quant/quantize.py)
    tensorrt: {attention: native}     # optional, with backends: [tensorrt]: native (TRT_Attention) or plugin
    # per model, optional: aux_hidden_layers: [2, 8, 13] or "eagle3" (layers whose inputs are exported)
    # per model, optional: precisions: [int4] (overrides the top-level list for that model)
    # per model, optional: quantization: {int8: {scheme: dynamic}} (over the top-level one)
    # draft, optional: vocab: 8192 (the target's most frequent tokens) or vocab: ids.json (a list of ids);
    #   a draft folder with a draft_vocab.json (written by distill-draft --draft-vocab) uses it by default
    medusa: {path: heads/medusa, top_k: 10}   # optional: Medusa heads for the target (published formats)
    eagle: {path: heads/eagle3, top_k: 10}    # optional: an EAGLE-1 or EAGLE-3 head (published formats; the
                                              #   version comes from its keys, the target's aux layers follow;
                                              #   prompts: a JSON-lines file tree: auto decodes from)
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specexport.errors import SpecexportError, shown
from specexport.owned import refuse_overlap
from specexport.schemes import (  # noqa: F401  (names of the model.yaml's contract, read from here too)
    DEFAULT_QUALITY_GATES, GPU_PRECISIONS, PRECISIONS, QUANTIZED, SCHEMES, default_scheme, quality_gates,
    quantization_settings)

# int8/int4: for ONNX Runtime CPU (weight-only MatMulNBits by default); fp16/fp8/int8_sq: for GPUs (a cast
# graph, E4M3 and SmoothQuant INT8 Q/DQ: calibrate/). All made from fp32 (quant/quantize.py).
BACKENDS = ("onnxruntime", "tensorrt")   # tensorrt: refused by the build where TensorRT is absent (_tensorrt.py)
MODEL_ROLES = ("target", "draft")
TOP_KEYS = {"name", "target", "draft", "max_seq_len", "precisions", "backends", "output",
            "max_verify_tokens", "parity_tolerance", "eval_text", "calibration_text", "quality_gates", "medusa",
            "quantization", "eagle", "tensorrt"}
HEAD_KINDS = ("medusa", "eagle")         # heads on the target's hidden states, built as their own graphs
HEADS_KEYS = {"medusa": {"path", "top_k"}, "eagle": {"path", "top_k", "prompts"}}
MODEL_KEYS = {"path", "aux_hidden_layers", "precisions", "quantization", "vocab"}
REQUIRED = ("name", "target", "max_seq_len")
GGUF_MAGIC = b"GGUF"


def is_gguf(path) -> bool:
    """True for a file whose first 4 bytes are b"GGUF" (a model path may be one: export/gguf.py)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:                       # missing, a folder, unreadable
        return False


WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelConfig:
    role: str
    path: Path
    aux_hidden_layers: tuple[int, ...] | str = ()   # explicit layer ids, or "eagle3"
    precisions: tuple[str, ...] = ("fp32",)         # what this model is built in; fp32 first (a lean GGUF
                                                    #   model: ("gguf",) alone)
    quantization: dict = field(default_factory=dict)   # precision -> scheme settings (SCHEMES)
    vocab: int | Path | None = None                 # draft only: its output vocabulary, N most frequent or a file
    gguf: Path | None = None                        # the GGUF file `path` was converted from (export/gguf.py);
                                                    #   until plan_build converts it, `path` is that file

    @property
    def lean(self) -> bool:
        """Built without an fp32 graph: a GGUF model whose precisions are gguf alone (builder/stages/gguf.py)."""
        return "fp32" not in self.precisions

    @property
    def on_kernels(self) -> bool:  # a precision on our CPU kernels (gguf, blocks): its heads follow them
        return any(p == "gguf" or self.quantization.get(p, {}).get("scheme") == "blocks" for p in self.precisions)


@dataclass(frozen=True)
class HeadsConfig:
    kind: str                                       # "medusa" or "eagle"
    path: Path                                      # a folder in one of the published layouts
    top_k: int = 10                                 # ids per head (per EAGLE row) the graph returns (the widest
                                                    #   tree rank + 1)
    prompts: Path | None = None                     # EAGLE: JSON-lines prompts tree: auto decodes from (chat
                                                    #   models: rendered as user messages); None: eval text


@dataclass(frozen=True)
class BuildConfig:
    name: str
    target: ModelConfig
    draft: ModelConfig | None
    max_seq_len: int
    precisions: tuple[str, ...]                     # the top-level list (fp32 first); see ModelConfig
    backends: tuple[str, ...]
    output: Path
    max_verify_tokens: int = 16
    parity_tolerance: float = 1e-4
    eval_text: Path | None = None                   # held-out text for the quality gates (None: sampled)
    calibration_text: Path | None = None            # text for Q/DQ calibration (None: eval_text's rest, or sampled)
    quality_gates: dict = field(default_factory=lambda: {p: dict(g) for p, g in DEFAULT_QUALITY_GATES.items()})
    source: Path | None = None                      # the YAML file this came from
    medusa: "HeadsConfig | None" = None
    eagle: "HeadsConfig | None" = None
    tensorrt: dict = field(default_factory=lambda: {"attention": "native"})   # engine options (backends: tensorrt)

    @property
    def heads(self) -> list["HeadsConfig"]:
        return [h for h in (self.medusa, self.eagle) if h is not None]

    @property
    def models(self) -> list[ModelConfig]:
        return [m for m in (self.target, self.draft) if m is not None]

    def to_dict(self) -> dict:
        d = asdict(self)
        return json.loads(json.dumps(d, default=str))


def load_config(path: str | os.PathLike) -> BuildConfig:
    """Read and validate a model.yaml. Raises SpecexportError naming the key and the expectation."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise SpecexportError(f"{path}: no such config file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecexportError(f"{path}: YAML syntax error{where}: {problem}") from None
    return config_from_dict(raw, base=path.parent.resolve(), source=path.resolve())


def config_from_dict(raw, *, base: Path, source: Path | None = None) -> BuildConfig:
    if not isinstance(raw, dict):
        raise SpecexportError(f"{source or 'config'}: expected a mapping of keys at the top level")
    _check_keys(raw, TOP_KEYS, REQUIRED, prefix="")
    name = raw["name"]
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise SpecexportError(f"name: expected a folder-safe string (letters, digits, . _ -), got {name!r}")
    max_seq_len = _positive_int(raw["max_seq_len"], "max_seq_len")
    max_verify = _positive_int(raw.get("max_verify_tokens", min(16, max_seq_len)), "max_verify_tokens")
    if max_verify < 2 or max_verify > max_seq_len:
        raise SpecexportError(f"max_verify_tokens: expected 2..max_seq_len ({max_seq_len}), got {max_verify}")
    tol = raw.get("parity_tolerance", 1e-4)
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not tol > 0:
        raise SpecexportError(f"parity_tolerance: expected a positive number, got {tol!r}")
    if raw.get("output") is not None and not isinstance(raw["output"], str):
        raise SpecexportError(f"output: expected a folder path (a string), got {raw['output']!r}")
    output = Path(raw["output"]) if raw.get("output") else Path("engines") / name
    listed = raw.get("precisions", ["fp32"])
    precisions = _precisions(listed, "precisions")
    schemes = quantization_settings(raw.get("quantization"), "quantization", None)
    cfg = BuildConfig(
        name=name,
        target=_model(raw["target"], "target", base, listed, schemes),
        draft=_model(raw["draft"], "draft", base, listed, schemes) if raw.get("draft") is not None else None,
        max_seq_len=max_seq_len,
        precisions=precisions,
        backends=_choices(raw.get("backends", ["onnxruntime"]), "backends", BACKENDS),
        output=output if output.is_absolute() else (base / output),
        max_verify_tokens=max_verify,
        parity_tolerance=float(tol),
        eval_text=_text_file(raw.get("eval_text"), "eval_text", base),
        calibration_text=_text_file(raw.get("calibration_text"), "calibration_text", base),
        quality_gates=quality_gates(raw.get("quality_gates")),
        source=source,
        medusa=_heads(raw["medusa"], "medusa", base) if raw.get("medusa") is not None else None,
        eagle=_heads(raw["eagle"], "eagle", base) if raw.get("eagle") is not None else None,
        tensorrt=_tensorrt_options(raw.get("tensorrt")),
    )
    _check_lean(cfg)
    _check_output_writable(cfg.output)
    check_output_apart(cfg)
    return cfg


def _check_lean(cfg: BuildConfig) -> None:
    """What reads a target's fp32 graph (Medusa and EAGLE heads) needs it built."""
    if not cfg.target.lean:
        return
    readers = [k for k in ("medusa", "eagle") if getattr(cfg, k) is not None]
    if readers:
        raise SpecexportError(f"target.precisions: [gguf] alone builds no fp32 graph, and {', '.join(readers)} "
                              f"read(s) the target's fp32 graph; list fp32 too (precisions: [fp32, gguf])")


def _check_keys(raw: dict, allowed: set, required, *, prefix: str) -> None:
    for key in raw:
        if key not in allowed:
            raise SpecexportError(f"{prefix}{shown(key)}: unknown key; allowed: {', '.join(sorted(allowed))}")
    for key in required:
        if key not in raw or raw[key] is None:
            raise SpecexportError(f"{prefix}{key}: missing required key")


def _positive_int(value, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecexportError(f"{key}: expected a positive integer, got {value!r}")
    return value


def _choices(value, key: str, allowed) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise SpecexportError(f"{key}: expected a non-empty list, got {value!r}")
    for v in value:
        if v not in allowed:
            raise SpecexportError(f"{key}: {v!r} is not supported; supported: {', '.join(allowed)}")
    return tuple(dict.fromkeys(value))


def _precisions(value, key: str, *, gguf: bool = False) -> tuple[str, ...]:
    """The listed precisions, fp32 first: the quantized graphs are made from it and checked against it.
    A GGUF model that lists gguf alone has none (a lean build: builder/stages/gguf.py)."""
    listed = _choices(value, key, PRECISIONS)
    if gguf and listed == ("gguf",):
        return listed
    return tuple(dict.fromkeys(("fp32", *listed)))


def _text_file(value, key: str, base: Path) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise SpecexportError(f"{key}: expected a text file path (a string), got {value!r}")
    return _existing_file(value, key, base)


def _existing_file(value: str, key: str, base: Path) -> Path:
    """A file named in the YAML (relative to its folder), resolved; else an error naming the key."""
    path = Path(value) if Path(value).is_absolute() else base / value
    if not path.is_file():
        raise SpecexportError(f"{key}: {shown(value)} does not exist or is not a file")
    return path.resolve()


def _with_folder(raw, key: str, allowed: set, *, base: Path, example: str) -> tuple[dict, Path, str]:
    """A `{path: DIR, ...}` entry (or a bare path string): (the mapping, the existing folder, the path
    as the user wrote it), its keys checked; errors name `key`."""
    if isinstance(raw, str):
        raw = {"path": raw}
    if not isinstance(raw, dict):
        raise SpecexportError(f"{key}: expected a mapping like {{path: {example}}}, got {raw!r}")
    _check_keys(raw, allowed, ("path",), prefix=f"{key}.")
    if not isinstance(raw["path"], str):
        raise SpecexportError(f"{key}.path: expected a folder path (a string), got {raw['path']!r}")
    path = Path(raw["path"])
    path = path if path.is_absolute() else base / path
    if not path.is_dir():
        raise SpecexportError(f"{key}.path: {shown(raw['path'])} does not exist or is not a folder")
    return raw, path, shown(raw["path"])


def _model(raw, role: str, base: Path, precisions: tuple[str, ...], schemes: dict) -> ModelConfig:
    gguf = _gguf_file(raw, role, base)
    if gguf is not None:                    # converted into a checkpoint folder by plan_build
        raw = {"path": str(gguf)} if isinstance(raw, str) else raw
        _check_keys(raw, MODEL_KEYS, ("path",), prefix=f"{role}.")
        return _model_options(raw, role, gguf, precisions=precisions, schemes=schemes, base=base, gguf=gguf)
    raw, path, shown = _with_folder(raw, role, MODEL_KEYS, base=base, example=f"models/{role}")
    if not (path / "config.json").is_file():
        raise SpecexportError(f"{role}.path: {shown} has no config.json")
    if not any(any(path.glob(p)) for p in WEIGHT_PATTERNS):
        raise SpecexportError(f"{role}.path: {shown} has no weights (*.safetensors or pytorch_model*.bin)")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise SpecexportError(f"{role}.path: {shown} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return _model_options(raw, role, path.resolve(), precisions=precisions, schemes=schemes, base=base)


def _gguf_file(raw, role: str, base: Path) -> Path | None:
    """The model's path when it names a file: a GGUF file (resolved), else an error; None for a folder."""
    value = raw if isinstance(raw, str) else raw.get("path") if isinstance(raw, dict) else None
    if not isinstance(value, str):
        return None
    path = Path(value) if Path(value).is_absolute() else base / value
    if not path.is_file():
        return None
    if not is_gguf(path):
        raise SpecexportError(f"{role}.path: {shown(value)} is a file but not a GGUF file; expected a checkpoint "
                              f"folder (config.json, weights, tokenizer) or a .gguf file")
    return path.resolve()


def _model_options(raw: dict, role: str, path: Path, *, precisions, schemes, base: Path, gguf=None) -> ModelConfig:
    aux = raw.get("aux_hidden_layers", ())
    if aux != "eagle3":
        if not isinstance(aux, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in aux):
            raise SpecexportError(f"{role}.aux_hidden_layers: expected a list of layer indices or 'eagle3', got {aux!r}")
        aux = tuple(sorted(set(aux)))
    own = raw.get("precisions") is not None           # the model's own list, else the top-level one
    precisions = _precisions(raw["precisions"] if own else precisions, f"{role}.precisions" if own else "precisions",
                             gguf=gguf is not None)
    if "gguf" in precisions and gguf is None:
        raise SpecexportError(f"{role}.precisions: gguf is made from a GGUF file's own blocks, and {role}.path is not a "
                              f".gguf file; give {role} a precisions: list without gguf")
    schemes = quantization_settings(raw.get("quantization"), f"{role}.quantization", schemes)
    return ModelConfig(role=role, path=path, aux_hidden_layers=aux, precisions=precisions,
                       quantization=schemes, vocab=_vocab(raw.get("vocab"), role, base, path), gguf=gguf)


DRAFT_VOCAB_FILE = "draft_vocab.json"    # in a draft checkpoint: the ids it was trained to propose


def _vocab(value, role: str, base: Path, path: Path):
    """draft.vocab: an int N >= 2 (the N tokens the target produces most) or a file of target ids;
    absent, a draft trained for a reduced vocabulary (its folder has draft_vocab.json) uses that."""
    if value is None:
        trained = path / DRAFT_VOCAB_FILE
        return trained.resolve() if role == "draft" and trained.is_file() else None
    if role != "draft":
        raise SpecexportError(f"{role}.vocab: only a draft can have a reduced output vocabulary")
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 2:
            raise SpecexportError(f"draft.vocab: expected at least 2 tokens, got {value}")
        return value
    if not isinstance(value, str):
        raise SpecexportError(f"draft.vocab: expected a token count or a file of target ids, got {value!r}")
    return _existing_file(value, "draft.vocab", base)


def _heads(raw, kind: str, base: Path) -> HeadsConfig:
    raw, path, _ = _with_folder(raw, kind, HEADS_KEYS[kind], base=base, example=f"heads/{kind}")
    top_k = raw.get("top_k", 10)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 64:
        raise SpecexportError(f"{kind}.top_k: expected an integer in 1..64, got {top_k!r}")
    prompts = raw.get("prompts")
    if prompts is not None:
        if not isinstance(prompts, str):
            raise SpecexportError(f"{kind}.prompts: expected a JSON-lines file path (a string), got {prompts!r}")
        prompts = _existing_file(prompts, f"{kind}.prompts", base)
    return HeadsConfig(kind=kind, path=path.resolve(), top_k=top_k, prompts=prompts)


TRT_ATTENTION = ("native", "plugin")     # TensorRT 11's TRT_Attention op, or the tree-attention plugin


def _tensorrt_options(raw) -> dict:
    """tensorrt: {attention: native | plugin} (trt/graph.py)."""
    if raw is None:
        return {"attention": "native"}
    if not isinstance(raw, dict):
        raise SpecexportError(f"tensorrt: expected a mapping like {{attention: native}}, got {raw!r}")
    _check_keys(raw, {"attention"}, (), prefix="tensorrt.")
    attention = raw.get("attention", "native")
    if attention not in TRT_ATTENTION:
        raise SpecexportError(f"tensorrt.attention: expected one of {', '.join(TRT_ATTENTION)}, got {attention!r}")
    return {"attention": attention}


def input_paths(cfg: BuildConfig) -> list[tuple[str, Path]]:
    """(key, path) of everything a build reads: checkpoints (and the tokenizer in the target's folder),
    GGUF files and their conversion cache, heads, prompt and text files, vocabulary files."""
    found = []
    for mc in cfg.models:
        found.append((f"{mc.role}.path", mc.path))
        if mc.gguf is not None:
            found += [(f"{mc.role}.path", mc.gguf), ("the GGUF cache ($SPECEXPORT_CACHE)", gguf_cache_root())]
        if isinstance(mc.vocab, Path):
            found.append((f"{mc.role}.vocab", mc.vocab))
    for hc in cfg.heads:
        found.append((f"{hc.kind}.path", hc.path))
        if hc.prompts is not None:
            found.append((f"{hc.kind}.prompts", hc.prompts))
    found += [(key, getattr(cfg, key)) for key in ("eval_text", "calibration_text") if getattr(cfg, key) is not None]
    return found


def check_output_apart(cfg: BuildConfig) -> None:
    """Refuse, before anything is written, an output folder that is, contains or lies inside anything the
    build reads: a build writes role folders (target/, draft/, ...) into it and removes what it wrote
    there, so an input inside it could be replaced, and an output inside a checkpoint would change it."""
    refuse_overlap(cfg.output, input_paths(cfg), option="output",
                   hint="build into a folder of its own, apart from the inputs (output: in the model.yaml)")


def gguf_cache_root(cache_dir=None) -> Path:
    """Where GGUF files are converted to checkpoint folders: cache_dir, else $SPECEXPORT_CACHE/gguf, else
    ~/.cache/specexport/gguf."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return cache_base() / "gguf"


def cache_base() -> Path:
    """$SPECEXPORT_CACHE, else ~/.cache/specexport: GGUF conversions, compiled CPU kernels."""
    return Path(os.environ.get("SPECEXPORT_CACHE") or Path.home() / ".cache" / "specexport").expanduser()


def _check_output_writable(output: Path) -> None:
    probe = output
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise SpecexportError(f"output: {probe} exists and is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SpecexportError(f"output: {output} cannot be written ({probe} is not writable)")
