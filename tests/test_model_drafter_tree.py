"""The model drafter's trees: a sampled tree's node budget is spread so it reaches its depth, and its children follow
q; a greedy tree is dynamic (EAGLE-2): the most probable of the candidates it drafts."""

import pytest
import torch
from scipy.stats import chisquare

from specdec.drafters import DraftConfig, build_drafter
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from tests.tiny_models import tiny_llama


@pytest.mark.parametrize(("width", "depth", "budget"), [(2, 3, 6), (2, 4, 3), (3, 3, 0)])
def test_sampled_tree_reaches_its_depth_within_budget(width: int, depth: int, budget: int) -> None:
    params = SamplingParams(temperature=1.0)
    target = tiny_llama(seed=3, vocab_size=8)
    config = DraftConfig(num_draft_tokens=depth, tree_width=width, tree_budget=budget, tree_sampling="iid")
    drafter = build_drafter("early-exit", target, config, early_exit_layers=1)
    handle = drafter.open([1, 2, 3], params, torch.Generator().manual_seed(0))
    [proposal] = drafter.propose([handle], [100])
    tree = proposal.tree
    assert len(tree) == config.max_nodes
    assert tree.max_depth() == min(depth, config.max_nodes)
    assert all(len(tree.children(node)) <= width for node in range(-1, len(tree)))
    drafter.close(handle)


@pytest.mark.parametrize("scheme", ["iid", "without_replacement"])
def test_sampled_children_follow_the_truncated_draft_row(scheme: str) -> None:
    """Children are drawn among the nonzero entries of q (draft_top_k = 5 of 64 tokens): the first child of many
    sequences in the same context follows q's row (seeded chi-square); siblings stay in q's support, and without
    replacement they are distinct."""
    target = tiny_llama(seed=3, vocab_size=64)
    config = DraftConfig(num_draft_tokens=1, tree_width=3, tree_sampling=scheme, draft_top_k=5)
    drafter = build_drafter("early-exit", target, config, early_exit_layers=1)
    params = SamplingParams(temperature=1.0)
    handles = [drafter.open([1, 2, 3], params, torch.Generator().manual_seed(seed)) for seed in range(600)]
    proposals = drafter.propose(handles, [100] * len(handles))
    q = proposals[0].draft_probs[0]
    support = set(torch.nonzero(q).flatten().tolist())
    assert len(support) == 5
    firsts = torch.zeros(64)
    for proposal in proposals:
        assert torch.equal(proposal.draft_probs[0], q)
        children = proposal.tree.tokens
        assert set(children) <= support
        if scheme == "without_replacement":
            assert len(set(children)) == len(children) == 3
        firsts[children[0]] += 1
    ids = sorted(support)
    assert chisquare(firsts[ids].numpy(), (q[ids] / q[ids].sum() * len(proposals)).numpy()).pvalue > 1e-3
    for handle in handles:
        drafter.close(handle)


def _token_paths(tree: TokenTree) -> set[tuple[int, ...]]:
    return {tuple(tree.tokens[node] for node in tree.path_to(node)) for node in range(len(tree))}


def _greedy_trees(width: int, depth: int, budgets: list[int]) -> list[TokenTree]:
    """The greedy tree an early-exit drafter on a tiny target proposes for the same text at each of ``budgets``."""
    target = tiny_llama(seed=3, vocab_size=8)
    trees = []
    for budget in budgets:
        config = DraftConfig(num_draft_tokens=depth, tree_width=width, tree_budget=budget)
        drafter = build_drafter("early-exit", target, config, early_exit_layers=1)
        handle = drafter.open([1, 2, 3], SamplingParams(temperature=0.0), torch.Generator().manual_seed(0))
        [proposal] = drafter.propose([handle], [1000])
        trees.append(proposal.tree)
        drafter.close(handle)
    return trees


@pytest.mark.parametrize(("width", "depth", "budget"), [(2, 3, 6), (3, 4, 5), (2, 5, 4)])
def test_greedy_tree_keeps_budget_nodes_of_its_dynamic_candidates(width: int, depth: int, budget: int) -> None:
    """Drafted without a bound, a greedy tree expands at most ``width`` nodes a level, ``width`` children each, to its
    full depth; with a budget it proposes ``budget`` of those nodes (a tree: their ancestors are among them)."""
    candidates, kept = _greedy_trees(width, depth, [1000, budget])
    assert len(candidates) == width + (depth - 1) * width * width
    assert candidates.max_depth() == depth
    for level in range(depth - 1):
        nodes = [node for node in range(len(candidates)) if len(candidates.path_to(node)) == level + 1]
        expanded = [node for node in nodes if candidates.children(node)]
        assert len(expanded) == width and all(len(candidates.children(node)) == width for node in expanded)
    assert len(kept) == budget
    assert _token_paths(kept) <= _token_paths(candidates)


@pytest.mark.parametrize(("width", "depth"), [(2, 3), (3, 4)])
def test_a_smaller_budgets_greedy_tree_is_the_first_nodes_of_a_larger_ones(width: int, depth: int) -> None:
    """A greedy tree numbers its nodes by draft path probability, so the tree of each budget is the first nodes of
    every larger budget's (what lets ``auto`` cut a tree node by node) and the first node is the draft's top token."""
    trees = _greedy_trees(width, depth, list(range(1, width * depth + 1)))
    largest = trees[-1]
    assert len(largest) == width * depth and not largest.is_chain
    for budget, tree in enumerate(trees, start=1):
        assert tree.tokens == largest.tokens[:budget] and tree.parents == largest.parents[:budget], budget
    assert trees[0] == TokenTree.chain([largest.tokens[0]])
