"""Runtime overhead benchmarks on the 110M Llama builds (benchmarks/make_llama110m.py + specexport build).

    python benchmarks/bench_runtime.py --root /tmp/llama110m [--threads 2]

(a) share of decode wall time spent outside ONNX Runtime's run calls (vanilla and draft, greedy);
(b) one decode step (T = 1 and T = 5) at a 128-token context in the 2048-capacity build against the
    128-capacity build, interleaved, medians and their ratio;
(c) resident memory growth over 2,000 generated tokens (2048-capacity build, draft method).
"""
import argparse
import re
import statistics
import time

import numpy as np

import specexport


def rss_mib() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


class TimedSession:
    """Wraps an ORT session: accumulates the time spent inside run_with_iobinding."""

    def __init__(self, session):
        self.session, self.seconds = session, 0.0

    def run_with_iobinding(self, binding):
        t = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.seconds += time.perf_counter() - t


def outside_share(pipe, method, n_tokens):
    backends = [pipe.target] + ([pipe.draft] if method == "draft" else [])
    timers = []
    for b in backends:
        b.session = TimedSession(b.session)
        timers.append(b.session)
    try:
        t = time.perf_counter()
        out = pipe.generate(prompt_ids=list(range(3, 40)), max_new_tokens=n_tokens, method=method, gamma=4)
        wall = time.perf_counter() - t
    finally:
        for b in backends:
            b.session = b.session.session
    inside = sum(x.seconds for x in timers)
    return 1 - inside / wall, wall, out


def step_times(backend, context, T, reps):
    prompt = np.arange(3, 3 + context)
    backend.reset()
    backend.forward(prompt[:64])
    backend.commit(64)
    backend.forward(prompt[64:])
    backend.commit(context - 64)
    toks = np.arange(5, 5 + T)
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        backend.forward(toks)
        samples.append(time.perf_counter() - t)
        backend.rollback(context)
    return samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/llama110m")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    big = specexport.load(f"{args.root}/build-cap2048", threads=args.threads)
    small = specexport.load(f"{args.root}/build-cap128", threads=args.threads)

    print("(a) share of decode time outside ORT run calls (greedy, 300 tokens, 3 runs each, medians)")
    for method in ("vanilla", "draft"):
        shares = [outside_share(big, method, 300)[0] for _ in range(3)]
        print(f"    {method:8} outside-ORT share median {statistics.median(shares) * 100:.1f}%  runs "
              + ", ".join(f"{s * 100:.1f}%" for s in shares))

    print("(b) step time at context 123: capacity 2048 vs capacity 128 (interleaved, 15 rounds x 10 steps)")
    for T in (1, 5):
        a, b = [], []
        for _ in range(15):
            a += step_times(big.target, 123, T, 10)
            b += step_times(small.target, 123, T, 10)
        ma, mb = statistics.median(a), statistics.median(b)
        print(f"    T={T}: cap2048 {ma * 1e3:.2f} ms, cap128 {mb * 1e3:.2f} ms, ratio {ma / mb:.3f}")

    print("(c) RSS over 2,000 generated tokens (draft, greedy)")
    from specexport.runtime.loop import DecodeStats, decode
    from specexport.runtime.proposers import DraftChain
    from specexport.runtime.sampling import SamplingParams

    big.generate(prompt_ids=list(range(3, 20)), max_new_tokens=50, method="draft", gamma=4)   # warm-up
    samples, emitted = [], 0
    for chunk in decode(big.target, DraftChain(big.draft, 4), np.arange(3, 20), max_new_tokens=2000,
                        params=SamplingParams(), rng=np.random.default_rng(0), stats=DecodeStats()):
        emitted += len(chunk)
        samples.append((emitted, rss_mib()))
    first, last = samples[0], samples[-1]
    print(f"    {emitted} tokens; RSS after token {first[0]}: {first[1]:.1f} MiB, after token {last[0]}: "
          f"{last[1]:.1f} MiB, growth {last[1] - first[1]:+.1f} MiB (max during run {max(r for _, r in samples):.1f})")
    for _ in range(2):
        big.generate(prompt_ids=list(range(3, 20)), max_new_tokens=2000, method="draft", gamma=4)
        print(f"    after another 2,000-token generation: {rss_mib():.1f} MiB")


if __name__ == "__main__":
    main()
