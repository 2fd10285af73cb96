"""One generation's request as it will run, its output, and the stream of its text pieces (Pipeline.stream)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.runtime.loop import DecodeStats
from specexport.runtime.methods import MethodOptions
from specexport.runtime.proposer_table import Plan
from specexport.runtime.sampling import SamplingParams


@dataclass
class Request:
    """One generation's checked options (Pipeline.request), its method resolved once (methods.resolve)."""
    ids: np.ndarray
    params: SamplingParams
    max_new_tokens: int
    seed: int | None
    stop: tuple
    options: MethodOptions              # as it will run: no "auto" left
    plan: Plan                          # its proposer, checked, not built (proposer_table.plan_proposer)
    note: str = ""                      # what method="auto" / gamma="auto" decided ("" when nothing was)


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]                # generated ids only (EOS included when it ended the output)
    finish_reason: str                  # "stop" (EOS or a stop string) or "length"
    stats: DecodeStats
    method: str = "vanilla"             # the method that ran (what "auto" chose)
    note: str = ""                      # what method="auto" / gamma="auto" decided, in one line
    shape: str = ""                     # its proposals' shape in words (Plan.words: "γ=4", "tree depth 3")


class TextStream:
    """A generation's text pieces, decoded as they are iterated; `output` is its GenerationOutput once they
    end (None before). `make(done)` returns the pieces' generator, which calls done(output) at its end."""

    def __init__(self, make):
        self.output: GenerationOutput | None = None
        self._pieces = make(self._done)

    def _done(self, output: GenerationOutput) -> None:
        self.output = output

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop decoding (what a generator's close does): the rounds end, nothing more is computed."""
        self._pieces.close()
