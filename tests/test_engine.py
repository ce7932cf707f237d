"""The co-located engine on tiny models: request validation, stop rules, speculation counters, state hygiene,
weight sharing of the early-exit drafter and seeded reproducibility (DESIGN §3, §7, §9)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from specdec.adaptive import SpeculationController
from specdec.drafters import DraftConfig, Proposal, build_drafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine, GenerationRequest, GenerationResult
from specdec.errors import InvalidArgumentError
from specdec.models import LoadedModel
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams, make_generator
from tests.controllers import CyclingController
from tests.tiny_models import tiny_draft, tiny_llama

VOCAB = 8
EOS = VOCAB - 1  # tiny_llama's EOS id
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)
PROMPTS = [[1, 2, 3, 1, 2], [4], [5, 5, 5, 5, 5, 5, 5, 5], [0, 6, 3], [2, 4, 6, 2, 4, 6, 2]]

# name -> (drafter kind, config)
DRAFTERS = {
    "none": ("none", DraftConfig()),
    "ngram": ("ngram", DraftConfig(num_draft_tokens=3)),
    "model": ("model", DraftConfig(num_draft_tokens=3)),
    "model-tree": ("model", DraftConfig(num_draft_tokens=2, tree_width=2, tree_budget=5)),
    "early-exit": ("early-exit", DraftConfig(num_draft_tokens=3)),
}
SPECULATIVE = [name for name in DRAFTERS if name != "none"]


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=21, vocab_size=VOCAB, num_layers=2)


@pytest.fixture(scope="module")
def draft(target: LoadedModel) -> LoadedModel:
    return tiny_draft(target, seed=22, num_layers=1, noise=0.2)


def make_engine(
    target: LoadedModel,
    draft: LoadedModel,
    name: str,
    *,
    max_seq_len: int | None = None,
    eos_token_ids: frozenset[int] | None = None,
) -> Engine:
    kind, config = DRAFTERS[name]
    drafter = build_drafter(kind, target, config, draft_model=draft, early_exit_layers=1)
    runner = KVRunner(target.model, max_seq_len=max_seq_len)
    return Engine(runner, target.eos_token_ids if eos_token_ids is None else eos_token_ids, drafter)


def assert_no_open_state(engine: Engine) -> None:
    assert engine.runner.num_open == 0, "runner sequences leaked"
    if engine.drafter is not None:
        assert engine.drafter.num_open == 0, "drafter sequences leaked"


# --- validation -----------------------------------------------------------------------------------------------

BAD_REQUESTS = {
    "empty prompt": (GenerationRequest([]), "prompt"),
    "token id = vocab size": (GenerationRequest([1, VOCAB]), "prompt"),
    "negative token id": (GenerationRequest([-1, 2]), "prompt"),
    "max_tokens 0": (GenerationRequest([1, 2], max_tokens=0), "max_tokens"),
    "max_tokens negative": (GenerationRequest([1, 2], max_tokens=-5), "max_tokens"),
    "prompt + max_tokens over context": (GenerationRequest(list(range(7)) * 2, max_tokens=3), "max_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_invalid_request_names_the_field(case: str, target, draft) -> None:
    request, field = BAD_REQUESTS[case]
    engine = make_engine(target, draft, "model", max_seq_len=16)
    good = GenerationRequest([1, 2, 3], max_tokens=4, seed=0)
    with pytest.raises(InvalidArgumentError) as raised:
        engine.generate([good, request])  # the bad request is second: nothing may be left open
    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: ")
    assert_no_open_state(engine)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_prompt_plus_max_tokens_may_fill_the_context_exactly(name: str, target, draft) -> None:
    engine = make_engine(target, draft, name, max_seq_len=16)
    requests = [GenerationRequest(list(range(7)) * 2, SAMPLED, max_tokens=2, seed=1, ignore_eos=True)]
    requests += [GenerationRequest([3] * 6, SAMPLED, max_tokens=10, seed=seed, ignore_eos=True) for seed in range(4)]
    for result in engine.generate(requests):
        assert result.finish_reason == "length"
    assert [len(result.token_ids) for result in engine.generate(requests)] == [2, 10, 10, 10, 10]
    assert_no_open_state(engine)


# --- stop rules ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_stops_at_the_first_eos(name: str, target, draft) -> None:
    """Declare a token the greedy continuation emits to be EOS: the output is cut right after its first use.

    The token chosen is the one whose first use comes latest, so the cut falls inside a speculative round.
    """
    reference_engine = make_engine(target, draft, "none")
    cuts = []
    for prompt in PROMPTS:
        [reference] = reference_engine.generate([GenerationRequest(prompt, GREEDY, 24, ignore_eos=True)])
        first = max(reference.token_ids.index(token) for token in set(reference.token_ids))
        stop_token = reference.token_ids[first]
        cuts.append(first)
        engine = make_engine(target, draft, name, eos_token_ids=frozenset({stop_token}))
        [stopped, ignored] = engine.generate(
            [GenerationRequest(prompt, GREEDY, 24), GenerationRequest(prompt, GREEDY, 24, ignore_eos=True)]
        )
        assert (stopped.token_ids, stopped.finish_reason) == (reference.token_ids[: first + 1], "stop")
        assert (ignored.token_ids, ignored.finish_reason) == (reference.token_ids, "length")
        assert_no_open_state(engine)
    assert max(cuts) >= 5, f"cuts at {cuts}: the test should stop some sequence after several rounds"


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_finish_reason_with_sampling(name: str, target, draft) -> None:
    """Seeded sampled runs: "stop" exactly when the last token is the first EOS, "length" at max_tokens."""
    engine = make_engine(target, draft, name)
    max_tokens = 10
    requests = [GenerationRequest(PROMPTS[seed % len(PROMPTS)], SAMPLED, max_tokens, seed=seed) for seed in range(40)]
    reasons = set()
    for result in engine.generate(requests):
        tokens = result.token_ids
        reasons.add(result.finish_reason)
        if result.finish_reason == "stop":
            assert 1 <= len(tokens) <= max_tokens and tokens[-1] == EOS and EOS not in tokens[:-1]
        else:
            assert result.finish_reason == "length"
            assert len(tokens) == max_tokens and EOS not in tokens
    assert reasons == {"stop", "length"}, "the seeds should exercise both outcomes"
    assert_no_open_state(engine)


# --- speculation counters ------------------------------------------------------------------------------------


def check_stats(result: GenerationResult, config: DraftConfig, speculative: bool, ignore_eos: bool) -> None:
    stats, tokens = result.stats, result.token_ids
    assert stats.rounds >= 1
    assert 0 <= stats.accepted_tokens <= stats.draft_tokens
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert len(stats.accepted_per_position) <= config.num_draft_tokens  # positions are depths, not tree nodes
    assert all(a >= b for a, b in zip(stats.accepted_per_position, stats.accepted_per_position[1:], strict=False))
    assert all(count <= stats.rounds for count in stats.accepted_per_position)
    assert stats.mean_accepted_length == pytest.approx(1 + stats.accepted_tokens / stats.rounds)
    assert stats.draft_s >= 0 and stats.verify_s >= 0 and stats.state_s >= 0
    if ignore_eos or result.finish_reason == "length":
        assert len(tokens) == stats.accepted_tokens + stats.rounds  # accepted drafts + one target token per round
    else:  # an accepted draft EOS ends its round before the target's own token
        assert len(tokens) in (stats.accepted_tokens + stats.rounds, stats.accepted_tokens + stats.rounds - 1)
    assert stats.draft_tokens <= stats.rounds * config.max_nodes
    if not speculative:
        assert (stats.rounds, stats.draft_tokens, stats.accepted_tokens) == (len(tokens), 0, 0)
        assert stats.accepted_per_position == [] and stats.mean_accepted_length == 1.0


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_stats_add_up(name: str, params: SamplingParams, target, draft) -> None:
    engine = make_engine(target, draft, name)
    _, config = DRAFTERS[name]
    speculative = name != "none"
    requests = [GenerationRequest(p, params, 30, seed=i, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    requests += [GenerationRequest(p, params, 30, seed=100 + i) for i, p in enumerate(PROMPTS)]
    results = engine.generate(requests)
    for request, result in zip(requests, results, strict=True):
        check_stats(result, config, speculative, request.ignore_eos)
    if config.tree_width > 1:  # draft_tokens counts every tree node, not only the depth
        rounds = sum(result.stats.rounds for result in results)
        assert sum(result.stats.draft_tokens for result in results) > rounds * config.num_draft_tokens
    if speculative:
        assert sum(result.stats.draft_tokens for result in results) > 0
        assert sum(result.stats.accepted_tokens for result in results) > 0, "no draft was ever accepted"
    assert_no_open_state(engine)


@pytest.mark.parametrize("name", SPECULATIVE)
def test_greedy_speculation_equals_target_only(name: str, target, draft) -> None:
    """The tiny-model version of tests/test_greedy_equality.py, over several batched prompts."""
    requests = [GenerationRequest(prompt, GREEDY, 40, ignore_eos=True) for prompt in PROMPTS]
    expected = [result.token_ids for result in make_engine(target, draft, "none").generate(requests)]
    got = [result.token_ids for result in make_engine(target, draft, name).generate(requests)]
    assert got == expected


# --- state hygiene --------------------------------------------------------------------------------------------


class SpyDrafter:
    """Delegates to ``inner``; records how many sequences each round drafts for and how many are open on the
    runner and on ``inner`` at that moment; raises on the ``fail_at``-th call of ``propose`` (0: never)."""

    def __init__(self, inner, runner: KVRunner, fail_at: int = 0) -> None:
        self.inner = inner
        self.runner = runner
        self.fail_at = fail_at
        self.calls = 0
        self.rounds: list[tuple[int, int, int]] = []  # (active handles, runner open, drafter open)

    @property
    def feature_width(self) -> int:
        return self.inner.feature_width

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.inner.feature_layers

    @property
    def feature_context(self) -> int:
        return self.inner.feature_context

    @property
    def lookup_min_match(self) -> int:
        return self.inner.lookup_min_match

    def open(self, prompt: list[int], params: SamplingParams, generator: torch.Generator) -> int:
        return self.inner.open(prompt, params, generator)

    def propose(self, handles: list[int], max_tokens: list[int]) -> list[Proposal]:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("drafter failed")
        self.rounds.append((len(handles), self.runner.num_open, self.inner.num_open))
        return self.inner.propose(handles, max_tokens)

    def commit(self, handle: int, accepted_path: list[int], emitted: list[int]) -> None:
        self.inner.commit(handle, accepted_path, emitted)

    def close(self, handle: int) -> None:
        self.inner.close(handle)


@pytest.mark.parametrize("name", SPECULATIVE)
def test_nothing_stays_open_after_a_failure_mid_generation(name: str, target, draft) -> None:
    inner = make_engine(target, draft, name).drafter
    runner = KVRunner(target.model)
    engine = Engine(runner, target.eos_token_ids, SpyDrafter(inner, runner, fail_at=3))
    with pytest.raises(RuntimeError, match="drafter failed"):
        engine.generate([GenerationRequest(prompt, SAMPLED, 20, seed=1) for prompt in PROMPTS])
    assert engine.runner.num_open == 0 and inner.num_open == 0
    # the same runner and drafter still serve the next request
    engine.drafter.fail_at = 0
    [result] = engine.generate([GenerationRequest(PROMPTS[0], GREEDY, 8, ignore_eos=True)])
    assert len(result.token_ids) == 8
    assert engine.runner.num_open == 0 and inner.num_open == 0


@pytest.mark.parametrize("name", SPECULATIVE)
def test_nothing_stays_open_after_many_requests(name: str, target, draft) -> None:
    engine = make_engine(target, draft, name)
    for batch in range(3):  # sequences end at different rounds (EOS or length) within each batch
        seeds = range(20 * batch, 20 * batch + 20)
        requests = [GenerationRequest(PROMPTS[i % len(PROMPTS)], SAMPLED, 1 + i % 9, seed=i) for i in seeds]
        results = engine.generate(requests)
        assert len({len(result.token_ids) for result in results}) > 1
        assert_no_open_state(engine)


@pytest.mark.parametrize("name", SPECULATIVE)
def test_finished_sequences_are_freed_before_the_next_round(name: str, target, draft) -> None:
    inner = make_engine(target, draft, name).drafter
    runner = KVRunner(target.model)
    spy = SpyDrafter(inner, runner)
    engine = Engine(runner, target.eos_token_ids, spy)
    requests = [GenerationRequest(PROMPTS[i % len(PROMPTS)], SAMPLED, 2 + 3 * i, seed=i) for i in range(6)]
    engine.generate(requests)
    assert spy.rounds[0][0] == len(requests) and spy.rounds[-1][0] < len(requests)
    for active, runner_open, drafter_open in spy.rounds:
        assert runner_open == drafter_open == active, spy.rounds
    assert runner.num_open == 0 and inner.num_open == 0


# --- early exit shares the target's weights ---------------------------------------------------------------------


def first_draft_row(drafter, prompt: list[int]) -> torch.Tensor:
    """q [V] of the first drafted token after ``prompt`` (temperature 1, untruncated)."""
    handle = drafter.open(prompt, SAMPLED, make_generator(0))
    try:
        [proposal] = drafter.propose([handle], [1])
    finally:
        drafter.close(handle)
    assert proposal.draft_probs is not None and len(proposal.tree) == 1
    return proposal.draft_probs[0]


def test_early_exit_runs_the_target_first_layers_and_its_output_head() -> None:
    """Edits to the target's weights beyond the exit layer leave the drafter's q as it was; edits before the exit
    and to the shared output head change it. (The drafter reads the weights when it is built: a CPU runner packs a
    copy of them, :mod:`specdec.linear`.)"""
    prompt = [1, 2, 3]

    def draft_row(edit: Callable[[torch.nn.Module], None]) -> torch.Tensor:
        target = tiny_llama(seed=31, vocab_size=VOCAB, num_layers=3)  # private: edited below
        with torch.no_grad():
            edit(target.model)
        config = DraftConfig(num_draft_tokens=1, draft_top_k=0)
        return first_draft_row(build_drafter("early-exit", target, config, early_exit_layers=1), prompt)

    before = draft_row(lambda model: None)
    after_exit = draft_row(lambda model: model.model.layers[2].mlp.down_proj.weight.mul_(3.0))
    torch.testing.assert_close(after_exit, before, atol=0, rtol=0)
    assert not torch.equal(draft_row(lambda model: model.model.layers[0].mlp.down_proj.weight.mul_(3.0)), before)
    zero_head = draft_row(lambda model: model.lm_head.weight.zero_())  # all logits 0: q uniform
    torch.testing.assert_close(zero_head, torch.full((VOCAB,), 1 / VOCAB))


# --- seeds ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_same_seed_same_output(name: str, target, draft) -> None:
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)
    request = GenerationRequest(PROMPTS[0], params, 24, seed=1234, ignore_eos=True)
    other = GenerationRequest(PROMPTS[2], params, 24, seed=99, ignore_eos=True)
    engine = make_engine(target, draft, name)
    [alone] = engine.generate([request])
    [again] = engine.generate([request])  # same engine, later call
    [fresh] = make_engine(target, draft, name).generate([request])  # new engine
    first, _, second = engine.generate([request, other, request])  # same seed twice in one batch
    assert alone.token_ids == again.token_ids == fresh.token_ids == first.token_ids == second.token_ids
    by_seed = engine.generate([GenerationRequest(PROMPTS[0], params, 24, seed=seed) for seed in range(8)])
    assert len({tuple(result.token_ids) for result in by_seed}) > 1, "the seed should matter"


def test_auto_learns_a_draft_levels_cost_only_from_a_draft_that_follows_a_drafting_round(
    target: LoadedModel, draft: LoadedModel
) -> None:
    """Co-located as through the router: a round's draft time teaches the level cost only when its sequence drafted
    the round before too (a draft after plain rounds also catches the drafter up on the tokens committed meanwhile)."""
    levels: list[int] = []

    class Recording(CyclingController):
        def observe_round(self, positions, forward_s, draft_levels, draft_s, other_s, rows=1, call_s=None) -> None:
            levels.append(draft_levels)
            super().observe_round(positions, forward_s, draft_levels, draft_s, other_s, rows, call_s)

    drafter = build_drafter("model", target, DraftConfig(num_draft_tokens=3), draft_model=draft)
    cycle = [0, 0, 2, 2, 0, 1, 1, 1]
    engine = Engine(KVRunner(target.model), frozenset(), drafter, Recording(lengths=cycle))
    [result] = engine.generate([GenerationRequest([1, 2, 3], SamplingParams(0.0), 24, ignore_eos=True)])
    assert len(levels) == result.stats.rounds
    chosen = [cycle[i % 8] for i in range(len(levels))]
    assert levels == [n if n and chosen[i - 1] else 0 for i, n in enumerate(chosen)]


def test_auto_measures_a_cut_dynamic_tree_as_it_prices_it(target: LoadedModel, draft: LoadedModel) -> None:
    """A greedy dynamic tree cut to its best two nodes cost its drafter two levels of the whole tree's rows, whatever
    shape the two make (a chain or two siblings): measured against that shape's own depth and rows, a round of two
    siblings charged its two levels' time to one, and ``auto`` learnt levels twice as dear as it prices them."""
    work: list[tuple[int, int]] = []

    class Recording(CyclingController):
        def observe_round(self, positions, forward_s, draft_levels, draft_s, other_s, rows=1, call_s=None) -> None:
            work.append((draft_levels, rows))
            super().observe_round(positions, forward_s, draft_levels, draft_s, other_s, rows, call_s)

    config = DraftConfig(num_draft_tokens=4, tree_width=2, tree_budget=8)
    drafter = build_drafter("model", target, config, draft_model=draft)
    engine = Engine(KVRunner(target.model), frozenset(), drafter, Recording(lengths=(2,)))
    for prompt in PROMPTS:  # one at a time: each round drafts for one sequence
        [result] = engine.generate([GenerationRequest(prompt, GREEDY, 16, ignore_eos=True)])
        assert result.stats.draft_tokens
    measured = [entry for entry in work if entry[0]]
    # two levels of the whole tree's two rows; one level where a request had room for one node only
    assert (2, 2) in measured and set(measured) <= {(2, 2), (1, 2)}


def test_auto_cuts_a_sampled_tree_that_is_a_chain(target: LoadedModel, draft: LoadedModel) -> None:
    """A sampled tree of 4 nodes in 4 levels is the chain of 4, so ``auto`` may cut it to 2 nodes, where it sends any
    other sampled tree whole (it would have drafted all 4 nodes every round)."""
    config = DraftConfig(num_draft_tokens=4, tree_width=3, tree_budget=4)
    drafter = build_drafter("model", target, config, draft_model=draft)
    engine = Engine(KVRunner(target.model), frozenset(), drafter, CyclingController(lengths=(2,)))
    request = GenerationRequest(PROMPTS[0], SamplingParams(temperature=0.7), 16, seed=3, ignore_eos=True)
    [result] = engine.generate([request])
    drafted = {size for size, rounds in enumerate(result.stats.rounds_per_draft_size) if rounds and size}
    assert 2 in drafted and drafted <= {1, 2}  # 1: a round near the end, with room for one token


class ReportedLookup(NgramDrafter):
    """An n-gram drafter whose chains are exactly an eagle drafter's prompt-lookup chains (tails of 2 to 8 tokens),
    reporting ``lookup_min_match`` (0: as a drafter whose rounds are all of one kind)."""

    def __init__(self, reported_min_match: int) -> None:
        super().__init__(DraftConfig(num_draft_tokens=4), max_ngram=8, min_ngram=2, vocab_size=VOCAB)
        self.lookup_min_match = reported_min_match


@pytest.mark.parametrize("reported_min_match", [2, 0])
def test_auto_plans_a_prompt_lookup_round_as_one(target: LoadedModel, reported_min_match: int) -> None:
    """Co-located as through the router: draft levels priced at a second each make the model's drafts never pay,
    but a round the drafter will propose a lookup chain in (the engine sees the text repeat a tail) costs no level,
    so the engine drafts that chain, longer than one token; unaware, it drafts only one-token probes. Either way
    the output is target-only greedy's."""
    controller = SpeculationController(4)
    for _ in range(8):
        controller.cost.draft_level.observe(1, 1.0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    request = GenerationRequest(prompt, SamplingParams(0.0), 24, ignore_eos=True)
    [result] = Engine(KVRunner(target.model), frozenset(), ReportedLookup(reported_min_match), controller).generate(
        [request]
    )
    [plain] = Engine(KVRunner(target.model), frozenset()).generate([request])
    assert result.token_ids == plain.token_ids
    longest = len(result.stats.rounds_per_draft_size) - 1
    assert longest > 1 if reported_min_match else longest <= 1
