"""Positions and attention masks of one sequence's tokens in a speculative forward pass.

A forward over one sequence holds ``L`` committed positions (KV already cached), ``m`` pending tokens
(committed text whose KV does not exist yet) and a :class:`~specdec.tree.TokenTree` of ``N`` candidate
nodes whose top level hangs off the last pending token. Tokens are laid out as
``pending[0..m-1], node[0..N-1]``; their KV is written at slots ``L .. L+m+N-1``.

Worked example (used in the docstrings below): ``L = 2`` committed, pending ``(a, b)``, tree
``tokens = (5, 6, 7)``, ``parents = (-1, -1, 0)``::

    c0 c1 ── a ── b ─┬─ 5 ── 7
                     └─ 6
"""

from __future__ import annotations

import torch

from specdec.tree import ROOT, TokenTree


def packed_positions(prefix_len: int, num_pending: int, tree: TokenTree) -> list[int]:
    """Position ids of the pending tokens then the tree nodes.

    Pending token ``i`` sits at ``prefix_len + i``; node ``j`` at ``prefix_len + num_pending + depth(j)``.
    Example → ``[2, 3, 4, 4, 5]``.
    """
    base = prefix_len + num_pending
    return list(range(prefix_len, base)) + [base + depth for depth in tree.depths()]


def attention_mask(
    prefix_len: int, num_pending: int, tree: TokenTree, *, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Which keys each new token may attend to: True = visible.

    Committed keys are visible to every new token; pending tokens are causal among themselves; a tree
    node sees every pending token, its ancestors and itself, never its siblings or cousins; pending
    tokens never see the tree. Example (columns c0 c1 a b 5 6 7)::

        a  [1, 1, 1, 0, 0, 0, 0]
        b  [1, 1, 1, 1, 0, 0, 0]
        5  [1, 1, 1, 1, 1, 0, 0]
        6  [1, 1, 1, 1, 0, 1, 0]
        7  [1, 1, 1, 1, 1, 0, 1]

    Returns: bool tensor [m + N, prefix_len + m + N] on ``device``.
    """
    size = num_pending + len(tree)
    mask = torch.ones(size, prefix_len + size, dtype=torch.bool, device=device).tril_(prefix_len)
    if len(tree):
        start = prefix_len + num_pending
        mask[num_pending:, start:] = ancestor_mask(tree).to(device)
    return mask


def ancestor_mask(tree: TokenTree) -> torch.Tensor:
    """``mask[i, j]`` is True iff node ``j`` is node ``i`` or one of its ancestors: siblings and cousins never see
    each other. For the tree ``tokens = (5, 6, 7, 8)``, ``parents = (-1, -1, 0, 2)``::

        [[1, 0, 0, 0],
         [0, 1, 0, 0],
         [1, 0, 1, 0],
         [1, 0, 1, 1]]

    Returns: bool tensor [N, N].
    """
    mask = torch.eye(len(tree), dtype=torch.bool)
    for index, parent in enumerate(tree.parents):
        if parent != ROOT:
            mask[index] |= mask[parent]
    return mask
