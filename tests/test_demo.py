"""The shipped demo pair builds, and its greedy speculative output equals vanilla greedy."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import specexport
from specexport.cli import main
from close import assert_close

DEMO = Path(__file__).parents[1] / "examples"


@pytest.fixture(scope="module")
def demo_build(tmp_path_factory):
    import yaml

    work = tmp_path_factory.mktemp("demo")
    cfg = yaml.safe_load((DEMO / "demo.yaml").read_text())
    for role in ("target", "draft", "medusa", "eagle"):
        cfg[role]["path"] = str((DEMO / cfg[role]["path"]).resolve())
    cfg["output"] = str(work / "build")
    (work / "demo.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["build", str(work / "demo.yaml")]) == 0
    return work / "build"


def test_demo_weights_are_small_and_fp16():
    from safetensors import safe_open

    files = list((DEMO / "demo" / "models").rglob("*.safetensors"))
    assert {f.parent.name for f in files} == {"target", "draft", "medusa", "eagle3"}
    assert sum(f.stat().st_size for f in files) <= 36 * 2**20
    for f in files:
        with safe_open(str(f), framework="np") as st:
            floats = {str(st.get_tensor(k).dtype) for k in st.keys() if k not in ("d2t", "t2d")}   # EAGLE-3's maps
            assert floats == {"float16"}, f


def test_demo_greedy_speculative_equals_vanilla(demo_build):
    pipe = specexport.load(demo_build)
    prompts = [json.loads(line) for line in open(DEMO / "demo" / "prompts" / "code.jsonl")][:4]
    accepted = 0
    for p in prompts:
        vanilla = pipe.generate(p, max_new_tokens=64, method="vanilla")
        for method, gamma in (("draft", 2), ("draft", 4), ("medusa", 0), ("eagle", 0)):
            spec = pipe.generate(p, max_new_tokens=64, method=method, gamma=max(gamma, 1))
            assert spec.token_ids == vanilla.token_ids, method
            accepted += spec.stats.accepted
    assert accepted > 0


def test_demo_depth_expansion_keeps_the_function():
    """train_demo.py's second stage deepens the trained model with identity blocks: same logits before
    training resumes, every layer knows its index (for the KV cache), the config says the new depth."""
    import copy
    import importlib.util

    import torch
    import transformers

    spec = importlib.util.spec_from_file_location("train_demo", DEMO / "demo" / "train_demo.py")
    train_demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_demo)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).eval()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 12))
    train_demo.expand_depth(model, 5)
    assert len(model.model.layers) == model.config.num_hidden_layers == 5
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(5))
    assert_close(model(ids).logits, original(ids).logits, rel=1e-6,
                 why="layers that add zero to the residual: rounding only")
    # with a KV cache (where layer indices matter) greedy generation is unchanged too
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert model.generate(ids[:1], **kw).tolist() == original.generate(ids[:1], **kw).tolist()
    with pytest.raises(SystemExit, match="already has 5 layers"):
        train_demo.expand_depth(model, 4)
