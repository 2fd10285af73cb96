"""The decoding methods, their tree catalogues, and the proposer a generate() call decodes with.

    vanilla   no proposer
    draft     a draft model proposes γ tokens (DraftChain), or a static token tree (DraftTree)
    lookup    prompt lookup: tokens copied from what followed an earlier occurrence (PromptLookup)
    suffix    suffix decoding: a tree of what followed the longest earlier match, in this request and in
              the pipeline's cache of earlier generations (SuffixProposer)
    medusa    the build's Medusa heads propose a static tree (MedusaTree)
    eagle     the build's EAGLE head drafts a token tree from the target's states (EagleTree)
    auto      the configuration `specexport bench` measured fastest (vanilla when every one lost)

A request's options are a MethodOptions; `resolve` settles "auto" and the defaults once per request
(with one-line errors naming the option) and says what it chose; runtime/proposer_table.py turns the
resolved options into the round's proposer. The bench and the server name methods from METHODS, here only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from specexport.errors import SpecexportError
from specexport.gamma import lookup as lookup_gamma

METHODS = ("vanilla", "draft", "lookup", "suffix", "medusa", "eagle")
HEAD_METHODS = ("medusa", "eagle")        # proposers made of heads on the target's states (not a draft model)
# Static draft trees (rank paths: the r-th most likely draft token at each depth). "wide" branches at
# the first two levels, "deep" follows the top-1 path further; both 15 nodes, for max_verify_tokens 16.
DRAFT_TREES = {
    "small": [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0)],
    "wide": [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0),
             (0, 0, 0, 0), (0, 0, 0, 0, 0)],
    "deep": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0, 0),
             (0, 0, 0, 0, 1), (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0, 0, 0), (1, 0, 0)],
}

# Static Medusa trees by size (nodes besides the root), rank paths into the heads' top-k. Depth d reads
# head d-1, so paths deeper than the build's heads are dropped. "medium" fits max_verify_tokens 16.
MEDUSA_TREES = {
    "small": [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)],
    "medium": [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1),
               (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)],
    "large": [(0,), (1,), (2,), (3,), (4,), (5,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (2, 0),
              (2, 1), (3, 0), (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (2, 0, 0),
              (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0), (0, 0, 0, 0, 0),
              (0, 0, 0, 0, 0, 0)],
}


DEFAULT_GAMMA = 4      # γ when neither the caller nor a bench of this build chose one


@dataclass(frozen=True)
class MethodOptions:
    """How one request drafts (Pipeline.request's method options). After resolve() the method is one of
    METHODS, γ and the tree are what runs, and draft_precision names the draft model's graphs."""
    method: str = "draft"
    gamma: int | str | None = None     # a chain's length; "auto": the bench's γ (draft), from the pass curve
                                       # (lookup: runtime/budget.py); None: the build's default
    tree: object = None                # a static tree (name or rank paths) or a dynamic EAGLE tree's settings
    draft_stop: float = 0.0            # end a round's drafting below this draft probability (draft chains)
    lookup_branches: int = 1           # prompt lookup: occurrences verified as one tree
    sampled_children: bool = False     # draft trees: children drawn from the draft, the multi-draft rule
    suffix_scope: str = ""             # suffix decoding: the part of the cache this request reads
    suffix_share: bool = True          # suffix decoding: read the pipeline's cache and add to it
    draft_precision: str | None = None  # the draft's graphs (None: the pipeline's)


@dataclass(frozen=True)
class BuildView:
    """What resolve() reads of a build: its manifest and folder, the precisions a request runs on, the verify
    width, the methods built, and this CPU's measured pass curve (Pipeline.view() makes one a request)."""
    manifest: dict
    dir: Path
    precision: str
    draft_precision: str | None
    max_verify_tokens: int
    methods: tuple[str, ...]
    verify_costs: Callable[[], object] = lambda: None    # c(T)/c(1) measured here, or None (runtime/budget.py)


def resolve(options: MethodOptions, build: BuildView) -> tuple[MethodOptions, str]:
    """(the options as they will run, a line saying what "auto" decided or ""). Once per request, before
    any model is touched. method="auto" takes the configuration `specexport
    bench` stored for these precisions and graphs (vanilla when every one lost, or when none was stored:
    the note says how to measure one); gamma="auto" (draft
    chains) the γ it stored, vanilla when it predicted speculation would lose; gamma=None what the build's
    bench measured for the method (measured_defaults), else DEFAULT_GAMMA."""
    top = build.max_verify_tokens - 1
    if options.method == "auto":
        choice = stored_choice(build)
        if choice is None:                  # a build no bench measured: vanilla, and the note says how to measure
            dp = build.draft_precision if "draft" in build.manifest["models"] else "-"
            return replace(options, method="vanilla", gamma=None, tree=None), (
                f"no measured choice for target {build.precision!r}{'' if dp == '-' else f' with draft {dp!r}'}: "
                f"decoding vanilla (run `specexport bench {build.dir}` to measure one)")
        note = auto_summary(choice, build.dir)
        if choice["method"] == "vanilla":
            return replace(options, method="vanilla", gamma=None, tree=None), note
        chosen = replace(options, method=choice["method"], gamma=max(1, min(choice["gamma"], top)),
                         draft_stop=choice.get("draft_stop", 0.0), lookup_branches=1, tree=choice["tree"],
                         sampled_children=False, draft_precision=choice["draft_precision"] or options.draft_precision)
        return resolve(chosen, build)[0], note
    method = options.method
    if method not in METHODS:
        raise SpecexportError(f"method: {method!r} is not supported; supported: {', '.join(METHODS)}, auto")
    if method != "vanilla" and method not in build.methods:
        what = {"medusa": "Medusa heads", "eagle": "EAGLE head"}.get(method, "draft model")
        raise SpecexportError(f"method: {method!r} was not built (no {what} in this build); "
                              f"available: {', '.join(build.methods)}")
    options = replace(options, draft_precision=options.draft_precision or build.draft_precision)
    if options.gamma is None:
        gamma, tree = measured_defaults(build, method, options.tree)
        options = replace(options, gamma=gamma, tree=tree)
    if method == "lookup" and options.gamma == "auto":
        return options, f"lookup rounds of up to {top} tokens, each sized from this CPU's pass curve (the bench's)"
    if method != "draft" or options.tree is not None or options.gamma != "auto":
        return options, ""
    choice = lookup_gamma(build.manifest, build.precision, options.draft_precision)
    if choice is None:
        raise SpecexportError(f"gamma: 'auto' needs a measured choice for target {build.precision!r} with "
                              f"draft {options.draft_precision!r}: run `specexport bench {build.dir}` first")
    if not choice["gamma"]:
        return replace(options, method="vanilla", gamma=None), (
            f"speculation predicted to lose here (best predicted speedup {choice['predicted_speedup']:.2f}x): "
            f"decoding vanilla")
    return (replace(options, gamma=min(int(choice["gamma"]), top)),
            f"γ = {choice['gamma']} (predicted speedup {choice['predicted_speedup']:.2f}x)")


def measured_defaults(build: BuildView, method: str, tree=None) -> tuple[int, object]:
    """(γ, tree) for a method asked for without a γ: the stored `--method auto` choice's when it chose this
    method (and no other tree was asked for), else for a draft chain the stored `--gamma auto` γ, else
    for lookup "auto" where the build's bench measured this CPU's pass curve (runtime/budget.py), else
    DEFAULT_GAMMA: the settings the build's bench measured are the defaults."""
    top = build.max_verify_tokens - 1
    choice = stored_choice(build)
    if choice is not None and choice["method"] == method and tree is None \
            and choice.get("draft_precision") in (None, build.draft_precision):
        return max(1, min(int(choice["gamma"]), top)), choice["tree"]
    if method == "draft" and tree is None:
        g = lookup_gamma(build.manifest, build.precision, build.draft_precision)
        if g is not None and g["gamma"]:
            return min(int(g["gamma"]), top), None
    if method == "lookup" and build.verify_costs() is not None:    # rounds sized from this CPU's pass curve
        return "auto", tree
    return min(DEFAULT_GAMMA, top), tree


def stored_choice(build: BuildView) -> dict | None:
    """The `--method auto` choice a bench stored for the build's precisions and graphs, if any."""
    dp = build.draft_precision if "draft" in build.manifest["models"] else "-"
    return lookup_gamma(build.manifest, build.precision, dp, section="method_auto")


def configuration(choice: dict) -> str:
    """A stored choice in words: "draft γ 4", "draft tree small", "suffix (trees up to 15 nodes)",
    "medusa tree auto"."""
    method, tree = choice["method"], choice.get("tree")
    if method == "suffix":
        return f"suffix (trees up to {choice['gamma']} nodes)"
    if tree:
        return f"{method} tree {tree}"
    return f"{method} γ {choice['gamma']}"


def auto_summary(choice: dict, output_dir) -> str:
    """What a stored `--method auto` choice says, in one line: the configuration and its measured speedup,
    or why it is vanilla (every measured configuration lost, or none was measured: then the command that
    measures them)."""
    if choice["method"] != "vanilla":
        ci = choice.get("speedup_ci95")
        interval = f" [95% interval {ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""
        return f"{configuration(choice)}: measured {choice['speedup']:.2f}x{interval} over vanilla"
    if not choice.get("best_measured"):
        return (f"vanilla: the bench that chose it measured no speculative configuration; measure them with "
                f"`specexport bench {output_dir} --methods vanilla,lookup,suffix` (and draft, medusa, eagle where built)")
    return (f"vanilla: every speculative configuration measured was slower (the best, {choice['best_measured']}, "
            f"measured {choice['speedup']:.2f}x)")


def default_note(build: BuildView, method: str) -> str:
    """The line a command or a server prints for the method its requests get by default (resolve()'s note, so
    "auto" is decided in one place); a method this build lacks fails here, before any request."""
    _, note = resolve(MethodOptions(method=method), build)
    return f"method {method}" + (f": {note}" if note else "")


def dynamic_tree_settings(text: str) -> dict:
    """"dynamic" -> {} (DynamicTree's defaults); "dynamic:K/D/N" -> {top_k: K, depth: D, total_tokens: N}
    (how the bench's --eagle-trees and the CLI's --tree name one dynamic tree)."""
    if text == "dynamic":
        return {}
    try:
        k, d, n = (int(x) for x in text.removeprefix("dynamic:").split("/"))
    except ValueError:
        raise SpecexportError(f"tree: {text!r}: expected 'dynamic' or 'dynamic:TOP_K/DEPTH/TOTAL_TOKENS' (e.g. "
                              f"dynamic:4/5/15)") from None
    return {"top_k": k, "depth": d, "total_tokens": n}


def named_tree(tree, named: dict):
    """A tree given by name (one of `named`) or as rank paths."""
    paths = named.get(tree) if isinstance(tree, str) else tree
    if paths is None:
        raise SpecexportError(f"tree: {tree!r} is not a known tree; known: {', '.join(named)}, or a list "
                              f"of rank paths like [[0], [1], [0, 0]]")
    return paths
