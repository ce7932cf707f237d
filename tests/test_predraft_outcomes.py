"""Multi-outcome pre-drafting and stopped (cancelled) drafts in the core drafters (``specdec.drafters.base``).

The invariant of ``test_drafter_sync`` extends to both: after a pre-draft for rejection verdicts and the ``sync`` that
selects one of them, or after a propose stopped mid-draft and the rollback that follows, a drafter proposes exactly
what a drafter opened fresh on the same text proposes (greedy: identical trees), and its runner leaks nothing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdec.drafters import DraftConfig, build_drafter
from specdec.drafters.base import ROOT, Rejection, SequenceDrafter, likely_rejections
from specdec.models import LoadedModel
from specdec.tree import TokenTree
from tests.test_drafter_sync import DRAFTERS, GREEDY, PROMPT, SAMPLED, assert_same_proposal, fresh_proposal
from tests.tiny_models import tiny_draft, tiny_llama

VOCAB = 16
NAMES = ["model-chain", "model-tree", "early-exit-chain"]


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=41, vocab_size=VOCAB, num_layers=2)


@pytest.fixture(scope="module")
def draft(target: LoadedModel) -> LoadedModel:
    return tiny_draft(target, seed=42, num_layers=1, noise=0.2)


def make(name: str, target: LoadedModel, draft: LoadedModel, outcomes: int) -> SequenceDrafter:
    kind, config = DRAFTERS[name]
    config = replace(config, predraft_outcomes=outcomes)
    return build_drafter(kind, target, config, draft_model=draft, early_exit_layers=1)


def test_likely_rejections_worked_example() -> None:
    tree = TokenTree((5, 6), (-1, 0))
    corrections = {ROOT: (7, 0.05), 0: (8, 0.3)}
    found = likely_rejections(tree, [0, 1], [0.9, 0.45], corrections, 2)
    assert found == (Rejection((0,), (5, 8)), Rejection((), (7,)))
    assert likely_rejections(tree, [0, 1], [0.9, 0.45], corrections, 1) == found[:1]
    assert likely_rejections(tree, [0, 1], [0.9, 0.45], {}, 3) == ()


@pytest.mark.parametrize("name", NAMES)
def test_a_selected_rejection_outcome_is_what_a_fresh_drafter_proposes(name: str, target, draft) -> None:
    drafter = make(name, target, draft, outcomes=3)
    single = make(name, target, draft, outcomes=1)
    for rank in range(2):
        handle = drafter.open(PROMPT, GREEDY, torch.Generator())
        [first] = drafter.propose([handle], [8])
        assert 1 <= len(first.rejections) <= min(2, len(first.assumed_path)) and first.assumed_path
        rank = min(rank, len(first.rejections) - 1)
        assert all(len(r.emitted) == len(r.accepted_path) + 1 for r in first.rejections)
        [outcomes] = drafter.pre_draft([handle], [8])
        drafter.assume_accepted(handle)
        [full] = drafter.propose([handle], [8])
        # the full-acceptance pre-draft is the single-outcome one
        reference = single.open(PROMPT, GREEDY, torch.Generator())
        single.propose([reference], [8])
        single.assume_accepted(reference)
        assert_same_proposal(full, single.propose([reference], [8])[0])
        single.close(reference)
        # every rejection outcome was drafted on its own text; the sync selects the chosen one
        emitted = list(first.rejections[rank].emitted)
        for index, rejection in enumerate(first.rejections):
            expected = fresh_proposal(drafter, PROMPT + list(rejection.emitted), GREEDY, 0, 8)
            assert_same_proposal(outcomes[index], expected)
        drafter.sync(handle, len(PROMPT), emitted)
        text = PROMPT + emitted
        assert drafter.text(handle) == text
        # the selected proposal is outstanding: commit a verdict of it, then propose as a fresh drafter would
        tree = outcomes[rank].tree
        path = tree.path_to(len(tree) - 1)[:1]
        verdict = [tree.tokens[node] for node in path] + [3]
        drafter.commit(handle, path, verdict)
        [after] = drafter.propose([handle], [8])
        assert_same_proposal(after, fresh_proposal(drafter, text + verdict, GREEDY, 0, 8))
        drafter.close(handle)
    assert drafter.runner_sequences == 0 and single.runner_sequences == 0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("stop_after", [0, 1])
def test_a_stopped_draft_leaves_nothing_outstanding_and_rolls_back(name: str, stop_after: int, target, draft) -> None:
    """A pre-draft stopped before its first forward or mid-draft; the miss's sync then rolls the sequence back."""
    drafter = make(name, target, draft, outcomes=2)
    handle = drafter.open(PROMPT, SAMPLED, torch.Generator().manual_seed(1))
    [first] = drafter.propose([handle], [8])
    drafter.pre_draft([handle], [8])
    drafter.assume_accepted(handle)
    checks = iter(range(100))
    [stopped] = drafter.propose([handle], [8], stop=lambda _: next(checks) >= stop_after)
    assert len(stopped.tree) == 0
    with pytest.raises(Exception, match="assume_previous_accepted"):
        drafter.assume_accepted(handle)  # nothing outstanding
    miss = [first.tree.tokens[0], (first.tree.tokens[1] + 1) % VOCAB] if len(first.tree) > 1 else [0]
    drafter.sync(handle, len(PROMPT), miss)
    greedy = make(name, target, draft, outcomes=2)
    state = greedy.open(PROMPT + miss, GREEDY, torch.Generator())
    drafter.close(handle)
    handle = drafter.open(PROMPT, GREEDY, torch.Generator())
    drafter.propose([handle], [8])
    drafter.assume_accepted(handle)
    drafter.propose([handle], [8], stop=lambda _: True)
    drafter.sync(handle, len(PROMPT), miss)
    assert_same_proposal(drafter.propose([handle], [8])[0], greedy.propose([state], [8])[0])
    drafter.close(handle)
    greedy.close(state)
    assert drafter.runner_sequences == 0


def test_one_outcome_drafts_no_rejections(target, draft) -> None:
    drafter = make("model-chain", target, draft, outcomes=1)
    handle = drafter.open(PROMPT, GREEDY, torch.Generator())
    [proposal] = drafter.propose([handle], [8])
    assert proposal.rejections == () and proposal.assumed_path == tuple(range(len(proposal.tree)))
    assert drafter.pre_draft([handle], [8]) == [[]]
    drafter.close(handle)


def test_predraft_outcomes_is_validated() -> None:
    with pytest.raises(ValueError, match="predraft_outcomes"):
        DraftConfig(predraft_outcomes=0)


@pytest.mark.parametrize("stop_after", [None, 0, 1])
def test_a_discarded_predraft_leaves_the_random_stream_as_it_found_it(stop_after: int | None, target, draft) -> None:
    """Seeded sampling is reproducible however far a pre-draft got before the miss that discards it."""
    proposals = []
    for predraft in (False, True):
        drafter = make("model-chain", target, draft, outcomes=2)
        handle = drafter.open(PROMPT, SAMPLED, torch.Generator().manual_seed(5))
        [first] = drafter.propose([handle], [8])
        if predraft:
            drafter.pre_draft([handle], [8])
            drafter.assume_accepted(handle)
            checks = iter(range(100))
            stop = None if stop_after is None else (lambda _, checks=checks: next(checks) >= stop_after)
            drafter.propose([handle], [8], stop=stop)
        drafter.sync(handle, len(PROMPT), [(first.tree.tokens[0] + 1) % VOCAB])  # a miss at the first token
        proposals.append(drafter.propose([handle], [8])[0])
        drafter.close(handle)
    assert_same_proposal(proposals[1], proposals[0])
