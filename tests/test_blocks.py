"""Hugging Face checkpoints into ggml blocks (issue 46): the quantizers against blocks ggml's own C wrote,
the GGUF writer read back through transformers' loader, and `scheme: blocks` builds on the kernels."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from machine import kernels_missing

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

REFERENCE = Path(__file__).parent / "data" / "kquant_reference.npz"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"])
def test_blocks_equal_ggml_reference_quantizers(qtype):
    from specexport.quant.kquant import quantize

    ref = np.load(REFERENCE)
    got = quantize(ref["x"], qtype)
    differ = np.nonzero((got != ref[qtype]).any(axis=1))[0]
    assert not len(differ), f"{qtype}: rows {differ.tolist()} differ from ggml's bytes ({ref['llama_cpp']})"
    back = gguf.quants.dequantize(got, gguf.GGMLQuantizationType[qtype]).reshape(ref["x"].shape)
    assert np.abs(back - ref["x"])[0].max() <= 0.2 * np.abs(ref["x"][0]).max()     # and they decode near x


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_K", "Q6_K", "Q4_0", "Q4_1"])
def test_weighed_blocks_equal_ggml_imatrix_quantizers(qtype):
    """With an importance matrix: ggml's quantize_row_<type>_impl (llama-quantize --imatrix), byte for byte."""
    from specexport.quant.kquant import quantize

    ref = np.load(REFERENCE)
    got = quantize(ref["x"], qtype, ref["importance"])
    differ = np.nonzero((got != ref[f"{qtype}_imatrix"]).any(axis=1))[0]
    assert not len(differ), f"{qtype} with an imatrix: rows {differ.tolist()} differ from ggml's bytes"
    assert (got != ref[qtype]).any()                   # the weights changed the choice somewhere


def test_a_broken_quantizer_fails_the_reference():
    """The reference test has teeth: Q4_K without its min search (the first guess only) differs."""
    from specexport.quant import kquant

    ref = np.load(REFERENCE)
    original = kquant._qkx2
    try:
        kquant._qkx2 = lambda x, w, **kw: original(x, w, nstep=0, **kw)
        assert (kquant.quantize(ref["x"], "Q4_K") != ref["Q4_K"]).any()
    finally:
        kquant._qkx2 = original


def test_quantize_refuses_rows_the_type_cannot_hold():
    from specexport.quant.kquant import quantize

    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 96), np.float32), "Q4_K")


def test_llama_quantize_type_choice():
    from specexport.quant.gguf_write import tensor_type, use_more_bits

    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert tensor_type("blk.0.attn_v.weight", (64, 512), "q4_k_m", n_layers=30, tied=False) == "Q6_K"
    assert tensor_type("blk.3.attn_v.weight", (64, 512), "q4_k_m", n_layers=30, tied=False) == "Q4_K"
    assert tensor_type("blk.3.attn_q.weight", (576, 576), "q4_k_m", n_layers=30,
                       tied=True) == "Q5_0"     # 576: not 256s
    assert tensor_type("token_embd.weight", (49152, 576), "q4_k_m", n_layers=30,
                       tied=True) == "Q8_0"     # tied: as output
    assert tensor_type("token_embd.weight", (49152, 512), "q4_k_m", n_layers=30, tied=False) == "Q4_K"
    assert tensor_type("output.weight", (49152, 512), "q4_k_m", n_layers=30, tied=False) == "Q6_K"
    assert tensor_type("blk.0.attn_norm.weight", (512,), "q4_k_m", n_layers=30, tied=False) == "F32"
    assert tensor_type("blk.0.ffn_up.weight", (512, 512), "q8_0", n_layers=30, tied=False) == "Q8_0"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_written_gguf_reads_back_as_the_checkpoint(model_type, tmp_path, tokenizer):
    """f32: every tensor back exactly through transformers' GGUF loader (llama's q/k row permutation
    undone); int4: every tensor within its blocks' error, the Q4_K_M mix present."""
    import transformers
    from safetensors.numpy import load_file

    from specexport.export.gguf_weights import GgufWeights
    from specexport.quant.gguf_write import write_gguf
    from specexport.export.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / model_type, model_type, tokenizer=tokenizer, hidden_size=256)
    state = load_file(str(ckpt / "model.safetensors"))
    config = transformers.AutoConfig.from_pretrained(ckpt)
    for scheme in ("f32", "q4_k_m"):
        record = write_gguf(ckpt, tmp_path / f"{scheme}.gguf", scheme)
        assert record["pre"] == "gpt-2"                   # the tiny tokenizer splits as GPT-2 does
        weights = GgufWeights(tmp_path / f"{scheme}.gguf", config)
        assert weights.missing() == []
        for hf in weights.names:
            want, got = state[hf], weights.get(hf)
            if scheme == "f32":
                assert np.array_equal(got, want), hf
            else:
                assert np.abs(got - want).max() <= 0.1 * np.abs(want).max(), hf
        if scheme == "q4_k_m":
            assert {"Q4_K", "Q6_K", "F32"} <= set(record["types"].values())
    reader = gguf.GGUFReader(str(tmp_path / "q4_k_m.gguf"))
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == config.vocab_size
    assert reader.fields["tokenizer.ggml.merges"].contents()


def test_blocks_build_runs_on_the_kernels_and_speculates_exactly(tmp_path, tokenizer, write_yaml, run_build):
    """int8 and int4 of a checkpoint through `scheme: blocks`: graphs on our kernels, the GGUF beside them,
    rows independent (min_tokens 1, trees exact), speculative output equal to vanilla."""
    import specexport
    from specexport.export.tiny import make_tiny_checkpoint
    from specexport.manifest import read_manifest
    from specexport.plugins import cpu

    if not cpu.status().available:
        kernels_missing(cpu.status().line())
    ckpt = make_tiny_checkpoint(tmp_path / "llama", "llama", tokenizer=tokenizer, hidden_size=256, num_layers=2)
    out = tmp_path / "out"
    yaml = write_yaml(tmp_path / "m.yaml", name="b", target={"path": ckpt}, max_seq_len=96,
                      precisions=["fp32", "int8", "int4"],          # blocks: the default scheme of both
                      quantization={"int4": {"importance": "imatrix"}},
                      quality_gates={"int4": {"min_top1": 0.2, "max_kl": 2.0}}, output=out)   # random weights
    assert run_build(yaml, "--no-bench") == 0
    manifest = read_manifest(out)
    for precision in ("int8", "int4"):
        entry = manifest["models"]["target"]["precisions"][precision]
        assert entry["quantization"]["scheme"] == "blocks"
        assert entry["quantization"]["kernels"]["ops"] == "specexport.cpu"
        assert entry["min_tokens"] == 1 and entry["trees"] == "exact"
        assert entry["row_dependence"]["two_tokens"] == 0.0
        assert entry["parity_max_rel_error"] <= 1e-4
        assert (out / entry["gguf_file"]["path"]).is_file()
        with specexport.load(out, precision=precision) as pipe:
            for prompt in ([1, 40, 41, 42], [1, 7, 300, 5, 9]):
                plain = pipe.generate(prompt_ids=prompt, max_new_tokens=24, method="vanilla").token_ids
                for method in ("lookup", "suffix"):
                    assert pipe.generate(prompt_ids=prompt, max_new_tokens=24, method=method).token_ids == plain
    int4 = manifest["models"]["target"]["precisions"]["int4"]["quantization"]
    assert {"Q4_K", "Q6_K"} <= set(int4["block_types"])
    assert int4["importance"]["method"].startswith("imatrix") and int4["importance"]["tokens"] > 0
    assert manifest["models"]["target"]["precisions"]["int8"]["quantization"]["importance"] == "none"


def test_a_checkpoint_blocks_cannot_hold_takes_matmulnbits_and_says_why(tiny_checkpoints, tmp_path, write_yaml,
                                                                     capsys):
    """mistral (transformers reads no mistral GGUF back): the plan names MatMulNBits and why, in one line."""
    from specexport.builder.plan import plan_build
    from specexport.cli import main
    from specexport.config import load_config

    yaml = write_yaml(tmp_path / "m.yaml", name="m", target={"path": tiny_checkpoints["mistral"]}, max_seq_len=96,
                      precisions=["fp32", "int4"], output=tmp_path / "out")
    plan = plan_build(load_config(yaml))
    assert plan.target.config.quantization["int4"]["scheme"] == "matmulnbits"
    assert plan.target.instead_of_blocks == (("int4", "model_type mistral (blocks are written for llama, qwen2, qwen3)"),)
    assert main(["build", str(yaml), "--dry-run"]) == 0
    said = " ".join(capsys.readouterr().err.split())          # the console wraps long lines
    assert "target int4: MatMulNBits (ONNX Runtime), not blocks on specexport's kernels: model_type mistral" in said
