"""A gguf build in each weight layout (quantization.gguf.layout: file | r8; plugins/cpu/sx_layout.h): the tiny
mixed-type Llama of test_gguf_exact (all eight block types) built lean both ways gives the same graph but
for the weights' order and the ops' layout attribute, the same size, the same greedy and speculative output;
the manifest says which layout and why; a layout this version does not know is refused before any pass."""
from __future__ import annotations

import json

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from test_gguf_exact import _own_cache, lean_builds, quantized_gguf  # noqa: F401, E402  (fixtures; after the skips)


@pytest.fixture(scope="module")
def two_layouts(quantized_gguf, tmp_path_factory, write_yaml, run_build):  # noqa: F811
    base = lean_builds(quantized_gguf, tmp_path_factory, write_yaml, run_build, "layouts",
                       {layout: {"draft": {"path": quantized_gguf}, "quantization": {"gguf": {"layout": layout}}}
                        for layout in ("file", "r8")})
    return {layout: base / layout for layout in ("file", "r8")}


def _entry(build):
    from specexport.manifest import read_manifest

    return read_manifest(build)["models"]["target"]["precisions"]["gguf"]


def test_both_layouts_give_the_same_outputs_in_graphs_of_the_same_size(two_layouts):
    import onnx

    import specexport

    entries = {k: _entry(v) for k, v in two_layouts.items()}
    kernels = {k: e["quantization"]["kernels"] for k, e in entries.items()}
    assert kernels["r8"]["layout"] == "r8" and kernels["r8"]["layout_why"] == "layout: r8"
    assert kernels["file"]["layout"] == "file"
    size = {k: e["files"][f"{e['dir']}/model.onnx.data"]["size"] for k, e in entries.items()}
    assert size["r8"] == size["file"]
    graphs = {k: onnx.load(str(v / entries[k]["dir"] / "model.onnx"), load_external_data=False) for k, v in two_layouts.items()}
    ours = {k: [n for n in g.graph.node if n.op_type.startswith("Gguf")] for k, g in graphs.items()}
    layouts = {k: {onnx.helper.get_attribute_value(a) for n in v for a in n.attribute if a.name == "layout"}
               for k, v in ours.items()}
    assert layouts == {"file": set(), "r8": {b"r8"}}                 # the file's: no attribute (its default)
    with specexport.load(two_layouts["file"]) as ref, specexport.load(two_layouts["r8"]) as got:
        for prompt in ([1, 40, 41, 42], [1, 7, 300, 5, 9]):
            want = ref.generate(prompt_ids=prompt, max_new_tokens=24, method="vanilla").token_ids
            assert got.generate(prompt_ids=prompt, max_new_tokens=24, method="vanilla").token_ids == want
            assert got.generate(prompt_ids=prompt, max_new_tokens=24, method="draft", gamma=3).token_ids == want


def test_a_layout_this_version_does_not_know_is_refused_before_any_pass(two_layouts, tmp_path):
    import shutil

    import specexport
    from specexport.errors import SpecexportError

    copy = tmp_path / "copy"
    shutil.copytree(two_layouts["r8"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["models"]["target"]["precisions"]["gguf"]["quantization"]["kernels"]["layout"] = "r16"
    manifest["specexport_version"] = "9.9"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecexportError, match=r"target/gguf: its weights are in the layout 'r16', written by "
                                              r"specexport 9\.9; this version reads file, r8"):
        specexport.load(copy)


def test_layout_r8_where_the_kernels_do_not_run_is_refused_naming_the_key(monkeypatch):
    from specexport.builder.stages.gguf_shared import choose_layout
    from specexport.errors import SpecexportError
    from specexport.plugins import cpu

    stock = cpu.Status(None, reason="SPECEXPORT_KERNELS=off")
    with pytest.raises(SpecexportError, match=r"target\.quantization\.gguf\.layout: r8 is a layout of specexport's CPU "
                                              r"kernels, which do not run here \(SPECEXPORT_KERNELS=off\)"):
        choose_layout("r8", stock, "target.quantization.gguf")
    assert choose_layout("auto", stock, "x")[0] == "file" and choose_layout("file", stock, "x") == ("file", "layout: file")
