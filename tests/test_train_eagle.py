"""specexport train-heads --kind eagle3 / eagle1 (distill/eagle.py) on a tiny 4-layer target: the head
learns, is written in the published layout that load_eagle reads, and make_head (the reference, the
same module loaded from the files) computes exactly the trained module; the training-time-test unroll is what inference computes; a
resumed run ends where an uninterrupted one does; bad options are one-line errors."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import numpy as np
import pytest
from close import assert_close

torch = pytest.importorskip("torch")

from specexport.cli import main  # noqa: E402
from specexport.distill.eagle_head import head_config  # noqa: E402
from specexport.distill.heads import HeadsTrainConfig, train_heads  # noqa: E402
from specexport.distill.core import DATA_FIELDS, data_fingerprint  # noqa: E402
from specexport.errors import SpecexportError  # noqa: E402
from specexport.heads.eagle import EagleWeights, load_eagle  # noqa: E402
from specexport.heads.eagle_torch import make_head, trainable_head  # noqa: E402
from specexport.export.tiny import make_tiny_checkpoint  # noqa: E402
from specexport.runtime.tree import Tree  # noqa: E402

CHAT = ("{% for m in messages %}<s>user: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread, and a second thread on a busy machine costs 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer):
    """4 layers (EAGLE-3 reads the inputs of layers 1, 2, 2), llama3 RoPE scaling, untied lm_head."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("t") / "llama4", "llama", num_layers=4, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def chat_target(target, tmp_path_factory):
    """The same target whose tokenizer has a chat template."""
    from transformers import AutoTokenizer

    dest = tmp_path_factory.mktemp("chat") / "llama4"
    shutil.copytree(target, dest)
    tok = AutoTokenizer.from_pretrained(dest)
    tok.chat_template = CHAT
    tok.save_pretrained(dest)
    return dest


def _cfg(target, out, corpus, **kw):
    base = dict(target=target, out=out, kind="eagle3", corpus=corpus, num_prompts=24, prompt_tokens=16,
                new_tokens=24, steps=24, batch_size=8, lr=3e-3, seed=0, checkpoint_every=12,
                device="cpu", eval_depth=3)
    base.update(kw)
    return HeadsTrainConfig(**base)


@pytest.fixture(scope="module")
def eagle3_run(chat_target, corpus, tmp_path_factory):
    """The one run that makes data (the others copy its data.pt): prompts in the chat template (auto)."""
    out = tmp_path_factory.mktemp("e3") / "head"
    return out, train_heads(_cfg(chat_target, out, corpus, draft_vocab=64))


def _reuse_data(run, out, *files):
    (out.parent / f".{out.name}.heads").mkdir()
    for file in files:
        shutil.copy(run[0].parent / ".head.heads" / file, out.parent / f".{out.name}.heads" / file)


def _load(folder, target_dir):
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(target_dir)
    return load_eagle(folder, hidden_size=tc.hidden_size, vocab_size=tc.vocab_size, num_layers=tc.num_hidden_layers)


def _module_of(w: EagleWeights):
    head = trainable_head(w.config, w.version)
    head.load_state_dict(w.tensors)
    return head.eval()


def _assert_reference_equals_module(w: EagleWeights):
    """Random inputs, a causal and a tree mask, own_hidden both ways: make_head's loading (the keys the
    module uses, d2t from target_ids) == a strict load_state_dict of every tensor in the files."""
    ours, ref = _module_of(w), make_head(w)
    H, V = w.config["hidden_size"], w.config["vocab_size"]
    g = torch.Generator().manual_seed(5)
    tree = Tree(np.array([-1, 0, 0, 1, 1, 2, 3]))
    lm = torch.randn(V, H, generator=g)
    for mask, pos in ((torch.ones(7, 7, dtype=torch.bool).tril(), torch.arange(3, 10)),
                      (torch.tensor(tree.mask), torch.from_numpy(12 + tree.depths))):   # a Tree is read-only
        for own in (False, True) if w.version == 3 else (False,):
            emb = torch.randn(2, 7, H, generator=g)
            feat = torch.randn(2, 7, H if own or w.version == 1 else 3 * H, generator=g)
            with torch.no_grad():
                pairs = zip(ours(emb, feat, pos, mask, lm, own_hidden=own), ref(emb, feat, pos, mask, lm, own_hidden=own))
                for a, b in pairs:
                    assert_close(a, b, rel=1e-5, why="one module, two ways of loading it")


def test_eagle3_with_a_draft_vocabulary_learns_and_is_the_published_layout(eagle3_run, chat_target):
    out, report = eagle3_run
    assert report["chat_template"] == "on"                         # auto: the tokenizer has one
    data = torch.load(out.parent / ".head.heads" / "data.pt", weights_only=False)
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(chat_target).decode(data["heldout"][0][0][:data["heldout"][0][1]])
    assert text.startswith("<s>user: ") and text.endswith("\nassistant:"), text
    assert np.mean(report["loss_last"]) < 0.6 * report["first_loss"], report
    assert report["after"]["acceptance_length"] > report["before"]["acceptance_length"], report
    assert len(report["after"]["top1"]) == 3 and report["reference_max_abs_diff"] < 1e-5
    assert json.loads((out / "train_report.json").read_text())["after"] == report["after"]
    w = _load(out, chat_target)
    assert (w.version, w.aux_layers, w.draft_vocab) == (3, (1, 2, 2), 64)
    ids = w.target_ids()
    assert ids.min() >= 0 and ids.max() < w.config["vocab_size"] and len(set(ids)) == 64 and 2 in ids   # EOS in
    assert (np.flatnonzero(w.tensors["t2d"].numpy()) == ids).all()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 2]}
    assert cfg["rope_scaling"]["rope_type"] == "llama3"             # copied from the target
    _assert_reference_equals_module(w)
    assert not any(p.name.startswith(".head.partial") for p in out.parent.iterdir())


def test_eagle1_learns_and_is_the_published_layout(eagle3_run, chat_target, corpus, tmp_path):
    _reuse_data(eagle3_run, tmp_path / "e1", "data.pt")             # its own features: the final state
    report = train_heads(_cfg(chat_target, tmp_path / "e1", corpus, kind="eagle1"))
    assert np.mean(report["loss_last"]) < 0.6 * report["first_loss"], report
    assert report["reference_max_abs_diff"] < 1e-5
    w = _load(tmp_path / "e1", chat_target)
    assert (w.version, w.aux_layers) == (1, ()) and "fc.bias" in w.tensors
    assert (tmp_path / "e1" / "pytorch_model.bin").is_file()
    assert json.loads((tmp_path / "e1" / "config.json").read_text())["bias"] is True
    _assert_reference_equals_module(w)


def test_resumed_run_equals_uninterrupted_full_vocabulary_fp16(eagle3_run, chat_target, corpus, tmp_path, capsys):
    from safetensors.torch import load_file

    kw = dict(steps=8, checkpoint_every=4, dtype="float16", ttt_steps=2, eval_depth=2)
    for name in "ab":                                # the same data and features: reuse the cached ones
        _reuse_data(eagle3_run, tmp_path / name, "data.pt", "features.pt")
    base = _cfg(chat_target, tmp_path / "a", corpus, **kw)        # the uninterrupted run through the CLI
    flags = {"--kind": "eagle3", "--steps": 8, "--checkpoint-every": 4, "--dtype": "float16", "--ttt-steps": 2,
             "--eval-depth": 2, **{f"--{k.replace('_', '-')}": getattr(base, k) for k in
                                   ("num_prompts", "prompt_tokens", "new_tokens", "batch_size", "lr", "device")}}
    args = [str(chat_target), "--out", str(tmp_path / "a"), "--corpus", str(corpus)]
    assert main(["train-heads", *args, *[str(x) for kv in flags.items() for x in kv]]) == 0
    said = " ".join(capsys.readouterr().err.split())                 # rich wraps at the terminal width
    assert "held-out acceptance length (tokens per target pass, greedy chains of depth 2)" in said, said

    def stop_at_6(step):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_heads(_cfg(chat_target, tmp_path / "b", corpus, **kw), on_step=stop_at_6)
    assert not (tmp_path / "b").exists()
    report = train_heads(_cfg(chat_target, tmp_path / "b", corpus, **kw))
    assert report["reference_max_abs_diff"] < 1e-4                 # against the fp16-rounded module
    a, b = (load_file(str(tmp_path / x / "model.safetensors")) for x in "ab")
    assert sorted(a) == sorted(b) and a["fc.weight"].dtype == torch.float16
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not a["d2t"].any() and a["t2d"].all()                   # the full vocabulary


@pytest.mark.parametrize("version", [3, 1])
def test_unrolled_steps_are_what_inference_computes(version, target):
    """Row i at TTT step s == make_head run as inference runs it: step-0 rows 0..i-s, then a chain of s
    rows each reading the previous row's output hidden (teacher-forced tokens, and greedy tokens)."""
    from transformers import AutoConfig

    tc = AutoConfig.from_pretrained(target)
    hcfg = head_config(tc, version, aux_layers=(1, 2, 2), draft_vocab=48 if version == 3 else None)
    ids = np.sort(np.random.default_rng(0).choice(tc.vocab_size, 48, replace=False)) if version == 3 else None
    g = torch.Generator().manual_seed(1)
    lm = torch.randn(tc.vocab_size, tc.hidden_size, generator=g) * 0.1
    head = trainable_head(hcfg, version, lm_head=lm, ids=ids, seed=3, init_std=0.1).eval()
    w = EagleWeights(version=version, config=hcfg, tensors=dict(head.state_dict()), aux_layers=(), path=None)
    ref = make_head(w)
    T, H = 9, tc.hidden_size
    embed = torch.nn.Embedding(tc.vocab_size, H)
    tokens = torch.randint(0, tc.vocab_size, (1, T), generator=g)
    feats = torch.randn(1, T, 3 * H if version == 3 else H, generator=g)
    to_target = head.target_ids()
    with torch.no_grad():
        forced = head.unroll(embed(tokens), feats, 4, lm_head=lm)
        greedy = head.unroll(embed(tokens), feats, 4, lm_head=lm, embed_next=lambda lg: embed(to_target[lg.argmax(-1)]))
        step0 = torch.nn.functional.linear(feats, w.tensors["fc.weight"]) if version == 3 else feats
        for outs, drafted in ((forced, False), (greedy, True)):
            for s, i in ((1, 1), (1, 5), (2, 6), (3, 8), (3, 3)):
                r = i - s
                emb, feat = embed(tokens[:, :r + 1]), step0[:, :r + 1]
                for t in range(1, s + 1):                       # one more draft level per call
                    n = r + t
                    logits, hidden = ref(emb, feat, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), lm,
                                         own_hidden=version == 3)
                    nxt = embed(to_target[logits[:, -1:].argmax(-1)]) if drafted else embed(tokens[:, n:n + 1])
                    emb, feat = torch.cat([emb, nxt], 1), torch.cat([feat, hidden[:, -1:]], 1)
                logits, hidden = ref(emb, feat, torch.arange(i + 1), torch.ones(i + 1, i + 1, dtype=torch.bool).tril(),
                                     lm, own_hidden=version == 3)
                assert_close(outs[s][0][0, i], logits[0, -1], rel=1e-5, why=f"logits {(s, i, drafted)}: fp32")
                assert_close(outs[s][1][0, i], hidden[0, -1], rel=1e-5, why=f"hidden {(s, i, drafted)}: fp32")


def test_fingerprints_of_existing_runs_do_not_change(target, corpus, tmp_path):
    cfg = _cfg(target, tmp_path / "x", corpus, kind="medusa")
    old = {k: str(getattr(cfg, k)) for k in DATA_FIELDS}
    assert data_fingerprint(cfg) == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert data_fingerprint(dataclasses.replace(cfg, chat_template="off")) == data_fingerprint(cfg)
    assert data_fingerprint(dataclasses.replace(cfg, chat_template="on")) != data_fingerprint(cfg)
    medusa_fields = {k: str(v) for k, v in dataclasses.asdict(cfg).items()
                     if k not in ("steps", "checkpoint_every", "device", "top_k", "eval_depth", "draft_vocab",
                                  "ttt_steps", "chat_template", "intermediate_size", "force")}
    assert cfg.fingerprint() == hashlib.sha256(json.dumps(medusa_fields, sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize("args, message", [
    (["--kind", "eagle3", "--heads", "2"], "error: --heads: Medusa option(s), not taken by --kind eagle3"),
    (["--kind", "medusa", "--ttt-steps", "2", "--draft-vocab", "9"],
     "error: --draft-vocab, --ttt-steps: EAGLE option(s), not taken by --kind medusa"),
    (["--kind", "eagle1", "--draft-vocab", "64"], "error: --draft-vocab: EAGLE-1 heads project through"),
    (["--kind", "eagle3", "--ttt-steps", "0"], "error: --ttt-steps: expected >= 1, got 0"),
    (["--kind", "eagle3", "--draft-vocab", "384"], "error: --draft-vocab: 384 is not smaller than the target's"),
    (["--kind", "eagle3", "--chat-template", "maybe"], "error: --chat-template: expected auto, on or off"),
    (["--kind", "eagle3", "--chat-template", "on"], "error: --chat-template on: the tokenizer of"),
    (["--kind", "eagle2"], "error: --kind: 'eagle2' is not supported; supported: medusa, eagle1, eagle3"),
])
def test_bad_options_are_one_line_errors(args, message, target, corpus, tmp_path, capsys):
    assert main(["train-heads", str(target), "--out", str(tmp_path / "o"), "--corpus", str(corpus), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err, err
    assert not (tmp_path / "o").exists()


def test_a_two_layer_target_has_no_three_eagle3_layers(tiny_checkpoints, corpus, tmp_path):
    with pytest.raises(SpecexportError, match=r"--kind eagle3 on a target of 2 layers: EAGLE-3 reads three target "
                                              r"layers in 0..1"):
        train_heads(_cfg(tiny_checkpoints["llama"], tmp_path / "x", corpus))
