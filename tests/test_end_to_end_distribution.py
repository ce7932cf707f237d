"""End to end: what the engine emits under speculation follows the target's exact sequence law.

A tiny random Llama target (vocabulary 5) and a related draft. The target's law of the first
``LENGTH`` generated tokens is enumerated exactly from the target model itself (every sequence,
one batched forward); the engine's empirical law over ``SAMPLES`` seeded requests must match it by
a chi-square test at significance 1e-3 (fixed seeds, so the test is deterministic).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from specdec.drafters import DraftConfig, build_drafter
from specdec.engine import Engine, GenerationRequest
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams, logits_to_probs
from tests.tiny_models import tiny_draft, tiny_llama

VOCAB = 5
LENGTH = 3
SAMPLES = 4000
PROMPT = [1, 2, 3, 1, 2]
SIGNIFICANCE = 1e-3


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=11, vocab_size=VOCAB, num_layers=2)


@pytest.fixture(scope="module")
def draft(target):
    return tiny_draft(target, seed=12, num_layers=1, noise=0.3)


def exact_law(
    target, params: SamplingParams, stop_at_eos: bool, prompt: list[int] = PROMPT
) -> dict[tuple[int, ...], float]:
    """P(first LENGTH tokens after ``prompt``) under the target, cut after the first EOS when ``stop_at_eos``."""
    sequences = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))
    inputs = torch.cat([torch.tensor(prompt).expand(len(sequences), -1), sequences], dim=1)
    with torch.inference_mode():
        logits = target.model(inputs.to(target.model.device)).logits[:, len(prompt) - 1 : -1].double().cpu()
    probs = logits_to_probs(logits, params).double()  # [S, LENGTH, V]
    seq_probs = probs.gather(-1, sequences.unsqueeze(-1)).squeeze(-1).prod(dim=-1)
    law: Counter = Counter()
    for sequence, prob in zip(sequences.tolist(), seq_probs.tolist(), strict=True):
        law[_outcome(sequence, target.eos_token_ids if stop_at_eos else frozenset())] += prob
    return dict(law)


def _outcome(tokens: list[int], eos: frozenset[int]) -> tuple[int, ...]:
    for index, token in enumerate(tokens[:LENGTH]):
        if token in eos:
            return tuple(tokens[: index + 1])
    return tuple(tokens[:LENGTH])


def sampled_law(engine: Engine, params: SamplingParams, max_tokens: int, stop_at_eos: bool, seed: int) -> Counter:
    eos = engine.eos_token_ids if stop_at_eos else frozenset()
    counts: Counter = Counter()
    for start in range(0, SAMPLES, 1000):
        requests = [
            GenerationRequest(PROMPT, params, max_tokens, seed=seed + index, ignore_eos=not stop_at_eos)
            for index in range(start, start + 1000)
        ]
        for result in engine.generate(requests):
            counts[_outcome(result.token_ids, eos)] += 1
    return counts


def assert_same_law(counts: Counter, law: dict[tuple[int, ...], float]) -> None:
    assert set(counts) <= {outcome for outcome, prob in law.items() if prob > 0}, "emitted an impossible sequence"
    samples = sum(counts.values())
    expected = {outcome: prob * samples for outcome, prob in law.items()}
    big = [outcome for outcome, value in expected.items() if value >= 5]
    observed = [counts[outcome] for outcome in big] + [samples - sum(counts[outcome] for outcome in big)]
    predicted = [expected[outcome] for outcome in big] + [samples - sum(expected[outcome] for outcome in big)]
    if predicted[-1] < 1e-6:
        observed, predicted = observed[:-1], predicted[:-1]
    total = sum(predicted)  # the law is computed in float32 softmaxes: rescale away rounding
    result = chisquare(observed, [value * sum(observed) / total for value in predicted])
    assert result.pvalue > SIGNIFICANCE, f"chi-square p = {result.pvalue:.2e} over {len(observed)} cells"


CASES = {
    "target-only": ("none", DraftConfig(), SamplingParams()),
    "chain-model": ("model", DraftConfig(num_draft_tokens=3), SamplingParams()),
    "chain-model-top-k-top-p": ("model", DraftConfig(num_draft_tokens=3), SamplingParams(top_k=3, top_p=0.9)),
    "tree-iid": ("model", DraftConfig(num_draft_tokens=2, tree_width=2, tree_sampling="iid"), SamplingParams()),
    "tree-without-replacement-top-p": (
        "model",
        DraftConfig(num_draft_tokens=2, tree_width=3, tree_budget=6, tree_sampling="without_replacement"),
        SamplingParams(top_p=0.8, temperature=0.8),
    ),
    "ngram": ("ngram", DraftConfig(num_draft_tokens=3), SamplingParams()),
    "early-exit-top-k": ("early-exit", DraftConfig(num_draft_tokens=3), SamplingParams(top_k=4)),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_speculation_follows_the_target_law(case: str, target, draft) -> None:
    kind, config, params = CASES[case]
    drafter = build_drafter(kind, target, config, draft_model=draft, early_exit_layers=1)
    engine = Engine(KVRunner(target.model), target.eos_token_ids, drafter)
    # Generate past LENGTH so full acceptance and bonus tokens happen inside the window.
    counts = sampled_law(engine, params, LENGTH + 3, stop_at_eos=False, seed=1000)
    assert_same_law(counts, exact_law(target, params, stop_at_eos=False))
    assert engine.runner.num_open == 0


def test_eos_and_length_cut_the_round(target, draft) -> None:
    params = SamplingParams()
    drafter = build_drafter("model", target, DraftConfig(num_draft_tokens=3), draft_model=draft)
    engine = Engine(KVRunner(target.model), target.eos_token_ids, drafter)
    counts = sampled_law(engine, params, LENGTH, stop_at_eos=True, seed=5000)
    assert_same_law(counts, exact_law(target, params, stop_at_eos=True))
