"""specexport.owned: a folder is removed or replaced only as far as its marker proves the command wrote it."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specexport import owned
from specexport.errors import SpecexportError


def _write(root, files: dict):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _tree(root) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_unmarked_folder_is_never_removed_whatever_its_name(tmp_path):
    folder = tmp_path / "fp32-1234abcd"
    _write(folder, {"model.onnx": "user", "sub/x": "y"})
    assert owned.remove(folder) == [folder]
    assert _tree(folder) == {"model.onnx": b"user", "sub/x": b"y"}


def test_an_open_folder_goes_whole_a_sealed_one_only_its_listed_files(tmp_path):
    open_ = owned.create(tmp_path / "open", by="t")
    _write(open_, {"a": "1", "b/c": "2"})
    assert owned.remove(open_) == [] and not open_.exists()

    sealed = owned.create(tmp_path / "sealed", by="t")
    _write(sealed, {"model.onnx": "ours", "deep/w.bin": "ours"})
    owned.seal(sealed)
    _write(sealed, {"notes.txt": "theirs", "deep/mine.txt": "theirs", "empty/.keep": ""})
    left = owned.remove(sealed)
    assert sorted(p.relative_to(sealed).as_posix() for p in left) == ["deep", "empty", "notes.txt"]
    assert _tree(sealed) == {"deep/mine.txt": b"theirs", "empty/.keep": b"", "notes.txt": b"theirs"}
    assert not (sealed / "model.onnx").exists() and not (sealed / "deep" / "w.bin").exists()


def test_a_damaged_or_forged_marker_does_not_make_a_folder_ours(tmp_path):
    for content in ("not json", "[]", '{"files": null}', '{"by": 3, "files": null}', '{"by": "x", "files": [1]}'):
        folder = tmp_path / f"f{len(list(tmp_path.iterdir()))}"
        _write(folder, {owned.MARKER: content, "data": "keep"})
        assert owned.remove(folder) == [folder] and (folder / "data").read_text() == "keep"


def test_create_never_takes_over_an_existing_folder(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(FileExistsError):
        owned.create(tmp_path / "x", by="t")
    assert not (tmp_path / "x" / owned.MARKER).exists()


def _sealed(parent, files: dict):
    """A sealed output of the command "cmd" holding `files`, as a build writes one before placing it."""
    partial = owned.fresh(parent, ".out.partial-", by="cmd")
    _write(partial, files)
    owned.seal(partial)
    return partial


def test_place_replaces_only_the_commands_files(tmp_path):
    def written(files):
        return _sealed(tmp_path, files)

    out = tmp_path / "out"
    owned.place(written({"config.json": "1", "weights": "1", "old.bin": "1"}), out, by="cmd")
    assert owned.owner(out)["files"].keys() == {"config.json", "weights", "old.bin"}
    _write(out, {"notes.txt": "mine"})                   # the user adds a file to an earlier output
    owned.place(written({"config.json": "2", "weights": "2"}), out, by="cmd")
    assert _tree(out) == {"config.json": b"2", "weights": b"2", "notes.txt": b"mine",
                          owned.MARKER: (out / owned.MARKER).read_bytes()}
    assert not list(tmp_path.glob(".out.*"))              # partial and swap folders gone

    other = tmp_path / "other"                             # --force into someone else's folder
    _write(other, {"config.json": "theirs", "keep/me": "x"})
    owned.place(written({"config.json": "ours"}), other, by="cmd")
    assert (other / "config.json").read_text() == "ours" and (other / "keep" / "me").read_text() == "x"
    assert owned.remove(other) == [other / "keep"] and (other / "keep" / "me").read_text() == "x"


def test_check_destination(tmp_path):
    owned.check_destination(tmp_path / "new", by="cmd", force=False)
    (tmp_path / "empty").mkdir()
    owned.check_destination(tmp_path / "empty", by="cmd", force=False)
    _write(tmp_path / "full", {"notes.txt": "x"})
    with pytest.raises(SpecexportError, match=r"--out: .*full is not empty and was not written by cmd; .*--force"):
        owned.check_destination(tmp_path / "full", by="cmd", force=False)
    owned.check_destination(tmp_path / "full", by="cmd", force=True)
    mine = owned.create(tmp_path / "mine", by="cmd")
    _write(mine, {"a": "1"})
    owned.check_destination(mine, by="cmd", force=False)
    with pytest.raises(SpecexportError, match="was written by cmd"):
        owned.check_destination(mine, by="other", force=False)


def test_adopt_marks_exactly_the_listed_files(tmp_path):
    folder = tmp_path / "fp32-old"
    _write(folder, {"model.onnx": "a", "model.onnx.data": "b", "notes.txt": "mine"})
    assert owned.adopt(folder, by="t", files=["model.onnx", "model.onnx.data", "gone.bin"])
    assert set(json.loads((folder / owned.MARKER).read_text())["files"]) == {"model.onnx", "model.onnx.data"}
    assert not owned.adopt(folder, by="t", files=["notes.txt"])          # marked already: unchanged
    assert owned.remove(folder) == [folder / "notes.txt"] and (folder / "notes.txt").read_text() == "mine"


def test_refuse_overlap_both_ways(tmp_path):
    inputs = [("target.path", tmp_path / "proj" / "target")]
    for out, word in ((tmp_path / "proj", "contains"), (tmp_path / "proj" / "target", "contains"),
                      (tmp_path / "proj" / "target" / "engines", "lies inside")):
        with pytest.raises(SpecexportError, match=f"output: .* {word} target.path"):
            owned.refuse_overlap(out, inputs, option="output", hint="h")
    owned.refuse_overlap(tmp_path / "proj" / "out", inputs, option="output", hint="h")
    owned.refuse_overlap(tmp_path / "proj" / "targets", inputs, option="output", hint="h")   # a prefix is not a parent


_names = st.sampled_from(["target", "draft", "medusa", "fp32-1234abcd", ".fp32-1234abcd.partial", "tokenizer-1a2b3c4d",
                          "model.onnx", "notes", owned.MARKER, "x.txt", ".manifest.json.abc"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(user=st.dictionaries(st.lists(_names, min_size=1, max_size=3).map("/".join), st.binary(max_size=20),
                            max_size=8))
def test_random_user_trees_survive_a_sealed_folders_removal(tmp_path_factory, user):
    root = tmp_path_factory.mktemp("r")
    folder = owned.create(root / "stage", by="t")
    _write(folder, {"model.onnx": "ours", "model.onnx.data": "ours"})
    owned.seal(folder)
    placed = {}
    for rel, data in user.items():            # files beside ours (a path that is someone's folder: skipped)
        path = folder / rel
        if rel in ("model.onnx", "model.onnx.data", owned.MARKER) or any(
                p.is_file() for p in [path, *path.parents] if p != folder) or path.is_dir():
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        except (NotADirectoryError, FileExistsError, IsADirectoryError):
            continue
        placed[rel] = data
    owned.remove(folder)
    for rel, data in placed.items():
        assert (folder / rel).read_bytes() == data
    assert not (folder / "model.onnx").exists()


def test_place_sees_links_and_empty_folders_as_foreign_and_never_writes_through_a_link(tmp_path):
    """A user's symbolic link (to a folder or a file) or empty folder inside an earlier output is theirs:
    the output is updated in place around it (not swapped and moved aside), and a link that would lead a
    write outside the output is refused, nothing written through it."""
    def written(files):
        return _sealed(tmp_path, files)

    outside = tmp_path / "elsewhere"
    _write(outside, {"keep.txt": "mine"})
    for extra in ("link-dir", "link-file", "empty"):
        out = tmp_path / f"out-{extra}"
        owned.place(written({"a.txt": "1", "sub/b.txt": "1"}), out, by="cmd")
        if extra == "link-dir":
            (out / "data").symlink_to(outside, target_is_directory=True)
        elif extra == "link-file":
            (out / "note").symlink_to(outside / "keep.txt")
        else:
            (out / "scratch").mkdir()
        owned.place(written({"a.txt": "2"}), out, by="cmd")
        assert (out / "a.txt").read_text() == "2" and not (out / "sub" / "b.txt").exists(), extra
        assert {"link-dir": (out / "data").is_symlink(), "link-file": (out / "note").is_symlink(),
                "empty": (out / "scratch").is_dir()}[extra], extra
        assert not list(tmp_path.glob(".out-*")), extra            # nothing moved aside
    out = tmp_path / "out-through"
    owned.place(written({"a.txt": "1"}), out, by="cmd")
    (out / "data").symlink_to(outside, target_is_directory=True)
    with pytest.raises(SpecexportError, match="data/keep.txt would be written outside it"):
        owned.place(written({"data/keep.txt": "overwritten"}), out, by="cmd")
    assert (outside / "keep.txt").read_text() == "mine"
