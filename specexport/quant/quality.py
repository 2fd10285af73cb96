"""Quality gate of a quantized graph: its next-token distributions against the fp32 graph's.

On a few token sequences (held-out text, or sequences sampled from the fp32 graph itself), both graphs
prefill each sequence; at every position we compare the next-token distributions:
  top1_agreement  share of positions where argmax p_quant == argmax p_fp32
  mean_kl         mean over positions of KL(p_fp32 || p_quant), in nats
Both sessions are opened the way the runtime opens them (all graph optimizations, weight prepacking
on): MatMulNBits computes differently when prepacking is off, and the gate must measure what runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport._optional import require
from specexport.io_spec import LOGITS, ModelIO

MIN_EVAL_TOKENS = 16        # an eval_text shorter than this is refused at plan time
EVAL_SEQUENCES = 4          # sequences per quality check
EVAL_LENGTH = 128           # tokens per sequence (at most max_seq_len)
SAMPLE_SEED = 0             # sequences sampled from the fp32 graph when there is no eval_text
SAMPLE_TEMPERATURE = 1.0
ROW_TOLERANCE = 1e-4        # a target graph's rows must not depend on each other more than this (relative)
# A position agrees when the token the graph ranks first is, under the reference, within TIE_NATS of the
# reference's best log-probability: a near-tie (both are the model's choice to 1e-4 in probability, well
# under fp16's rounding of a logit, ~5e-4) is not a disagreement. Without it an exact conversion of a
# small model with many tied logits measured top-1 agreement 0.424 at KL 0.0000. Ties are counted apart.
TIE_NATS = 1e-4
SETTINGS = {"sequences": EVAL_SEQUENCES, "length": EVAL_LENGTH, "seed": SAMPLE_SEED,
            "temperature": SAMPLE_TEMPERATURE, "tie_nats": TIE_NATS}     # part of the stage fingerprint


def min_tokens_for(rows: dict, scheme: str) -> int:
    """Rows per call the runtime must run this graph with (it pads shorter calls) so that a verify pass
    computes what decoding computes: 2 when one-row calls differ from multi-row ones. For schemes that
    quantize activations (quantize.CALIBRATED) any difference counts: a 1e-6 change in the K/V a
    one-row call writes moves values across rounding steps in later calls, and on SmolLM2-135M int8_sq
    (one-row difference 1.0e-6, multi-row exactly 0) greedy speculative output differed from vanilla on
    2 of 3 prompts within 32 tokens; others tolerate ROW_TOLERANCE (fp32 kernels' 1e-7 differences do
    not grow)."""
    from specexport.quant.quantize import CALIBRATED

    limit = 0.0 if scheme in CALIBRATED else ROW_TOLERANCE
    return 2 if rows["one_token"] > limit else 1


@dataclass(frozen=True)
class QualityReport:
    top1_agreement: float
    mean_kl: float
    positions: int
    sequences: int
    ties: int = 0                   # positions that agree only as near-ties (TIE_NATS)

    def failures(self, gate: dict) -> list[str]:
        """What misses `gate` ({min_top1, max_kl}), e.g. ["top-1 agreement 0.712 < min_top1 0.900"]."""
        out = []
        if not self.top1_agreement >= gate["min_top1"]:
            out.append(f"top-1 agreement {self.top1_agreement:.3f} < min_top1 {gate['min_top1']:.3f}")
        if not self.mean_kl <= gate["max_kl"]:
            out.append(f"mean KL {self.mean_kl:.4f} > max_kl {gate['max_kl']:.4f}")
        return out

    def describe(self) -> str:
        ties = f" ({self.ties} of them near-ties)" if self.ties else ""
        return (f"top-1 agreement {self.top1_agreement:.3f}{ties}, mean KL {self.mean_kl:.4f} nats "
                f"over {self.positions} positions of {self.sequences} sequences")


def runtime_session(onnx_path, optimization: str = "all"):
    """An ORT CPU session configured like the runtime's (OrtBackend; `optimization` as the manifest's
    ort_optimization: "basic" for FP8 Q/DQ graphs, which full optimisation would fuse into kernels
    without FP8)."""
    from specexport.plugins import cpu
    from specexport.runtime.backends.ort import OPTIMIZATION_LEVELS, base_options, release_freed_heap

    ort = require("onnxruntime")
    opts = base_options()
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPTIMIZATION_LEVELS[optimization])
    cpu.register(opts, onnx_path)
    session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    release_freed_heap()
    return session


def text_sequences(ids, *, bos: int | None, length: int, count: int = EVAL_SEQUENCES) -> list[np.ndarray]:
    """Up to `count` consecutive chunks of the held-out ids, each [<= length], BOS first when there is one."""
    body = length - (bos is not None)
    chunks = [np.asarray(ids[i:i + body], np.int64) for i in range(0, min(len(ids), count * body), body)]
    chunks = [c for c in chunks if len(c) >= 2]
    return [np.concatenate([[bos], c]) if bos is not None else c for c in chunks]


def sampled_sequences(session, io: ModelIO, *, start: int | None, length: int, count: int = EVAL_SEQUENCES,
                      seed: int = SAMPLE_SEED, temperature: float = SAMPLE_TEMPERATURE,
                      ids: np.ndarray | None = None, steps=None) -> list[np.ndarray]:
    """`count` sequences of `length` tokens sampled from the graph itself (batched, seeded). `ids`: a
    reduced-vocabulary draft's target ids (its logit j is token ids[j]). steps: _console.Steps, told of
    each of the length - 1 batched passes."""
    if steps is not None:
        steps.total(length - 1)
    rng = np.random.default_rng(seed)
    seqs = np.empty((count, length), np.int64)                                 # [B, L]
    seqs[:, 0] = start if start is not None else rng.integers(0, io.vocab_size, count)
    past = io.empty_caches(count)
    for t in range(length - 1):
        logits, past = _step(session, io, seqs[:, t:t + 1], positions=np.full((count, 1), t), past=past)   # [B, 1, V]
        z = logits[:, -1].astype(np.float64) / temperature                     # [B, V]
        probs = np.exp(z - z.max(-1, keepdims=True))
        cdf = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)         # [B, V]
        drawn = np.minimum((cdf < rng.random((count, 1))).sum(-1), io.vocab_size - 1)
        seqs[:, t + 1] = drawn if ids is None else np.asarray(ids)[drawn]
        if steps is not None:
            steps.advance()
    return list(seqs)


def prefill_logits(session, io: ModelIO, ids: np.ndarray) -> np.ndarray:
    """[T, V] logits of one sequence prefilled from an empty cache."""
    past = io.empty_caches()
    logits, _ = _step(session, io, ids[None], positions=np.arange(len(ids))[None], past=past)
    return logits[0]


ROWS_AT_ONCE = 16       # measure_quality's positions per step (a 152k vocabulary: 19 MB per float64 array)


class SpilledLogits:
    """Logits [T, V] appended one at a time, kept in a temporary folder of this process and read back one
    at a time (`[i]`): a large vocabulary's logits for a few sequences are hundreds of MB, which a
    build would otherwise hold beside a session. A context manager: the folder goes on exit."""

    def __init__(self):
        self._dir, self._count = None, 0

    def __enter__(self):
        import tempfile

        self._dir = tempfile.TemporaryDirectory(prefix="specexport-logits-")
        return self

    def __exit__(self, *exc):
        self._dir.cleanup()

    def _path(self, i: int) -> str:
        return f"{self._dir.name}/{i}.npy"

    def append(self, logits: np.ndarray) -> None:
        np.save(self._path(self._count), logits)
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._count:
            raise IndexError(i)
        return np.load(self._path(i))


def measure_quality(reference, quantized, io: ModelIO, *, sequences: list[np.ndarray]) -> QualityReport:
    """Top-1 agreement and mean KL(p_ref || p_quant) over every position of `sequences`. Each of
    `reference`, `quantized`: a session, or the sequences' prefill logits computed before (a list of
    [T, V] or SpilledLogits: a lean build runs one session at a time)."""
    def logits(source, i, ids):
        return source[i] if isinstance(source, (list, SpilledLogits)) else prefill_logits(source, io, ids)

    exact, near, kls = [], [], []
    for i, ids in enumerate(sequences):
        ref, quant = logits(reference, i, ids), logits(quantized, i, ids)
        for r in range(0, len(ref), ROWS_AT_ONCE):     # float64 temporaries of a few rows, not of them all
            lp = _log_softmax(ref[r:r + ROWS_AT_ONCE])
            lq = _log_softmax(quant[r:r + ROWS_AT_ONCE])
            chosen = lq.argmax(-1)                                              # [rows]
            gap = lp.max(-1) - lp[np.arange(len(chosen)), chosen]              # [rows] nats below the best
            exact.append(lp.argmax(-1) == chosen)
            near.append(gap <= TIE_NATS)
            kls.append((np.exp(lp) * (lp - lq)).sum(-1))
    exact, near, kls = np.concatenate(exact), np.concatenate(near), np.concatenate(kls)
    agree = exact | near
    return QualityReport(float(agree.mean()), float(max(kls.mean(), 0.0)), len(agree), len(sequences),
                         ties=int((agree & ~exact).sum()))


def row_dependence(session, io: ModelIO, ids: np.ndarray, *, rows: int = 12, last: int = 1) -> float:
    """max|Δ| / max|logits| of the last of `rows` tokens: computed inside one pass of all of them vs in
    a pass of the `last` tokens after the others. fp32 graphs: ~1e-6 either way. One activation scale
    per call (dynamic quantization): ~1e-1 for any `last`, and a verify pass disagrees with decoding.
    MatMulNBits with accuracy_level 4 (ORT 1.32): bit-exact for `last` >= 2, but its one-row kernel
    computes differently (7e-3 on SmolLM2-135M int8), so a graph whose `last=1` figure fails but whose
    `last=2` one passes is run with at least 2 rows a call (the runtime pads: `min_tokens`)."""
    ids = np.asarray(ids[:rows], np.int64)
    n = len(ids)
    together, _ = _step(session, io, ids[None], positions=np.arange(n)[None], past=io.empty_caches())
    _, past = _step(session, io, ids[None, :n - last], positions=np.arange(n - last)[None], past=io.empty_caches())
    apart, _ = _step(session, io, ids[None, n - last:], positions=np.arange(n - last, n)[None], past=past)
    ref = together[0, -1]
    return float(np.abs(ref - apart[0, -1]).max() / max(float(np.abs(ref).max()), 1e-30))


def sibling_row_dependence(session, io: ModelIO, ids: np.ndarray, rows: int = 12) -> float:
    """max|Δ| / max|logits| of a tree's second child: in a pass [root, a, b] where a and b are both
    children of the root (tree mask, b at a's position) vs in the chain pass [root, b]. fp32 graphs:
    ~1e-6 (the attention kernel sums a masked row in another order). Graphs that quantize activations
    (MatMulNBits accuracy_level 4, the gguf precision) turn that into ~2e-2 on SmolLM2-135M: a token
    verified off the tree's first chain then disagrees with decoding, so such a graph verifies chains
    only (`tree_rows_for`)."""
    ids = np.asarray(ids[:rows], np.int64)
    n = len(ids)
    prefix, root, a, b = ids[:n - 3], ids[n - 3], ids[n - 2], ids[n - 1]
    _, past = _step(session, io, prefix[None], positions=np.arange(n - 3)[None], past=io.empty_caches())
    P = n - 3
    mask = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    feeds = io.feeds(np.array([[root, a, b]]), positions=np.array([P, P + 1, P + 1]), mask=mask, past=past)
    tree = dict(zip(io.output_names, session.run(None, feeds)))[LOGITS][0, 2]
    chain, _ = _step(session, io, np.array([[root, b]]), positions=np.array([[P, P + 1]]), past=past)
    ref = chain[0, 1]
    return float(np.abs(ref - tree).max() / max(float(np.abs(ref).max()), 1e-30))


def tree_rows_for(rows: dict, scheme: str) -> str:
    """"exact": the graph verifies token trees as it decodes; "chains": a tree's sibling rows differ from
    decoding (sibling_row_dependence over the limit min_tokens_for uses), so the runtime verifies only
    a tree's first chain on it (runtime/loop.py) and speculative output stays this graph's vanilla
    output token for token."""
    from specexport.quant.quantize import CALIBRATED

    if "siblings" not in rows:
        return "exact"
    limit = 0.0 if scheme in CALIBRATED else ROW_TOLERANCE
    return "chains" if rows["siblings"] > limit else "exact"


def _step(session, io: ModelIO, tokens: np.ndarray, *, positions: np.ndarray, past: list):
    """One graph call on [B, T] tokens after `past`; returns logits [B, T, V] and the caches with the new K/V."""
    feeds = io.feeds(tokens, positions=positions, past=past)
    outs = dict(zip(io.output_names, session.run(None, feeds)))
    return outs[LOGITS], io.presents(outs)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))
