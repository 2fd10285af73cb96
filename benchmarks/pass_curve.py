"""The target pass by its rows, c(M), on each kernel path (SPECEXPORT_KERNEL_PATH forced, one process each,
the paths alternated), beside llama.cpp's `llama-bench -p M -n 0` on the same file (and ik_llama.cpp's with
`-rtr 1`, where built: benchmarks/build_ik_llama_cpp.py).

    python benchmarks/pass_curve.py engines/qwen [engines/qwen-file ...] --paths tiers,avx512vnni,avx2 --rounds 2 \\
        [--llama-cpp "$(python benchmarks/build_llama_cpp.py)"] [--ik-llama-cpp DIR]

Several builds of one file (one per weight layout: quantization.gguf.layout) are timed side by side, each row
named by its build and layout.

Each process: one 64-token prefill, then M-row forwards (M = 1, 2, 4, 8, 16) interleaved, 9 each, nothing
committed (report/timing.py's pass_curve, what `specexport bench` prints); medians over rounds; the CPU named.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROWS = (1, 2, 4, 8, 16)


def one(build: str, path: str, threads: int) -> dict:
    code = ("import json, sys, time; import specexport; from specexport.report.timing import pass_curve; "
            f"p = specexport.load({build!r}, precision='gguf', threads={threads}); "
            "c = pass_curve(p, time.perf_counter, reps=9); print(json.dumps({m: t * 1e3 for m, t in c.items()}))")
    env = {**os.environ, "SPECEXPORT_KERNEL_PATH": path}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"path {path}: {out.stderr.strip()[-600:]}")
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def llama(bin_dir: Path, gguf: Path, threads: int, extra: tuple[str, ...] = ()) -> dict:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", ",".join(map(str, ROWS)), "-n", "0",
                          "-t", str(threads), "-r", "9", "-o", "json", *extra], capture_output=True, text=True, check=True)
    return {r["n_prompt"]: 1e3 * r["n_prompt"] / r["avg_ts"] for r in json.loads(out.stdout)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="builds of one GGUF file (e.g. the r8 and the file layout)")
    ap.add_argument("--paths", default="tiers,avx512vnni,avx2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp", type=Path, default=None, help="the folder with llama-bench")
    ap.add_argument("--ik-llama-cpp", type=Path, default=None, help="the folder with ik_llama.cpp's llama-bench")
    args = ap.parse_args()
    from specexport.plugins.cpu import layout_of

    entries = {b: json.loads((Path(b) / "manifest.json").read_text())["models"]["target"]["precisions"]["gguf"]
               for b in args.builds}
    gguf = Path(entries[args.builds[0]]["quantization"]["source"])
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for p in args.paths.split(","):
            for b, entry in entries.items():
                name = p if len(entries) == 1 else f"{p}, {b} ({layout_of(entry)})"
                runs.setdefault(name, []).append(one(b, p, args.threads))
        if args.llama_cpp:
            runs.setdefault("llama.cpp", []).append(llama(args.llama_cpp, gguf, args.threads))
        if args.ik_llama_cpp:
            runs.setdefault("ik_llama.cpp -rtr", []).append(llama(args.ik_llama_cpp, gguf, args.threads, ("-rtr", "1")))
    from specexport.plugins.cpu.tiers import cpu_id

    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), "?")
    print(f"CPU: {model} ({cpu_id()}), {args.threads} threads, {args.rounds} rounds; c(M) ms and c(M)/c(1)")
    print("| path | " + " | ".join(f"M={m}" for m in ROWS) + " |")
    print("|---|" + "---|" * len(ROWS))
    for p, rs in runs.items():
        med = {m: statistics.median(r[m] for r in rs) for m in ROWS}
        print(f"| {p} | " + " | ".join(f"{med[m]:.1f} ({med[m] / med[1]:.2f})" for m in ROWS) + " |")


if __name__ == "__main__":
    main()
