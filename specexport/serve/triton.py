"""`specexport export-triton`: a Triton Inference Server model repository that runs a build.

    REPO/<name>/config.pbtxt        backend "python", decoupled, inputs/outputs, instance_group, parameters
    REPO/<name>/1/model.py          triton_model.py (TritonPythonModel)
    REPO/<name>/1/build/            the build's listed files (or, with copy=False, its absolute path in
                                    the config's `build` parameter)

The repository is written beside its final place as `.<name>.partial-<id>` and renamed, so a failed
export leaves nothing that looks like a model. `--force` replaces only a model folder that
export-triton wrote (its marker: `specexport.owned`), and in it only the files it wrote. Triton loads `instances` copies of the model (each
its own Python process with its own Pipeline), which decode in parallel.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from specexport import owned
from specexport.errors import SpecexportError
from specexport.manifest import listed_files, read_manifest

INPUTS = [  # name, Triton type, dims, optional
    ("text_input", "TYPE_STRING", [1], False),
    ("max_tokens", "TYPE_INT32", [1], True),
    ("temperature", "TYPE_FP32", [1], True),
    ("top_p", "TYPE_FP32", [1], True),
    ("top_k", "TYPE_INT32", [1], True),
    ("seed", "TYPE_INT64", [1], True),
    ("method", "TYPE_STRING", [1], True),
    ("stop", "TYPE_STRING", [-1], True),
]
BY = "specexport export-triton"
OUTPUTS = [("text_output", "TYPE_STRING", [-1]), ("finish_reason", "TYPE_STRING", [1]), ("stats", "TYPE_STRING", [1])]


def write_repository(build_dir, repo, *, name: str | None = None, instances: int = 1, copy: bool = True,
                     precision: str | None = None, draft_precision: str | None = None, method: str = "auto",
                     threads: int | None = None, force: bool = False) -> Path:
    """Write the model folder into `repo` and return it."""
    build_dir, repo = Path(build_dir).resolve(), Path(repo)
    manifest = read_manifest(build_dir)                  # a clear error if it is not a build
    name = name or manifest.get("name") or build_dir.name
    if not name.replace("-", "").replace("_", "").isalnum():
        raise SpecexportError(f"--name: {name!r} is not a Triton model name (letters, digits, '-', '_')")
    if not isinstance(instances, int) or instances < 1:
        raise SpecexportError(f"--instances: expected an integer >= 1, got {instances!r}")
    precision = precision or next(iter(manifest["models"]["target"]["precisions"]))   # fp32, or a lean build's gguf
    if precision not in manifest["models"]["target"]["precisions"]:
        raise SpecexportError(f"--precision: {precision!r} was not built; built: "
                              f"{', '.join(manifest['models']['target']['precisions'])}")
    final = repo / name
    if final.exists() and not force:
        raise SpecexportError(f"{final}: exists (pass --force to replace it)")
    if final.exists() and not owned.is_owned(final, BY):
        raise SpecexportError(f"{final}: exists and was not written by {BY}; --force replaces only a model folder "
                              f"it wrote: move it away or choose another --name")
    partial = owned.fresh(repo, f".{name}.partial-", by=BY)
    try:
        version = partial / "1"
        version.mkdir()
        shutil.copy2(Path(__file__).with_name("triton_model.py"), version / "model.py")
        if copy:
            for rel in ["manifest.json", *listed_files(manifest)]:
                dest = version / "build" / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(build_dir / rel, dest)
        params = {"build": "build" if copy else str(build_dir), "precision": precision,
                  "draft_precision": draft_precision or "", "method": method, "threads": str(threads or "")}
        (partial / "config.pbtxt").write_text(config_pbtxt(name, instances, params))
        owned.seal(partial)
        owned.place(partial, final, by=BY)      # replaces only the files an earlier export wrote
    finally:
        owned.remove(partial)
    return final


def config_pbtxt(name: str, instances: int, params: dict) -> str:
    def tensor(entry, optional=None):
        n, kind, dims = entry[:3]
        extra = "\n    optional: true" if optional else ""
        return f'  {{\n    name: "{n}"\n    data_type: {kind}\n    dims: [ {", ".join(map(str, dims))} ]{extra}\n  }}'

    inputs = ",\n".join(tensor(e, e[3]) for e in INPUTS)
    outputs = ",\n".join(tensor(e) for e in OUTPUTS)
    parameters = "\n".join(f'parameters {{\n  key: "{k}"\n  value: {{ string_value: {json.dumps(v)} }}\n}}'
                           for k, v in params.items())
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            f"model_transaction_policy {{\n  decoupled: true\n}}\n"
            f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
            f"instance_group [\n  {{\n    count: {instances}\n    kind: KIND_CPU\n  }}\n]\n{parameters}\n")
