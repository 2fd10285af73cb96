"""Lean builds (issue 25 item 2): a GGUF model with precisions: [gguf] alone builds without any fp32
graph: a weightless export filled from the file by name (export/lean.py, quant/gguf_fill.fill), its
parity checked against transformers run one layer at a time from the file (export/gguf_reference.py).

The tiny mixed-type Llama of test_gguf_exact (all eight block types; q/k rows permuted in the file as
llama.cpp writes them) is built both ways: the lean graph must give the fp32 route's gguf graph's logits
and greedy output, and the layer-by-layer reference must equal the whole HF model."""
from __future__ import annotations

import numpy as np
import pytest
from close import assert_close

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from test_gguf_exact import SUPPORTED, _own_cache, quantized_gguf  # noqa: F401, E402  (fixtures; after the skips)


def test_layerwise_reference_equals_the_whole_model(quantized_gguf):  # noqa: F811
    import torch
    import transformers

    from specexport.export.gguf import hf_folder_from_gguf
    from specexport.export.gguf_reference import layerwise_logits
    from specexport.export.gguf_weights import GgufWeights

    folder = hf_folder_from_gguf(quantized_gguf)                    # fp32 weights: transformers' own load
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    weights = GgufWeights(quantized_gguf, transformers.AutoConfig.from_pretrained(folder))
    seqs = [np.array([1, 40, 41, 42, 7]), np.array([3, 9, 300])]
    got = layerwise_logits(weights, seqs)
    rows = [5, 40, 200]
    some = layerwise_logits(weights, seqs[:1], vocab_rows=rows)[0]
    with torch.no_grad():
        for s, g in zip(seqs, got):
            want = model(torch.from_numpy(s)[None]).logits[0].numpy()
            assert_close(g, want, rel=1e-4, why="layer-by-layer from dequantized tensors vs the whole model: other "
                         "summation orders over 1e2-1e3 terms")
    assert_close(some, got[0][:, rows], rel=1e-6, why="a head of 3 rows vs the whole head: the same dot "
                 "products through another matmul kernel")


def test_lean_build_equals_the_fp32_route(quantized_gguf, tmp_path, write_yaml, run_build):  # noqa: F811
    import specexport
    from specexport.manifest import read_manifest

    gates = {"gguf": {"min_top1": 0.0, "max_kl": 100.0}}
    lean, full = tmp_path / "lean", tmp_path / "full"
    for out, precisions in ((lean, ["gguf"]), (full, ["fp32", "gguf"])):
        yaml = write_yaml(tmp_path / f"{out.name}.yaml", name=out.name, target={"path": quantized_gguf},
                          draft={"path": quantized_gguf}, max_seq_len=96, precisions=precisions,
                          quality_gates=gates, output=out)
        assert run_build(yaml, "--no-bench") == 0
    manifest = read_manifest(lean)
    assert set(manifest["models"]["target"]["precisions"]) == {"gguf"}          # no fp32 graph at all
    assert not list(lean.rglob("fp32"))
    entry = manifest["models"]["target"]["precisions"]["gguf"]
    assert entry["quantization"]["route"].startswith("lean")
    assert set(entry["quantization"]["block_types"]) == set(SUPPORTED)
    assert entry["parity_max_rel_error"] <= 1e-4 and entry["parity_reference"].startswith("transformers")
    assert manifest["build_peak_rss_bytes"]["process"] > 0
    file_weights = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(quantized_gguf)).tensors)
    assert entry["files"][f"{entry['dir']}/model.onnx.data"]["size"] <= 1.10 * file_weights
    assert not [p for p in lean.rglob("*.onnx") if p.name != "model.onnx"]        # skeleton, twin: gone
    with specexport.load(full, precision="gguf") as ref, specexport.load(lean) as got:
        assert got.precision == "gguf"                 # a lean build's default: its one precision
        for prompt in ([1, 40, 41, 42], [1, 7, 300, 5, 9]):
            a = ref.generate(prompt_ids=prompt, max_new_tokens=32, method="vanilla").token_ids
            b = got.generate(prompt_ids=prompt, max_new_tokens=32, method="vanilla").token_ids
            spec = got.generate(prompt_ids=prompt, max_new_tokens=32, method="draft", gamma=3).token_ids
            assert a == b and spec == b


def test_lean_target_refuses_heads_which_read_its_fp32_graph(quantized_gguf, tmp_path, write_yaml, run_build,  # noqa: F811
                                                              capsys):
    (tmp_path / "heads").mkdir()
    yaml = write_yaml(tmp_path / "m.yaml", name="g", target={"path": quantized_gguf}, medusa={"path": "heads"},
                      max_seq_len=96, precisions=["gguf"], output=tmp_path / "out")
    assert run_build(yaml) == 1
    err = capsys.readouterr().err
    assert "target.precisions: [gguf] alone builds no fp32 graph, and medusa read(s)" in err
    assert not (tmp_path / "out").exists()


def test_a_lean_draft_vocabulary_is_measured_on_the_targets_gguf_graph(quantized_gguf, tmp_path, write_yaml,  # noqa: F811
                                                                       run_build):
    import specexport
    from specexport.manifest import read_manifest

    out = tmp_path / "out"
    yaml = write_yaml(tmp_path / "m.yaml", name="v", target={"path": quantized_gguf},
                      draft={"path": quantized_gguf, "vocab": 64}, max_seq_len=96, precisions=["gguf"],
                      quality_gates={"gguf": {"min_top1": 0.0, "max_kl": 100.0}}, output=out)
    assert run_build(yaml, "--no-bench") == 0
    draft = read_manifest(out)["models"]["draft"]
    assert len(draft["vocab_ids"]) == 64 and draft["vocab_source"]["graph"] == "target/gguf"
    assert draft["precisions"]["gguf"]["parity_max_rel_error"] <= 1e-4
    with specexport.load(out, precision="gguf") as pipe:
        plain = pipe.generate(prompt_ids=[1, 40, 41], max_new_tokens=30, method="vanilla").token_ids
        assert pipe.generate(prompt_ids=[1, 40, 41], max_new_tokens=30, method="draft", gamma=3).token_ids == plain


def test_dry_run_converts_nothing_and_writes_nothing(quantized_gguf, tmp_path, monkeypatch, write_yaml,  # noqa: F811
                                                     run_build, capsys):
    """`build --dry-run` on a GGUF model not converted yet names what a build would convert and where, and
    writes nothing: no conversion in the cache, no output folder (issue 33: it converted for 282 s)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECEXPORT_CACHE", str(cache))
    out = tmp_path / "out"
    yaml = write_yaml(tmp_path / "m.yaml", name="dry", target={"path": quantized_gguf}, max_seq_len=64,
                      precisions=["gguf"], output=out)
    capsys.readouterr()
    assert run_build(yaml, "--dry-run") == 0
    err = capsys.readouterr().err
    words = " ".join(err.split())                    # the console may wrap (a $COLUMNS in the environment)
    assert "not converted yet" in words and "converts nothing" in words
    assert str(cache / "gguf") in err.replace("\n", ""), err
    assert not cache.exists() and not out.exists()


def _mapped_rss_kib(path) -> int:
    """This process's resident KiB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_released_file_pages_leave_the_process_and_read_back_the_same(quantized_gguf):  # noqa: F811
    """The layer-by-layer reference reads the whole file through its memory map; release() drops the pages
    read from the process's resident memory (they counted in the build's peak beside the graph's session)."""
    import transformers

    from specexport.export.gguf import hf_folder_from_gguf
    from specexport.export.gguf_weights import GgufWeights

    folder = hf_folder_from_gguf(quantized_gguf)
    weights = GgufWeights(quantized_gguf, transformers.AutoConfig.from_pretrained(folder))
    before = {name: weights.get(name) for name in weights.names}
    assert _mapped_rss_kib(quantized_gguf) > 0
    weights.release()
    assert _mapped_rss_kib(quantized_gguf) == 0
    for name, w in before.items():
        assert np.array_equal(weights.get(name), w), name
