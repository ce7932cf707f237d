"""Tree shape of the model drafter: the node budget is spread so the tree reaches its depth."""

import pytest
import torch

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
