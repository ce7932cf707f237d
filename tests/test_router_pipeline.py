"""The router's round loop (router.pipeline) against in-memory workers that check the protocol.

The fake target is a deterministic greedy function of the context, so the exact output of every request is
known; the fake verifier applies the greedy rule to chains (with the deferred bonus of DESIGN §4) and the fake
drafter guesses, wrong at chosen positions, and follows ``Commit`` like a real one (``text[:base] + emitted``,
keeping a pre-drafted chain when the commit confirms what it assumed). Every case checks: output equal to the
target's own greedy continuation, finish reason, counters that add up, and no sequence or placement left open.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

import pytest

from router.errors import WorkerError, WorkerRejectedError, WorkerUnavailableError
from router.pipeline import Chunk, Commit, Drafted, Final, SequenceSpec, Session, Verified, derive_seed
from router.requests import DraftShape, Plan
from specdec.adaptive import SpeculationController
from specdec.lookup import LookupIndex
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from tests.controllers import CyclingController

VOCAB = 50
EOS = 49
PROMPT = (3, 1, 4, 1, 5)


def target_next(context: Sequence[int]) -> int:
    """The fake target's greedy token after ``context`` (never EOS unless the context says so)."""
    return (sum(context) * 7 + len(context) * 3) % (VOCAB - 1)


def reference(prompt: Sequence[int], max_tokens: int, eos: int | None = None) -> tuple[list[int], str]:
    text, out = list(prompt), []
    while len(out) < max_tokens:
        token = eos if eos is not None and len(out) == 7 else target_next(text)
        text.append(token)
        out.append(token)
        if token == eos:
            return out, "stop"
    return out, "length"


class FakeVerifier:
    """Greedy verification of chains; ``eos_at`` makes the target emit EOS as its 8th generated token."""

    def __init__(
        self,
        address: str = "verifier-0",
        eos_at_8: bool = False,
        fail_on_call: int = 0,
        next_token: Callable[[Sequence[int]], int] = target_next,
    ) -> None:
        self.address = address
        self.eos_at_8 = eos_at_8
        self.next_token = next_token
        self.fail_on_call = fail_on_call
        self.reject_proposals = False
        self.calls = 0
        self.sequences: dict[str, dict] = {}
        self.opened: list[str] = []

    def _fail(self) -> None:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise WorkerUnavailableError(self.address, "UNAVAILABLE", "injected failure")

    def _next(self, state: dict, emitted: list[int]) -> int:
        if self.eos_at_8 and state["generated"] + len(emitted) == 7:
            return EOS
        return self.next_token(state["text"] + emitted)

    async def open(self, sequence_id: str, spec: SequenceSpec, seed: int) -> None:
        self._fail()
        assert sequence_id not in self.sequences
        self.opened.append(sequence_id)
        self.sequences[sequence_id] = {
            "text": list(spec.prompt_ids),
            "generated": 0,
            "max_tokens": spec.max_tokens,
            "eos": set() if spec.ignore_eos else {EOS},
            "deferred": False,
        }

    async def verify(
        self, sequence_id: str, drafted: Drafted | None, *, defer_bonus: bool, stop_features: bool = False
    ) -> Verified:
        self._fail()
        await asyncio.sleep(0)
        state = self.sequences[sequence_id]
        if self.reject_proposals and drafted is not None:
            raise WorkerRejectedError(self.address, "INVALID_ARGUMENT", "proposal: malformed")
        chain = list(drafted.tree.tokens) if drafted else []
        assert drafted is None or drafted.tree.is_chain
        assert not (defer_bonus and not chain), "the router never defers the bonus of an empty proposal"
        emitted: list[int] = []
        finished = deferred = False

        def add(token: int) -> bool:
            emitted.append(token)
            return token in state["eos"] or state["generated"] + len(emitted) >= state["max_tokens"]

        accepted = 0
        for token in chain:
            expected = self._next(state, emitted)
            if token != expected:
                finished = add(expected)
                break
            accepted += 1
            if add(token):
                finished = True
                break
        else:
            last_allowed = state["generated"] + len(emitted) + 1 >= state["max_tokens"]
            if defer_bonus and not last_allowed:
                deferred = True
            else:
                finished = add(self._next(state, emitted))
        state["text"] += emitted
        state["generated"] += len(emitted)
        return Verified(tuple(range(accepted)), tuple(emitted), finished, deferred, (), 1000, 10)

    async def close(self, sequence_id: str) -> None:
        self.sequences.pop(sequence_id, None)


class SizedVerifier(FakeVerifier):
    """Says how many positions each forward held: this call's proposal and its pending token (``auto`` learns costs
    only from forwards the verifier sized)."""

    async def verify(self, sequence_id: str, drafted: Drafted | None, **options: bool) -> Verified:
        verified = await super().verify(sequence_id, drafted, **options)
        return replace(verified, forward_positions=1 + (len(drafted.tree) if drafted else 0))


class FakeDrafter:
    """Guesses the target's next tokens, wrong wherever ``wrong(context)``; follows Commit like a real drafter.

    Pre-drafts are cancelled like a real drafter's: a Commit's ``cancel_through`` fails every pre-draft numbered up to
    it that has not answered yet (``cancelled`` counts them, ``cancels`` lists the ids). With ``hold_predrafts`` a
    pre-draft answers only once cancelled (or closed): a router that waited for it on a miss would hang. With
    ``guess_rejections`` it pre-drafts like a multi-outcome drafter: each chain names up to two rejection verdicts
    (its wrong positions, corrected by an oracle), a pre-draft also drafts on each, and a Commit equal to one makes
    that chain the outstanding one.
    """

    feature_width = 0
    feature_layers = ()
    feature_context = 0
    lookup_min_match = 0
    kind = None

    def __init__(
        self,
        address: str = "drafter-0",
        wrong_every: int = 0,
        fail_on_call: int = 0,
        next_token: Callable[[Sequence[int]], int] = target_next,
    ) -> None:
        self.address = address
        self.wrong_every = wrong_every
        self.next_token = next_token
        self.fail_on_call = fail_on_call
        self.calls = 0
        self.sequences: dict[str, dict] = {}
        self.log: list[str] = []
        self.hold_predrafts = False
        self.guess_rejections = False
        self.cancelled = 0
        self.cancels: list[int] = []

    def _fail(self, name: str) -> None:
        self.calls += 1
        self.log.append(name)
        if self.calls == self.fail_on_call:
            raise WorkerUnavailableError(self.address, "DEADLINE_EXCEEDED", "injected failure")

    def _guess(self, context: list[int]) -> int:
        token = self.next_token(context)
        if self.wrong_every and len(context) % self.wrong_every == 0:
            return (token + 1) % (VOCAB - 1)
        return token

    async def open(self, sequence_id: str, spec: SequenceSpec, seed: int) -> None:
        self._fail("open")
        assert sequence_id not in self.sequences
        self.sequences[sequence_id] = {
            "text": list(spec.prompt_ids),
            "outstanding": None,
            "gamma": spec.shape.num_draft_tokens,
            "cancelled_through": 0,
            "rejections": (),
            "alternatives": {},
            "alternatives_base": -1,
        }

    async def propose(
        self,
        sequence_id: str,
        max_tokens: int,
        *,
        assume_previous_accepted: bool,
        commit: Commit | None = None,
        propose_id: int = 0,
    ) -> Drafted:
        if commit is not None:
            await self.commit(sequence_id, *commit)
        self._fail("propose-assume" if assume_previous_accepted else "propose")
        await asyncio.sleep(0)
        while self.hold_predrafts and assume_previous_accepted and not self._cancelled(sequence_id, propose_id):
            await asyncio.sleep(0.001)
        if self._cancelled(sequence_id, propose_id):
            self.cancelled += 1
            raise WorkerUnavailableError(self.address, "CANCELLED", "cancelled by a Commit")
        state = self.sequences[sequence_id]
        assert max_tokens >= 1
        outcomes: list[Drafted] = []
        if assume_previous_accepted:
            assert state["outstanding"] is not None, "assume needs an outstanding proposal"
            state["alternatives"], state["alternatives_base"] = {}, len(state["text"])
            for emitted in state["rejections"]:
                alternative = self._draft(state, state["text"] + list(emitted), max_tokens)
                state["alternatives"][emitted] = alternative.payload
                outcomes.append(alternative)
            state["text"] = state["text"] + state["outstanding"]
        drafted = self._draft(state, state["text"], max_tokens)
        state["outstanding"], state["rejections"] = list(drafted.payload), drafted.rejections
        return replace(drafted, outcomes=tuple(outcomes))

    def _draft(self, state: dict, text: list[int], max_tokens: int) -> Drafted:
        chain: list[int] = []
        for _ in range(min(state["gamma"], max_tokens)):
            chain.append(self._guess(text + chain))
        rejections = []
        for index, token in enumerate(chain):
            truth = self.next_token(text + chain[:index])
            if self.guess_rejections and truth != token and len(rejections) < 2:
                rejections.append((*chain[:index], truth))
        path = tuple(range(len(chain)))
        return Drafted(TokenTree.chain(chain), tuple(chain), 500, 8 * len(chain), path, tuple(rejections))

    def _cancelled(self, sequence_id: str, propose_id: int) -> bool:
        state = self.sequences.get(sequence_id)
        return state is None or 0 < propose_id <= state["cancelled_through"]

    async def commit(
        self,
        sequence_id: str,
        base_length: int,
        emitted: Sequence[int],
        features: object | None = None,
        cancel_through: int = 0,
    ) -> None:
        self._fail("commit")
        state = self.sequences[sequence_id]
        state["cancelled_through"] = max(state["cancelled_through"], cancel_through)
        if cancel_through:
            self.cancels.append(cancel_through)
        assert base_length <= len(state["text"])
        new_text = state["text"][:base_length] + list(emitted)
        alternatives, state["alternatives"] = state["alternatives"], {}
        alternative = alternatives.get(tuple(emitted)) if base_length == state["alternatives_base"] else None
        if new_text != state["text"]:
            state["text"], state["outstanding"], state["rejections"] = new_text, None, ()
        if alternative is not None:
            state["outstanding"] = list(alternative)
            state["rejections"] = self._draft(state, new_text, len(alternative)).rejections

    async def close(self, sequence_id: str) -> None:
        self.sequences.pop(sequence_id, None)


class FakePlacement:
    def __init__(self, verifiers: list[FakeVerifier], drafters: list[FakeDrafter]) -> None:
        self.verifiers = verifiers
        self.drafters = drafters
        self.outstanding: dict[str, int] = {}
        self.failed: list[str] = []

    def _acquire(self, workers, exclude: Collection[str]):
        for worker in workers:
            if worker.address not in exclude and worker.address not in self.failed:
                self.outstanding[worker.address] = self.outstanding.get(worker.address, 0) + 1
                return worker
        return None

    def acquire_verifier(self, exclude: Collection[str]) -> FakeVerifier | None:
        return self._acquire(self.verifiers, exclude)

    def acquire_drafter(self, kind: str | None, exclude: Collection[str]) -> FakeDrafter | None:
        return self._acquire(self.drafters, exclude)

    def release(self, worker) -> None:
        self.outstanding[worker.address] -= 1
        assert self.outstanding[worker.address] >= 0

    def report_failure(self, worker, error: WorkerError) -> None:
        self.failed.append(worker.address)


def make_plan(mode: str, max_tokens: int = 40, gamma: int = 4, ignore_eos: bool = True) -> Plan:
    return Plan(
        prompt_ids=PROMPT,
        sampling=SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        seed=7,
        stop=(),
        ignore_eos=ignore_eos,
        logprobs=False,
        mode=mode,  # type: ignore[arg-type]
        drafter_kind=None,
        shape=DraftShape(gamma),
        eos_token_ids=frozenset() if ignore_eos else frozenset({EOS}),
    )


def run(plan: Plan, placement: FakePlacement) -> tuple[list[int], Final, list[Chunk]]:
    chunks: list[Chunk] = []

    async def emit(chunk: Chunk) -> None:
        chunks.append(chunk)

    final = asyncio.run(Session(plan, placement, emit, sequence_id="seq").run())
    tokens = [token for chunk in chunks for token in chunk.token_ids]
    return tokens, final, chunks


def assert_clean(placement: FakePlacement) -> None:
    for worker in [*placement.verifiers, *placement.drafters]:
        assert worker.sequences == {}, f"{worker.address} left sequences open"
    assert all(count == 0 for count in placement.outstanding.values()), placement.outstanding


def check_stats(final: Final, tokens: list[int], mode: str, finish_reason: str = "length") -> None:
    stats = final.stats
    assert final.finish_reason == finish_reason
    assert final.completion_tokens == len(tokens) and final.prompt_tokens == len(PROMPT)
    assert sum(stats.accepted_per_position) == stats.accepted_tokens <= stats.draft_tokens
    if finish_reason == "length":  # every round emits its accepted tokens plus one, except a deferred bonus
        deferred = stats.pipeline_hits - stats.pipeline_rejection_hits
        assert len(tokens) == stats.accepted_tokens + stats.rounds - deferred
    if mode not in ("pipelined", "auto"):
        assert stats.pipeline_hits == stats.pipeline_misses == 0
    if mode == "off":
        assert stats.draft_tokens == 0 and stats.rounds == len(tokens)


@pytest.mark.parametrize("mode", ["off", "sequential", "pipelined"])
@pytest.mark.parametrize("wrong_every", [0, 2, 3, 5])
@pytest.mark.parametrize("gamma", [1, 4])
def test_output_is_the_targets_greedy_continuation(mode: str, wrong_every: int, gamma: int) -> None:
    placement = FakePlacement([FakeVerifier()], [FakeDrafter(wrong_every=wrong_every)])
    tokens, final, _ = run(make_plan(mode, gamma=gamma), placement)
    expected, _ = reference(PROMPT, 40)
    assert tokens == expected
    check_stats(final, tokens, mode)
    assert_clean(placement)
    stats = final.stats
    if mode != "off":
        assert stats.draft_tokens > 0 and stats.draft_ns > 0 and stats.wire_bytes > 0
        assert not stats.drafter_fallback
    if mode == "pipelined" and wrong_every == 0:
        assert stats.pipeline_hits > 0 and stats.pipeline_misses == 0
    if mode == "pipelined" and wrong_every in (2, 3) and gamma == 4:
        assert stats.pipeline_misses > 0


def test_pipelined_calls_overlap_and_commit_confirms_the_assumption() -> None:
    """With a perfect drafter: Propose(assume) follows each Verify; after a hit, Commit comes before the next one."""
    drafter = FakeDrafter()
    placement = FakePlacement([FakeVerifier()], [drafter])
    tokens, final, _ = run(make_plan("pipelined", max_tokens=30), placement)
    assert tokens == reference(PROMPT, 30)[0]
    assert drafter.log[:3] == ["open", "propose", "propose-assume"]
    assert "commit" in drafter.log
    assert final.stats.pipeline_hits >= 4
    # the rounds after a hit verify the pre-drafted chain: fewer plain proposals than rounds
    assert drafter.log.count("propose") < final.stats.rounds


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
def test_eos_stops_with_reason_stop(mode: str) -> None:
    placement = FakePlacement([FakeVerifier(eos_at_8=True)], [FakeDrafter(wrong_every=3)])
    tokens, final, _ = run(make_plan(mode, ignore_eos=False), placement)
    expected, reason = reference(PROMPT, 40, eos=EOS)
    assert (tokens, final.finish_reason) == (expected, reason) == (expected, "stop")
    assert_clean(placement)


def test_eos_as_the_last_allowed_token_is_stop() -> None:
    placement = FakePlacement([FakeVerifier(eos_at_8=True)], [FakeDrafter()])
    tokens, final, _ = run(make_plan("pipelined", max_tokens=8, ignore_eos=False), placement)
    assert tokens[-1] == EOS and len(tokens) == 8 and final.finish_reason == "stop"


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
@pytest.mark.parametrize("fail_on_call", range(1, 12))
def test_a_failing_drafter_never_fails_the_request(mode: str, fail_on_call: int) -> None:
    """The drafter fails at its n-th call (open, propose, assume, commit): same output, fallback noted."""
    drafter = FakeDrafter(wrong_every=3, fail_on_call=fail_on_call)
    placement = FakePlacement([FakeVerifier()], [drafter])
    tokens, final, _ = run(make_plan(mode, max_tokens=30), placement)
    assert tokens == reference(PROMPT, 30)[0]
    assert final.stats.drafter_fallback
    assert placement.failed == [drafter.address]
    check_stats(final, tokens, mode)
    assert_clean(placement)


class OpenLoggingDrafter(FakeDrafter):
    """Also logs the text each sequence was opened on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.opened_on: list[tuple[int, ...]] = []

    async def open(self, sequence_id: str, spec: SequenceSpec, seed: int) -> None:
        self.opened_on.append(spec.prompt_ids)
        await super().open(sequence_id, spec, seed)


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
@pytest.mark.parametrize("fail_on_call", [1, 2, 4, 7])
def test_a_failed_drafter_is_replaced_by_another_of_its_kind_on_the_committed_text(
    mode: str, fail_on_call: int
) -> None:
    """A drafter failing mid-request used to drop speculation for the rest of it, another healthy one or not."""
    failing = FakeDrafter("drafter-0", wrong_every=3, fail_on_call=fail_on_call)
    spare = OpenLoggingDrafter("drafter-1", wrong_every=3)
    placement = FakePlacement([FakeVerifier()], [failing, spare])
    tokens, final, _ = run(make_plan(mode, max_tokens=30), placement)
    assert tokens == reference(PROMPT, 30)[0]
    assert not final.stats.drafter_fallback and placement.failed == ["drafter-0"]
    [text] = spare.opened_on  # opened once, on the prompt and the tokens committed before the failure
    assert text[: len(PROMPT)] == PROMPT and list(text[len(PROMPT) :]) == tokens[: len(text) - len(PROMPT)]
    assert "propose" in spare.log[1:]  # and it drafted for the rest of the request
    check_stats(final, tokens, mode)
    assert_clean(placement)


class OpenLoggingVerifier(FakeVerifier):
    """Also logs the text and the features flag each sequence was opened with."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.opened_with: list[tuple[tuple[int, ...], bool]] = []

    async def open(self, sequence_id: str, spec: SequenceSpec, seed: int) -> None:
        self.opened_with.append((spec.prompt_ids, spec.features))
        await super().open(sequence_id, spec, seed)


def test_a_replacement_drafter_that_drafts_from_features_gets_a_fresh_verifier_sequence() -> None:
    """The target's feature rows of the text so far went to the failed drafter: the verifier re-prefills the committed
    text in a new sequence, which sends its rows from position 0, for the replacement."""
    failing, spare = FakeDrafter("drafter-0", fail_on_call=4), OpenLoggingDrafter("drafter-1")
    failing.feature_width = spare.feature_width = 16
    verifier = OpenLoggingVerifier()
    placement = FakePlacement([verifier], [failing, spare])
    tokens, final, _ = run(make_plan("pipelined", max_tokens=30), placement)
    assert tokens == reference(PROMPT, 30)[0]
    assert not final.stats.drafter_fallback and verifier.opened == ["seq", "seq.1"]
    (first, first_features), (again, again_features) = verifier.opened_with
    assert first == PROMPT and first_features and again_features and spare.opened_on == [again]
    assert len(again) > len(PROMPT) and list(again[len(PROMPT) :]) == tokens[: len(again) - len(PROMPT)]
    assert_clean(placement)


def test_a_refused_proposal_drops_the_drafter() -> None:
    verifier = FakeVerifier()
    verifier.reject_proposals = True
    placement = FakePlacement([verifier], [FakeDrafter()])
    tokens, final, _ = run(make_plan("pipelined", max_tokens=12), placement)
    assert tokens == reference(PROMPT, 12)[0]
    assert final.stats.drafter_fallback and final.stats.draft_tokens == 0
    assert_clean(placement)


@pytest.mark.parametrize("mode", ["off", "sequential", "pipelined"])
@pytest.mark.parametrize("fail_on_call", [1, 2, 5])
def test_a_failed_verifier_is_replaced_with_a_re_prefill(mode: str, fail_on_call: int) -> None:
    first, second = FakeVerifier("verifier-0", fail_on_call=fail_on_call), FakeVerifier("verifier-1")
    placement = FakePlacement([first, second], [FakeDrafter(wrong_every=3)])
    tokens, final, _ = run(make_plan(mode, max_tokens=30), placement)
    assert tokens == reference(PROMPT, 30)[0]
    assert placement.failed == ["verifier-0"] and second.opened
    if fail_on_call > 1:  # re-prefilled on prompt + output so far, under a new sequence id
        assert second.opened[0] == "seq.1"
    assert not final.stats.drafter_fallback
    assert_clean(placement)


@pytest.mark.parametrize("fail_on_call", [1, 3])
def test_a_failed_verifier_without_replacement_fails_the_request(fail_on_call: int) -> None:
    placement = FakePlacement([FakeVerifier(fail_on_call=fail_on_call)], [FakeDrafter()])
    with pytest.raises(WorkerUnavailableError):
        run(make_plan("pipelined"), placement)
    assert_clean(placement)


def test_cancel_closes_both_sequences() -> None:
    verifier, drafter = FakeVerifier(), FakeDrafter()
    placement = FakePlacement([verifier], [drafter])

    async def main() -> None:
        started = asyncio.Event()

        async def emit(chunk: Chunk) -> None:
            started.set()
            await asyncio.sleep(3600)  # a client that stopped reading

        task = asyncio.ensure_future(Session(make_plan("pipelined"), placement, emit, sequence_id="seq").run())
        await started.wait()
        assert verifier.sequences and drafter.sequences
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert_clean(placement)


def test_derived_seeds_are_deterministic_and_distinct() -> None:
    assert derive_seed(1, "verifier") == derive_seed(1, "verifier")
    seeds = {
        derive_seed(seed, role, attempt) for seed in range(3) for role in ("verifier", "drafter") for attempt in (0, 1)
    }
    assert len(seeds) == 12 and all(0 <= seed < 2**64 for seed in seeds)


def test_a_miss_never_waits_for_its_predraft() -> None:
    """Every guess is wrong and a pre-draft answers only once cancelled: the request still completes (exactly), each
    miss's Commit having cancelled the pre-draft it would have thrown away."""
    drafter = FakeDrafter(wrong_every=1)
    drafter.hold_predrafts = True
    placement = FakePlacement([FakeVerifier()], [drafter])
    chunks: list[Chunk] = []
    background: set[asyncio.Task] = set()

    async def emit(chunk: Chunk) -> None:
        chunks.append(chunk)

    async def serve() -> Final:
        plan = make_plan("pipelined", max_tokens=20)
        final = await Session(plan, placement, emit, sequence_id="seq", background=background).run()
        # the owner keeps the abandoned pre-drafts alive until they end, as the router's frontend does: each then
        # sees its cancellation (it polls for it every millisecond) instead of being torn down with the loop
        await asyncio.gather(*background, return_exceptions=True)
        return final

    final = asyncio.run(serve())
    tokens = [token for chunk in chunks for token in chunk.token_ids]
    assert tokens == reference(PROMPT, 20)[0]
    check_stats(final, tokens, "pipelined")
    assert final.stats.pipeline_hits == 0 and final.stats.pipeline_misses > 3
    # every miss but the last (it ends the request) sent its Commit at once, cancelling the pre-draft it had started
    assert len(set(drafter.cancels)) == len(drafter.cancels) >= final.stats.pipeline_misses - 1
    assert drafter.cancelled > 0
    assert not final.stats.drafter_fallback
    assert_clean(placement)


@pytest.mark.parametrize("wrong_every", [2, 3, 5])
def test_a_predrafted_rejection_outcome_is_verified_next(wrong_every: int) -> None:
    """Multi-outcome pre-drafting: a verdict equal to a guessed rejection selects the chain pre-drafted for it."""
    drafter = FakeDrafter(wrong_every=wrong_every)
    drafter.guess_rejections = True
    placement = FakePlacement([FakeVerifier()], [drafter])
    tokens, final, _ = run(make_plan("pipelined"), placement)
    assert tokens == reference(PROMPT, 40)[0]
    check_stats(final, tokens, "pipelined")
    assert final.stats.pipeline_rejection_hits > 0
    assert drafter.log.count("propose") < final.stats.rounds - final.stats.pipeline_hits + 2
    assert_clean(placement)


def test_a_round_that_drafts_nothing_verifies_while_the_drafter_hears_the_last_verdict() -> None:
    """``auto`` at γ = 0: the verdict's Commit travels while the verifier works, never before it. The drafter here
    acknowledges the Commit of round n only once round n + 1's verification has started, so a round that waited for
    the acknowledgement first would never verify."""
    verifier, drafter = FakeVerifier(), FakeDrafter()
    verify, commit = verifier.verify, drafter.commit
    counts = {"verify": 0, "commit": 0}

    async def counting_verify(*args, **kwargs) -> Verified:
        counts["verify"] += 1
        return await verify(*args, **kwargs)

    async def commit_once_the_next_round_verifies(*args, **kwargs) -> None:
        counts["commit"] += 1
        round_after = counts["commit"] + 1
        async with asyncio.timeout(5):
            while counts["verify"] < round_after:
                await asyncio.sleep(0.001)
        await commit(*args, **kwargs)

    verifier.verify = counting_verify  # type: ignore[method-assign]
    drafter.commit = commit_once_the_next_round_verifies  # type: ignore[method-assign]
    placement = FakePlacement([verifier], [drafter])
    plan = make_plan("auto", max_tokens=6)  # six rounds, each at γ = 0
    chunks: list[Chunk] = []

    async def emit(chunk: Chunk) -> None:
        chunks.append(chunk)

    session = Session(plan, placement, emit, sequence_id="seq", controller=CyclingController((0,) * 6 + (1,)))
    final = asyncio.run(session.run())
    tokens = [token for chunk in chunks for token in chunk.token_ids]
    assert tokens == reference(PROMPT, 6)[0]
    assert final.stats.draft_tokens == 0 and counts["commit"] == final.stats.rounds - 1 == 5
    assert not final.stats.drafter_fallback
    assert_clean(placement)


def test_rounds_that_draft_nothing_do_not_wait_for_a_busy_drafter_to_answer_their_commits() -> None:
    """``auto`` at γ = 0 for five rounds, then γ = 1: the drafter (busy with a long job) answers no Commit until five
    tokens have been streamed. The plain rounds go on without its answers, their Commits queue behind the first in
    order, and only the round that drafts waits for them. A round that waited for its own Commit's answer would
    stream one token and stop (the drafter's wait then times out)."""
    verifier, drafter = FakeVerifier(), FakeDrafter()
    commit, released = drafter.commit, asyncio.Event()
    commits: list[tuple[int, int]] = []

    async def commit_when_released(sequence_id: str, base_length: int, emitted: Sequence[int], *args) -> None:
        async with asyncio.timeout(5):
            await released.wait()
        commits.append((base_length, len(emitted)))
        await commit(sequence_id, base_length, emitted, *args)

    drafter.commit = commit_when_released  # type: ignore[method-assign]
    placement = FakePlacement([verifier], [drafter])
    tokens: list[int] = []

    async def emit(chunk: Chunk) -> None:
        tokens.extend(chunk.token_ids)
        if len(tokens) >= 5:
            released.set()

    controller = CyclingController((0,) * 5 + (1,))
    final = asyncio.run(
        Session(make_plan("auto", max_tokens=8), placement, emit, sequence_id="s", controller=controller).run()
    )
    assert tokens == reference(PROMPT, 8)[0]
    assert final.stats.draft_tokens >= 1 and not final.stats.drafter_fallback
    assert commits[:5] == [(len(PROMPT) + n, 1) for n in range(5)]  # in order, each after the one before
    assert_clean(placement)


CYCLE = (3, 1, 4, 1, 5, 9)


def cyclic_next(context: Sequence[int]) -> int:
    """A target that repeats ``CYCLE``: the text's tail always occurred earlier, one cycle back."""
    return CYCLE[len(context) % len(CYCLE)]


class LookupDrafter(FakeDrafter):
    """An eagle-like drafter: a prompt-lookup chain (``specdec.lookup``, model-free) when the text's
    tail of ``lookup_min_match`` (2) tokens occurred earlier, else the model's guesses, always wrong.
    ``reported_min_match`` is what it tells the router (0: nothing, as a drafter that never looks up)."""

    def __init__(self, reported_min_match: int) -> None:
        super().__init__(next_token=cyclic_next)
        self.lookup_min_match = reported_min_match

    def _draft(self, state: dict, text: list[int], max_tokens: int) -> Drafted:
        limit = min(state["gamma"], max_tokens)
        chain, model_free = LookupIndex(text).prompt_lookup(2, limit), True
        if not chain:
            chain, model_free = [(cyclic_next(text) + 1) % (VOCAB - 1)] * limit, False
        path = tuple(range(len(chain)))
        return Drafted(TokenTree.chain(chain), tuple(chain), 500, 8 * len(chain), path, model_free=model_free)


@pytest.mark.parametrize("reported_min_match", [2, 0])
def test_auto_plans_a_prompt_lookup_round_as_one(reported_min_match: int) -> None:
    """``auto`` with a drafter whose model never pays (its draft levels priced at a second each) but whose prompt-
    lookup chains do: told the drafter's ``lookup_min_match``, the router sees each round will be a lookup chain
    (the text repeats) and drafts it whole, with the request's own estimate of lookup chains; a router not told
    plans every round as the model's draft, and drafts only one-token probes (and their pre-drafts)."""
    controller = SpeculationController(4)
    for _ in range(8):
        controller.cost.draft_level.observe(1, 1.0)
    drafter = LookupDrafter(reported_min_match)
    placement = FakePlacement([FakeVerifier(next_token=cyclic_next)], [drafter])
    plan = replace(make_plan("auto", max_tokens=40), prompt_ids=CYCLE * 2)
    tokens: list[int] = []

    async def emit(chunk: Chunk) -> None:
        tokens.extend(chunk.token_ids)

    final = asyncio.run(Session(plan, placement, emit, sequence_id="s", controller=controller).run())
    assert tokens == [CYCLE[n % len(CYCLE)] for n in range(len(CYCLE) * 2, len(CYCLE) * 2 + 40)]
    stats = final.stats
    if reported_min_match:
        assert stats.draft_tokens >= 24 and stats.accepted_tokens == stats.draft_tokens  # whole chains, accepted
        assert stats.rounds <= 12
    else:
        assert len(stats.rounds_per_draft_size) == 2 and stats.rounds >= 35  # one-token drafts, the rest plain steps
    assert_clean(placement)


@pytest.mark.parametrize("wrong_every", [0, 5])
def test_auto_pipelines_the_draft_length_the_controller_picks_next(wrong_every: int) -> None:
    """``auto`` pre-drafts while it verifies, with the length the controller chooses for the next round; a
    choice of 0 pre-drafts nothing (the bonus is drawn at once) and the next round verifies the pending token."""
    drafter = FakeDrafter(wrong_every=wrong_every)
    placement = FakePlacement([FakeVerifier()], [drafter])
    plan = make_plan("auto", max_tokens=30)
    chunks: list[Chunk] = []
    proposals: list[int] = []

    class Sizes:
        def on_proposal(self, drafted: Drafted) -> None:
            proposals.append(len(drafted.tree))

        def on_round(self, record: object) -> None:
            pass

    async def emit(chunk: Chunk) -> None:
        chunks.append(chunk)

    controller = CyclingController((2, 0, 3, 1))
    session = Session(plan, placement, emit, sequence_id="seq", controller=controller, observer=Sizes())
    final = asyncio.run(session.run())
    tokens = [token for chunk in chunks for token in chunk.token_ids]
    assert tokens == reference(PROMPT, 30)[0]
    check_stats(final, tokens, "auto")
    stats = final.stats
    assert (
        stats.pipeline_hits > 0 and drafter.log.count("propose-assume") == stats.pipeline_hits + stats.pipeline_misses
    )
    assert (stats.pipeline_misses > 0) == bool(wrong_every)
    assert set(proposals) <= {1, 2, 3} and stats.rounds_per_draft_size[0] > 0  # some rounds drafted nothing
    assert_clean(placement)


def test_auto_drafts_sequentially_when_the_drafting_a_predraft_would_hide_costs_nothing() -> None:
    """The measured controller under ``auto`` with a drafter whose every token is accepted and whose drafting costs
    microseconds: it drafts every round, after the verdict (no pre-draft). Before, ``auto`` pre-drafted whenever it
    drafted, and a pre-drafted round defers a whole acceptance's bonus: on the CPU stack auto chose γ = 1 there, whose
    pipelined rounds commit exactly one token each, and ran at 0.88x of speculation off."""
    drafter = FakeDrafter()
    placement = FakePlacement([FakeVerifier()], [drafter])
    chunks: list[Chunk] = []

    async def emit(chunk: Chunk) -> None:
        chunks.append(chunk)

    session = Session(
        make_plan("auto", max_tokens=30), placement, emit, sequence_id="seq", controller=SpeculationController(4)
    )
    final = asyncio.run(session.run())
    tokens = [token for chunk in chunks for token in chunk.token_ids]
    assert tokens == reference(PROMPT, 30)[0]
    check_stats(final, tokens, "auto")
    assert final.stats.draft_tokens > 0 and final.stats.rounds < len(tokens)
    assert final.stats.pipeline_hits == final.stats.pipeline_misses == 0
    assert drafter.log.count("propose-assume") == 0
    assert_clean(placement)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_auto_prices_a_greedy_trees_nodes_by_rank_and_a_sampled_tree_whole(temperature: float) -> None:
    """A greedy tree request under ``auto`` keeps a rank estimate: the controller plans its tree node by node and hears
    every verdict's tree size and accepted nodes (a dynamic tree's node index is its rank); a sampled tree, whose
    nodes are draws that cannot be cut after the fact, is planned whole."""
    observed: list[tuple[int, tuple[int, ...]]] = []
    ranked: list[bool] = []

    class Recording(CyclingController):
        def choose(self, candidates, **load):
            ranked.extend(candidate.ranks is not None for candidate in candidates)
            return super().choose(candidates, **load)

        def observe_verdict(self, tracker, proposed, accepted, *, model_free=False, nodes=0, accepted_nodes=()):
            if proposed:
                observed.append((nodes, tuple(accepted_nodes)))
            super().observe_verdict(
                tracker, proposed, accepted, model_free=model_free, nodes=nodes, accepted_nodes=accepted_nodes
            )

    placement = FakePlacement([FakeVerifier()], [FakeDrafter(wrong_every=3)])
    plan = replace(
        make_plan("auto", max_tokens=30),
        sampling=SamplingParams(temperature=temperature),
        shape=DraftShape(3, tree_width=2, tree_budget=4),
    )

    async def emit(chunk: Chunk) -> None:
        pass

    controller = Recording(lengths=(2, 0, 3, 1), pipelining=(False,))
    asyncio.run(Session(plan, placement, emit, sequence_id="s", controller=controller).run())
    assert ranked and set(ranked) == {temperature == 0}
    assert observed and all(nodes >= 1 and set(path) <= set(range(nodes)) for nodes, path in observed)
    assert any(path for _, path in observed) and any(len(path) < nodes for nodes, path in observed)
    assert_clean(placement)


def test_auto_measures_a_cut_dynamic_tree_as_it_prices_it() -> None:
    """A greedy tree cut to its best two nodes (here a chain of two) cost its drafter two levels of the whole tree's
    rows (the drafter expands two nodes a level whatever it keeps): ``auto`` learns the level cost at those rows, as
    it prices the cut, not at the one row a chain of two would have."""
    measured: list[tuple[int, int]] = []

    class Recording(CyclingController):
        def observe_round(self, positions, forward_s, draft_levels, draft_s, other_s, rows=1, call_s=None) -> None:
            if draft_levels:
                measured.append((draft_levels, rows))
            super().observe_round(positions, forward_s, draft_levels, draft_s, other_s, rows, call_s)

    placement = FakePlacement([SizedVerifier()], [FakeDrafter()])
    plan = replace(make_plan("auto", max_tokens=30), shape=DraftShape(4, tree_width=2, tree_budget=8))

    async def emit(chunk: Chunk) -> None:
        pass

    controller = Recording(lengths=(2,), pipelining=(False,))
    asyncio.run(Session(plan, placement, emit, sequence_id="s", controller=controller).run())
    assert (2, 2) in measured and set(measured) <= {(2, 2), (1, 2)}
    assert_clean(placement)


def test_auto_leaves_the_wait_at_the_verifier_out_of_a_rounds_fixed_cost() -> None:
    """Under load a round mostly waits for the verifier's forward to start; counted as a fixed cost, that wait made
    every extra position look cheap next to it, and ``auto`` drafted where the verifier was the bottleneck."""
    fixed: list[float] = []

    class Recording(CyclingController):
        def observe_round(self, positions, forward_s, draft_levels, draft_s, other_s, rows=1, call_s=None) -> None:
            fixed.append(other_s)
            super().observe_round(positions, forward_s, draft_levels, draft_s, other_s, rows, call_s)

    class BusyVerifier(FakeVerifier):  # every call waits 50 ms for a forward, and says so
        async def verify(self, sequence_id: str, drafted: Drafted | None, **options: bool) -> Verified:
            await asyncio.sleep(0.05)
            verified = await super().verify(sequence_id, drafted, **options)
            return replace(verified, forward_positions=1 + (len(drafted.tree) if drafted else 0), queued_ns=50_000_000)

    placement = FakePlacement([BusyVerifier()], [FakeDrafter()])

    async def emit(chunk: Chunk) -> None:
        pass

    controller = Recording(lengths=(2, 0), pipelining=(False,))
    asyncio.run(Session(make_plan("auto", max_tokens=8), placement, emit, sequence_id="s", controller=controller).run())
    assert fixed and all(seconds < 0.025 for seconds in fixed), fixed
    assert controller.cost.overhead_s.value < 0.025
    assert_clean(placement)


def test_auto_learns_no_draft_level_cost_from_a_model_free_proposal_or_the_draft_after_one() -> None:
    """A drafter's prompt-lookup proposal (``model_free``) ran no model: its microseconds priced as levels taught
    ``auto`` that levels are nearly free. The head draft after one ran over every token the lookup committed. Neither
    teaches a level's cost; both still teach the drafter call's."""
    rounds: list[tuple[int, float | None]] = []

    class Recording(CyclingController):
        def observe_round(self, positions, forward_s, draft_levels, draft_s, other_s, rows=1, call_s=None) -> None:
            rounds.append((draft_levels, call_s))
            super().observe_round(positions, forward_s, draft_levels, draft_s, other_s, rows, call_s)

    model_free = [False, False, True, False, False, False, True, True, False, False]

    class LookupDrafter(FakeDrafter):  # every proposal it answers is model-free or not by ``model_free`` in turn
        answered = 0

        async def propose(self, *args: Any, **kwargs: Any) -> Drafted:
            drafted = await super().propose(*args, **kwargs)
            self.answered += 1
            return replace(drafted, model_free=model_free[(self.answered - 1) % len(model_free)])

    placement = FakePlacement([SizedVerifier()], [LookupDrafter()])
    controller = Recording(lengths=(2,), pipelining=(False,))

    async def emit(chunk: Chunk) -> None:
        pass

    final = asyncio.run(
        Session(make_plan("auto", max_tokens=30), placement, emit, sequence_id="s", controller=controller).run()
    )
    assert len(rounds) == final.stats.rounds >= len(model_free)
    # round 0 drafts from the prompt (nothing before it drafted); then levels only where neither it nor the
    # round before was model-free
    for index, (levels, call_s) in enumerate(rounds[1 : len(model_free)], start=1):
        expected = 0 if model_free[index] or model_free[index - 1] else 2
        assert levels == expected and call_s is not None, (index, rounds)
    assert_clean(placement)


def test_auto_learns_a_draft_levels_cost_only_from_a_draft_that_follows_a_drafting_round() -> None:
    """A proposal drafted after plain rounds carries the drafter's catch-up on the tokens committed meanwhile (an
    EAGLE head runs over them: on the CPU stack such one-level probes reported 3.6-4 ms where a level costs 0.8, and
    priced as levels they kept ``auto`` from drafting at all). So the controller is told a round's draft levels (and
    the drafter call's cost) only when the round before drafted too; every round still teaches the forward."""
    rounds: list[tuple[int, float | None]] = []

    class Recording(CyclingController):
        def observe_round(self, positions, forward_s, draft_levels, draft_s, other_s, rows=1, call_s=None) -> None:
            rounds.append((draft_levels, call_s))
            super().observe_round(positions, forward_s, draft_levels, draft_s, other_s, rows, call_s)

    placement = FakePlacement([SizedVerifier()], [FakeDrafter()])
    controller = Recording(lengths=(0, 0, 2, 2, 0, 1, 1, 1), pipelining=(False,))

    async def emit(chunk: Chunk) -> None:
        pass

    final = asyncio.run(
        Session(make_plan("auto", max_tokens=24), placement, emit, sequence_id="s", controller=controller).run()
    )
    sizes = final.stats.rounds_per_draft_size
    assert sizes[0] > 0 and sizes[1] > 0 and sizes[2] > 0
    cycle = [0, 0, 2, 2, 0, 1, 1, 1]  # the lengths chosen, round by round (each round's proposal is drafted fresh)
    expected = [cycle[i % 8] if cycle[i % 8] and cycle[(i - 1) % 8] else 0 for i in range(len(rounds))]
    assert len(rounds) == final.stats.rounds and [levels for levels, _ in rounds] == expected
    assert all((call_s is None) == (levels == 0) for levels, call_s in rounds)
    assert_clean(placement)
