"""specexport train-heads on a tiny random target: the heads learn, a resumed run ends where an
uninterrupted one does, and the output is the published Medusa-1 layout that a build takes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specexport.distill.heads import HeadsTrainConfig, train_heads
from specexport.errors import SpecexportError
from specexport.heads.medusa import load_medusa


def _cfg(target, out, corpus, **kw):
    base = dict(target=target, out=out, heads=2, corpus=corpus, num_prompts=24, prompt_tokens=16, new_tokens=24,
                heldout=6, steps=30, batch_size=8, lr=3e-3, seed=0, checkpoint_every=10, top_k=4, device="cpu")
    base.update(kw)
    return HeadsTrainConfig(**base)


def test_heads_learn_and_are_written_in_the_medusa_1_layout(tiny_checkpoints, corpus, tmp_path):
    from transformers import AutoConfig

    report = train_heads(_cfg(tiny_checkpoints["llama"], tmp_path / "h", corpus))
    assert report["final_loss"] < 0.8 * report["first_loss"], report
    assert json.loads((tmp_path / "h" / "train_report.json").read_text())["after"] == report["after"]
    # on this random target greedy top-1 over ~130 held-out positions is noise; the held-out KL is not
    for k in range(2):
        assert report["after"]["kl"][k] < 0.9 * report["before"]["kl"][k], report
        assert report["after"]["topk"][k] >= report["after"]["top1"][k]
    cfg = AutoConfig.from_pretrained(tiny_checkpoints["llama"])
    w = load_medusa(tmp_path / "h", hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
    assert (w.format, w.num_heads, w.num_layers, w.lm_head) == ("medusa-1", 2, 1, "own")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["medusa_num_heads"] == 2
    assert not any(p.name.startswith(".h.partial") for p in tmp_path.iterdir())


def test_resumed_run_equals_uninterrupted_and_shared_projection(tiny_checkpoints, corpus, tmp_path):
    from safetensors.numpy import load_file

    kw = dict(steps=8, checkpoint_every=4, projection="shared")
    train_heads(_cfg(tiny_checkpoints["llama"], tmp_path / "a", corpus, **kw))

    def stop_at_6(step):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_heads(_cfg(tiny_checkpoints["llama"], tmp_path / "b", corpus, **kw), on_step=stop_at_6)
    assert not (tmp_path / "b").exists()                    # nothing that looks complete
    train_heads(_cfg(tiny_checkpoints["llama"], tmp_path / "b", corpus, **kw))
    a, b = (load_file(str(tmp_path / x / "medusa_lm_head.safetensors")) for x in "ab")
    assert sorted(a) == sorted(b) and not any(k.endswith(".1.weight") for k in a)    # version-2 layout
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_trained_heads_build_and_decode_like_vanilla(tiny_checkpoints, corpus, tmp_path, write_yaml, run_build):
    import specexport

    train_heads(_cfg(tiny_checkpoints["llama"], tmp_path / "heads", corpus, heads=3, steps=20, dtype="float16"))
    yaml = write_yaml(tmp_path / "m.yaml", name="trained-heads", target={"path": tiny_checkpoints["llama"]},
                      medusa={"path": tmp_path / "heads"}, max_seq_len=128, output=tmp_path / "out")
    assert run_build(yaml) == 0
    with specexport.load(tmp_path / "out") as pipe:
        for prompt in ("def f(x):", "import os", "class A:"):
            ref = pipe.generate(prompt, max_new_tokens=60, method="vanilla").token_ids
            assert pipe.generate(prompt, max_new_tokens=60, method="medusa").token_ids == ref


def test_train_heads_errors(tiny_checkpoints, corpus, tmp_path):
    with pytest.raises(SpecexportError, match="--kind: 'eagle2' is not supported; supported: medusa, eagle1, eagle3"):
        train_heads(_cfg(tiny_checkpoints["llama"], tmp_path / "x", corpus, kind="eagle2"))
    with pytest.raises(SpecexportError, match="--projection: expected own or shared"):
        train_heads(_cfg(tiny_checkpoints["llama"], tmp_path / "x", corpus, projection="tied"))
    with pytest.raises(SpecexportError, match="--heads: expected >= 1"):
        train_heads(_cfg(tiny_checkpoints["llama"], tmp_path / "x", corpus, heads=0))
