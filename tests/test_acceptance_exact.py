"""The acceptance rule, exactly: DESIGN §3's worked example, and the exact law of one round.

Losslessness is proved by exhaustive enumeration in ``Fraction`` arithmetic (``tests/exact_law.py``): for
context-dependent toy target and draft models over 3-4 tokens, the law of a round's output extended by
target sampling to ``L`` tokens equals the target's own law of ``L`` tokens, with ``==``. Two wrong rules
(resampling from ``p``; the i.i.d. rule on siblings drawn without replacement) fail the same criterion.
The sampled implementation is tied to this law by tests/test_acceptance_statistical.py.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from specdec.acceptance import recovered_probs, verify_batched, verify_greedy, verify_reference
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.tree import TokenTree
from tests.exact_law import (
    acceptance_probs,
    accepted_mass,
    continue_with_target,
    greedy_model,
    random_model,
    residual,
    round_law,
    target_law,
)

A, B, C = 0, 1, 2
P = (Fraction(1, 2), Fraction(3, 10), Fraction(1, 5))
Q = (Fraction(3, 5), Fraction(1, 10), Fraction(3, 10))

TREES = {
    "width2-depth2": TokenTree((0,) * 6, (-1, -1, 0, 0, 1, 1)),
    "width3-depth2": TokenTree((0,) * 6, (-1, -1, -1, 0, 1, 2)),
    "irregular": TokenTree((0,) * 5, (-1, -1, 0, 0, 0)),
}


def test_worked_example_in_fractions() -> None:
    assert acceptance_probs(P, Q) == (Fraction(5, 6), 1, Fraction(2, 3))
    mass = accepted_mass(P, Q)
    assert mass == (Fraction(1, 2), Fraction(1, 10), Fraction(1, 5))
    assert sum(mass) == Fraction(4, 5)
    assert residual(P, Q) == (0, 1, 0)
    assert tuple(m + (1 - sum(mass)) * r for m, r in zip(mass, residual(P, Q), strict=True)) == P


def test_worked_example_replay() -> None:
    """Draft A, C, B; uniforms 0.7 (A), 0.9 (C); final draw 0.2: emit A, B; the draft B is discarded."""
    tree = TokenTree.chain([A, C, B])
    p = torch.tensor([[float(x) for x in P]] * 4)
    q = torch.tensor([[float(x) for x in Q]] * 3)
    assert recovered_probs(p[1].double(), q[1].double()).tolist() == [0.0, 1.0, 0.0]
    for unused in (0.0, 0.5, 0.999):
        uniforms = torch.tensor([0.7, 0.9, unused], dtype=torch.float64)
        verdict = verify_reference(tree, p, q, uniforms, 0.2, max_new_tokens=16)
        assert verdict.emitted == [A, B]
        assert verdict.accepted_path == [0]
        assert verdict.num_accepted == 1
        assert verdict.final_token_kind == "recovered"
        assert verdict.final_row == 1
        assert not verdict.finished
        batched = verify_batched(
            [tree], p[None], q[None], uniforms[None], torch.tensor([0.2]), max_new_tokens=[16], eos_token_ids=[()]
        )
        assert batched == [verdict]


def _assert_lossless(shape: TokenTree, target, draft, scheme: str = "iid", **stops) -> None:
    vocab = len(target(()))
    law = round_law(shape, target, draft, scheme, **stops)
    assert sum(law.values()) == 1
    length = shape.max_depth() + 1
    assert continue_with_target(law, target, length, **stops) == target_law(target, vocab, length, **stops)


def _mean_length(law) -> Fraction:
    return sum((len(sequence) * prob for sequence, prob in law.items()), Fraction(0))


@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_chain_round_is_lossless(gamma: int, seed: int) -> None:
    shape = TokenTree.chain([0] * gamma)
    target, draft = random_model(seed, 4), random_model(seed + 100, 4)
    _assert_lossless(shape, target, draft)
    assert _mean_length(round_law(shape, target, draft)) > 1 + Fraction(gamma, 4), "too few acceptances to prove much"


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("scheme", ["iid", "without_replacement"])
def test_tree_round_is_lossless(name: str, scheme: str) -> None:
    shape = TREES[name]
    target, draft = random_model(2, 3), random_model(3, 3, zeros=scheme == "iid")
    _assert_lossless(shape, target, draft, scheme)
    assert _mean_length(round_law(shape, target, draft, scheme)) > Fraction(3, 2)


@pytest.mark.parametrize(
    "shape",
    [TokenTree.chain([0, 1, 1]), TokenTree.chain([2, 2]), TokenTree((1, 0, 2, 1, 0), (-1, -1, -1, 0, 0))],
    ids=["chain3", "chain2", "tree"],
)
@pytest.mark.parametrize("scheme", ["iid", "without_replacement"])
def test_model_free_draft_is_lossless(shape: TokenTree, scheme: str) -> None:
    _assert_lossless(shape, random_model(4, 3), None, scheme)


@pytest.mark.parametrize("stops", [{"eos": {1}}, {"max_new_tokens": 2}, {"eos": {0, 2}, "max_new_tokens": 1}])
@pytest.mark.parametrize("shape", [TokenTree.chain([0, 0, 0]), TREES["width2-depth2"]], ids=["chain", "tree"])
def test_stop_rules_keep_the_round_lossless(stops: dict, shape: TokenTree) -> None:
    _assert_lossless(shape, random_model(5, 3), random_model(6, 3), **stops)


@pytest.mark.parametrize("shape", [TokenTree.chain([0, 0, 0]), TREES["width2-depth2"]], ids=["chain", "tree"])
def test_greedy_target_emits_its_argmax_path(shape: TokenTree) -> None:
    target = greedy_model(7, 3)
    law = round_law(shape, target, random_model(8, 3))
    assert len(target_law(target, 3, shape.max_depth() + 1)) == 1
    _assert_lossless(shape, target, random_model(8, 3))
    assert all(prob == 1 for prob in continue_with_target(law, target, shape.max_depth() + 1).values())


def test_wrong_rules_fail_the_criterion() -> None:
    """The criterion has teeth: resampling from ``p`` after a rejection, or the i.i.d. rule on siblings
    drawn without replacement, change the law."""
    shape = TREES["width2-depth2"]
    target, draft = random_model(2, 3), random_model(3, 3, zeros=False)
    expected = target_law(target, 3, 3)
    naive = round_law(TokenTree.chain([0, 0]), target, draft, naive=True)
    assert continue_with_target(naive, target, 3) != expected
    mismatched = round_law(shape, target, draft, "without_replacement", rule_scheme="iid")
    assert continue_with_target(mismatched, target, 3) != expected


def _one_hot_target(generator: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    return logits_to_probs(torch.randn(rows, vocab, generator=generator), SamplingParams(temperature=0))


@pytest.mark.parametrize("seed", range(5))
def test_greedy_is_the_one_hot_limit_of_the_rule(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    vocab = 3
    for _ in range(40):
        size = int(torch.randint(0, 7, (), generator=generator))
        parents = tuple(int(torch.randint(-1, i, (), generator=generator)) for i in range(size))
        tree = TokenTree(tuple(torch.randint(0, vocab, (size,), generator=generator).tolist()), parents)
        target = _one_hot_target(generator, size + 1, vocab)
        draft = torch.softmax(torch.randn(size, vocab, generator=generator), dim=-1)
        uniforms = torch.rand(size, generator=generator, dtype=torch.float64)
        draw = float(torch.rand((), generator=generator))
        greedy = verify_greedy(tree, target, max_new_tokens=8)
        assert verify_reference(tree, target, draft, uniforms, draw, max_new_tokens=8) == greedy
        assert verify_reference(tree, target, None, uniforms, draw, max_new_tokens=8) == greedy


def test_greedy_walks_the_matching_child() -> None:
    tree = TokenTree((5, 6, 7, 8), (-1, -1, 1, 1))
    target = torch.zeros(5, 10)
    target[0, 6] = target[2, 8] = target[4, 3] = 1.0
    verdict = verify_greedy(tree, target, max_new_tokens=8)
    assert verdict.accepted_path == [1, 3] and verdict.emitted == [6, 8, 3] and verdict.final_token_kind == "bonus"
    target[2, 8], target[2, 9] = 0.0, 1.0
    verdict = verify_greedy(tree, target, max_new_tokens=8)
    assert verdict.emitted == [6, 9] and verdict.final_token_kind == "recovered" and verdict.final_row == 2


def _always_accept_chain() -> tuple[TokenTree, torch.Tensor]:
    tree = TokenTree.chain([3, 1, 4])
    target = torch.zeros(4, 6)
    target[torch.arange(4), torch.tensor([3, 1, 4, 5])] = 1.0
    return tree, target


@pytest.mark.parametrize(
    ("eos", "limit", "emitted", "path", "kind", "finished"),
    [
        ((), 8, [3, 1, 4, 5], [0, 1, 2], "bonus", False),
        ((), 4, [3, 1, 4, 5], [0, 1, 2], "bonus", True),
        ((), 2, [3, 1], [0, 1], None, True),
        ((1,), 8, [3, 1], [0, 1], None, True),
        ((5,), 8, [3, 1, 4, 5], [0, 1, 2], "bonus", True),
        ((4, 1), 1, [3], [0], None, True),
    ],
)
def test_stop_rules_truncate_after_eos_or_budget(eos, limit, emitted, path, kind, finished) -> None:
    tree, target = _always_accept_chain()
    uniforms = torch.zeros(3)
    verdict = verify_reference(tree, target, None, uniforms, 0.5, max_new_tokens=limit, eos_token_ids=set(eos))
    assert (verdict.emitted, verdict.accepted_path, verdict.final_token_kind, verdict.finished) == (
        emitted,
        path,
        kind,
        finished,
    )
    assert verdict.num_accepted == len(path)
    assert verdict.final_row == (3 if kind else None)


def test_equal_distributions_never_reject() -> None:
    """``p == q``: every ratio is exactly 1, so the residual (0/0) is never formed."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 50, generator=generator), dim=-1)
    tokens = [int(torch.multinomial(probs[i], 1, generator=generator)) for i in range(5)]
    for _ in range(50):
        uniforms = torch.rand(5, generator=generator)
        verdict = verify_reference(TokenTree.chain(tokens), probs, probs[:5], uniforms, 0.3, max_new_tokens=9)
        assert verdict.accepted_path == [0, 1, 2, 3, 4] and verdict.final_token_kind == "bonus"


def test_residual_that_rounds_to_zero_falls_back_to_p() -> None:
    p = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    assert torch.equal(recovered_probs(p, p + 1e-17 * torch.tensor([1.0, 0.0, 1.0])), p)
    assert recovered_probs(p, torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)).tolist() == [0.0, 0.0, 1.0]


def test_invalid_inputs_are_rejected() -> None:
    tree, target = _always_accept_chain()
    draft = torch.full((3, 6), 1 / 6)
    draft[1, 1] = 0.0
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_reference(tree, target, draft, torch.zeros(3), 0.5, max_new_tokens=4)
    for trees in ([tree], [tree, TokenTree((1, 2), (-1, -1))]):  # the chain path, the tree path
        with pytest.raises(ValueError, match="draft probability 0"):
            verify_batched(
                trees,
                target.expand(len(trees), -1, -1),
                draft.expand(len(trees), -1, -1),
                torch.zeros(len(trees), 3),
                torch.zeros(len(trees)),
                max_new_tokens=[4] * len(trees),
                eos_token_ids=[()] * len(trees),
            )
    with pytest.raises(ValueError, match="scheme"):
        verify_reference(tree, target, None, torch.zeros(3), 0.5, max_new_tokens=4, scheme="top_k")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_new_tokens"):
        verify_reference(tree, target, None, torch.zeros(3), 0.5, max_new_tokens=0)
    with pytest.raises(ValueError, match="target_probs"):
        verify_reference(tree, target[:3], None, torch.zeros(3), 0.5, max_new_tokens=4)
    siblings = TokenTree((2, 2), (-1, -1))
    with pytest.raises(ValueError, match="repeats a sibling"):
        verify_reference(
            siblings, torch.eye(6)[:3], None, torch.ones(2) * 0.99, 0.5, max_new_tokens=4, scheme="without_replacement"
        )
