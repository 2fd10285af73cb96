"""Calibration feeds in the shapes the runtime runs, with real past KV.

Activation ranges depend on the call: a prefill chunk attends over its own rows only, a decode or
verify step over hundreds of committed ones. Random token ids break the embedding Gather (ModelOpt
fills any input it is not given with random data), and zero caches make every decode step look like
the first token. So for each calibration sequence the fp32 graph prefills its first P tokens from an
empty cache, and the K/V that pass wrote are the past of two more calls at P: one decode token and one
verify pass of `verify_tokens` tokens (the sequence's own next tokens, causal: a chain). P varies
between sequences so positions spread over the sequence length.
"""
from __future__ import annotations

import numpy as np

from specexport.io_spec import ModelIO

PHASES = ("prefill", "decode", "verify")
VERIFY_TOKENS = 5           # a γ = 4 chain: the runtime's default verify width


def runtime_feeds(session, io: ModelIO, sequences, *, verify_tokens: int = VERIFY_TOKENS) -> tuple[list[dict], dict]:
    """(feed dicts for session.run, the manifest record of what they are). `session`: the fp32 graph
    in ONNX Runtime, whose own K/V become the decode and verify feeds' past."""
    feeds, phases = [], {p: 0 for p in PHASES}
    for i, ids in enumerate(sequences):
        ids = np.asarray(ids, np.int64)
        P = split_point(len(ids), i, verify_tokens)
        if P is None:
            continue
        prefill = io.feeds(ids[None, :P])
        outs = dict(zip(io.output_names, session.run(None, prefill)))
        past = io.presents(outs)                                   # [1, Hkv, P, D] each: the real cache
        feeds += [prefill, io.feeds(ids[None, P:P + 1], past=past),
                  io.feeds(ids[None, P:P + verify_tokens], past=past)]
        for p in PHASES:
            phases[p] += 1
    record = {"feeds": len(feeds), "phases": phases, "verify_tokens": verify_tokens,
              "past_kv": "the fp32 graph's K/V of each sequence's prefill"}
    return feeds, record


def split_point(length: int, index: int, verify_tokens: int) -> int | None:
    """Committed tokens before the decode/verify calls of sequence `index`: from a quarter to all but
    `verify_tokens` of it, stepping between sequences. None: too short for a prefill and a verify pass."""
    last = length - verify_tokens
    if last < 2:
        return None
    first = max(1, length // 4)
    span = max(last - first, 0)
    return first + (index * 7919) % (span + 1) if span else last
