"""The llama.cpp and ik_llama.cpp peers' command lines and skips (the servers themselves run in the bench,
not here: neither is built on CI)."""
from pathlib import Path

from specexport.report.llama_cpp import IK_LLAMA_CPP, LLAMA_CPP, _gguf_files, open_llama_cpp, server_command

MANIFEST = {"models": {"target": {"gguf": "/m/target.gguf", "precisions": {}},
                       "draft": {"gguf": "/m/draft.gguf", "precisions": {}}}}


def test_llama_cpp_draft_flags():
    cmd = server_command(LLAMA_CPP, Path("/b/llama-server"), Path("/m/t.gguf"), port=9, draft=Path("/m/d.gguf"),
                         n_max=4, threads=2)
    assert cmd[:3] == ["/b/llama-server", "-m", "/m/t.gguf"]
    assert "--no-webui" in cmd and "-rtr" not in cmd
    at = cmd.index("-md")
    assert cmd[at:at + 6] == ["-md", "/m/d.gguf", "--spec-type", "draft-simple", "--spec-draft-n-max", "4"]
    assert cmd[-2:] == ["-td", "2"] and cmd[cmd.index("-t") + 1] == "2"


def test_ik_llama_cpp_repacks_and_uses_its_stage_syntax():
    plain = server_command(IK_LLAMA_CPP, Path("/ik/llama-server"), Path("/m/t.gguf"), port=9)
    assert "-rtr" in plain and "--no-webui" not in plain and "-md" not in plain
    assert plain[plain.index("--webui") + 1] == "none"
    spec = server_command(IK_LLAMA_CPP, Path("/ik/llama-server"), Path("/m/t.gguf"), port=9, draft=Path("/m/d.gguf"),
                          n_max=5)
    assert spec[spec.index("-md") + 1:spec.index("-md") + 4] == ["/m/d.gguf", "--spec-type", "draft:n_max=5"]
    assert "--spec-draft-n-max" not in spec and "draft-simple" not in spec


def test_ik_llama_cpp_is_never_taken_from_path(tmp_path, monkeypatch):
    (tmp_path / "llama-server").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "llama-server").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))               # a llama-server on PATH is llama.cpp's, not ik's
    peers, skipped = open_llama_cpp(MANIFEST, None, threads=2, flavour=IK_LLAMA_CPP)
    assert peers == [] and skipped[0]["peer"] == "ik_llama.cpp"
    assert "no folder given" in skipped[0]["skipped"] and "--ik-llama-cpp" in skipped[0]["skipped"]
    peers, skipped = open_llama_cpp(MANIFEST, tmp_path / "nowhere", threads=2, flavour=IK_LLAMA_CPP)
    assert peers == [] and "nowhere" in skipped[0]["skipped"]


def test_the_peer_runs_the_bytes_of_the_precision_benched():
    """A checkpoint that came as a GGUF file and was quantized again (scheme blocks): benching int4 runs
    llama.cpp on int4's own model.gguf files, not on the file the checkpoint was converted from."""
    written = {"int4": {"gguf_file": {"path": "target/int4-1/model.gguf"}}}
    models = {"target": {"gguf": "/m/target.gguf", "precisions": {"fp32": {}, **written}},
              "draft": {"gguf": "/m/draft.gguf", "precisions": {"int4": {"gguf_file": {"path": "draft/int4-2/model.gguf"}}}}}
    assert _gguf_files(models, Path("/out"), ["int4"]) == ("int4", "/out/target/int4-1/model.gguf",
                                                             "/out/draft/int4-2/model.gguf")
    here = _gguf_files(models, Path("out"), ["int4"])                  # a relative output folder: made absolute
    assert here[1] == str(Path.cwd() / "out/target/int4-1/model.gguf")
    assert _gguf_files(models, Path("/out"), ["gguf", "int4"]) == ("gguf", "/m/target.gguf", "/m/draft.gguf")
    assert _gguf_files(models, Path("/out"), ["fp32"]) == ("gguf", "/m/target.gguf", "/m/draft.gguf")
    plain = {"target": {"precisions": {"fp32": {}}}}
    assert _gguf_files(plain, Path("/out"), ["fp32"]) == ("gguf", None, None)
