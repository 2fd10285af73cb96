"""Workloads for `specexport bench --workload FILE`: requests replayed in order, so that a method that
learns across requests (suffix decoding's shared cache) meets what a server would: the same question
again, a file asked back with a small change, a conversation that carries its earlier answers.

A workload file is JSON lines, each one request:
    "a user message"                          one request
    {"prompt": "a user message"}              the same
    {"turns": ["first", "second", ...]}       a conversation: turn k is sent as the earlier turns and the
                                              target's answers to them, then turn k, as one message
Turns carry the target's own greedy vanilla answers, computed once before the timed runs (greedy, every
method answers the same; sampled, each run's request is still a valid request).

Every round replays the whole workload through fresh caches, one per suffix row, so its second request
can hit its first and no round sees another's answers.
"""
from __future__ import annotations

from pathlib import Path

from specexport.errors import SpecexportError
from specexport.prompts import json_lines


def read_workload(path: Path) -> tuple:
    """The requests of a workload file: strings, or tuples of a conversation's turns."""
    items = []
    for number, value in json_lines(Path(path), where="--workload"):
        where = f"--workload: {path} line {number}"
        if isinstance(value, dict) and "prompt" in value:
            value = value["prompt"]
        if isinstance(value, dict) and "turns" in value:
            turns = value["turns"]
            if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
                raise SpecexportError(f"{where}: \"turns\" must be a non-empty list of non-empty strings")
            items.append(tuple(turns))
        elif isinstance(value, str) and value:
            items.append(value)
        else:
            raise SpecexportError(f"{where}: expected a non-empty JSON string, {{\"prompt\": ...}} or "
                                  f"{{\"turns\": [...]}}, got {type(value).__name__}")
    if not items:
        raise SpecexportError(f"--workload: {path} holds no requests")
    return tuple(items)


def conversation_turn(turns, answers) -> str:
    """Turn k (k = len(answers)) as one message: the earlier turns with their answers, then turn k.

    Example: turns ("Write f.", "Add a test."), answers ["def f(): ..."] ->
    "Write f.\\n\\ndef f(): ...\\n\\nAdd a test."
    """
    parts = [p for turn, answer in zip(turns, answers) for p in (turn, answer)]
    return "\n\n".join([*parts, turns[len(answers)]])


def expand_workload(items, pipe, *, chat: bool, max_new_tokens: int, log=print) -> tuple[str, ...]:
    """The workload as the flat list of request texts the bench sends, in order."""
    from specexport.report.timing import encode_prompt

    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append(item)
            continue
        answers = []
        for k in range(len(item)):
            prompts.append(conversation_turn(item, answers))
            if k + 1 < len(item):
                out = pipe.generate(prompt_ids=encode_prompt(pipe, prompts[-1], chat), max_new_tokens=max_new_tokens,
                                    method="vanilla", suffix_share=False)
                answers.append(out.text)
    conversations = sum(not isinstance(i, str) for i in items)
    log(f"bench: workload of {len(prompts)} requests ({conversations} conversations), replayed in order each round")
    return tuple(prompts)


def suffix_caches(configs, cfg) -> dict:
    """A fresh SuffixCache per suffix row when the bench replays a workload; none otherwise."""
    if cfg.workload is None:
        return {}
    from specexport.runtime.pipeline import SUFFIX_CACHE_TOKENS
    from specexport.runtime.suffix import SuffixCache

    return {c: SuffixCache(SUFFIX_CACHE_TOKENS) for c in configs if c.method == "suffix"}
