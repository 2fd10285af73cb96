"""The method table: a resolved request's MethodOptions (runtime/methods.py) -> the round's proposer, in two
steps, so a request is checked (and the bench's grid laid out) without opening a model:

    plan = plan_proposer(options, facts)       # one parse of trees, γ and widths; one-line errors
    proposer = plan.build(resources)            # opens the models it drafts with (None for vanilla)

Each entry reads the build's `Facts` (its verify width, the heads' manifest entries, the pass curve) and
returns a `Plan`: how deep and wide a round can go (the bench's γ column), the words the CLI prints for it,
and how to build the proposer from a `Resources` (the models it may draft with, opened only when it asks:
a request in a batch and one alone get theirs from the same code).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specexport.errors import SpecexportError
from specexport.runtime.methods import DRAFT_TREES, MEDUSA_TREES, MethodOptions, dynamic_tree_settings, named_tree
from specexport.runtime.proposers import (DraftChain, DraftTree, DynamicTree, EagleTree, MedusaTree, PromptLookup,
                                          SuffixProposer)
from specexport.runtime.proposers.eagle import feature_columns
from specexport.runtime.tree import from_rank_paths


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What planning reads of a build (nothing opened)."""
    verify_width: int                       # max_verify_tokens: a round's rows, the root included
    heads_manifest: dict                    # manifest["heads"]: the measured trees, the heads' widths
    target_io: dict                         # manifest's target io (the EAGLE-3 head's feature columns)
    verify_costs: Callable[[], object] = lambda: None   # c(T)/c(1) measured on this CPU, or None (runtime/budget.py)

    @classmethod
    def of(cls, manifest: dict, verify_costs: Callable[[], object] = lambda: None) -> "Facts":
        """A build's facts from its manifest (the bench lays its grid out with no pass curve)."""
        return cls(verify_width=manifest["max_verify_tokens"], heads_manifest=manifest.get("heads", {}),
                   target_io=manifest["models"]["target"]["io"], verify_costs=verify_costs)


@dataclass(frozen=True, kw_only=True)
class Resources(Facts):
    """What a proposer is made of. Pipeline supplies its own models; Batch its slots of the shared ones."""
    draft: Callable[[str], object]          # draft(precision) -> the draft model's backend
    heads: Callable[[str], object]          # heads("medusa" | "eagle") -> the heads this request drafts with
    suffix_cache: Callable[[], object]      # the cache of earlier generations (suffix decoding)


@dataclass(frozen=True)
class Plan:
    """A request's proposer before any model is opened."""
    method: str
    depth: int                              # the deepest a round reaches: a chain's γ, a tree's depth (0: vanilla)
    nodes: int                              # the most nodes a round proposes besides the root
    words: str                              # the shape in words, as the CLI prints it ("γ=4", "tree depth 3")
    make: Callable[[Resources], object] = field(repr=False, compare=False)

    def build(self, res: Resources):
        """The proposer (None for vanilla), made of the models `res` opens."""
        return _one_line(self.make, res)        # ValueError: a check only a model can make (a draft's vocabulary)


def plan_proposer(options: MethodOptions, facts: Facts) -> Plan:
    """The plan of resolved options, checked against the build."""
    return PROPOSERS[options.method](options, facts)


def make_proposer(options: MethodOptions, res: Resources):
    """The round's proposer for resolved options (None for vanilla)."""
    return plan_proposer(options, res).build(res)


def _vanilla(o: MethodOptions, facts: Facts) -> Plan:
    return Plan("vanilla", 0, 0, "", lambda res: None)


def _draft(o: MethodOptions, facts: Facts) -> Plan:
    if o.tree is not None:
        paths = named_tree(o.tree, DRAFT_TREES)
        depth, nodes = _tree_shape(facts, paths)
        return Plan("draft", depth, nodes, f"tree depth {depth}",
                    lambda res: DraftTree(res.draft(o.draft_precision), paths, sampled=o.sampled_children))
    if o.sampled_children:
        raise SpecexportError("sampled_children: only for draft trees (give tree=...)")
    gamma = _check_gamma(facts, o.gamma)
    DraftChain.check_stop(o.draft_stop)
    return Plan("draft", gamma, gamma, f"γ={gamma}",
                lambda res: DraftChain(res.draft(o.draft_precision), gamma, draft_stop=o.draft_stop))


def _lookup(o: MethodOptions, facts: Facts) -> Plan:
    """gamma "auto": up to the verify width, each round's length from this CPU's pass curve and the
    acceptance so far (runtime/budget.py); a number: that many tokens a round."""
    branches, top = o.lookup_branches, facts.verify_width - 1
    if isinstance(branches, bool) or not isinstance(branches, int) or branches < 1:
        raise SpecexportError(f"lookup_branches: expected an integer >= 1, got {branches!r}")
    if o.gamma == "auto":
        costs = facts.verify_costs()
        if costs is None:
            raise SpecexportError("gamma: 'auto' for lookup sizes rounds from the pass curve `specexport bench` "
                                  "measures; this build has none for this CPU and thread count (run the bench "
                                  "here, or give gamma a number)")
        return Plan("lookup", top, top, f"γ ≤ {top}, sized a round",
                    lambda res: PromptLookup(top, branches=branches, max_nodes=top, costs=costs))
    gamma = _check_gamma(facts, o.gamma)
    return Plan("lookup", gamma, min(gamma * branches, top), f"γ={gamma}",
                lambda res: PromptLookup(gamma, branches=branches, max_nodes=top))


def _suffix(o: MethodOptions, facts: Facts) -> Plan:
    """Depth and nodes up to the verify width, cut by the match length and, where the build's bench
    measured this CPU's pass curve, by what each node is expected to earn against what it costs."""
    top = facts.verify_width - 1
    return Plan("suffix", top, top, f"trees up to {top} nodes",
                lambda res: SuffixProposer(top, cache=res.suffix_cache() if o.suffix_share else None,
                                           scope=o.suffix_scope, max_nodes=top, costs=res.verify_costs()))


def _medusa(o: MethodOptions, facts: Facts) -> Plan:
    entry = facts.heads_manifest["medusa"]      # a build without heads: refused by resolve (bench: check_request)
    auto = entry.get("auto_tree")
    tree = ("auto" if auto else "medium") if o.tree is None else o.tree
    if tree == "auto":
        if auto is None:
            raise SpecexportError("tree: 'auto' needs the tree the build measured; this build has none "
                                  "(rebuild it with this version)")
        paths = auto["paths"]
    else:
        paths = named_tree(tree, MEDUSA_TREES)
        if isinstance(tree, str):           # a default: keep the paths these heads can reach
            paths = [p for p in paths if len(p) <= entry["num_heads"] and max(p) < entry["top_k"]]
    depth, nodes = _tree_shape(facts, paths, check=lambda t, r: MedusaTree.check(t, r, entry["num_heads"],
                                                                                  entry["top_k"]))
    return Plan("medusa", depth, nodes, f"tree depth {depth}", lambda res: MedusaTree(res.heads("medusa"), paths))


def _eagle(o: MethodOptions, facts: Facts) -> Plan:
    """tree: "auto" (the default: what the build measured best), "dynamic" (DynamicTree's defaults), a mapping
    {top_k, depth, total_tokens} (a dynamic tree), or a static tree (rank paths or a DRAFT_TREES name)."""
    entry = facts.heads_manifest["eagle"]
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
        shape = _dynamic(tree, entry)
        depth, nodes = shape.depth, shape.total_tokens
        _check_nodes(facts, nodes)
        _one_line(EagleTree.check_width, shape.top_k, entry["top_k"])
    else:
        shape = named_tree(tree, DRAFT_TREES)
        depth, nodes = _tree_shape(facts, shape, check=lambda t, r: EagleTree.check_width(int(r.max()) + 1,
                                                                                         entry["top_k"]))
    version = entry["version"]
    columns = feature_columns(facts.target_io["aux_hidden_layers"], entry["aux_layers"],
                              facts.target_io["hidden_size"]) if version == 3 else None
    return Plan("eagle", depth, nodes, f"tree depth {depth}",
                lambda res: EagleTree(res.heads("eagle"), shape, target_ids=entry.get("target_ids"),
                                      feature_columns=columns, feature_source="aux" if version == 3 else "hidden"))


PROPOSERS = {"vanilla": _vanilla, "draft": _draft, "lookup": _lookup, "suffix": _suffix, "medusa": _medusa,
             "eagle": _eagle}


def _dynamic(settings: dict, entry: dict) -> DynamicTree:
    unknown = set(settings) - {"top_k", "depth", "total_tokens"}
    if unknown:
        raise SpecexportError(f"tree: unknown keys {sorted(unknown)} for a dynamic EAGLE tree; allowed: "
                              f"top_k, depth, total_tokens")
    shape = _one_line(DynamicTree, **settings)
    if shape.scratch_rows > entry["scratch_rows"]:
        raise SpecexportError(f"tree: (depth - 1) x top_k = {shape.scratch_rows} draft rows; the head's "
                              f"cache has {entry['scratch_rows']} beyond max_seq_len")
    return shape


def _tree_shape(facts: Facts, paths, check=None) -> tuple[int, int]:
    """(depth, nodes besides the root) of rank paths, parsed once and checked (by `check(tree, ranks)` too)."""
    tree, ranks = _one_line(from_rank_paths, paths)
    if check is not None:
        _one_line(check, tree, ranks)
    _check_nodes(facts, tree.size - 1)
    return int(tree.depths.max()), tree.size - 1


def _one_line(call, *args, **kwargs):
    """call(...) with its ValueError as a one-line SpecexportError (the proposers' own checks raise ValueError)."""
    try:
        return call(*args, **kwargs)
    except ValueError as err:
        raise SpecexportError(str(err)) from None


def _check_nodes(facts: Facts, nodes: int) -> None:
    if nodes > facts.verify_width - 1:
        raise SpecexportError(f"tree: {nodes} nodes; the graph verifies at most max_verify_tokens "
                              f"- 1 = {facts.verify_width - 1} besides the root (rebuild with a larger "
                              f"max_verify_tokens)")


def _check_gamma(facts: Facts, gamma) -> int:
    top = facts.verify_width - 1
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= top:
        raise SpecexportError(f"gamma: expected an integer in 1..{top} (the graph verifies up to "
                              f"max_verify_tokens={facts.verify_width}) or 'auto', got {gamma!r}")
    return gamma
