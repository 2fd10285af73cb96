"""llama.cpp and ik_llama.cpp as peers of `specexport bench`: their servers on the same GGUF files and the
same prompt tokens.

    llama-server -m TARGET.gguf                                   row "llama.cpp"
    llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-simple --spec-draft-n-max N
                                                                  row "llama.cpp speculative (draft, n-max N)"
    ik's llama-server -m TARGET.gguf -rtr                         row "ik_llama.cpp -rtr"
    ik's llama-server ... -rtr -md DRAFT.gguf --spec-type draft:n_max=N
                                                                  row "ik_llama.cpp -rtr speculative (draft, n-max N)"

One server process per row, started once and asked once per prompt and round, interleaved with our
rows like the other peers (report/peers.py). A request sends the prompt as token ids, greedy
(top_k 1, no other samplers), no prompt cache, and asks for the generated token ids back; decode time
is the server's own `timings.predicted_ms` (prefill is `prompt_ms`), so its tokens/s is decode-time
tokens/s as ours is. The binaries come from `--llama-cpp DIR` or PATH (benchmarks/build_llama_cpp.py
builds them from the llama-cpp-python sdist); ik_llama.cpp's only from `--ik-llama-cpp DIR` (its binary has
the same name; benchmarks/build_ik_llama_cpp.py builds it from a checkout). Without them, or without a GGUF
file in the build, the peer is skipped and the report says why. ik_llama.cpp's server answers text, not
token ids: its tokens are the text tokenized by the same server (/tokenize).
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specexport.report.peers import Generation

SERVER = "llama-server"


@dataclass(frozen=True)
class Flavour:
    """What differs between the two servers: the family's name, the flags every server of it gets, the
    draft's flags, and where its binaries come from (the error's hint)."""
    family: str
    flags: tuple[str, ...]
    builder: str

    def draft_flags(self, draft: Path, n_max: int) -> list[str]:
        if self.family == "ik_llama.cpp":       # its repeated stage syntax (the draft-simple flags are refused)
            return ["-md", str(draft), "--spec-type", f"draft:n_max={n_max}"]
        return ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max)]


LLAMA_CPP = Flavour("llama.cpp", ("--no-webui",), "python benchmarks/build_llama_cpp.py builds one; pass --llama-cpp DIR")
# -rtr: its run-time repack of the weights into its row-interleaved types (its fastest CPU path; the issue's
# peer); no webui to serve
IK_LLAMA_CPP = Flavour("ik_llama.cpp", ("--webui", "none", "-rtr"),
                       "python benchmarks/build_ik_llama_cpp.py --source CHECKOUT builds one; pass --ik-llama-cpp DIR")
FLAVOURS = {f.family: f for f in (LLAMA_CPP, IK_LLAMA_CPP)}


def server_command(flavour: Flavour, server: Path, target: Path, *, port: int, draft: Path | None = None,
                   n_max: int = 5, threads: int | None = None, ctx: int = 4096) -> list[str]:
    """The server's command line for one row: greedy, one slot, the target [and the draft]."""
    cmd = [str(server), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx),
           "-np", "1", "--temp", "0", *flavour.flags]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    if draft is not None:
        cmd += flavour.draft_flags(draft, n_max)
        if threads:
            cmd += ["-td", str(threads)]
    return cmd


def find_server(bin_dir: Path | None) -> Path | None:
    """llama-server in `bin_dir`, else on PATH, else None."""
    if bin_dir is not None:
        path = Path(bin_dir) / SERVER
        return path if path.is_file() else None
    found = shutil.which(SERVER)
    return Path(found) if found else None


class LlamaServerPeer:
    """One llama-server process; the PeerProcess interface (names, run, close, peak_rss_bytes)."""

    def __init__(self, server: Path, target: Path, *, name: str, draft: Path | None = None, n_max: int = 5,
                 threads: int | None = None, ctx: int = 4096, start_timeout_s: float = 300,
                 flavour: Flavour = LLAMA_CPP, precision: str = "gguf"):
        from specexport.report.peers import PeerSpec

        self.names = [name]
        self.reference_precision = precision     # our precision whose bytes `target` holds
        self.spec = PeerSpec(flavour.family, f"{precision} (its GGUF file" + (" + the draft's" if draft else "") + ")",
                             ((name, str(target)),))
        self.peak_rss_bytes = None
        self.draft_totals: dict = {}              # name -> [drafted, accepted] over its runs
        self.port = _free_port()
        cmd = server_command(flavour, server, target, port=self.port, draft=draft, n_max=n_max, threads=threads,
                             ctx=ctx)
        self._log = open(Path("/tmp") / f"llama-server-{self.port}.log", "wb")
        # run beside its log: ik_llama.cpp's server writes a llama.log into its working folder
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      cwd=Path(self._log.name).parent)
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self._proc.returncode}) before it was ready; its log: "
                                   f"{self._log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"llama-server was not ready within {timeout_s:.0f} s")

    def run(self, name: str, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        body = {"prompt": [int(t) for t in prompt_ids], "n_predict": max_new_tokens, "temperature": 0.0,
                "top_k": 1, "samplers": ["top_k"], "cache_prompt": False, "return_tokens": True, "stream": False}
        out = self._post("/completion", body)
        tokens = out.get("tokens")
        if tokens is None:                       # ik_llama.cpp answers text only
            tokens = self._post("/tokenize", {"content": out.get("content", ""), "add_special": False})["tokens"]
        t = out.get("timings", {})
        prefill_s, decode_s = t.get("prompt_ms", 0.0) / 1e3, t.get("predicted_ms", 0.0) / 1e3
        if "draft_n" in t:                       # a speculative server's own count
            totals = self.draft_totals.setdefault(name, [0, 0])
            totals[0] += int(t.get("draft_n") or 0)
            totals[1] += int(t.get("draft_n_accepted") or 0)
        return Generation([int(x) for x in tokens or []], prefill_s, prefill_s + decode_s)

    def _post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        if self._proc.poll() is None:
            self.peak_rss_bytes = _peak_rss(self._proc.pid)
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def open_llama_cpp(manifest: dict, bin_dir: Path | None, *, threads: int | None, n_max: int = 5,
                   out: Path | None = None, precisions=(), flavour: Flavour = LLAMA_CPP):
    """(peers, skipped records) for llama.cpp (or ik_llama.cpp) on the build's GGUF files: the model's own file,
    else the file a `blocks` precision wrote (the first of `precisions` that has one, in folder `out`): the
    same bytes. ik_llama.cpp is looked for in `bin_dir` only (not PATH: llama.cpp's binary has its name)."""
    family = flavour.family
    server = find_server(bin_dir) if bin_dir is not None or flavour is LLAMA_CPP else None
    if server is None:
        where = f"in {bin_dir}" if bin_dir is not None else "on PATH" if flavour is LLAMA_CPP else "(no folder given)"
        return [], [{"peer": family, "skipped": f"no {SERVER} {where} ({flavour.builder})"}]
    models = manifest["models"]
    precision, target, draft = _gguf_files(models, out, precisions)
    if target is None:
        return [], [{"peer": family, "skipped": f"the target is not a GGUF file and no precision wrote one "
                                                f"({family} runs GGUF files; quantization scheme blocks writes one)"}]
    peers, skipped = [], []
    label = family + (" -rtr" if "-rtr" in flavour.flags else "")
    rows = [(label, None)]
    if draft is not None:
        rows.append((f"{label} speculative (draft, n-max {n_max})", draft))
    for name, d in rows:
        try:
            peer = LlamaServerPeer(server, Path(target), name=name, draft=Path(d) if d else None, n_max=n_max,
                                   threads=threads, flavour=flavour, precision=precision)
            peers.append(peer)
        except (RuntimeError, OSError) as err:
            skipped.append({"peer": name, "skipped": str(err)})
    return peers, skipped


def _gguf_files(models: dict, out: Path | None, precisions) -> tuple[str, str | None, str | None]:
    """(our precision whose weights the files hold, the target's GGUF file, the draft's): the first of the
    benched `precisions` with a file, `gguf` (the model's own file) or one a `blocks` precision wrote (in
    folder `out`), so llama.cpp runs the bytes of a row we run; else the model's own file."""
    source = models["target"].get("gguf")
    for p in precisions:
        if p == "gguf" and source is not None:
            return "gguf", source, models.get("draft", {}).get("gguf")
        written = {role: m["precisions"].get(p, {}).get("gguf_file") for role, m in models.items()}
        if written.get("target") and out is not None:      # absolute: the server runs in its log's folder
            draft, base = written.get("draft"), Path(out).resolve()
            return p, str(base / written["target"]["path"]), str(base / draft["path"]) if draft else None
    return "gguf", source, models.get("draft", {}).get("gguf") if source is not None else None
