"""The decode loop's own Python per round, as the statistical tests pay it: seeded decodes through the whole
loop on the tests' tabular fakes (tests/fakes.py), for two checkouts interleaved round by round.

Each (checkout, case) runs in a fresh process with the checkout first on sys.path (its specexport and its
tests' fakes); a case prints its seconds and a hash of the tokens it emitted, so equal hashes show the two
checkouts decode the same tokens for the same seeds. Medians and the ratio new / old per case.

    python benchmarks/loop_rounds.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 3] [--runs 2000]
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = ("draft-tree", "sampled-tree", "eagle-tree", "chain-top-p", "multi-draft-token", "lookup-trie", "suffix",
         "medusa-tree")


def run_case(case: str, runs: int) -> tuple[float, str]:
    """(seconds, token hash) of one case, from the checkout first on sys.path."""
    import numpy as np

    from specexport.runtime.sampling import SamplingParams
    if case == "draft-tree":
        import test_proposers as t
        go = lambda: t.run(t.draft_tree(), t.T1, runs, seed=21)[0]                            # noqa: E731
    elif case == "sampled-tree":
        import test_multidraft as t
        go = lambda: t.run_sampled_tree(SamplingParams(1.0), runs, seed=31)[0]                # noqa: E731
    elif case == "eagle-tree":
        import test_eagle_tree as t
        name, make, params = t.CASES[0]
        go = lambda: t.run(make(), params, runs, seed=len(name))[0]                            # noqa: E731
    elif case == "chain-top-p":
        import test_loop_stats as t
        _, prompt, params, gamma = t.SAMPLED_CASES[-1]
        target, draft = t.backends()
        go = lambda: t.run_decodes(target, draft, prompt, params, gamma, runs, max_new=6, seed=5)[0]  # noqa: E731
    elif case == "lookup-trie":
        import test_proposers as t
        _, proposer, params = t.LOOKUP_CASES[0]
        go = lambda: t.run(proposer, params, runs, seed=7)[0]                                   # noqa: E731
    elif case == "suffix":
        import test_suffix as t
        go = lambda: t.run(t.T1, runs, seed=1)[0]                                               # noqa: E731
    elif case == "medusa-tree":
        import test_medusa as t
        go = lambda: t.run(t.MedusaTree(t.TabularHeads(), t.TREE), t.T1, runs, seed=41)[0]       # noqa: E731
    else:
        import test_multidraft as t
        p, q = t.CASES["random sharp 0"]
        go = lambda: t.first_tokens(p, q, replacement=False, trials=20 * runs, seed=3)         # noqa: E731
    start = time.perf_counter()
    tokens = go()
    return time.perf_counter() - start, hashlib.sha1(np.ascontiguousarray(tokens).tobytes()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2000, help="decodes per case (the token-level case: 20x trials)")
    ap.add_argument("--case", help=argparse.SUPPRESS)              # the child process: one case, one checkout
    args = ap.parse_args()
    if args.case:
        seconds, digest = run_case(args.case, args.runs)
        print(f"{seconds:.4f} {digest}")
        return
    times: dict = {}
    hashes: dict = {}
    for _ in range(args.rounds):
        for case in CASES:
            for which in ("old", "new"):
                root = getattr(args, which).resolve()
                out = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.path[:0] = sys.argv[1:3]; "
                                      "sys.argv = sys.argv[3:]; runpy.run_path(sys.argv[0], run_name='__main__')",
                                      str(root), str(root / "tests"), __file__, "x", "y", "--case", case,
                                      "--runs", str(args.runs)],
                                     check=True, capture_output=True, text=True).stdout.split()
                times.setdefault((case, which), []).append(float(out[0]))
                hashes.setdefault((case, which), set()).add(out[1])
    print(f"| case | old s (median of {args.rounds}) | new s | new / old | same tokens |")
    print("|---|---|---|---|---|")
    for case in CASES:
        old, new = (statistics.median(times[(case, w)]) for w in ("old", "new"))
        print(f"| {case} | {old:.2f} | {new:.2f} | {new / old:.2f} | {hashes[(case, 'old')] == hashes[(case, 'new')]} |")


if __name__ == "__main__":
    main()
