"""Token trees: the one shape of every draft (a chain is a tree with one child per node).

Nodes are stored in topological order (a parent's index is smaller than its children's). The
parent index -1 means "child of the root", the root being the last token of the committed
sequence. Depths, children and paths are derived by the pure functions below (positions and attention
masks by :mod:`specdec.attention_masks`).

Worked example (used in the docstrings below)::

    tokens  = (5, 6, 7, 8)
    parents = (-1, -1, 0, 2)        # 5 and 6 hang off the root, 7 under 5, 8 under 7

    root ─┬─ 5 ── 7 ── 8
          └─ 6
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = -1
# The shape of a request that names none: the 4 most probable nodes of a tree 4 deep, 3 children under each of a
# level's 3 most probable nodes. Greedy, EAGLE-2's dynamic tree (co-located here 1.77x target-only against 1.70x for
# the chain of 4, bench/results/eagle-default-shape.md); sampled, or from a drafter of chains, the chain of 4.
DEFAULT_DEPTH = 4
DEFAULT_WIDTH = 3


def default_budget(tree_width: int, depth: int) -> int:
    """The node budget of a shape that names none: as many nodes as levels (0, the whole shape, for a chain)."""
    return depth if tree_width > 1 else 0


def grown_dynamically(tree_width: int, greedy: bool) -> bool:
    """Whether a model drafter grows a round's tree as EAGLE-2's dynamic tree (a greedy tree): one numbered by its
    draft's path probability, node i its (i+1)-th most probable, whose first b nodes are the tree a budget of b
    gets (:meth:`specdec.drafters.model.TreeDraft.select`)."""
    return greedy and tree_width > 1


def sampled_tree_is_chain(tree_width: int, tree_budget: int, depth: int) -> bool:
    """Whether a sampled tree of this shape is a chain: one spends its budget level by level, at least a node a level
    (:func:`specdec.drafters.model.grow_level`), so with a budget of at most its depth it is the chain of its budget.
    Planned as that chain, an adaptive round may cut it to any length, where it sends another tree whole or not at
    all."""
    return tree_width > 1 and 0 < tree_budget <= depth


@dataclass(frozen=True)
class TokenTree:
    """Candidate tokens and their parent links; see the module docstring."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents must have the same length")
        for index, parent in enumerate(self.parents):
            if not ROOT <= parent < index:
                raise ValueError(f"node {index} has parent {parent}; parents must precede children")

    @classmethod
    def chain(cls, tokens: list[int] | tuple[int, ...]) -> TokenTree:
        """A chain: ``chain([5, 7, 8]).parents == (-1, 0, 1)``."""
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def empty(cls) -> TokenTree:
        return cls((), ())

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """True when every node has exactly the previous node as parent."""
        return all(parent == index - 1 for index, parent in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node, 0 for children of the root: example → ``[0, 0, 1, 2]``."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent == ROOT else depths[parent] + 1)
        return depths

    def max_depth(self) -> int:
        """Number of levels (0 for an empty tree): example → 3."""
        return max(self.depths(), default=-1) + 1

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (``ROOT`` for the top level) in proposal order: example, ROOT → ``[0, 1]``."""
        return [index for index, parent in enumerate(self.parents) if parent == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the top level down to ``node`` inclusive: example, 3 → ``[0, 2, 3]``."""
        path: list[int] = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
