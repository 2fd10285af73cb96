"""Peers measured on the same weights and prompt tokens, interleaved with our runs in one bench.

- transformers (PyTorch, CPU): plain greedy `generate`, and assisted generation with
  `assistant_model=` the draft, from the checkpoints named in the manifest (`models.<role>.source`).
- onnxruntime-genai: its model builder makes its own graph from the same target checkpoint
  (`python -m onnxruntime_genai.models.builder -p fp32|int4 -e cpu`, cached under the bench's output
  folder); measured with plain greedy search and with its n-gram (prompt lookup) speculation
  (`speculative: {ngram_size, max_draft_tokens}` in genai_config.json).
A peer whose package is missing or whose build fails is skipped, and the report says why.

Each peer family runs in a process of its own (`PeerProcess`): its weights, thread pools and
memory are apart from ours, so the bench's memory figures are ours and theirs separately, and
torch is never imported into the bench. The child times each generation itself (first token and
last token, so peers report decode-time tokens/s as we do) and answers over a pipe.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# precisions of ours that onnxruntime-genai's builder has a counterpart of: its int4 is weight-only
# MatMulNBits like ours, but its quantization choices differ, so its greedy tokens differ from ours
# (the row says how often they match); its int8 is another scheme altogether and is left out
ORT_GENAI_PRECISIONS = {"fp32": "fp32", "int4": "int4"}
NGRAM = {"ngram_size": 3, "max_draft_tokens": 4}


@dataclass(frozen=True)
class PeerSpec:
    """What a child process needs to open one peer family (picklable)."""
    family: str                     # "transformers" | "onnxruntime-genai"
    precision: str                  # shown in the report, e.g. "fp32 (PyTorch)"
    sources: tuple                  # ((role, checkpoint folder), ...) or ((variant, model folder), ...)


@dataclass
class Generation:
    tokens: list[int]
    ttft_s: float                   # request -> first token
    total_s: float                  # request -> last token

    @property
    def decode_tokens_per_s(self) -> float | None:
        n, t = len(self.tokens) - 1, self.total_s - self.ttft_s
        return n / t if n > 0 and t > 0 else None


class PeerProcess:
    """One peer family in a child process; `names` are its rows, `run(name, ids, n)` one generation.

    The child is `python -m specexport.report.peers FD SPEC` talking over a socket pair, not a
    multiprocessing "spawn" child: spawn re-imports the caller's __main__, which breaks a bench run
    from a script without a `if __name__ == "__main__"` guard."""

    def __init__(self, spec: PeerSpec, *, start_timeout_s: float = 600):
        from multiprocessing.connection import Connection

        self.spec = spec
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "specexport.report.peers", str(theirs.fileno()),
                                       json.dumps([spec.family, spec.precision, [list(s) for s in spec.sources]])],
                                      pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        if not self._conn.poll(start_timeout_s):
            self._proc.kill()
            raise RuntimeError(f"did not start within {start_timeout_s:.0f} s")
        kind, payload = self._recv()
        if kind != "ready":
            try:                                   # the child reported why and is exiting
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._conn.close()
            raise RuntimeError(payload)
        self.names: list[str] = payload
        self.peak_rss_bytes: int | None = None

    def run(self, name: str, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        self._conn.send((name, list(prompt_ids), max_new_tokens))
        kind, payload = self._recv()
        if kind != "done":
            raise RuntimeError(f"{name}: {payload}")
        return Generation(*payload)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._conn.send(None)
                kind, payload = self._recv()
                self.peak_rss_bytes = payload if kind == "rss" else None
            except (EOFError, OSError, RuntimeError):
                pass
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        self._conn.close()

    def _recv(self):
        try:
            return self._conn.recv()
        except (EOFError, ConnectionResetError):
            raise RuntimeError(f"the {self.spec.family} peer process died (exit {self._proc.poll()})") from None


def _serve(conn, spec: PeerSpec) -> None:
    """The child's loop: open the family's runners, then answer (name, ids, n) until None."""
    import traceback

    try:
        runners = _transformers(dict(spec.sources)) if spec.family == "transformers" else \
            _ort_genai(dict(spec.sources))
    except Exception as err:                       # reported to the parent as a skipped peer
        conn.send(("error", f"could not open: {err}"))
        traceback.print_exc()
        return
    conn.send(("ready", list(runners)))
    while (msg := conn.recv()) is not None:
        name, ids, n = msg
        try:
            conn.send(("done", runners[name](ids, n)))
        except Exception as err:
            conn.send(("error", f"{type(err).__name__}: {err}"))
    conn.send(("rss", _peak_rss_bytes()))


def _peak_rss_bytes() -> int:
    """This process's own peak RSS. Not ru_maxrss: on Linux it survives fork + exec, so a child would
    report the bench's peak whenever that was larger (it did: every peer "used" 1506 MiB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- opening the peers that can run here (in the bench's process: no heavy imports) ----------------
def peer_specs(manifest: dict, precisions, *, work_dir: Path, log=print,
               families=("transformers", "onnxruntime-genai")) -> tuple[list[PeerSpec], list[dict]]:
    """The peer families (of `families`) that can run here, and a {"peer", "skipped"} record for each one
    that cannot."""
    specs, skipped = [], []
    sources = {role: Path(m["source"]) for role, m in manifest["models"].items()}
    missing = [p for p in ("torch", "transformers") if importlib.util.find_spec(p) is None]
    if "transformers" not in families:
        pass
    elif missing:
        skipped.append({"peer": "transformers", "skipped": f"not installed: {', '.join(missing)}"})
    elif not all(p.is_dir() for p in sources.values()):
        skipped.append({"peer": "transformers", "skipped": f"checkpoints not found: {sorted(map(str, sources.values()))}"})
    else:
        specs.append(PeerSpec("transformers", "fp32 (PyTorch)", tuple((r, str(p)) for r, p in sources.items())))
    if "onnxruntime-genai" not in families:
        pass
    elif importlib.util.find_spec("onnxruntime_genai") is None:
        skipped.append({"peer": "onnxruntime-genai", "skipped": "not installed (pip install onnxruntime-genai)"})
    elif missing:
        skipped.append({"peer": "onnxruntime-genai", "skipped": f"its model builder needs {', '.join(missing)}"})
    else:
        for p in precisions:
            if p not in ORT_GENAI_PRECISIONS:
                skipped.append({"peer": f"onnxruntime-genai {p}", "skipped": f"no counterpart of our {p} in its builder"})
                continue
            try:
                folders = build_ort_genai(sources["target"], p, Path(work_dir) / f"onnxruntime-genai-{p}", log)
            except RuntimeError as e:
                skipped.append({"peer": f"onnxruntime-genai {p}", "skipped": str(e)})
                continue
            specs.append(PeerSpec("onnxruntime-genai", p, tuple((k, str(v)) for k, v in folders.items())))
    return specs, skipped


def build_ort_genai(source: Path, precision: str, folder: Path, log) -> dict[str, Path]:
    """Its builder's model from our target checkpoint (cached), plus a copy configured for n-gram
    speculation. Returns {"greedy": folder, "ngram": folder}."""
    from importlib.metadata import version

    plain, ngram = folder / "greedy", folder / "ngram"
    stamp = {"source": str(source), "precision": precision, "onnxruntime_genai": version("onnxruntime-genai")}
    stamp_file = folder / "built_from.json"
    if not (stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp):
        from specexport import owned

        if folder.exists() and (not owned.is_owned(folder, "specexport bench") or owned.remove(folder)):
            raise RuntimeError(f"{folder} exists and was not written by specexport bench: move it away")
        owned.create(folder, by="specexport bench")      # open: everything in it is the bench's
        log(f"peers: building the onnxruntime-genai {precision} model from {source}")
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", str(plain),
               "-p", ORT_GENAI_PRECISIONS[precision], "-e", "cpu", "-c", str(folder / "cache")]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0 or not (plain / "genai_config.json").is_file():
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"its builder failed (exit {res.returncode}): {tail[0]}")
        shutil.rmtree(folder / "cache", ignore_errors=True)
        shutil.copytree(plain, ngram)
        cfg = json.loads((ngram / "genai_config.json").read_text())
        cfg["speculative"] = dict(NGRAM)
        (ngram / "genai_config.json").write_text(json.dumps(cfg, indent=1))
        stamp_file.write_text(json.dumps(stamp))
    return {"greedy": plain, "ngram": ngram}


# -- the runners (in the child process) ------------------------------------------------------------
def _transformers(sources: dict) -> dict:
    import torch
    import transformers
    from transformers.generation.streamers import BaseStreamer

    transformers.utils.logging.disable_progress_bar()
    target = transformers.AutoModelForCausalLM.from_pretrained(sources["target"], dtype=torch.float32).eval()
    draft = (transformers.AutoModelForCausalLM.from_pretrained(sources["draft"], dtype=torch.float32).eval()
             if "draft" in sources else None)
    eos = target.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos

    class Stamps(BaseStreamer):
        """generate() puts the prompt first, then each new token (or accepted run of tokens)."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def runner(**extra):
        def run(ids: list[int], max_new_tokens: int):
            x = torch.tensor([ids])
            stamps = Stamps()
            start = time.perf_counter()
            with torch.no_grad():
                out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=pad, streamer=stamps, **extra)
            total = time.perf_counter() - start
            first = stamps.times[1] - start if len(stamps.times) > 1 else total
            return out[0, len(ids):].tolist(), first, total
        return run

    runners = {"transformers greedy": runner()}
    if draft is not None:
        runners["transformers assisted"] = runner(assistant_model=draft)
    return runners


def _ort_genai(folders: dict) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    def runner(path: str):
        model = og.Model(path)

        def run(ids: list[int], max_new_tokens: int):
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
            start = time.perf_counter()
            gen = og.Generator(model, params)
            gen.append_tokens(np.asarray([ids], dtype=np.int32))
            first = None
            while not gen.is_done():
                gen.generate_next_token()
                if first is None:
                    first = time.perf_counter() - start
            total = time.perf_counter() - start
            return [int(t) for t in gen.get_sequence(0)[len(ids):]], first or total, total
        return run

    return {"onnxruntime-genai greedy": runner(folders["greedy"]),
            f"onnxruntime-genai n-gram (n={NGRAM['ngram_size']}, k={NGRAM['max_draft_tokens']})":
                runner(folders["ngram"])}


if __name__ == "__main__":            # the peer process: python -m specexport.report.peers FD SPEC
    from multiprocessing.connection import Connection

    family, precision, sources = json.loads(sys.argv[2])
    _serve(Connection(int(sys.argv[1])), PeerSpec(family, precision, tuple(tuple(s) for s in sources)))
