"""EAGLE: a one-layer head that drafts from the target's own states grows a token tree each round.

The head's cache row j holds token x_{j+1} read with the target's feature of position j (EAGLE-1:
its final state; EAGLE-3: three layers' inputs) and predicts x_{j+2}. A round, N tokens so far:

  1. catch up: the head runs the rows j = head.length .. N-2 (the accepted tokens of the last round,
     with the target's features of the rows the target just committed) and commits them: its cache
     then holds exactly the accepted text. Row N-2's top-K are the root's children (depth 1).
  2. grow: each further level feeds chosen nodes as rows at position N-2 + depth, reading their
     parent's output state instead of a target feature and seeing, among the cached rows, the
     committed ones and their own ancestors (earlier levels stay in the cache past the committed rows
     until the tree is done, then `rollback` forgets them: a rejected branch never stays).
     * dynamic (EAGLE-2, Li et al. 2024): level 1 is the root's top-k; each level feeds the k
       candidates of the previous one with the best cumulative log-probability and adds each one's
       top-k children as candidates; after `depth` levels the `total_tokens` best candidates (by
       cumulative log-probability, parents first) are the tree.
     * static: rank paths, as for a draft tree: the r-th most likely token at each node.
  3. the loop verifies the tree in one target pass; the head is told nothing else: the next round's
     catch-up reads the target's states of the accepted path (`features`).

The children are chosen deterministically from the head's outputs, before the target's randomness is
drawn, so the q-free rule verifies the tree losslessly at any temperature; greedy equals plain greedy.
A head over a reduced draft vocabulary (EAGLE-3's d2t) proposes target ids `target_ids[draft id]`;
a target token outside that vocabulary still comes out, from the rule's draw at the node.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.errors import SpecexportError
from specexport.runtime.proposers.base import Limits, Proposal, Proposer
from specexport.runtime.tree import cut, from_rank_paths, tree_of


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2's dynamic tree: expand the best `top_k` candidates per level for `depth` levels, keep the
    `total_tokens` best (root excluded)."""
    top_k: int = 4
    depth: int = 5
    total_tokens: int = 15

    def __post_init__(self):
        for name in ("top_k", "depth", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"tree.{name}: expected an integer >= 1, got {value!r}")

    @property
    def scratch_rows(self) -> int:
        """Head cache rows a round's draft levels occupy beyond the committed text."""
        return (self.depth - 1) * self.top_k


class EagleTree(Proposer):
    role = "eagle"
    wants_features = True

    def __init__(self, head, tree, *, target_ids=None, feature_columns=None, feature_source: str = "hidden"):
        """head: an OrtEagleHead (or anything with its `draft` / commit / rollback); tree: a DynamicTree
        or rank paths; target_ids [Vd]: the target id of each draft id (None: the same ids);
        feature_columns: which columns of the target's states form the head's feature (EAGLE-3 over a
        target that exports its aux layers once each: a repeated layer's columns twice), None for all."""
        self.head = head
        self.feature_source = feature_source
        self.target_ids = None if target_ids is None else np.asarray(target_ids, np.int64)
        self.columns = None if feature_columns is None else np.asarray(feature_columns, np.int64)
        if isinstance(tree, DynamicTree):
            self.dynamic, self.tree, self.ranks = tree, None, None
            self.max_depth, self.max_nodes, scratch, widest = tree.depth, tree.total_tokens, tree.scratch_rows, tree.top_k
        else:
            self.dynamic = None
            self.tree, self.ranks = from_rank_paths(tree)
            self.max_depth, self.max_nodes = int(self.tree.depths.max()), self.tree.size - 1
            scratch = int(sum(1 for i in range(1, self.tree.size) if self.tree.children[i]))
            widest = int(self.ranks.max()) + 1
        self.check_width(widest, head.top_k)
        self.scratch = scratch
        self._plans = {}                    # (max depth, max nodes) -> a static tree's cut and levels
        self._feats = None                  # [capacity, F] the target's states by position
        self._count = 0                     # positions received

    @staticmethod
    def check_width(widest: int, top_k: int) -> None:
        if widest > top_k:
            raise ValueError(f"tree: needs each node's top {widest}; the head graph returns its top {top_k} "
                             f"(eagle.top_k in the model.yaml)")

    # -- the target's states ---------------------------------------------------------------------
    def features(self, hidden: np.ndarray, start: int) -> None:
        states = hidden if self.columns is None else hidden[:, self.columns]
        if self._feats is None:
            self._feats = np.zeros((self.head.capacity, states.shape[1]), np.float32)
        self._feats[start:start + len(states)] = states
        self._count = start + len(states)

    def begin(self, prompt: np.ndarray, prefill_chunk: int) -> None:
        """The head's rows for the prompt: row j reads token j + 1 with the feature of position j."""
        self.head.reset()
        self._catch_up(prompt, len(prompt), prefill_chunk, phase="prefill")

    def _catch_up(self, seq, n: int, chunk: int, phase: str = "decode", stats=None):
        """Run and commit the head rows up to N - 2; returns the last call's step (None when no row)."""
        head, step = self.head, None
        if self._count < n - 1:
            raise SpecexportError(f"EAGLE: the head needs the target's states of positions 0..{n - 2}, "
                                  f"it has {self._count}")
        while head.length < n - 1:
            lo = head.length
            hi = min(n - 1, lo + min(chunk, head.max_tokens))
            step = head.draft(seq[lo + 1:hi + 1], np.arange(lo, hi), features=self._feats[lo:hi],
                              last_only=hi == n - 1, phase=phase)
            head.commit(hi - lo)
            if stats is not None:
                stats.count_forward(self.role, hi - lo)
        return step

    # -- a round -----------------------------------------------------------------------------------
    def propose(self, seq, n, limits: Limits, params, rng, stats) -> Proposal:
        head = self.head
        if head.length >= n - 1:             # a round always emits, so the last one left rows to read
            raise SpecexportError(f"EAGLE head: its cache holds {head.length} rows; the accepted text has "
                                  f"{n - 1} (a draft level was kept)")
        step = self._catch_up(seq, n, head.max_tokens, stats=stats)
        if head.length + self.scratch > head.capacity:
            raise SpecexportError(f"EAGLE head: {head.length} cached rows + {self.scratch} draft rows exceed its "
                                  f"capacity {head.capacity}")
        root_ids, root_lp, root_hidden = step.ids[-1].copy(), step.logprobs[-1].copy(), step.hidden[-1].copy()
        stats.draft_passes += 1
        try:
            if self.dynamic is not None:
                parents, draft_ids, levels = self._dynamic(root_ids, root_lp, root_hidden, limits, stats)
            else:
                parents, draft_ids, levels = self._static(root_ids, root_hidden, limits, stats)
        finally:
            head.rollback(n - 1)             # forget every draft level: the cache holds the accepted text only
        stats.draft_passes += levels
        tokens = np.empty(len(parents), dtype=np.int64)                           # [T]
        tokens[0] = seq[n - 1]
        tokens[1:] = draft_ids[1:] if self.target_ids is None else self.target_ids[draft_ids[1:]]
        return Proposal(tree_of(parents), tokens)

    def _level(self, draft_ids, own, ancestors_rows, depth: int, base: int, stats):
        """Feed one level of nodes (their draft ids [m], their parents' states own [m, H], each node's
        ancestor rows) at position base + depth - 1; keep their rows cached for the next level. Returns
        the step and the first row the nodes were written to (the rest follow in order). The head reads
        target ids (it embeds with the target's table): a reduced vocabulary's draft ids are mapped first."""
        tokens = np.asarray(draft_ids, np.int64)
        if self.target_ids is not None:
            tokens = self.target_ids[tokens]
        head = self.head
        P = head.length
        past = np.zeros((len(tokens), P), bool)                                   # [m, P]
        past[:, :base] = True
        for i, rows in enumerate(ancestors_rows):
            past[i, rows] = True
        step = head.draft(tokens, np.full(len(tokens), base + depth - 1), own=own, past_mask=past)
        head.commit(len(tokens))
        stats.count_forward(self.role, len(tokens))
        return step, P

    def _dynamic(self, root_ids, root_lp, root_hidden, limits: Limits, stats):
        """EAGLE-2: (parents [T], draft ids [T] (root's unused), head calls after the catch-up)."""
        cfg, base = self.dynamic, self.head.length
        k = cfg.top_k
        depth = min(cfg.depth, limits.max_depth)
        total = min(cfg.total_tokens, limits.max_nodes)
        # candidates (index 0 = the root): draft id, cumulative log-prob, parent, depth, cache row, state
        ids, score, parent, level = [0], [0.0], [-1], [0]
        ids += root_ids[:k].tolist()
        score += root_lp[:k].astype(np.float64).tolist()
        parent += [0] * k
        level += [1] * k
        row, state = {0: None}, {0: root_hidden}
        frontier = list(range(1, k + 1))
        calls = 0
        for d in range(2, depth + 1):
            anc = [self._ancestor_rows(c, parent, row) for c in frontier]
            step, first = self._level([ids[c] for c in frontier], np.stack([state[parent[c]] for c in frontier]),
                                      anc, d - 1, base, stats)
            calls += 1
            hidden = step.hidden.copy()                 # the head's buffer is reused by the next call
            step_ids, step_lp = step.ids.tolist(), step.logprobs.tolist()      # [m, K] as Python numbers
            new = []
            for i, c in enumerate(frontier):
                row[c], state[c] = first + i, hidden[i]
                for r in range(k):
                    new.append(len(ids))
                    ids.append(step_ids[i][r])
                    score.append(score[c] + step_lp[i][r])
                    parent.append(c)
                    level.append(d)
            frontier = sorted(new, key=lambda c: -score[c])[:k]
        keep = _best_closed(score, parent, level, total)
        return _as_tree(keep, parent, level, ids) + (calls,)

    @staticmethod
    def _ancestor_rows(c, parent, row):
        rows, p = [], parent[c]
        while p > 0:
            rows.append(row[p])
            p = parent[p]
        return rows

    def _static(self, root_ids, root_hidden, limits: Limits, stats):
        """Rank paths: (parents [T], draft ids [T], head calls after the catch-up)."""
        tree, ranks, levels = self._static_plan(limits.max_depth, limits.max_nodes)
        base, T = self.head.length, tree.size
        ids = np.zeros(T, np.int64)
        rows = np.full(T, -1, np.int64)
        states = np.zeros((T, len(root_hidden)), np.float32)
        states[0] = root_hidden
        for c in tree.children[0]:
            ids[c] = root_ids[ranks[c]]
        for d, level, paths in levels:
            anc = [rows[path] for path in paths]
            step, first = self._level(ids[level], states[tree.parents[level]], anc, d, base, stats)
            for j, i in enumerate(level):
                rows[i], states[i] = first + j, step.hidden[j]
                for c in tree.children[i]:
                    ids[c] = step.ids[j, ranks[c]]
        return tree.parents, ids, len(levels)

    def _static_plan(self, max_depth: int, max_nodes: int):
        """The rank tree cut to a round's limits, and its levels to feed: (depth, nodes with children,
        each one's ancestors below the root); worked out once per limits (they repeat every round)."""
        key = (max_depth, max_nodes)
        plan = self._plans.get(key)
        if plan is None:
            tree, ranks = cut(self.tree, self.ranks, max_depth, max_nodes)
            levels = []
            for d in range(1, int(tree.depths.max())):
                level = [int(i) for i in np.flatnonzero(tree.depths == d) if tree.children[i]]
                if level:
                    levels.append((d, level, [tree.path_to(i)[1:-1] for i in level]))
            plan = self._plans[key] = (tree, ranks, levels)
        return plan


def feature_columns(target_layers, head_layers, hidden_size: int) -> np.ndarray | None:
    """Columns of the target's aux states [k*H] (its aux_hidden_layers, each once, ascending) that form
    an EAGLE-3 head's feature [3H] (its layers, low to high, a repeated layer repeated); None when they
    are the same. Example: target (1, 2), head (1, 2, 2), H 2 -> [0, 1, 2, 3, 2, 3]."""
    target_layers, head_layers = list(target_layers), list(head_layers)
    if target_layers == head_layers:
        return None
    missing = sorted(set(head_layers) - set(target_layers))
    if missing:
        raise SpecexportError(f"EAGLE-3 head reads layers {head_layers}; the target graph exports {target_layers} "
                              f"(rebuild it with the head in the model.yaml)")
    return np.concatenate([target_layers.index(layer) * hidden_size + np.arange(hidden_size) for layer in head_layers])


def _best_closed(score: list, parent: list, depth: list, total: int) -> list[int]:
    """The `total` best candidates by cumulative log-prob (ties: shallower first), each taken only once
    its parent is in, so the result is a tree (a child's log-prob sum never exceeds its parent's, up to
    rounding, which this guards against). Example: scores root 0, a -0.1, b -0.5, a's child -0.2,
    total 2 -> [a, a's child]. Python lists: a round's few candidates."""
    order = sorted(range(1, len(score)), key=lambda c: (-score[c], depth[c], c))
    chosen, inside = [], {0}
    for c in order:
        if c in inside or parent[c] not in inside:
            continue
        chosen.append(c)
        inside.add(c)
        if len(chosen) == total:
            break
    return chosen


def _as_tree(keep: list[int], parent: list, depth: list, ids: list):
    """Candidates -> (parents [T], ids [T]) in breadth-first order (root first, parents before children)."""
    rank = {c: i for i, c in enumerate(keep)}
    order = [0] + sorted(keep, key=lambda c: (depth[c], rank[c]))
    index = {c: i for i, c in enumerate(order)}
    parents = np.array([-1] + [index[parent[c]] for c in order[1:]], np.int64)
    return parents, np.array([ids[c] for c in order], np.int64)
