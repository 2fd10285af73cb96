"""EAGLE heads in the published layouts (heads/eagle.py): loading, version from the keys, the checks
against the target, and the PyTorch head against transformers' Llama layer and across tree masks."""
from __future__ import annotations

import json

import numpy as np
import pytest
from close import assert_close

torch = pytest.importorskip("torch")

from specexport.errors import SpecexportError  # noqa: E402
from specexport.heads.eagle import eagle3_layers, load_eagle  # noqa: E402
from specexport.heads.eagle_torch import make_head  # noqa: E402

H, HEADS, KV, INTER, V = 32, 4, 2, 64, 96


def layer_tensors(prefix, width_in, g):
    hd = H // HEADS
    return {f"{prefix}self_attn.q_proj.weight": torch.randn(HEADS * hd, width_in, generator=g) * 0.2,
            f"{prefix}self_attn.k_proj.weight": torch.randn(KV * hd, width_in, generator=g) * 0.2,
            f"{prefix}self_attn.v_proj.weight": torch.randn(KV * hd, width_in, generator=g) * 0.2,
            f"{prefix}self_attn.o_proj.weight": torch.randn(H, HEADS * hd, generator=g) * 0.2,
            f"{prefix}mlp.gate_proj.weight": torch.randn(INTER, H, generator=g) * 0.2,
            f"{prefix}mlp.up_proj.weight": torch.randn(INTER, H, generator=g) * 0.2,
            f"{prefix}mlp.down_proj.weight": torch.randn(H, INTER, generator=g) * 0.2,
            f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g)}


def config(**extra):
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "intermediate_size": INTER, "num_hidden_layers": 1, "vocab_size": V,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, **extra}


def write_eagle1(folder, *, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.2, **layer_tensors("layers.0.", H, g)}
    if bias:
        t["fc.bias"] = torch.randn(H, generator=g) * 0.1
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config(**({} if bias else {"bias": False}))))
    torch.save(t, folder / "pytorch_model.bin")
    return t


def write_eagle3(folder, *, draft_vocab=40, aux=None, seed=1):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    ids = np.sort(np.random.default_rng(seed).choice(V, draft_vocab, replace=False))
    t = {"fc.weight": torch.randn(H, 3 * H, generator=g) * 0.2, **layer_tensors("midlayer.", 2 * H, g),
         "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
         "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(H, generator=g),
         "norm.weight": 1 + 0.1 * torch.randn(H, generator=g), "lm_head.weight": torch.randn(draft_vocab, H, generator=g),
         "d2t": torch.from_numpy(ids - np.arange(draft_vocab)), "t2d": torch.from_numpy(np.isin(np.arange(V), ids))}
    folder.mkdir(parents=True)
    extra = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": aux}} if aux else {}
    (folder / "config.json").write_text(json.dumps(config(draft_vocab_size=draft_vocab, **extra)))
    save_file(t, str(folder / "model.safetensors"))
    return t, ids


def export_eagle3(root):
    """write_eagle3's head exported (random embedding, no lm_head): (weights, embed, io, the graph's path)."""
    from specexport.heads.eagle_graph import export_head, io_for

    write_eagle3(root / "head")
    w = load_eagle(root / "head", hidden_size=H, vocab_size=V, num_layers=12)
    io = io_for(w, target_hidden=H, top_k=5)
    embed = np.random.default_rng(0).normal(size=(V, H)).astype(np.float32)
    export_head(w, embed, None, io=io, onnx_path=root / "model.onnx")
    return w, embed, io, root / "model.onnx"


def test_versions_come_from_the_keys_and_d2t_maps_to_target_ids(tmp_path):
    write_eagle1(tmp_path / "e1")
    w1 = load_eagle(tmp_path / "e1", hidden_size=H, vocab_size=V, num_layers=12)
    assert (w1.version, w1.aux_layers, w1.draft_vocab) == (1, (), None)
    _, ids = write_eagle3(tmp_path / "e3")
    w3 = load_eagle(tmp_path / "e3", hidden_size=H, vocab_size=V, num_layers=12)
    assert (w3.version, w3.aux_layers, w3.draft_vocab) == (3, (2, 6, 9), 40)
    assert (w3.target_ids() == ids).all()
    write_eagle3(tmp_path / "e3x", aux=[1, 5, 10])
    assert load_eagle(tmp_path / "e3x", hidden_size=H, vocab_size=V, num_layers=12).aux_layers == (1, 5, 10)
    # a target so shallow that the default layers coincide
    assert eagle3_layers({}, 4) == (1, 2, 2) and eagle3_layers({}, 3) == (0, 1, 2)
    write_eagle1(tmp_path / "nobias", bias=False)
    assert "fc.bias" not in load_eagle(tmp_path / "nobias", hidden_size=H, vocab_size=V, num_layers=2).tensors


@pytest.mark.parametrize("break_it, match", [
    (lambda f: (f / "config.json").unlink(), "has no config.json"),
    (lambda f: (f / "pytorch_model.bin").unlink(), r"has no weights \(model.safetensors or pytorch_model.bin\)"),
    (lambda f: torch.save({"x.weight": torch.zeros(2)}, f / "pytorch_model.bin"), "neither an EAGLE-1 head"),
    (lambda f: torch.save({**torch.load(f / "pytorch_model.bin"), "fc.weight": torch.zeros(H, 3 * H)},
                          f / "pytorch_model.bin"), r"fc.weight is \[32, 96\]; expected \[32, 64\]"),
    (lambda f: torch.save({k: v for k, v in torch.load(f / "pytorch_model.bin").items() if k != "fc.bias"},
                          f / "pytorch_model.bin"), r"needs \['fc.bias'\]"),
])
def test_bad_heads_are_named(tmp_path, break_it, match):
    write_eagle1(tmp_path / "e")
    break_it(tmp_path / "e")
    with pytest.raises(SpecexportError, match=match) as err:
        load_eagle(tmp_path / "e", hidden_size=H, vocab_size=V, num_layers=4)
    assert "eagle.path" in str(err.value)


def test_eagle3_aux_layers_and_d2t_are_checked(tmp_path):
    write_eagle3(tmp_path / "a", aux=[1, 5, 40])
    with pytest.raises(SpecexportError, match=r"three target layers in 0..11; got \[1, 5, 40\]"):
        load_eagle(tmp_path / "a", hidden_size=H, vocab_size=V, num_layers=12)
    write_eagle3(tmp_path / "b")
    with pytest.raises(SpecexportError, match="d2t maps draft ids outside"):
        load_eagle(tmp_path / "b", hidden_size=H, vocab_size=20, num_layers=12)


def test_eagle1_layer_equals_transformers_llama_layer_without_its_input_norm(tmp_path):
    """The head's decoder layer is a Llama layer with the input norm skipped: transformers' own layer on
    fc's output, with the same weights, gives the same hidden state."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    t = write_eagle1(tmp_path / "e")
    head = make_head(load_eagle(tmp_path / "e", hidden_size=H, vocab_size=V, num_layers=4))
    cfg = LlamaConfig(**{k: v for k, v in config().items() if k != "architectures"})
    cfg._attn_implementation = "eager"
    layer = LlamaDecoderLayer(cfg, layer_idx=0).eval()
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in t.items() if k.startswith("layers.0.")}, strict=False)
    layer.input_layernorm = torch.nn.Identity()
    g = torch.Generator().manual_seed(3)
    emb, feat = torch.randn(1, 7, H, generator=g), torch.randn(1, 7, H, generator=g)
    positions = torch.arange(5, 12)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    lm_head = torch.randn(V, H, generator=g)
    with torch.no_grad():
        logits, hidden = head(emb, feat, positions, mask, lm_head)
        x = torch.nn.functional.linear(torch.cat([emb, feat], -1), t["fc.weight"], t["fc.bias"])
        additive = torch.zeros(7, 7).masked_fill(~mask, float("-inf"))[None, None]
        ref = layer(x, attention_mask=additive, position_ids=positions[None],
                    position_embeddings=LlamaRotaryEmbedding(cfg)(x, positions[None]))
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert_close(hidden, ref, rel=1e-5, why="our head vs transformers' layer: fp32, other kernels")
    assert_close(logits, hidden @ lm_head.T, rel=1e-5, why="fp32 matmuls in another order")


def test_a_tree_mask_gives_each_node_what_its_own_chain_gives(tmp_path):
    """Under the ancestor mask, node i's output equals running the head causally on the path to i
    (positions = depth): the property the head graph's tree expansion relies on."""
    from specexport.runtime.tree import Tree

    write_eagle3(tmp_path / "e")
    head = make_head(load_eagle(tmp_path / "e", hidden_size=H, vocab_size=V, num_layers=12))
    tree = Tree(np.array([-1, 0, 0, 1, 1, 2, 3]))
    g = torch.Generator().manual_seed(4)
    emb, feat = torch.randn(1, 7, H, generator=g), torch.randn(1, 7, 3 * H, generator=g)
    with torch.no_grad():
        logits, _ = head(emb, feat, torch.from_numpy(10 + tree.depths), torch.tensor(tree.mask))   # a Tree is read-only
        for node in range(7):
            path = torch.from_numpy(tree.path_to(node))
            chain, _ = head(emb[:, path], feat[:, path], 10 + torch.arange(len(path)),
                            torch.ones(len(path), len(path), dtype=torch.bool).tril())
            assert_close(logits[0, node], chain[0, -1], rel=1e-5, why=f"node {node}: tree pass vs its chain, fp32")
    assert logits.shape == (1, 7, 40)
