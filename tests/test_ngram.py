"""Prompt-lookup drafting."""

import torch

from specdec.drafters import DraftConfig, NgramDrafter
from specdec.drafters.ngram import lookup_continuation
from specdec.sampling import SamplingParams


def test_longest_tail_most_recent_match() -> None:
    assert lookup_continuation([1, 2, 3, 9, 1, 2], 3, 1, 2) == [3, 9]
    # The 2-gram "4 5" beats the more recent 1-gram "5".
    assert lookup_continuation([4, 5, 6, 5, 7, 4, 5], 3, 1, 3) == [6, 5, 7]
    assert lookup_continuation([1, 2, 3], 3, 1, 4) == []
    assert lookup_continuation([7], 3, 1, 4) == []


def test_drafter_proposes_deterministic_chains_and_follows_commits() -> None:
    drafter = NgramDrafter(DraftConfig(num_draft_tokens=2))
    handle = drafter.open([1, 2, 3, 1], SamplingParams(), torch.Generator())
    [proposal] = drafter.propose([handle], [5])
    assert proposal.tree.tokens == (2, 3)
    assert proposal.tree.is_chain
    assert proposal.draft_probs is None
    drafter.commit(handle, [0], [2, 9])
    [proposal] = drafter.propose([handle], [1])
    assert proposal.tree.tokens == ()  # tail "9" never occurred before
    assert drafter.propose([handle], [0])[0].tree.tokens == ()
    drafter.close(handle)
    assert drafter.num_open == 0
