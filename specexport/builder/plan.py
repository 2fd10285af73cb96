"""Plan a build: every check that needs the checkpoints' configs and tokenizers, before any export.

`plan_build(config)` reads each model's config.json and tokenizer, resolves its adapter and options,
tokenizes the held-out text of the quality gates (`eval_text`), and fingerprints the inputs of each
stage so an unchanged stage can be skipped on rerun.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from specexport import __version__
from specexport._optional import require
from specexport.builder.sources import (EAGLE_SOURCES, ENGINE_SOURCES, GRAPH_SOURCES, HEADS_SOURCES, QUANTIZER_SOURCES,
                                        source_hash, tool_versions)
from specexport.chat import load_chat_template
from specexport.config import (GPU_PRECISIONS, TOKENIZER_FILES, WEIGHT_PATTERNS, BuildConfig, HeadsConfig, ModelConfig,
                               check_output_apart)
from specexport.errors import SpecexportError
from specexport.export.arch import ArchSpec, arch_spec_from_hf, check_supported
from specexport.export.registry import get_adapter
from specexport.io_spec import HeadsIO, ModelIO
from specexport.plugins.cpu import layout, status as kernels_status
from specexport.prompts import read_prompts
from specexport.quant.gguf_write import blocks_or_matmulnbits

TOKENIZER_EXTRA = ("tokenizer_config.json", "special_tokens_map.json", "merges.txt", "added_tokens.json",
                   "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class ModelPlan:
    role: str
    config: ModelConfig
    arch: ArchSpec
    io: ModelIO
    eos_token_ids: tuple[int, ...]
    fingerprint: str                    # hash of everything the export + parity stage depends on
    vocab_ids: tuple[int, ...] | None = None   # a reduced-vocabulary draft's target ids (None: all; or
                                               # not known yet: draft.vocab = N is measured by the build)
    instead_of_blocks: tuple[tuple[str, str], ...] = ()   # (precision, why): scheme blocks could not be made


@dataclass(frozen=True)
class HeadsPlan:
    """Heads on the target's states (Medusa, EAGLE), exported as their own graph."""
    config: HeadsConfig
    weights: object                     # export.medusa.MedusaWeights or export.eagle.EagleWeights, checked
    io: object                          # HeadsIO (Medusa) or EagleIO
    fingerprint: str
    prompt_ids: tuple = ()              # EAGLE: eagle.prompts as token ids (chat-rendered when the tokenizer has a
                                        #   chat template): tree: auto's decoding contexts

    @property
    def role(self) -> str:
        return self.config.kind


@dataclass(frozen=True)
class Plan:
    config: BuildConfig
    models: tuple[ModelPlan, ...]
    tokenizer_files: tuple[Path, ...]   # files copied into <output>/tokenizer
    special_tokens: dict = field(default_factory=dict)
    eval_ids: tuple[int, ...] | None = None    # eval_text through the target tokenizer (None: no eval_text)
    calibration_ids: tuple[int, ...] | None = None   # calibration_text, the same way
    heads: tuple[HeadsPlan, ...] = ()

    def stages(self) -> list:
        """The build, in the order it runs (build/stage.py): per model its fp32 graph, then (a draft with
        `vocab: N`, after the target's graph) its measured vocabulary before its own graphs, then each
        quantized precision; the heads; the kernel library (gguf, blocks); the tokenizer copy."""
        from specexport.builder.outdir import tokenizer_digest
        from specexport.builder.stages.blocks import BlocksStage
        from specexport.builder.stages.eagle import EagleStage
        from specexport.builder.stages.export import ExportStage
        from specexport.builder.stages.gguf import GgufStage
        from specexport.builder.stages.kernels import KernelsStage
        from specexport.builder.stages.medusa import MedusaStage
        from specexport.builder.stages.quantize import QuantizeStage
        from specexport.builder.stages.tokenizer import TokenizerStage
        from specexport.builder.stages.vocab import VocabStage

        stages = []
        for mp in self.models:
            measured = isinstance(mp.config.vocab, int) and mp.vocab_ids is None
            if measured:                  # on the target's fp32 graph; a lean target's gguf graph
                graph = "target/gguf" if self.target.config.lean else "target/fp32"
                stages.append(VocabStage(f"{mp.role}/vocab", mp.fingerprint, needs=(graph,)))
            for precision in mp.config.precisions:
                name = f"{mp.role}/{precision}"
                if precision == "fp32":
                    stages.append(ExportStage(name, self.stage_fingerprint(mp, precision),
                                              needs=(f"{mp.role}/vocab",) if measured else ()))
                elif mp.config.quantization.get(precision, {}).get("scheme") == "blocks":
                    stages.append(BlocksStage(name, self.stage_fingerprint(mp, precision), needs=(f"{mp.role}/fp32",)))
                elif precision == "gguf":
                    stages.append(GgufStage(name, self.stage_fingerprint(mp, precision),
                                            needs=() if mp.config.lean else (f"{mp.role}/fp32",)))
                else:
                    stages.append(QuantizeStage(name, self.stage_fingerprint(mp, precision), needs=(f"{mp.role}/fp32",)))
        for hp in self.heads:
            kind = EagleStage if hp.role == "eagle" else MedusaStage
            stages.append(kind(hp.role, hp.fingerprint, needs=("target/fp32",), heads=hp))
        if any(mp.config.on_kernels for mp in self.models):      # the library its graphs ran, carried
            stages.append(KernelsStage("kernels", "carried", needs=tuple(s.name for s in stages if s.precision)))
        stages.append(TokenizerStage("tokenizer", tokenizer_digest(self.tokenizer_files)))
        return stages

    def stage_fingerprint(self, mp: ModelPlan, precision: str) -> str:
        """What a stage depends on: the model's export fingerprint and, for a quantized precision, the
        quantizer settings, its quality gate and the held-out tokens."""
        if precision == "fp32":
            return mp.fingerprint
        from specexport.quant.quality import SETTINGS
        options = {"model": mp.fingerprint, "precision": precision,
                   "quantizer": layout.settled(mp.config.quantization[precision], kernels_status),  # auto: as here
                   "gate": self.config.quality_gates[precision], "quality": SETTINGS,
                   "quantizer_code": source_hash(QUANTIZER_SOURCES),
                   "eval": hashlib.sha256(json.dumps(self.eval_ids).encode()).hexdigest(),
                   "calibration": hashlib.sha256(json.dumps(self.calibration_ids).encode()).hexdigest()}
        return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def target(self) -> ModelPlan:
        return self.models[0]


def plan_build(cfg: BuildConfig, *, console=None) -> Plan:
    """console: a rich Console for progress lines (converting a GGUF model takes tens of seconds)."""
    check_before_work(cfg)
    cfg = _with_gguf_converted(cfg, console)
    target = _plan_model(cfg.target, cfg)
    eagle = _plan_eagle(cfg.eagle, target) if cfg.eagle is not None else None
    if eagle is not None and not set(eagle.weights.aux_layers) <= set(target.io.aux_hidden_layers):
        # the target exports the layers an EAGLE-3 head reads, whatever aux_hidden_layers says
        layers = tuple(sorted(set(eagle.weights.aux_layers) | set(target.io.aux_hidden_layers)))
        target = _plan_model(dataclasses.replace(cfg.target, aux_hidden_layers=layers), cfg)
        eagle = _plan_eagle(cfg.eagle, target)
    models = [target]
    vocab = _tokenizer_vocab(cfg.target)
    if cfg.draft is not None:
        draft = _plan_model(cfg.draft, cfg)
        _check_same_vocabulary(target, draft, vocab, _tokenizer_vocab(cfg.draft))
        if isinstance(cfg.draft.vocab, int):     # its ids are measured on the target: a new target, new ids
            both = hashlib.sha256(f"{draft.fingerprint}:{target.fingerprint}".encode()).hexdigest()[:16]
            draft = dataclasses.replace(draft, fingerprint=both)
        models.append(draft)
    tok_files = tuple(cfg.target.path / f for f in (*TOKENIZER_FILES, *TOKENIZER_EXTRA)
                      if (cfg.target.path / f).is_file())
    special = {"bos_token_id": target.arch.bos_token_id, "eos_token_ids": list(target.eos_token_ids),
               "pad_token_id": target.arch.pad_token_id}
    heads = ((_plan_medusa(cfg.medusa, target),) if cfg.medusa is not None else ()) + \
        ((eagle,) if eagle is not None else ())
    return Plan(config=cfg, models=tuple(models), tokenizer_files=tok_files, special_tokens=special,
                eval_ids=_text_ids(cfg, cfg.eval_text, "eval_text"),
                calibration_ids=_text_ids(cfg, cfg.calibration_text, "calibration_text"), heads=heads)


def check_before_work(cfg: BuildConfig) -> None:
    """What is checked before anything is read at length or written: inputs and output apart, the output
    folder usable, the optional packages the config needs. Raises SpecexportError naming the problem."""
    from specexport.builder.outdir import check_output

    check_output_apart(cfg)
    check_output(cfg.output)
    if "tensorrt" in cfg.backends:               # one line naming what is missing
        import importlib.util

        from specexport._tensorrt import require_engines

        require_engines("backends: tensorrt")
        if importlib.util.find_spec("onnxruntime_extensions") is None:
            raise SpecexportError("backends: tensorrt: the engine graph's CPU check needs onnxruntime-extensions: "
                                  "pip install 'specexport[quant]'")
    _check_quantizers(cfg)


def _with_gguf_converted(cfg: BuildConfig, console) -> BuildConfig:
    """Models given as GGUF files point at their converted checkpoint folders (made once, cached:
    export/gguf.py); `gguf` keeps the file for the manifest."""
    from specexport.export.gguf import hf_folder_from_gguf

    changes = {}
    for mc in cfg.models:
        if mc.gguf is not None and mc.path == mc.gguf:
            folder = hf_folder_from_gguf(mc.gguf, console=console, weights=not mc.lean)
            changes[mc.role] = dataclasses.replace(mc, path=folder)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _check_quantizers(cfg: BuildConfig) -> None:
    """Before any work: the fp8 / int8_sq precisions need NVIDIA ModelOpt (and the parts of its ONNX
    extra it imports); every GPU precision's plugin graph is checked with onnxruntime-extensions."""
    import importlib.util

    from specexport.quant.quantize import MODELOPT

    models = [m for m in (cfg.target, cfg.draft) if m is not None]
    gpu = sorted({p for m in models for p in m.precisions if p in GPU_PRECISIONS})
    modelopt = [p for m in models for p in m.precisions if m.quantization.get(p, {}).get("scheme") in MODELOPT]
    needed = (("modelopt", "onnx_graphsurgeon", "onnxslim", "polygraphy", "lief", "cppimport") if modelopt else ()) \
        + (("onnxruntime_extensions",) if gpu else ())
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        what = "NVIDIA ModelOpt's ONNX quantization and onnxruntime-extensions" if modelopt else "onnxruntime-extensions"
        raise SpecexportError(f"precisions: {', '.join(gpu)} need {what}, and {', '.join(missing)} cannot be "
                              f"imported here: pip install 'specexport[quant]'")


def _plan_medusa(hc: HeadsConfig, target: ModelPlan) -> HeadsPlan:
    from specexport.heads.medusa import load_medusa

    weights = load_medusa(hc.path, hidden_size=target.arch.hidden_size, vocab_size=target.arch.vocab_size)
    if hc.top_k > target.arch.vocab_size:
        raise SpecexportError(f"medusa.top_k: {hc.top_k} exceeds the vocabulary ({target.arch.vocab_size})")
    io = HeadsIO(hidden_size=target.arch.hidden_size, num_heads=weights.num_heads, top_k=hc.top_k)
    stat = weights.file.stat()
    options = {"target": target.fingerprint, "top_k": hc.top_k, "graph_code": source_hash(HEADS_SOURCES),
               "blocks": target.config.on_kernels,
               "file": f"{weights.file.name}:{stat.st_size}:{stat.st_mtime_ns}"}
    fingerprint = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
    return HeadsPlan(config=hc, weights=weights, io=io, fingerprint=fingerprint)


def _plan_eagle(hc: HeadsConfig, target: ModelPlan) -> HeadsPlan:
    from specexport.heads.eagle import WEIGHT_FILES, load_eagle
    from specexport.heads.eagle_graph import io_for

    arch = target.arch
    weights = load_eagle(hc.path, hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
                         num_layers=arch.num_layers)
    if hc.top_k > (weights.draft_vocab or arch.vocab_size):
        raise SpecexportError(f"eagle.top_k: {hc.top_k} exceeds the head's vocabulary "
                              f"({weights.draft_vocab or arch.vocab_size})")
    files = [hc.path / n for n in ("config.json", *WEIGHT_FILES) if (hc.path / n).is_file()]
    prompt_ids = _prompt_ids(hc.prompts, target.config.path) if hc.prompts else ()
    options = {"target": target.fingerprint, "top_k": hc.top_k, "graph_code": source_hash(EAGLE_SOURCES),
               "blocks": target.config.on_kernels,
               "files": [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files],
               "prompts": hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()}
    fingerprint = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]
    return HeadsPlan(config=hc, weights=weights, io=io_for(weights, target_hidden=arch.hidden_size, top_k=hc.top_k),
                     fingerprint=fingerprint, prompt_ids=prompt_ids)


def _prompt_ids(path: Path, tokenizer_dir: Path) -> tuple[tuple[int, ...], ...]:
    """eagle.prompts as the runtime feeds them: each a user message rendered by the runtime's own chat
    template (chat.py, what Pipeline.chat_ids uses) and encoded without adding special tokens
    again, when the tokenizer has a template; else the text as generate() encodes it."""
    tok = require("transformers").AutoTokenizer.from_pretrained(tokenizer_dir)
    template = load_chat_template(tokenizer_dir)
    texts = read_prompts(path, where="eagle.prompts")
    if template is None:
        return tuple(tuple(tok(text).input_ids) for text in texts)
    return tuple(tuple(tok(template.render([{"role": "user", "content": text}]), add_special_tokens=False).input_ids)
                 for text in texts)


def _text_ids(cfg: BuildConfig, path: Path | None, key: str) -> tuple[int, ...] | None:
    """A text file's token ids (target tokenizer, no special tokens); checked long enough here."""
    from specexport.quant.quality import MIN_EVAL_TOKENS

    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SpecexportError(f"{key}: {path} is not a readable UTF-8 text file ({err})") from None
    tok = require("transformers").AutoTokenizer.from_pretrained(cfg.target.path)
    ids = tuple(tok(text, add_special_tokens=False).input_ids)
    if len(ids) < MIN_EVAL_TOKENS:
        needs = "the quality gate" if key == "eval_text" else "calibration"
        raise SpecexportError(f"{key}: {path} has {len(ids)} tokens; {needs} needs at least {MIN_EVAL_TOKENS}")
    return ids


def _plan_model(mc: ModelConfig, cfg: BuildConfig) -> ModelPlan:
    raw = _read_json(mc.path / "config.json", f"{mc.role}.path")
    model_type = raw.get("model_type")
    adapter = get_adapter(model_type, where=f"{mc.role}.path: {mc.path.name}/config.json")
    transformers = require("transformers")
    try:
        hf_config = transformers.AutoConfig.from_pretrained(mc.path)
    except Exception as err:  # transformers raises many types for malformed configs
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise SpecexportError(f"{mc.role}.path: {mc.path}/config.json could not be read by transformers: {first}") from err
    arch = arch_spec_from_hf(hf_config)
    check_supported(arch, max_seq_len=cfg.max_seq_len, where=f"{mc.role} ({mc.path.name})")
    mc, instead = blocks_or_matmulnbits(mc, hf_config)
    aux = _aux_layers(mc, arch)
    vocab_ids, out_vocab = _draft_vocab(mc, arch.vocab_size)
    io = ModelIO(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                 hidden_size=arch.hidden_size, vocab_size=out_vocab, aux_hidden_layers=aux)
    gen = mc.path / "generation_config.json"
    eos = arch.eos_token_ids
    if gen.is_file():    # what HF generate() stops on: generation_config first, then config
        gen_eos = _read_json(gen, f"{mc.role}.path").get("eos_token_id")
        if gen_eos is not None:
            eos = tuple(gen_eos) if isinstance(gen_eos, list) else (gen_eos,)
    gguf = mc.gguf.stat() if mc.gguf is not None else None
    fingerprint = _fingerprint(mc.path, {
        "gguf": f"{mc.gguf.name}:{gguf.st_size}:{gguf.st_mtime_ns}" if gguf else None,
        "specexport": __version__, "graph_code": source_hash(GRAPH_SOURCES),
        "adapter": type(adapter).__name__, "aux": list(aux),
        "max_seq_len": cfg.max_seq_len, "max_verify_tokens": cfg.max_verify_tokens,
        "parity_tolerance": cfg.parity_tolerance, "versions": tool_versions(),
        "vocab": list(vocab_ids) if vocab_ids is not None else mc.vocab,
        "engines": dict(cfg.tensorrt, code=source_hash(ENGINE_SOURCES)) if "tensorrt" in cfg.backends else None,
    })
    return ModelPlan(role=mc.role, config=mc, arch=arch, io=io, eos_token_ids=eos, fingerprint=fingerprint,
                     vocab_ids=vocab_ids, instead_of_blocks=instead)


def _draft_vocab(mc: ModelConfig, full: int) -> tuple[tuple[int, ...] | None, int]:
    """(the ids of a given vocabulary file, or None; the graph's output vocabulary size)."""
    if mc.vocab is None:
        return None, full
    if isinstance(mc.vocab, int):
        if mc.vocab >= full:
            raise SpecexportError(f"draft.vocab: {mc.vocab} is not smaller than the vocabulary ({full})")
        return None, mc.vocab
    text = mc.vocab.read_text()
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in text.split()]
    except ValueError:
        raise SpecexportError(f"draft.vocab: {mc.vocab} is neither a JSON list of token ids nor one id per "
                              f"line") from None
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise SpecexportError(f"draft.vocab: {mc.vocab}: expected integer token ids")
    if min(ids) < 0 or max(ids) >= full or len(set(ids)) != len(ids) or len(ids) < 2:
        raise SpecexportError(f"draft.vocab: {mc.vocab}: expected at least 2 distinct ids in 0..{full - 1}")
    return tuple(sorted(ids)), len(ids)


def _aux_layers(mc: ModelConfig, arch: ArchSpec) -> tuple[int, ...]:
    n = arch.num_layers
    if mc.aux_hidden_layers == "eagle3":     # EAGLE-3 reads the inputs of layers 2, N//2 and N-3
        layers = tuple(sorted({2, n // 2, n - 3}))
    else:
        layers = tuple(mc.aux_hidden_layers)
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise SpecexportError(f"{mc.role}.aux_hidden_layers: {bad} out of range for a {n}-layer model (0..{n - 1})")
    return layers


def _tokenizer_vocab(mc: ModelConfig) -> dict:
    transformers = require("transformers")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(mc.path)
    except Exception as err:
        raise SpecexportError(f"{mc.role}.path: tokenizer in {mc.path} could not be loaded: {err}") from err
    return tok.get_vocab()


def _check_same_vocabulary(target: ModelPlan, draft: ModelPlan, t_vocab: dict, d_vocab: dict) -> None:
    if target.arch.vocab_size != draft.arch.vocab_size:
        raise SpecexportError(f"draft.path: vocab_size {draft.arch.vocab_size} differs from the target's "
                              f"{target.arch.vocab_size} (draft {draft.config.path}, target {target.config.path})")
    if t_vocab != d_vocab:
        only_t = sorted(set(t_vocab) - set(d_vocab))[:3]
        moved = sorted(k for k in set(t_vocab) & set(d_vocab) if t_vocab[k] != d_vocab[k])[:3]
        raise SpecexportError(
            f"draft.path: tokenizer differs from the target's (target {len(t_vocab)} tokens, draft "
            f"{len(d_vocab)} tokens; e.g. only in target {only_t}, different ids for {moved})")


def _read_json(path: Path, key: str) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SpecexportError(f"{key}: {path} is not readable JSON ({err})") from None


def _fingerprint(path: Path, options: dict) -> str:
    digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    files = ["config.json", *[p.name for pat in WEIGHT_PATTERNS for p in sorted(path.glob(pat))]]
    for name in files:
        stat = (path / name).stat()
        # size + mtime, not content: hashing multi-GB weights on every rerun costs more than it saves.
        digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:16]
