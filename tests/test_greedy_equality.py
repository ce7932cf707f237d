"""Greedy equality on the real model (DESIGN §3 "What lossless promises").

In float32 on CPU, greedy output with speculation must equal greedy output without it, token for token.
SmolLM2-135M-Instruct, chat-templated prompts of several kinds, 64 new tokens each with EOS ignored so every
prompt really yields 64 tokens. The reference is target-only decoding (``--drafter none``), one prompt per
``generate`` call, on the same runner code; every drafter (n-gram, early exit, a draft model, trees) runs all
prompts in one batched call and must reproduce it. Target-only is also checked batched against alone, and
against Hugging Face ``generate(do_sample=False)`` as an independent implementation.

On a mismatch the message names the prompt, the first differing position and the target's logits there
(from a plain Hugging Face forward), so a float near-tie can be told apart from a bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.adaptive import SpeculationController
from specdec.cli import encode_prompt
from specdec.drafters import DraftConfig, build_drafter
from specdec.engine import Engine, GenerationRequest, GenerationResult
from specdec.models import LoadedModel
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams
from tests.controllers import CyclingController
from tests.eagle_heads import memorised_head
from tests.tiny_models import smollm2

pytestmark = pytest.mark.slow

MAX_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0)
EARLY_EXIT_LAYERS = 8

PROMPTS = {
    "code": "Write a Python function that checks whether a number is prime.",
    "rewrite": (
        "Rewrite this sentence three times, each time more formally: the cat sat on the mat and the cat was happy."
    ),
    "list": "List ten fruits, one per line, numbered.",
    "question": "What is the capital of France, and why is it famous?",
    "poem": "Write a short poem about the ocean at night.",
    "repeat": (
        "Repeat exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
    ),
    "arithmetic": "Explain step by step how to compute 17 times 23.",
    "json": "Give a JSON object describing a book with title, author and year.",
}

# name -> (drafter kind, draft config, draft is the target itself)
DRAFTERS = {
    "ngram": ("ngram", DraftConfig(num_draft_tokens=4), False),
    "early-exit": ("early-exit", DraftConfig(num_draft_tokens=3), False),
    "model": ("model", DraftConfig(num_draft_tokens=4), True),
    "model-tree": ("model", DraftConfig(num_draft_tokens=3, tree_width=2, tree_budget=6), True),
    "early-exit-tree": ("early-exit", DraftConfig(num_draft_tokens=3, tree_width=2, tree_budget=6), False),
    "eagle": ("eagle", DraftConfig(num_draft_tokens=4), False),
    "eagle-tree": ("eagle", DraftConfig(num_draft_tokens=3, tree_width=2, tree_budget=6), False),
}


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return smollm2()


@pytest.fixture(scope="module")
def prompts(target: LoadedModel) -> dict[str, list[int]]:
    return {name: encode_prompt(target, text, chat=True) for name, text in PROMPTS.items()}


def generate(
    target: LoadedModel,
    kind: str,
    config: DraftConfig,
    prompts: list[list[int]],
    head: Path | None = None,
    controller: SpeculationController | None = None,
) -> list[GenerationResult]:
    """Greedy, EOS ignored, all ``prompts`` in one ``Engine.generate`` call on a fresh runner (``controller``: the
    draft lengths adapt, speculation ``auto``)."""
    draft_model = str(head) if kind == "eagle" else target
    drafter = build_drafter(kind, target, config, draft_model=draft_model, early_exit_layers=EARLY_EXIT_LAYERS)
    engine = Engine(KVRunner(target.model), target.eos_token_ids, drafter, controller)
    requests = [GenerationRequest(ids, GREEDY, MAX_TOKENS, seed=0, ignore_eos=True) for ids in prompts]
    results = engine.generate(requests)
    assert engine.runner.num_open == 0
    for result in results:
        assert len(result.token_ids) == MAX_TOKENS and result.finish_reason == "length"
        # every round commits its accepted drafts plus exactly one target token
        assert len(result.token_ids) == result.stats.accepted_tokens + result.stats.rounds
    return results


@pytest.fixture(scope="module")
def target_only(target: LoadedModel, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """The reference: ``--drafter none``, each prompt alone."""
    reference = {}
    for name, ids in prompts.items():
        [result] = generate(target, "none", DraftConfig(), [ids])
        assert result.stats.rounds == MAX_TOKENS and result.stats.draft_tokens == 0
        reference[name] = result.token_ids
    return reference


@pytest.fixture(scope="module")
def eagle_head(target, prompts, target_only, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A head trained on the reference outputs themselves, so the eagle drafters accept often."""
    texts = [(prompts[name], target_only[name]) for name in prompts]
    return memorised_head(target, texts, tmp_path_factory.mktemp("eagle-head"))


def mismatch_report(target: LoadedModel, prompt: list[int], expected: list[int], got: list[int]) -> str | None:
    """None when equal; else the first differing position and the target's logits for both tokens there."""
    if got == expected:
        return None
    position = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    if position is None:
        return f"lengths differ: expected {len(expected)} tokens, got {len(got)}"
    with torch.inference_mode():
        logits = target.model(torch.tensor([prompt + expected[:position]])).logits[0, -1].float()
    want, have = expected[position], got[position]
    top2 = logits.topk(2).values
    return (
        f"first difference at generated position {position}: expected {want} "
        f"({target.tokenizer.decode([want])!r}, logit {logits[want].item():.6f}), got {have} "
        f"({target.tokenizer.decode([have])!r}, logit {logits[have].item():.6f}); "
        f"gap {abs(logits[want] - logits[have]).item():.3g}, HF top-2 gap {(top2[0] - top2[1]).item():.3g}"
    )


def assert_all_equal(
    target: LoadedModel,
    prompts: dict[str, list[int]],
    expected: dict[str, list[int]],
    got: dict[str, list[int]],
    label: str,
) -> None:
    reports = {name: mismatch_report(target, prompts[name], expected[name], got[name]) for name in prompts}
    failures = [f"{label}, prompt {name!r}: {report}" for name, report in reports.items() if report]
    assert not failures, "\n".join(failures)


def test_prompts_are_varied(prompts: dict[str, list[int]]) -> None:
    assert len(prompts) >= 8
    assert len({len(ids) for ids in prompts.values()}) >= 4, "a batch of different prompt lengths"


def test_target_only_batched_equals_alone(target, prompts, target_only) -> None:
    results = generate(target, "none", DraftConfig(), list(prompts.values()))
    got = {name: result.token_ids for name, result in zip(prompts, results, strict=True)}
    assert_all_equal(target, prompts, target_only, got, "target-only batched vs alone")


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_speculation_equals_target_only(name: str, target, prompts, target_only, request) -> None:
    kind, config, self_draft = DRAFTERS[name]
    head = request.getfixturevalue("eagle_head") if kind == "eagle" else None
    results = generate(target, kind, config, list(prompts.values()), head)
    got = {prompt: result.token_ids for prompt, result in zip(prompts, results, strict=True)}
    assert_all_equal(target, prompts, target_only, got, f"drafter {name} (batched) vs target-only (alone)")
    drafted = sum(result.stats.draft_tokens for result in results)
    assert drafted > 0, "the drafter never proposed anything: nothing was tested"
    if kind == "eagle":  # the memorised head must accept often, or the equality proved little
        accepted = sum(result.stats.accepted_tokens for result in results)
        assert accepted >= 0.3 * drafted, (accepted, drafted)
    if self_draft:
        # The draft is the target: its top child is the target's argmax (up to float noise), so a drafter whose
        # state did not follow the committed path would show up here even though the output stays exact.
        for prompt, result in zip(prompts, results, strict=True):
            stats = result.stats
            if config.tree_width == 1:
                assert stats.accepted_tokens >= 0.95 * stats.draft_tokens, (prompt, stats)
            else:
                assert stats.accepted_per_position[0] >= 0.95 * (stats.rounds - 1), (prompt, stats)


@pytest.mark.parametrize(
    ("drafter", "controller"), [("eagle", "cycling"), ("eagle-tree", "cycling"), ("model-tree", "measured")]
)
def test_auto_speculation_equals_target_only(drafter: str, controller: str, target, prompts, target_only, request):
    """Draft lengths that change every round (a fixed cycle through 0..4, or the real controller's choices from
    what it measures) leave greedy output unchanged."""
    kind, config, _ = DRAFTERS[drafter]
    head = request.getfixturevalue("eagle_head") if kind == "eagle" else None
    chooser = CyclingController() if controller == "cycling" else SpeculationController(config.num_draft_tokens)
    results = generate(target, kind, config, list(prompts.values()), head, chooser)
    got = {prompt: result.token_ids for prompt, result in zip(prompts, results, strict=True)}
    assert_all_equal(target, prompts, target_only, got, f"auto {drafter} ({controller}) vs target-only")
    for result in results:
        sizes = result.stats.rounds_per_draft_size
        assert sum(sizes) == result.stats.rounds
        if controller == "cycling":  # target-only rounds, and drafts of several sizes (a greedy tree cut by rank)
            assert sizes[0] > 0 and sum(count > 0 for count in sizes[1:]) >= 2


def test_target_only_matches_hugging_face_generate(target, prompts, target_only) -> None:
    got = {}
    for name, ids in prompts.items():
        input_ids = torch.tensor([ids])
        with torch.inference_mode():
            output = target.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),  # the prompt contains the pad id (<|im_end|>)
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=[],  # keep going after EOS, like ignore_eos (None would fall back to the model's)
                pad_token_id=target.tokenizer.pad_token_id,
            )
        got[name] = output[0, len(ids) :].tolist()
    assert_all_equal(target, prompts, got, target_only, "target-only vs Hugging Face generate")
