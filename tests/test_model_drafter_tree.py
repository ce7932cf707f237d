"""The model drafter's trees: the node budget is spread so they reach their depth; sampled children follow q."""

import pytest
import torch
from scipy.stats import chisquare

from specdec.drafters import DraftConfig, build_drafter
from specdec.sampling import SamplingParams
from tests.tiny_models import tiny_llama


@pytest.mark.parametrize(
    ("width", "depth", "budget", "params"),
    [
        (2, 3, 6, SamplingParams(temperature=0.0)),
        (3, 4, 0, SamplingParams(temperature=0.0)),
        (2, 3, 6, SamplingParams(temperature=1.0)),
        (2, 4, 3, SamplingParams(temperature=1.0)),
    ],
)
def test_tree_reaches_its_depth_within_budget(width: int, depth: int, budget: int, params: SamplingParams) -> None:
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
