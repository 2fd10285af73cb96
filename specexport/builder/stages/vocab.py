"""VocabStage: `draft: {vocab: N}`: the N target ids the draft proposes from, measured on the target's fp32
graph, or a lean target's gguf graph: the stage it needs (the ids it produces most often). It writes no
folder: its entry, the ids and where they came from, goes into models.draft of the manifest, and the
draft's graph stages read the ids from it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.builder.stage import Stage

VOCAB_SEQUENCES, VOCAB_LENGTH, VOCAB_SEED = 32, 128, 2


@dataclass(frozen=True)
class VocabStage(Stage):
    forceable = False            # the ids follow from the target graph, which the fingerprint pins

    def previous(self, ctx) -> dict | None:
        old = ctx.previous.get("models", {}).get(self.role) or {}
        if old.get("fingerprint") != self.fingerprint or not old.get("vocab_ids"):
            return None
        return {"vocab_ids": old["vocab_ids"], "vocab_source": old.get("vocab_source"),
                "stage_fingerprint": self.fingerprint}

    def reusable(self, ctx, entry: dict) -> bool:
        return True

    def describe(self, entry: dict) -> str:
        return f"{len(entry['vocab_ids'])} ids"

    def run(self, ctx) -> dict:
        from specexport.quant.quality import runtime_session

        mp, target = ctx.model(self.role), ctx.model("target")
        n = mp.config.vocab
        with ctx.reporter.stage(f"measure the draft's {n} tokens on the target's continuations") as steps:
            ids = frequent_ids(runtime_session(ctx.stage_dir(self.needs[0]) / "model.onnx"), target, n,
                               eval_ids=ctx.plan.eval_ids, steps=steps)
        return {"vocab_ids": list(ids),
                "vocab_source": {"most_frequent": n, "sequences": VOCAB_SEQUENCES, "length": VOCAB_LENGTH,
                                 "seed": VOCAB_SEED, "eval_text": ctx.plan.eval_ids is not None,
                                 "graph": self.needs[0]}}

    def place(self, manifest: dict, entry: dict) -> None:
        manifest["models"][self.role].update(vocab_ids=entry["vocab_ids"], vocab_source=entry["vocab_source"])


def frequent_ids(target_session, target, n: int, *, eval_ids=None, steps=None) -> tuple[int, ...]:
    """The n target ids most frequent in sequences sampled from the target graph (32 x 128 tokens,
    temperature 1, seeded) and in eval_text: the EOS ids first, then by count, ties and any shortfall
    by ascending id (a token the draft cannot propose still comes out through the verifier)."""
    from specexport.quant.quality import sampled_sequences
    from specexport.runtime.backends.vocab import most_frequent_ids

    seqs = sampled_sequences(target_session, target.io, start=target.arch.bos_token_id, length=VOCAB_LENGTH,
                             count=VOCAB_SEQUENCES, seed=VOCAB_SEED, steps=steps)
    tokens = np.concatenate([*seqs, np.asarray(eval_ids or [], np.int64)])
    return most_frequent_ids(tokens, n, target.io.vocab_size, always=target.eos_token_ids)
