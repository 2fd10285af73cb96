"""Which kernel path serves a pass of M rows, measured on this CPU (the `tiers` path, sx_dispatch.cc).

Every path gives the reference's bits, so the choice is a matter of speed only: each weight type's matmul is
timed on every SIMD path this CPU runs, one thread, at M = 2..16 rows (the passes speculation makes: a
verify of a chain or a tree), interleaved, the fastest of REPS runs each (the least disturbed by
whatever else the machine runs), and each M goes to the fastest; a vector path displaces the one
before it in the library's order (the best vector path first) only when MARGIN faster, so paths that run
the same kernel (VNNI in two encodings) never trade places on noise; a matrix tier (AMX, i8mm: kernels of
another structure) needs only MATRIX_MARGIN (at 0.85, AMX's 13% at Q4_K M 4 went unused). Measured once
per CPU and library and cached in the kernels' cache (tiers/, by the library's sha256); never assumed. A path that hands a type
to another path's kernel (the 512-bit tier's Q5_K, AMX's Q5 types) is not timed for it: two
timings of one kernel would trade places on noise. Each path's time relative to the first path's is
smoothed over neighbouring M (a median of three: a run of ratios that rises or falls with M is kept as is, one
M disturbed alone is not): with five runs and no smoothing, tables measured on this 2-core Zen 3 while
other work ran put Q4_K's 8-column lanes (0.70x avx2's time at every M from 2, quiet) on avx2 for M 2-7 and
Q6_K's off M 10-16 in half of thirteen libraries. One row stays on the first path, the one-row kernels: a
one-row pass streams its weights from memory, which this cache-resident timing cannot see (the lanes' prefetch
made Q4_K look 15% faster at M 1 in 3 of 8 measurements; in the 1.5B's one-row step, alternated 30 times,
the one-row kernel was 7% faster by median).
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import numpy as np

from specexport.manifest import sha256_file, write_json_atomic

ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)     # M between two of them takes the lower one's tier
TIMED = ROWS[1:]                             # measured (one row: the first path)
MAX_ROWS = 17                                # the table's last row: more than 16
SHAPE = (512, 4096)                           # N, K: L2-sized (1.7 MB of Q6_K); K as a layer's (16 blocks)
REPS = 25                                     # ~1 s for every type; once a CPU and library
MARGIN = 0.85                                 # another vector path is taken when it needs at most 85% of the time
MATRIX_MARGIN = 0.93                          # a matrix tier, at most 93%
MATRIX = ("amx", "i8mm")
ORDER = ("avx512vnni", "avxvnni", "avx2", "neon", "avx512", "avx2lanes", "amx", "i8mm")   # the proven vector path first


def cpu_id() -> str:
    """A digest of what decides the speeds: the CPU's model and flags (Linux), else the platform."""
    import platform

    try:
        text = Path("/proc/cpuinfo").read_text()
        model = re.findall(r"^model name\s*:(.*)$", text, re.M)[:1]
        feats = re.findall(r"^(?:flags|Features)\s*:(.*)$", text, re.M)[:1]
        key = "".join(model + feats) or platform.processor()
    except OSError:
        key = platform.platform()
    return hashlib.sha256(key.encode()).hexdigest()[:12]


RULE = 8                                      # the measurement's version: a new rule measures anew (8: r8 types)


def table_file(lib: Path, cache: Path) -> Path:
    """The table's file in the kernels' cache, named by the library's bytes and the CPU: never beside the
    library, which may be an engine folder's (read-only, carried to other machines)."""
    return cache / "tiers" / f"tiers-{RULE}-{cpu_id()}-{sha256_file(lib)[:16]}.json"


def load_or_measure(kernels, lib: Path, cache: Path) -> dict[str, list[str]]:
    """{type: [path for M = 1..17]}: the cached table, else a measurement (then cached, atomically)."""
    f = table_file(lib, cache)
    try:
        table = json.loads(f.read_text())
        if _valid(table, kernels):
            return table
    except (OSError, ValueError):
        pass
    table = measure(kernels)
    try:
        write_json_atomic(f, table)
    except OSError:                  # an unwritable cache: measured again next time, nothing else lost
        pass
    return table


def _valid(table, kernels) -> bool:
    paths = set(kernels.paths())
    return isinstance(table, dict) and set(table) == set(keys()) and all(isinstance(v, list) and len(v) == MAX_ROWS and set(v) <= paths
                                           for v in table.values())


def keys() -> list[str]:
    """The table's entries: each type in the file's layout ("Q4_K") and in r8 ("Q4_K.r8")."""
    from specexport.plugins.cpu.capi import LAYOUTS, TYPES

    return [q if layout == "file" else f"{q}.{layout}" for layout in LAYOUTS for q in TYPES]


def split(key: str) -> tuple[str, str]:
    """"Q4_K.r8" -> ("Q4_K", "r8"); "Q4_K" -> ("Q4_K", "file")."""
    qtype, _, layout = key.partition(".")
    return qtype, layout or "file"


def measure(kernels) -> dict[str, list[str]]:
    """Time each type (in each layout) on each SIMD path at ROWS, interleaved; per type, the fastest path for
    each M."""
    candidates = [p for p in ORDER if p in kernels.paths()]
    rng = np.random.default_rng(0)
    N, K = SHAPE
    table, timed = {}, {}
    for key in keys():
        qtype, layout = split(key)
        here = [p for p in candidates if kernels.own_kernel(p, qtype, layout)]   # a path lending another's: not timed
        if len(here) < 2:
            table[key] = [(here or candidates or ["ref"])[0]] * MAX_ROWS
        else:
            w = _blocks(rng, kernels.row_bytes(qtype, K), qtype, N)
            timed[key] = (here, w if layout == "file" else kernels.repack(qtype, w, K, to=layout))
    x = rng.standard_normal((max(ROWS), K)).astype(np.float32)
    times = {(q, m, p): [] for q, (here, _) in timed.items() for m in TIMED for p in here}
    for _ in range(REPS):            # every type in each repetition: a busy spell spoils a few of each's runs, not all
        for key, (here, w) in timed.items():
            qtype, layout = split(key)
            for m in TIMED:
                for p in here:
                    t = time.perf_counter()
                    kernels.matmul(qtype, x[:m], w, path=p, layout=layout)
                    times[(key, m, p)].append(time.perf_counter() - t)
    for qtype, (here, _) in timed.items():
        best = choose({(m, p): min(times[(qtype, m, p)]) for m in TIMED for p in here}, here)  # min: what each can do
        table[qtype] = [best[max(r for r in ROWS if r <= m)] for m in range(1, MAX_ROWS + 1)]
    return {k: table[k] for k in keys()}


def choose(fastest: dict[tuple[int, str], float], paths: list[str]) -> dict[int, str]:
    """{M: path} from each (M, path)'s fastest time (M > 1; one row: paths[0]): each path's ratio to
    paths[0]'s, a median over M - 1, M, M + 1 (the first and last M as measured), then the library's order
    and margins."""
    ratio = {p: [fastest[(m, p)] / fastest[(m, paths[0])] for m in TIMED] for p in paths}
    smooth = {p: [r[i] if i in (0, len(r) - 1) else sorted(r[i - 1:i + 2])[1] for i in range(len(r))]
              for p, r in ratio.items()}
    best = {1: paths[0]}
    for i, m in enumerate(TIMED):
        best[m] = paths[0]
        for p in paths[1:]:
            margin = MATRIX_MARGIN if p in MATRIX else MARGIN
            if smooth[p][i] <= margin * smooth[best[m]][i]:
                best[m] = p
    return best


def _blocks(rng, row_bytes: int, qtype: str, N: int) -> np.ndarray:
    """N rows of random blocks with finite fp16 scales (their speed is what is measured, not their values)."""
    from specexport.plugins.cpu.capi import BLOCK

    size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[qtype]
    w = rng.integers(0, 256, (N, row_bytes // size, size), dtype=np.uint8)
    halves = [208] if qtype == "Q6_K" else [0, 2] if qtype in ("Q4_1", "Q5_1") or BLOCK[qtype] == 256 else [0]
    for at in halves:
        w[:, :, at:at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return w.reshape(N, row_bytes)


def apply(c, table: dict[str, list[str]]) -> None:
    """Set the library's tier table (c: the library through ctypes)."""
    from specexport.plugins.cpu.capi import PATHS, type_id

    for key, paths in table.items():
        for m, p in enumerate(paths, start=1):
            c.sx_set_tier(type_id(*split(key)), m, PATHS[p])


def describe(table: dict[str, list[str]]) -> str:
    """'Q4_K: M 1-5 avx512vnni, M 6+ amx; ...', types with the same ranges together."""
    by_ranges: dict[str, list[str]] = {}
    for qtype, paths in table.items():
        parts, start = [], 1
        for m in range(2, MAX_ROWS + 2):
            if m > MAX_ROWS or paths[m - 1] != paths[start - 1]:
                end = "+" if m > MAX_ROWS else f"-{m - 1}" if m - 1 > start else ""
                parts.append(f"M {start}{end} {paths[start - 1]}")
                start = m
        by_ranges.setdefault(", ".join(parts), []).append(qtype)
    return "; ".join(f"{'/'.join(types)}: {ranges}" for ranges, types in by_ranges.items())
