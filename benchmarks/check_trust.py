"""The trust checks on any model: damaged files are named, killed and failed rebuilds keep the old build.

    python benchmarks/check_trust.py MODEL.yaml [--prompt "def f(x):"]

Builds MODEL.yaml (reusing an existing build), then, each on the real build folder and restored
afterwards:
  1. flips 8 bytes in the middle of every listed file: `specexport inspect --verify` must exit 1 naming it;
  2. truncates every weight file to half: `specexport generate` must exit 1 with one line naming it;
  3. starts `specexport build --force` and SIGKILLs it after its first checked stage: the old build must
     still decode the same tokens;
  4. rebuilds with an impossible parity tolerance: exit 2, and the old build must still decode the same tokens.
Prints one line per check and exits 1 if any failed.
"""
import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

import specexport
from specexport.config import load_config
from specexport.manifest import listed_files, read_manifest

parser = argparse.ArgumentParser()
parser.add_argument("config")
parser.add_argument("--prompt", default="def main():")
args = parser.parse_args()
config = Path(args.config).resolve()
out = load_config(config).output
failures = []


def cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specexport", *argv], capture_output=True, text=True)


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def greedy() -> list[int]:
    with specexport.load(out) as pipe:
        return pipe.generate(args.prompt, max_new_tokens=24, method="draft", gamma=3).token_ids


assert cli("build", str(config), "--no-bench").returncode == 0, "the initial build failed"
expected = greedy()
manifest_text = (out / "manifest.json").read_text()
manifest = read_manifest(out)
files = listed_files(manifest)
owner = {rel: (role, precision) for role, m in manifest["models"].items() for precision, e in m["precisions"].items()
         for rel in e["files"]}          # which graph a file belongs to: generate must open that one
print(f"build {out}: {len(files)} files, greedy output {len(expected)} tokens")

with tempfile.TemporaryDirectory() as tmp:
    for rel in files:
        path = out / rel
        backup = Path(tmp) / "backup"
        shutil.copy2(path, backup)
        data = bytearray(path.read_bytes())
        i = len(data) // 2
        data[i:i + 8] = bytes(b ^ 0xFF for b in data[i:i + 8])
        path.write_bytes(bytes(data))
        res = cli("inspect", str(out), "--verify")
        check(res.returncode == 1 and f"{path}: content differs" in res.stderr, f"flipped bytes named: {rel}")
        if rel.endswith((".onnx", ".data")):
            with open(path, "r+b") as f:
                f.truncate(len(data) // 2)
            role, precision = owner[rel]
            flag = "--precision" if role == "target" else "--draft-precision"
            res = cli("generate", str(out), args.prompt, "--max-new-tokens", "4", flag, precision)
            lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
            check(res.returncode == 1 and len(lines) == 1 and f"{path}: truncated" in lines[0]
                  and "Traceback" not in res.stderr, f"truncated file named in one line by generate: {rel}")
        shutil.copy2(backup, path)
check(cli("inspect", str(out), "--verify").returncode == 0, "restored build verifies")

proc = subprocess.Popen([sys.executable, "-u", "-m", "specexport", "build", str(config), "--force", "--no-bench"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
for line in proc.stderr:
    if line.startswith("✓ check"):
        proc.send_signal(signal.SIGKILL)
        break
proc.wait()
check((out / "manifest.json").read_text() == manifest_text and greedy() == expected,
      f"forced rebuild killed after {line.strip()!r}: old build decodes as before")

raw = yaml.safe_load(config.read_text())
raw["parity_tolerance"] = 1e-30
with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=config.parent, delete=False) as f:
    yaml.safe_dump(raw, f)
try:
    res = cli("build", f.name, "--no-bench")
finally:
    Path(f.name).unlink()
check(res.returncode == 2 and "parity check failed" in res.stderr and greedy() == expected
      and json.loads((out / "manifest.json").read_text())["build_id"] == json.loads(manifest_text)["build_id"],
      "rebuild failing its parity gate: exit 2, old build decodes as before")
print("all checks passed" if not failures else f"{len(failures)} checks failed")
sys.exit(1 if failures else 0)
