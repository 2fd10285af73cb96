"""The decoding methods, their tree catalogues, and the proposer a generate() call decodes with.

    vanilla   no proposer
    draft     a draft model proposes γ tokens (DraftChain), or a static token tree (DraftTree)
    lookup    prompt lookup: tokens copied from what followed an earlier occurrence (PromptLookup)
    suffix    suffix decoding: a tree of what followed the longest earlier match, in this request and in
              the pipeline's cache of earlier generations (SuffixProposer)
    medusa    the build's Medusa heads propose a static tree (MedusaTree)
    eagle     the build's EAGLE head drafts a token tree from the target's states (EagleTree)
    auto      the configuration `specexport bench` measured fastest (vanilla when every one lost)

`proposer_for(pipe, method, ...)` turns a generate() call's options into the round's proposer, or
None for vanilla, with one-line errors naming the option; trees are checked against the graph's
verify width. The bench and the server name methods from METHODS, here only.
"""
from __future__ import annotations

from specexport.errors import SpecexportError
from specexport.gamma import lookup as lookup_gamma
from specexport.runtime.proposers import (DraftChain, DraftTree, DynamicTree, EagleTree, MedusaTree, PromptLookup,
                                          SuffixProposer)

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


def proposer_for(pipe, method: str, gamma, draft_stop: float, lookup_branches: int, tree=None,
                  sampled_children: bool = False, suffix_scope: str = "", suffix_share: bool = True):
    """The round's proposer (None for vanilla). gamma="auto" (draft only) takes the γ `specexport
    bench` stored for these precisions, and decodes vanilla when it predicted speculation would lose.
    gamma=None: what the build's bench measured for this method (measured_defaults), else DEFAULT_GAMMA."""
    if gamma is None and method in METHODS:
        gamma, tree = measured_defaults(pipe, method, tree)
    if method == "auto":
        return _auto_method(pipe, suffix_scope, suffix_share)
    if method not in METHODS:
        raise SpecexportError(f"method: {method!r} is not supported; supported: {', '.join(METHODS)}, auto")
    if method == "vanilla":
        return None
    if method not in pipe.methods:
        what = {"medusa": "Medusa heads", "eagle": "EAGLE head"}.get(method, "draft model")
        raise SpecexportError(f"method: {method!r} was not built (no {what} in this build); "
                              f"available: {', '.join(pipe.methods)}")
    if method == "medusa":
        return _medusa_tree(pipe, ("auto" if _auto_medusa_tree(pipe) else "medium") if tree is None else tree)
    if method == "eagle":
        return _eagle_tree(pipe, "auto" if tree is None else tree)
    if method == "suffix":                  # depth and nodes up to the verify width, cut by the match length
        return SuffixProposer(pipe.max_verify_tokens - 1, cache=pipe.suffix_cache if suffix_share else None,
                              scope=suffix_scope, max_nodes=pipe.max_verify_tokens - 1)
    if method == "lookup":
        gamma = _check_gamma(pipe, gamma, auto=False)
        if not isinstance(lookup_branches, int) or lookup_branches < 1:
            raise SpecexportError(f"lookup_branches: expected an integer >= 1, got {lookup_branches!r}")
        return PromptLookup(gamma, branches=lookup_branches, max_nodes=pipe.max_verify_tokens - 1)
    if tree is not None:
        return _draft_tree(pipe, tree, sampled_children)
    if sampled_children:
        raise SpecexportError("sampled_children: only for draft trees (give tree=...)")
    if gamma == "auto":
        choice = lookup_gamma(pipe.manifest, pipe.precision, pipe.draft_precision)
        if choice is None:
            raise SpecexportError(f"gamma: 'auto' needs a measured choice for target {pipe.precision!r} with "
                                  f"draft {pipe.draft_precision!r}: run `specexport bench {pipe.dir}` first")
        pipe.auto_note = (f"γ = {choice['gamma']} (predicted speedup {choice['predicted_speedup']:.2f}x)"
                          if choice["gamma"] else
                          f"speculation predicted to lose here (best predicted speedup "
                          f"{choice['predicted_speedup']:.2f}x): decoding vanilla")
        if choice["gamma"] == 0:
            return None
        gamma = min(int(choice["gamma"]), pipe.max_verify_tokens - 1)
    return DraftChain(pipe.draft, _check_gamma(pipe, gamma, auto=True), draft_stop=draft_stop)


def measured_defaults(pipe, method: str, tree=None) -> tuple[int, object]:
    """(γ, tree) for a method asked for without a γ: the stored `--method auto` choice's when it chose this
    method (and no other tree was asked for), else for a draft chain the stored `--gamma auto` γ, else
    DEFAULT_GAMMA: the settings the build's bench measured are the defaults."""
    top = pipe.max_verify_tokens - 1
    choice = stored_choice(pipe)
    if choice is not None and choice["method"] == method and tree is None \
            and choice.get("draft_precision") in (None, pipe.draft_precision):
        return max(1, min(int(choice["gamma"]), top)), choice["tree"]
    if method == "draft" and tree is None:
        g = lookup_gamma(pipe.manifest, pipe.precision, pipe.draft_precision)
        if g is not None and g["gamma"]:
            return min(int(g["gamma"]), top), None
    return min(DEFAULT_GAMMA, top), tree


def stored_choice(pipe) -> dict | None:
    """The `--method auto` choice a bench stored for the pipeline's precisions and graphs, if any."""
    dp = pipe.draft_precision if "draft" in pipe.manifest["models"] else "-"
    return lookup_gamma(pipe.manifest, pipe.precision, dp, section="method_auto")


def _auto_method(pipe, suffix_scope: str = "", suffix_share: bool = True):
    """The configuration `specexport bench` measured best for these precisions (vanilla when every
    one lost), on exactly these graphs."""
    dp = pipe.draft_precision if "draft" in pipe.manifest["models"] else "-"
    choice = stored_choice(pipe)
    if choice is None:
        raise SpecexportError(f"method: 'auto' needs a measured choice for target {pipe.precision!r}"
                              f"{'' if dp == '-' else f' with draft {dp!r}'}: run `specexport bench {pipe.dir}` "
                              f"first (with the --methods to choose from)")
    pipe.auto_note = auto_summary(choice, pipe.dir)
    if choice["method"] == "vanilla":
        return None
    if choice["draft_precision"] not in (None, pipe.draft_precision):
        pipe.use_draft_precision(choice["draft_precision"])
    return proposer_for(pipe, choice["method"], max(1, min(choice["gamma"], pipe.max_verify_tokens - 1)),
                        choice.get("draft_stop", 0.0), 1, choice["tree"], suffix_scope=suffix_scope,
                        suffix_share=suffix_share)


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


def resolve_default_method(pipe, method: str) -> tuple[str, str]:
    """(the method a command or request gets by default, a line saying why). `auto` without a measured
    choice in the build decodes vanilla (and says to run `specexport bench`) rather than refusing."""
    if method != "auto":
        if method != "vanilla" and method not in pipe.methods:
            raise SpecexportError(f"--method: {method!r} is not available in {pipe.dir}; available: "
                                  f"{', '.join(('auto', 'vanilla', *pipe.methods))}")
        return method, f"method {method}"
    choice = stored_choice(pipe)
    if choice is None:
        return "vanilla", (f"method auto: {pipe.dir} has no measured choice for target {pipe.precision!r}; "
                           f"decoding vanilla (run `specexport bench {pipe.dir}` to measure one)")
    return "auto", f"method auto: {auto_summary(choice, pipe.dir)}"


def _draft_tree(pipe, tree, sampled: bool = False) -> DraftTree:
    return _fitting(pipe, lambda paths: DraftTree(pipe.draft, paths, sampled=sampled), named_tree(tree, DRAFT_TREES))


def _auto_medusa_tree(pipe):
    return pipe.manifest.get("heads", {}).get("medusa", {}).get("auto_tree")


def _medusa_tree(pipe, tree) -> MedusaTree:
    heads = pipe.medusa
    if tree == "auto":
        auto = _auto_medusa_tree(pipe)
        if auto is None:
            raise SpecexportError("tree: 'auto' needs the tree the build measured; this build has none "
                                  "(rebuild it with this version)")
        return _fitting(pipe, lambda paths: MedusaTree(heads, paths), auto["paths"])
    paths = named_tree(tree, MEDUSA_TREES)
    if isinstance(tree, str):               # a default: keep the paths these heads can reach
        paths = [p for p in paths if len(p) <= heads.num_heads and max(p) < heads.top_k]
    return _fitting(pipe, lambda paths: MedusaTree(heads, paths), paths)


def _eagle_tree(pipe, tree) -> EagleTree:
    """tree: "auto" (what the build measured best), "dynamic" (DynamicTree's defaults), a mapping
    {top_k, depth, total_tokens} (a dynamic tree), or a static tree (rank paths or a DRAFT_TREES name)."""
    entry = pipe.manifest["heads"]["eagle"]
    if tree == "auto":
        auto = entry.get("auto_tree")
        if not auto:
            raise SpecexportError("tree: 'auto' needs the tree the build measured; this build has none "
                                  "(rebuild it with this version)")
        tree = {k: auto[k] for k in ("top_k", "depth", "total_tokens")}
    if isinstance(tree, str) and tree.startswith("dynamic"):
        tree = dynamic_tree_settings(tree)
    if isinstance(tree, dict):
        unknown = set(tree) - {"top_k", "depth", "total_tokens"}
        if unknown:
            raise SpecexportError(f"tree: unknown keys {sorted(unknown)} for a dynamic EAGLE tree; allowed: "
                                  f"top_k, depth, total_tokens")
        try:
            shape = DynamicTree(**tree)
        except ValueError as err:
            raise SpecexportError(str(err)) from None
        if shape.scratch_rows > entry["scratch_rows"]:
            raise SpecexportError(f"tree: (depth - 1) x top_k = {shape.scratch_rows} draft rows; the head's "
                                  f"cache has {entry['scratch_rows']} beyond max_seq_len")
    else:
        shape = named_tree(tree, DRAFT_TREES)
    version = entry["version"]
    columns = None
    if version == 3:
        from specexport.runtime.proposers.eagle import feature_columns

        target_io = pipe.manifest["models"]["target"]["io"]
        columns = feature_columns(target_io["aux_hidden_layers"], entry["aux_layers"], target_io["hidden_size"])
    head = pipe.eagle
    return _fitting(pipe, lambda t: EagleTree(head, t, target_ids=entry.get("target_ids"), feature_columns=columns,
                                             feature_source="aux" if version == 3 else "hidden"), shape)


def _fitting(pipe, make, paths):
    """make(paths) with one-line errors, checked against the graph's verify width."""
    try:
        proposer = make(paths)
    except ValueError as err:
        raise SpecexportError(str(err)) from None
    if proposer.max_nodes > pipe.max_verify_tokens - 1:
        raise SpecexportError(f"tree: {proposer.max_nodes} nodes; the graph verifies at most max_verify_tokens "
                              f"- 1 = {pipe.max_verify_tokens - 1} besides the root (rebuild with a larger "
                              f"max_verify_tokens)")
    return proposer


def _check_gamma(pipe, gamma, *, auto: bool) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= pipe.max_verify_tokens - 1:
        alternative = " or 'auto'" if auto else ""
        raise SpecexportError(f"gamma: expected an integer in 1..{pipe.max_verify_tokens - 1} (the graph "
                              f"verifies up to max_verify_tokens={pipe.max_verify_tokens}){alternative}, "
                              f"got {gamma!r}")
    return gamma


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
