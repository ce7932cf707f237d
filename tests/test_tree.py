"""Token tree derivations on the module docstring's worked example."""

import pytest
import torch

from specdec.attention_masks import ancestor_mask, packed_positions
from specdec.tree import ROOT, TokenTree

EXAMPLE = TokenTree(tokens=(5, 6, 7, 8), parents=(-1, -1, 0, 2))


def test_depths_positions_children_and_paths() -> None:
    assert EXAMPLE.depths() == [0, 0, 1, 2]
    assert EXAMPLE.max_depth() == 3
    assert packed_positions(10, 0, EXAMPLE) == [10, 10, 11, 12]
    assert EXAMPLE.children(ROOT) == [0, 1]
    assert EXAMPLE.children(0) == [2]
    assert EXAMPLE.children(1) == []
    assert EXAMPLE.path_to(3) == [0, 2, 3]
    assert not EXAMPLE.is_chain


def test_ancestor_mask_hides_siblings_and_cousins() -> None:
    expected = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(ancestor_mask(EXAMPLE), expected)


def test_chain_is_a_tree_with_one_child_per_node() -> None:
    chain = TokenTree.chain([5, 7, 8])
    assert chain.parents == (-1, 0, 1)
    assert chain.is_chain
    assert torch.equal(ancestor_mask(chain), torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    assert packed_positions(4, 0, chain) == [4, 5, 6]
    assert len(TokenTree.empty()) == 0
    assert TokenTree.empty().max_depth() == 0


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-2,)])
def test_parents_must_precede_children(parents: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="parent"):
        TokenTree(tokens=tuple(range(len(parents))), parents=parents)
