"""Property-based tests of the model.yaml loader: whatever a user writes, `load_config` either returns
a BuildConfig or raises SpecexportError (one line) — never another exception, never a traceback.

Three generators: random YAML documents built from the config's own keys and arbitrary values,
random mutations (delete, replace, retype, nest) of a valid config, and arbitrary text.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specexport.config import MODEL_KEYS, PRECISIONS, TOP_KEYS, BuildConfig, load_config
from specexport.schemes import GATE_KEYS
from specexport.errors import SpecexportError

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from([*PRECISIONS, "fp8", "eagle3", "onnxruntime", "tensorrt", "", ".", "/", "..", "\x00"]))
keys = st.sampled_from(sorted(TOP_KEYS | MODEL_KEYS | set(GATE_KEYS) | {"int8", "int4", "fp32", "bogus"})) | st.text(
    max_size=6)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=5),
                      max_leaves=12)


@pytest.fixture(scope="module")
def valid(tiny_checkpoints, tmp_path_factory) -> tuple[dict, Path]:
    """A valid config (as a dict) and the folder its YAML is written into."""
    folder = tmp_path_factory.mktemp("prop")
    raw = {"name": "prop", "target": {"path": str(tiny_checkpoints["llama"])},
           "draft": {"path": str(tiny_checkpoints["llama-draft"]), "precisions": ["int4"]},
           "max_seq_len": 64, "precisions": ["fp32", "int8"], "max_verify_tokens": 8, "parity_tolerance": 1e-4,
           "quality_gates": {"int8": {"min_top1": 0.9, "max_kl": 0.05}}, "output": str(folder / "out"),
           "aux_hidden_layers": None}
    raw.pop("aux_hidden_layers")
    return raw, folder


def _load(folder: Path, text: str):
    path = folder / "model.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        cfg = load_config(path)
    except SpecexportError as err:
        assert "\n" not in str(err).strip(), f"error is not one line: {err!r}"
        return None
    assert isinstance(cfg, BuildConfig)
    return cfg


def _dump(doc) -> str:
    return yaml.safe_dump(doc, allow_unicode=True)


def test_the_valid_config_loads(valid):
    raw, folder = valid
    assert _load(folder, _dump(raw)) is not None


@SETTINGS
@given(doc=st.dictionaries(keys, values, max_size=8) | values)
def test_random_documents_load_or_fail_cleanly(valid, doc):
    _, folder = valid
    _load(folder, _dump(doc))


@st.composite
def mutations(draw, raw: dict):
    """A valid config with a few keys deleted, replaced by random values, or nested one level down."""
    doc = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for _ in range(draw(st.integers(1, 3))):
        parent = draw(st.sampled_from([doc] + [v for v in doc.values() if isinstance(v, dict)]))
        if not parent:
            continue
        key = draw(st.sampled_from(sorted(parent, key=str)) | keys)
        action = draw(st.sampled_from(["delete", "replace", "wrap"]))
        if action == "delete":
            parent.pop(key, None)
        elif action == "replace":
            parent[key] = draw(values)
        else:
            parent[key] = [parent.get(key)] if draw(st.booleans()) else {draw(keys): parent.get(key)}
    return doc


@SETTINGS
@given(data=st.data())
def test_mutations_of_a_valid_config_load_or_fail_cleanly(valid, data):
    raw, folder = valid
    _load(folder, _dump(data.draw(mutations(raw))))


@SETTINGS
@given(text=st.text(max_size=200) | st.sampled_from(["name: [", "{", "a: b: c", "- - -", "? [a]\n: 1", "name: *x",
                                                     "!!python/object:os.system {}", "\t- x"]))
def test_arbitrary_text_loads_or_fails_cleanly(valid, text):
    _, folder = valid
    _load(folder, text)
