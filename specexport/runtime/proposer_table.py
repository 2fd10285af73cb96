"""The method table: a resolved request's MethodOptions (runtime/methods.py) -> the round's proposer.

    proposer = make_proposer(options, resources)       # None for vanilla

Each factory takes the options and a Resources: the models it may draft with (opened only when it asks
for them) and the graph's verify width, never the Pipeline, so a request in a batch and one alone
get their proposers from the same code, each from the models its caller supplies. Trees are checked
against the verify width here, with one-line errors naming the option.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specexport.errors import SpecexportError
from specexport.runtime.methods import DRAFT_TREES, MEDUSA_TREES, MethodOptions, dynamic_tree_settings, named_tree
from specexport.runtime.proposers import (DraftChain, DraftTree, DynamicTree, EagleTree, MedusaTree, PromptLookup,
                                          SuffixProposer)


@dataclass(frozen=True)
class Resources:
    """What a proposer is made of. Pipeline supplies its own models; Batch its slots of the shared ones."""
    verify_width: int                       # max_verify_tokens: a round's rows, the root included
    heads_manifest: dict                    # manifest["heads"]: the measured trees, the EAGLE head's layout
    target_io: dict                         # manifest's target io (the EAGLE-3 head's feature columns)
    draft: Callable[[str], object]          # draft(precision) -> the draft model's backend
    heads: Callable[[str], object]          # heads("medusa" | "eagle") -> the heads this request drafts with
    suffix_cache: Callable[[], object]      # the cache of earlier generations (suffix decoding)
    verify_costs: Callable[[], object] = lambda: None   # c(T)/c(1) measured on this CPU, or None (runtime/budget.py)


def make_proposer(options: MethodOptions, res: Resources):
    """The round's proposer for resolved options (None for vanilla)."""
    return PROPOSERS[options.method](options, res)


def _vanilla(o: MethodOptions, res: Resources):
    return None


def _draft(o: MethodOptions, res: Resources):
    if o.tree is not None:
        return _fitting(res, lambda paths: DraftTree(res.draft(o.draft_precision), paths, sampled=o.sampled_children),
                        named_tree(o.tree, DRAFT_TREES))
    if o.sampled_children:
        raise SpecexportError("sampled_children: only for draft trees (give tree=...)")
    return DraftChain(res.draft(o.draft_precision), _check_gamma(res, o.gamma, auto=True), draft_stop=o.draft_stop)


def _lookup(o: MethodOptions, res: Resources):
    """gamma "auto": up to the verify width, each round's length from this CPU's pass curve and the
    acceptance so far (runtime/budget.py); a number: that many tokens a round."""
    if not isinstance(o.lookup_branches, int) or o.lookup_branches < 1:
        raise SpecexportError(f"lookup_branches: expected an integer >= 1, got {o.lookup_branches!r}")
    if o.gamma == "auto":
        costs = res.verify_costs()
        if costs is None:
            raise SpecexportError("gamma: 'auto' for lookup sizes rounds from the pass curve `specexport bench` "
                                  "measures; this build has none for this CPU and thread count (run the bench "
                                  "here, or give gamma a number)")
        return PromptLookup(res.verify_width - 1, branches=o.lookup_branches, max_nodes=res.verify_width - 1,
                            costs=costs)
    gamma = _check_gamma(res, o.gamma, auto=True)
    return PromptLookup(gamma, branches=o.lookup_branches, max_nodes=res.verify_width - 1)


def _suffix(o: MethodOptions, res: Resources):
    """Depth and nodes up to the verify width, cut by the match length and, where the build's bench
    measured this CPU's pass curve, by what each node is expected to earn against what it costs."""
    return SuffixProposer(res.verify_width - 1, cache=res.suffix_cache() if o.suffix_share else None,
                          scope=o.suffix_scope, max_nodes=res.verify_width - 1, costs=res.verify_costs())


def _medusa(o: MethodOptions, res: Resources):
    auto = res.heads_manifest.get("medusa", {}).get("auto_tree")
    tree = ("auto" if auto else "medium") if o.tree is None else o.tree
    heads = res.heads("medusa")
    if tree == "auto":
        if auto is None:
            raise SpecexportError("tree: 'auto' needs the tree the build measured; this build has none "
                                  "(rebuild it with this version)")
        return _fitting(res, lambda paths: MedusaTree(heads, paths), auto["paths"])
    paths = named_tree(tree, MEDUSA_TREES)
    if isinstance(tree, str):               # a default: keep the paths these heads can reach
        paths = [p for p in paths if len(p) <= heads.num_heads and max(p) < heads.top_k]
    return _fitting(res, lambda paths: MedusaTree(heads, paths), paths)


def _eagle(o: MethodOptions, res: Resources):
    """tree: "auto" (the default: what the build measured best), "dynamic" (DynamicTree's defaults), a mapping
    {top_k, depth, total_tokens} (a dynamic tree), or a static tree (rank paths or a DRAFT_TREES name)."""
    entry = res.heads_manifest["eagle"]
    tree = "auto" if o.tree is None else o.tree
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

        columns = feature_columns(res.target_io["aux_hidden_layers"], entry["aux_layers"],
                                  res.target_io["hidden_size"])
    head = res.heads("eagle")
    return _fitting(res, lambda t: EagleTree(head, t, target_ids=entry.get("target_ids"), feature_columns=columns,
                                            feature_source="aux" if version == 3 else "hidden"), shape)


PROPOSERS = {"vanilla": _vanilla, "draft": _draft, "lookup": _lookup, "suffix": _suffix, "medusa": _medusa,
             "eagle": _eagle}


def _fitting(res: Resources, make, paths):
    """make(paths) with one-line errors, checked against the graph's verify width."""
    try:
        proposer = make(paths)
    except ValueError as err:
        raise SpecexportError(str(err)) from None
    if proposer.max_nodes > res.verify_width - 1:
        raise SpecexportError(f"tree: {proposer.max_nodes} nodes; the graph verifies at most max_verify_tokens "
                              f"- 1 = {res.verify_width - 1} besides the root (rebuild with a larger "
                              f"max_verify_tokens)")
    return proposer


def _check_gamma(res: Resources, gamma, *, auto: bool) -> int:
    top = res.verify_width - 1
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= top:
        alternative = " or 'auto'" if auto else ""
        raise SpecexportError(f"gamma: expected an integer in 1..{top} (the graph verifies up to "
                              f"max_verify_tokens={res.verify_width}){alternative}, got {gamma!r}")
    return gamma
