"""specexport distill-draft on a tiny random target: it learns, it resumes exactly, its output builds."""
from __future__ import annotations

import json

import pytest

from specexport.cli import main
from specexport.distill.train import DistillConfig, distill_draft
from specexport.errors import SpecexportError


def _cfg(target, out, corpus, **kw):
    base = dict(target=target, out=out, layers=1, corpus=corpus, num_prompts=24, prompt_tokens=16, new_tokens=24,
                heldout=6, steps=40, batch_size=8, lr=3e-3, seed=0, checkpoint_every=10, device="cpu")
    base.update(kw)
    return DistillConfig(**base)


def _weights(folder):
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


def test_distillation_lowers_kl_and_raises_agreement(tiny_checkpoints, corpus, tmp_path):
    report = distill_draft(_cfg(tiny_checkpoints["llama"], tmp_path / "d", corpus))
    assert report["kl_after"] < 0.9 * report["kl_before"], report
    assert report["agreement_after"] > report["agreement_before"], report
    assert json.loads((tmp_path / "d" / "distill_report.json").read_text())["kl_after"] == report["kl_after"]


def test_resumed_run_equals_uninterrupted(tiny_checkpoints, corpus, tmp_path):
    cfg_a = _cfg(tiny_checkpoints["llama"], tmp_path / "a", corpus, steps=12, checkpoint_every=4,
                 hidden_size=32, intermediate_size=64)
    distill_draft(cfg_a)

    def interrupt(step):
        if step == 6:
            raise KeyboardInterrupt
    cfg_b = _cfg(tiny_checkpoints["llama"], tmp_path / "b", corpus, steps=12, checkpoint_every=4,
                 hidden_size=32, intermediate_size=64)
    with pytest.raises(KeyboardInterrupt):
        distill_draft(cfg_b, on_step=interrupt)
    assert not (tmp_path / "b").exists()                      # nothing that looks like a checkpoint
    assert (tmp_path / ".b.distill" / "state.pt").is_file()
    distill_draft(cfg_b)                                      # resumes from the step-4 checkpoint
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k
    # and a different seed gives different weights (the comparison can fail)
    distill_draft(_cfg(tiny_checkpoints["llama"], tmp_path / "c", corpus, steps=12, seed=1,
                       hidden_size=32, intermediate_size=64))
    c = _weights(tmp_path / "c")
    assert any((a[k] != c[k]).any() for k in a if k in c)


def test_distilled_draft_builds_and_decodes(tiny_checkpoints, corpus, tmp_path, write_yaml, run_build):
    import specexport

    assert main(["distill-draft", str(tiny_checkpoints["llama"]), "--out", str(tmp_path / "d"), "--corpus",
                 str(corpus), "--layers", "1", "--steps", "5", "--num-prompts", "12", "--new-tokens", "16",
                 "--batch-size", "4", "--device", "cpu"]) == 0
    cfg = write_yaml(tmp_path / "m.yaml", name="distilled", target={"path": tiny_checkpoints["llama"]},
                     draft={"path": tmp_path / "d"}, max_seq_len=96, output=tmp_path / "build")
    assert run_build(cfg) == 0
    pipe = specexport.load(tmp_path / "build")
    vanilla = pipe.generate(prompt_ids=[1, 40, 41], max_new_tokens=40, method="vanilla")
    spec = pipe.generate(prompt_ids=[1, 40, 41], max_new_tokens=40, method="draft", gamma=3)
    assert spec.token_ids == vanilla.token_ids and spec.stats.proposed > 0


def test_distill_needs_prompts_or_corpus(tiny_checkpoints, tmp_path):
    with pytest.raises(SpecexportError, match="exactly one of them"):
        distill_draft(_cfg(tiny_checkpoints["llama"], tmp_path / "x", None))
    assert main(["distill-draft", str(tmp_path), "--out", str(tmp_path / "y"), "--corpus", str(tmp_path)]) == 1


def test_reduced_vocabulary_draft_trains_builds_and_decodes(tiny_checkpoints, corpus, tmp_path, write_yaml,
                                                            run_build):
    """--draft-vocab N: the draft learns over its N ids, draft_vocab.json is written, and the build uses it
    without being told (the manifest names the file), its graph has N logits, greedy equals vanilla."""
    import specexport
    from specexport.config import DRAFT_VOCAB_FILE

    report = distill_draft(_cfg(tiny_checkpoints["llama"], tmp_path / "d", corpus, draft_vocab=48))
    ids = json.loads((tmp_path / "d" / DRAFT_VOCAB_FILE).read_text())
    assert len(ids) == 48 == report["draft_vocab"]["size"] and ids == sorted(set(ids))
    assert report["kl_after"] < 0.9 * report["kl_before"], report
    assert 0 < report["draft_vocab"]["target_mass"] < 1
    cfg = write_yaml(tmp_path / "m.yaml", name="rv", target={"path": tiny_checkpoints["llama"]},
                     draft={"path": tmp_path / "d"}, max_seq_len=96, output=tmp_path / "build")
    assert run_build(cfg) == 0
    draft = json.loads((tmp_path / "build" / "manifest.json").read_text())["models"]["draft"]
    assert draft["vocab_ids"] == ids and draft["vocab_source"]["file"].endswith(DRAFT_VOCAB_FILE)
    pipe = specexport.load(tmp_path / "build")
    for prompt in ([1, 40, 41], [1, 7, 300, 9]):
        vanilla = pipe.generate(prompt_ids=prompt, max_new_tokens=40, method="vanilla")
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=40, method="draft", gamma=3)
        assert spec.token_ids == vanilla.token_ids and spec.stats.proposed > 0
    with pytest.raises(SpecexportError, match="--draft-vocab"):
        distill_draft(_cfg(tiny_checkpoints["llama"], tmp_path / "x", corpus, draft_vocab=1))
