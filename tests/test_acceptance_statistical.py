"""The sampled rule against the exact law: 100 000 seeded rounds per case, chi-square at significance 1e-3.

Drafts are sampled from the toy draft model of tests/exact_law.py (vectorised, ``torch.multinomial``), the
rule's uniforms come from a seeded ``torch.Generator`` and the rounds run through ``verify_batched`` (which
tests/test_acceptance_batched.py ties bit for bit to ``verify_reference``). The empirical law of the
emitted sequence must match ``round_law`` (proved lossless in tests/test_acceptance_exact.py): outcomes of
expected count < 5 are pooled into one cell; an outcome of probability 0 fails at once. Fixed seeds, so the
test is deterministic.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdec.acceptance import verify_batched
from specdec.tree import ROOT, TokenTree
from tests.exact_law import Law, Model, random_model, round_law

ROUNDS = 100_000
SIGNIFICANCE = 1e-3


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Many small tensor ops: intra-op threads only add overhead (and dominate on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _contexts(vocab: int, longest: int) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """All contexts up to ``longest`` tokens and ``extend[c, t]``, the index of context c followed by t."""
    contexts = [c for n in range(longest + 1) for c in itertools.product(range(vocab), repeat=n)]
    index = {c: i for i, c in enumerate(contexts)}
    extend = torch.tensor([[index.get((*c, t), -1) for t in range(vocab)] for c in contexts])
    return extend, contexts


def _table(model: Model, contexts: list[tuple[int, ...]]) -> torch.Tensor:
    return torch.tensor([[float(x) for x in model(c)] for c in contexts], dtype=torch.float64)


def _sample_rounds(
    shape: TokenTree, target: Model, draft: Model | None, scheme: str, vocab: int, generator: torch.Generator
) -> tuple[list[TokenTree], torch.Tensor, torch.Tensor | None]:
    """ROUNDS drafts for ``shape`` (its own tokens when ``draft`` is None) with their p and q rows."""
    size = len(shape)
    extend, contexts = _contexts(vocab, shape.max_depth())
    p_table = _table(target, contexts)
    q_table = None if draft is None else _table(draft, contexts)
    tokens = torch.tensor(shape.tokens, dtype=torch.long).repeat(ROUNDS, 1)
    parent_context = torch.zeros(ROUNDS, size, dtype=torch.long)
    node_context = torch.zeros(ROUNDS, size, dtype=torch.long)
    for node, parent in enumerate(shape.parents):
        if parent != ROOT:
            parent_context[:, node] = node_context[:, parent]
        if q_table is not None:
            q = q_table[parent_context[:, node]]
            if scheme == "without_replacement":
                for sibling in shape.children(parent):
                    if sibling < node:
                        q = q.scatter(1, tokens[:, sibling : sibling + 1], 0.0)
            tokens[:, node] = torch.multinomial(q, 1, generator=generator).squeeze(1)
        node_context[:, node] = extend[parent_context[:, node], tokens[:, node]]
    target_probs = torch.cat([p_table[torch.zeros(ROUNDS, 1, dtype=torch.long)], p_table[node_context]], dim=1)
    draft_probs = None if q_table is None else q_table[parent_context]
    trees = [TokenTree(tuple(row), shape.parents) for row in tokens.tolist()]
    return trees, target_probs, draft_probs


def _assert_same_law(counts: Counter, law: Law) -> None:
    assert set(counts) <= set(law), f"impossible outcomes emitted: {set(counts) - set(law)}"
    expected = {outcome: float(prob) * ROUNDS for outcome, prob in law.items()}
    big = [outcome for outcome, value in expected.items() if value >= 5]
    small = [outcome for outcome in expected if outcome not in big]
    observed = [counts[outcome] for outcome in big]
    predicted = [expected[outcome] for outcome in big]
    if small:
        observed.append(sum(counts[outcome] for outcome in small))
        predicted.append(sum(expected[outcome] for outcome in small))
    assert len(big) >= 8, "too few outcomes to test"
    assert chisquare(observed, predicted).pvalue > SIGNIFICANCE


CASES = {
    "chain-gamma3": (TokenTree.chain([0, 0, 0]), 4, "iid", True, {}),
    "tree-width2-depth2-iid": (TokenTree((0,) * 6, (-1, -1, 0, 0, 1, 1)), 3, "iid", True, {}),
    "tree-width3-depth2-without-replacement": (
        TokenTree((0,) * 7, (-1, -1, -1, 0, 0, 1, 2)),
        4,
        "without_replacement",
        True,
        {},
    ),
    "model-free-tree-with-stops": (
        TokenTree((1, 2, 0, 3, 2), (-1, -1, 0, 0, 1)),
        4,
        "iid",
        False,
        {"eos": {3}, "max_new_tokens": 3},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sampled_rounds_follow_the_exact_law(name: str) -> None:
    shape, vocab, scheme, with_draft_model, stops = CASES[name]
    seed = sorted(CASES).index(name)
    target = random_model(seed + 10, vocab)
    draft = random_model(seed + 20, vocab, zeros=scheme == "iid") if with_draft_model else None
    generator = torch.Generator().manual_seed(seed)
    trees, target_probs, draft_probs = _sample_rounds(shape, target, draft, scheme, vocab, generator)
    verdicts = verify_batched(
        trees,
        target_probs,
        draft_probs,
        torch.rand(ROUNDS, len(shape), generator=generator, dtype=torch.float64),
        torch.rand(ROUNDS, generator=generator, dtype=torch.float64),
        scheme=scheme,
        max_new_tokens=[stops.get("max_new_tokens", 1 << 30)] * ROUNDS,
        eos_token_ids=[stops.get("eos", ())] * ROUNDS,
    )
    counts = Counter(tuple(verdict.emitted) for verdict in verdicts)
    _assert_same_law(counts, round_law(shape, target, draft, scheme, **stops))
