"""specexport.export.gguf: a GGUF file converted into a plain HF checkpoint folder, its tokenizer checked.

The GGUF files are written here with gguf.GGUFWriter from a seeded random 2-layer Llama and the tiny
byte-level BPE tokenizer, in llama.cpp's tensor naming and q/k row order: no downloads.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from close import assert_close

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
tokenizers = pytest.importorskip("tokenizers")

from specexport.errors import MissingDependency, SpecexportError  # noqa: E402
from specexport.export import gguf as gguf_mod  # noqa: E402
from specexport.export.gguf import hf_folder_from_gguf, is_gguf  # noqa: E402
from specexport.export.tiny import train_tokenizer  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
# Digits after whitespace are where a pre-tokenizer without the digit split gives other ids.
TEXTS = ["x =   12345", "a  2024 and 7", "def fib(n):\n    return n", "Hello world!", "    42,   7\n"]


def _tokenizer(*, split_digits: bool):
    """The tiny byte-level BPE; with split_digits, SmolLM's pre-tokenizer (Digits, then ByteLevel)."""
    tok = train_tokenizer()
    if split_digits:
        pre = tokenizers.pre_tokenizers
        tok.backend_tokenizer.pre_tokenizer = pre.Sequence(
            [pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)])
    return tok


def _model(tok, *, tied: bool):
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
        tie_word_embeddings=tied, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():                      # norms away from 1, so swapped norms would show in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute: q/k rows in its RoPE pair order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(path, model, tok, *, pre: str, arch: str = "llama", tokens: list[str] | None = None, quantize=None):
    """quantize(name, array) -> (raw block bytes, GGMLQuantizationType) or None: a tensor written quantized
    (tests/test_gguf_exact.py); None writes it as float32."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tok.all_special_ids)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens or [t for t, _ in vocab])
    w.add_token_types([3 if i in special else 1 for _, i in vocab])   # 3 CONTROL, 1 NORMAL
    w.add_token_merges([" ".join(m) for m in json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_unk_token_id(tok.unk_token_id)
    w.add_add_bos_token(True)                  # train_tokenizer's post-processor adds <s>
    w.add_chat_template(CHAT_TEMPLATE)
    n_head, n_kv = c.num_attention_heads, c.num_key_value_heads
    for name, value in model.state_dict().items():
        arr = value.numpy().astype(np.float32)
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue                           # llama.cpp writes no output.weight for tied embeddings
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            key = LAYER_NAMES[".".join(rest[:-1])]
            arr = _permute(arr, n_head) if key == "attn_q" else _permute(arr, n_kv) if key == "attn_k" else arr
            name = f"blk.{i}.{key}.weight"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]
        quantized = quantize(name, arr) if quantize is not None else None
        if quantized is not None:
            w.add_tensor(name, quantized[0], raw_dtype=quantized[1])
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def smollm_like(tmp_path_factory):
    """(original model, original tokenizer, gguf path, converted folder) with pre = "smollm", untied."""
    tmp = tmp_path_factory.mktemp("gguf")
    tok = _tokenizer(split_digits=True)
    model = _model(tok, tied=False)
    path = write_gguf(tmp / "tiny.gguf", model, tok, pre="smollm")
    return model, tok, path, hf_folder_from_gguf(path, cache_dir=tmp / "cache")


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits


def test_is_gguf(smollm_like, tmp_path):
    (tmp_path / "x.txt").write_text("GGU")
    assert is_gguf(smollm_like[2])
    assert not is_gguf(tmp_path / "x.txt") and not is_gguf(tmp_path / "missing") and not is_gguf(tmp_path)


def test_converted_model_gives_the_original_logits(smollm_like):
    model, tok, path, folder = smollm_like
    assert folder.name.startswith("tiny-") and len(folder.name) == len("tiny-") + 16
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "gguf_source.json"):
        assert (folder / name).is_file(), name
    converted = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    ids = np.random.default_rng(0).integers(0, len(tok), size=(2, 12)).tolist()
    assert_close(_logits(converted, ids), _logits(model, ids), rel=1e-5,
                 why="the converted checkpoint vs the model written: fp32 weights round-tripped")


def test_tokenizer_gives_the_original_ids_digits_split(smollm_like):
    _, tok, path, folder = smollm_like
    converted = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert converted(text)["input_ids"] == tok(text)["input_ids"], text
    assert converted.tokenize("12345") == list("12345")
    # transformers adds GPT-2's '<|endoftext|>' past a byte-level GGUF vocabulary that lacks it: dropped
    assert len(converted) == len(tok) and max(converted("<|endoftext|>")["input_ids"]) < len(tok)
    assert converted.chat_template == CHAT_TEMPLATE
    # transformers' own GGUF tokenizer lacks the split (5.24): the fix was needed and recorded
    raw = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    raw_split = [p for p, _ in raw.backend_tokenizer.pre_tokenizer.pre_tokenize_str("12345")] == list("12345")
    record = json.loads((folder / "gguf_source.json").read_text())
    fixes = [f["fix"] for f in record["fixed"]]
    assert any("Digits" in f for f in fixes) == (not raw_split)
    if not raw_split:
        assert raw("x =   12345")["input_ids"] != tok("x =   12345")["input_ids"]   # the fix matters
    assert record["tokenizer.ggml.pre"] == "smollm" and record["gguf_file"] == "tiny.gguf"
    assert record["checked"]["digits_split"] is True and "smollm" in record["checked"]["pre_tokenizer"]


def test_second_call_does_not_convert(smollm_like, monkeypatch):
    *_, path, folder = smollm_like
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(gguf_mod, "_convert", lambda *a: pytest.fail("converted again"))
    assert hf_folder_from_gguf(path, cache_dir=folder.parent) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_interrupted_conversion_leaves_no_folder(smollm_like, tmp_path, monkeypatch):
    def broken(path, out, **_):
        (out / "config.json").parent.mkdir(parents=True, exist_ok=True)      # the partial folder exists (marked)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt
    monkeypatch.setattr(gguf_mod, "_convert", broken)
    with pytest.raises(KeyboardInterrupt):
        hf_folder_from_gguf(smollm_like[2], cache_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_not_a_gguf_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(SpecexportError, match=r"model\.gguf: not a GGUF file") as err:
        hf_folder_from_gguf(bad, cache_dir=tmp_path / "cache")
    assert "\n" not in str(err.value)


def test_token_list_mismatch_is_refused(tmp_path):
    """A GGUF listing one token twice: transformers' vocabulary keeps one id, the check sees the other."""
    tok = _tokenizer(split_digits=True)
    tokens = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens[100] = tokens[101]
    path = write_gguf(tmp_path / "dup.gguf", _model(tok, tied=True), tok, pre="smollm", tokens=tokens)
    with pytest.raises(SpecexportError, match=r"dup\.gguf: .* at id 100, tokenizer.ggml.tokens has"):
        hf_folder_from_gguf(path, cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("dup-*"))


def test_unfixed_digit_split_fails_the_llama_cpp_check(tmp_path, monkeypatch):
    """The check has teeth: without the fix, the sample ids differ from llama.cpp's 'smollm' split."""
    tok = _tokenizer(split_digits=True)
    path = write_gguf(tmp_path / "nofix.gguf", _model(tok, tied=True), tok, pre="smollm")
    monkeypatch.setattr(gguf_mod, "_splits_digits", lambda backend: True)     # so no fix is applied
    with pytest.raises(SpecexportError, match=r"nofix\.gguf: .*llama\.cpp's 'smollm' pre-tokenizer gives"):
        hf_folder_from_gguf(path, cache_dir=tmp_path / "cache")


def test_gpt2_pre_tied_embeddings_no_digit_fix(tmp_path):
    tok = _tokenizer(split_digits=False)
    model = _model(tok, tied=True)
    path = write_gguf(tmp_path / "gpt2pre.gguf", model, tok, pre="gpt-2")
    folder = hf_folder_from_gguf(path, cache_dir=tmp_path / "cache")
    converted = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert converted.config.tie_word_embeddings
    ids = [[1, 5, 9, 200, 17, 3]]
    assert_close(_logits(converted, ids), _logits(model, ids), rel=1e-5,
                 why="the converted checkpoint vs the model written: fp32 weights round-tripped")
    converted_tok = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert converted_tok(text)["input_ids"] == tok(text)["input_ids"], text
    record = json.loads((folder / "gguf_source.json").read_text())
    assert not any("Digits" in f["fix"] for f in record["fixed"]) and "gpt-2" in record["checked"]["pre_tokenizer"]


def test_unknown_architecture_is_refused(tmp_path):
    tok = _tokenizer(split_digits=True)
    path = write_gguf(tmp_path / "odd.gguf", _model(tok, tied=True), tok, pre="smollm", arch="notanarch")
    with pytest.raises(SpecexportError, match=r"odd\.gguf: transformers .* cannot read this GGUF .*notanarch"):
        hf_folder_from_gguf(path, cache_dir=tmp_path / "cache")


def test_missing_gguf_package_names_the_extra(smollm_like, tmp_path, monkeypatch):
    def require(name):
        if name == "gguf":
            raise MissingDependency("no gguf")
        return __import__(name)
    monkeypatch.setattr(gguf_mod, "require", require)
    with pytest.raises(MissingDependency, match=r"tiny\.gguf: .*'gguf' package: pip install 'specexport\[export\]'"):
        hf_folder_from_gguf(smollm_like[2], cache_dir=tmp_path)


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECEXPORT_CACHE", str(tmp_path))
    assert gguf_mod._cache_root(None) == tmp_path / "gguf"
    assert gguf_mod._cache_root(tmp_path / "c") == tmp_path / "c"
    monkeypatch.delenv("SPECEXPORT_CACHE")
    assert gguf_mod._cache_root(None) == Path.home() / ".cache" / "specexport" / "gguf"


def test_a_gguf_file_builds_as_a_model_path(smollm_like, tmp_path, monkeypatch, write_yaml, run_build):
    """target: {path: tiny.gguf} in a model.yaml: the build converts it once (cached), exports the folder,
    records the file, and decodes; a file that is not a GGUF is refused naming the key."""
    import specexport
    from specexport.config import load_config
    from specexport.manifest import read_manifest

    model, tok, path, _ = smollm_like
    monkeypatch.setenv("SPECEXPORT_CACHE", str(tmp_path / "cache"))
    yaml = write_yaml(tmp_path / "m.yaml", name="g", target={"path": str(path)}, max_seq_len=64,
                      output=tmp_path / "out")
    assert load_config(yaml).target.gguf == path.resolve()
    assert run_build(yaml, "--no-bench") == 0
    m = read_manifest(tmp_path / "out")
    assert m["models"]["target"]["gguf"] == str(path.resolve())
    assert (tmp_path / "cache" / "gguf").is_dir()
    prompt = tok("def fib(n):")["input_ids"]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    with specexport.load(tmp_path / "out") as pipe:
        assert pipe.generate(prompt_ids=prompt, max_new_tokens=12, method="lookup").token_ids == expected.tolist()
        assert pipe.chat_prompt("hi") == "<s>user: hi</s>"            # the GGUF's chat template came along
        ids = pipe.chat_ids("hi")                                      # the template's <s>, not a second one
        assert ids == tok("<s>user: hi</s>", add_special_tokens=False)["input_ids"] and ids.count(tok.bos_token_id) == 1
    (tmp_path / "x.gguf").write_text("not a model")
    bad = write_yaml(tmp_path / "bad.yaml", name="g", target={"path": str(tmp_path / "x.gguf")}, max_seq_len=64)
    with pytest.raises(SpecexportError, match="target.path: .*x.gguf is a file but not a GGUF file"):
        load_config(bad)
