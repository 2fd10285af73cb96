"""Tree topology for verification: parents -> ancestor mask, depths, children.

A tree of T nodes is given by `parents` [T]: node 0 is the root (the last committed-but-unverified
token, parent -1) and every other node's parent has a smaller index, so index order is a valid
topological order and a root-to-node path is increasing. A chain of γ proposals is the tree
parents = [-1, 0, 1, ..., γ-1].

Worked example, a root with two children, the first of which has a child:
    parents = [-1, 0, 0, 1]
    depths  = [0, 1, 1, 2]            -> position ids = context length - 1 + depths
    ancestor_mask =
        [[1 0 0 0]
         [1 1 0 0]
         [1 0 1 0]
         [1 1 0 1]]                    row i: the nodes node i may attend to (itself and its ancestors)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Tree:
    parents: np.ndarray                              # [T] int64, parents[0] == -1
    depths: np.ndarray = field(init=False)           # [T] int64
    mask: np.ndarray = field(init=False)             # [T, T] bool ancestor-or-self mask
    children: tuple = field(init=False)              # children[i]: tuple of child indices, in order
    is_chain: bool = field(init=False)               # parents == [-1, 0, 1, ..., T-2]

    def __post_init__(self):
        parents = np.asarray(self.parents, dtype=np.int64)
        check_parents(parents)
        size = len(parents)
        mask = np.eye(size, dtype=bool)
        depths = [0] * size
        kids = [[] for _ in range(size)]
        for i, p in enumerate(parents.tolist()[1:], 1):        # Python ints: trees are built every round
            mask[i] |= mask[p]
            depths[i] = depths[p] + 1
            kids[p].append(i)
        if parents is self.parents:
            parents = parents.copy()                             # the caller's array stays theirs
        depths = np.asarray(depths, dtype=np.int64)
        for a in (parents, depths, mask):
            a.flags.writeable = False                            # trees are shared (chains, tree_of)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "mask", mask)
        object.__setattr__(self, "children", tuple(tuple(k) for k in kids))
        object.__setattr__(self, "is_chain", parents.tolist() == list(range(-1, size - 1)))

    @property
    def size(self) -> int:
        return len(self.parents)

    @classmethod
    def chain(cls, gamma: int) -> "Tree":
        """Root plus γ proposals in a line: parents [-1, 0, 1, ..., γ-1] (built once per γ)."""
        return _chain(gamma)

    def path_to(self, node: int) -> np.ndarray:
        """[depth + 1] node indices from the root to `node`. Example: tree above, node 3 -> [0, 1, 3]."""
        return np.flatnonzero(self.mask[node])


@functools.lru_cache(maxsize=64)
def _chain(gamma: int) -> Tree:
    return Tree(np.arange(-1, gamma, dtype=np.int64))


def tree_of(parents) -> Tree:
    """Tree(parents), built once per shape: proposers' trees repeat round after round."""
    parents = np.asarray(parents, dtype=np.int64)
    key = parents.tobytes()
    tree = _TREES.get(key)
    if tree is None:
        if len(_TREES) >= 4096:                                  # bounded: a dynamic tree's shapes vary
            _TREES.clear()
        tree = _TREES[key] = Tree(parents)
    return tree


_TREES: dict = {}


def check_parents(parents: np.ndarray) -> None:
    if parents.ndim != 1 or len(parents) == 0 or parents[0] != -1:
        raise ValueError(f"parents: expected a 1-D array starting with -1 (the root), got {parents!r}")
    if not all(0 <= p < i for i, p in enumerate(parents.tolist()[1:], 1)):
        raise ValueError(f"parents: every non-root node's parent must be a smaller index, got {parents!r}")


def from_rank_paths(paths) -> tuple[Tree, np.ndarray]:
    """A static tree written as Medusa's `medusa_choices`: each path (r_1, ..., r_d) is the node reached
    by taking the r_1-th most likely token at depth 1, then the r_2-th at depth 2, and so on. Returns
    (Tree with the root as node 0 and nodes in breadth-first order, ranks [T] with -1 for the root).

    Example: [(0,), (1,), (0, 0)] -> parents [-1, 0, 0, 1], ranks [-1, 0, 1, 0].
    Every prefix of a path must be a path too; ranks are integers >= 0; no path twice.
    """
    try:
        norm = [tuple(int(r) for r in p) for p in paths]
    except (TypeError, ValueError):
        raise ValueError(f"tree: expected a list of rank paths like [[0], [1], [0, 0]], got {paths!r}") from None
    if len(set(norm)) != len(norm) or any(not p or min(p) < 0 or max(p) >= 2 ** 31 for p in norm):
        raise ValueError(f"tree: rank paths must be distinct, non-empty and made of ranks in 0..2^31-1, got "
                         f"{str(paths)[:200]}")
    order = sorted(norm, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, ranks = [-1], [-1]
    for p in order:
        if p[:-1] not in index:
            raise ValueError(f"tree: path {list(p)} has no parent path {list(p[:-1])}")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    return Tree(np.asarray(parents, dtype=np.int64)), np.asarray(ranks, dtype=np.int64)


def cut(tree: Tree, ranks: np.ndarray, max_depth: int, max_nodes: int) -> tuple[Tree, np.ndarray]:
    """A static tree from `from_rank_paths` cut to a round's depth and node limits (root excluded from
    max_nodes). Breadth-first order keeps parents before children, so a prefix of the kept nodes is a
    tree; the tree itself is returned when nothing is cut. Each cut is made once (rounds repeat limits)."""
    key = (id(tree), id(ranks), max_depth, max_nodes)
    known = _CUTS.get(key)
    if known is not None and known[0] is tree and known[1] is ranks:
        return known[2]
    keep = np.flatnonzero(tree.depths <= max_depth)[:max_nodes + 1]
    if len(keep) == tree.size:
        out = tree, ranks
    else:
        out = tree_of(tree.parents[keep]), ranks[keep]
        out[1].flags.writeable = False                # shared by every round that makes this cut
    if len(_CUTS) >= 4096:
        _CUTS.clear()
    _CUTS[key] = (tree, ranks, out)                  # holds tree and ranks, so their ids stay theirs
    return out


_CUTS: dict = {}
