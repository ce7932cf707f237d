"""The simulated workers of ``bench.load``: latency laws, the verifier's acceptance law and rules, the drafter's
wire format, and a whole simulated stack behind the real router serving concurrent SDK requests."""

from __future__ import annotations

import argparse
import asyncio
import math
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from specdec_wire.v1 import common_pb2, drafter_pb2, verifier_pb2

from bench.load.simulate import (
    LatencySpec,
    SimulationConfig,
    add_simulation_arguments,
    expected_accepted_length,
    simulated_stack,
    simulation_config_from_args,
)
from bench.load.simulated.config import WorkerConfig
from bench.load.simulated.drafter import SimDrafter, first_path, grow_tree
from bench.load.simulated.server import stream_batches
from bench.load.simulated.verifier import (
    SimVerifier,
    VerifySequence,
    accept_path,
    advance,
    check_proposal,
    decide_verify,
)
from grpc_common.convert_rows import proposal_from_wire, proposal_to_wire
from specdec.client import AsyncClient
from specdec.drafters.base import Proposal
from specdec.errors import InvalidArgumentError
from specdec.tree import TokenTree

ALPHA = 0.001  # significance of the statistical tests; every draw is seeded, so they are deterministic
ACCEPTANCE = (0.8, 0.7, 0.6, 0.5)
VOCAB = 1000


# --- latency ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("const:5", LatencySpec("const", 5.0)),
        ("normal:5,1", LatencySpec("normal", 5.0, 1.0)),
        ("lognormal:5,0.3", LatencySpec("lognormal", 5.0, 0.3)),
        ("uniform:3,7", LatencySpec("uniform", 3.0, 7.0)),
    ],
)
def test_latency_parses_and_round_trips(text: str, expected: LatencySpec) -> None:
    assert LatencySpec.parse(text) == expected
    assert str(expected) == text
    assert LatencySpec.parse(str(expected)) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("gamma:1,2", "kind"),
        ("normal:5", "2 parameter"),
        ("const:x", "numbers"),
        ("uniform:7,3", "low <= high"),
        ("normal:-1,1", ">= 0"),
        ("lognormal:0,1", "mean > 0"),
    ],
)
def test_latency_rejects_bad_strings(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        LatencySpec.parse(text)


@pytest.mark.parametrize(
    ("text", "mean", "std"),
    [
        ("const:5", 5.0, 0.0),
        ("normal:5,1", 5.0, 1.0),  # clipping at 0 is 5 sigma away: invisible here
        ("lognormal:5,0.3", 5.0, 5.0 * math.sqrt(math.exp(0.09) - 1)),
        ("uniform:3,7", 5.0, 4 / math.sqrt(12)),
    ],
)
def test_latency_moments(text: str, mean: float, std: float) -> None:
    """20 000 seeded draws: the sample mean within 4 standard errors of the law's mean, the sample standard
    deviation within 5 % of the law's."""
    spec = LatencySpec.parse(text)
    rng = np.random.default_rng(7)
    draws = np.array([spec.sample_ms(rng) for _ in range(20_000)])
    assert draws.min() >= 0
    assert spec.mean_ms == pytest.approx(mean)
    assert abs(draws.mean() - mean) <= 4 * std / math.sqrt(len(draws)) + 1e-12
    assert draws.std() == pytest.approx(std, rel=0.05, abs=1e-12)
    again = np.random.default_rng(7)
    assert [spec.sample_ms(again) for _ in range(5)] == list(draws[:5])


def test_arguments_build_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_simulation_arguments(parser)
    config = simulation_config_from_args(
        parser.parse_args(["--sim-acceptance", "0.9,0.5", "--sim-verify-latency", "const:3", "--sim-verifiers", "2"])
    )
    assert config.acceptance == (0.9, 0.5)
    assert config.verify_latency == LatencySpec("const", 3.0)
    assert config.num_verifiers == 2
    assert config.max_concurrent_requests >= 1024
    assert config.drafter_kind == "model"
    assert simulation_config_from_args(parser.parse_args([])) == SimulationConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["--sim-draft-latency", "normal:1"])


# --- the verifier's law -------------------------------------------------------------------------------------


def _length_law(acceptance: tuple[float, ...], gamma: int) -> np.ndarray:
    """P(accepted length = k), k = 0..γ, for a chain of γ under per-position acceptance (the last repeats)."""
    law, survive = [], 1.0
    for position in range(gamma):
        a = acceptance[min(position, len(acceptance) - 1)]
        law.append(survive * (1 - a))
        survive *= a
    return np.array([*law, survive])


@pytest.mark.parametrize(("gamma", "width"), [(4, 1), (6, 1), (4, 2)])
def test_accepted_length_follows_the_configured_law(gamma: int, width: int) -> None:
    """20 000 seeded rounds: the accepted-length histogram passes a chi-square test against
    ``P(k) = Π_{j<k} a_j (1 - a_k)`` at ALPHA (γ = 6 exercises the repeated last value; width 2 a tree, whose
    accepted depth follows the same per-depth law)."""
    rng = np.random.default_rng(11)
    _, parents = grow_tree(rng, gamma, width, width * gamma, (32, VOCAB))  # width 2: two children under node 0, 2, ..
    assert len(first_path(parents)) == gamma
    lengths = [len(accept_path(parents, ACCEPTANCE, rng)) for _ in range(20_000)]
    observed = np.bincount(lengths, minlength=gamma + 1)
    expected = _length_law(ACCEPTANCE, gamma) * len(lengths)
    assert stats.chisquare(observed, expected).pvalue > ALPHA
    per_position = [observed[k + 1 :].sum() / observed[k:].sum() for k in range(gamma)]
    assert per_position == pytest.approx([ACCEPTANCE[min(k, 3)] for k in range(gamma)], abs=0.03)
    assert np.mean(lengths) + 1 == pytest.approx(expected_accepted_length(ACCEPTANCE, gamma), abs=0.05)


def _sequence(remaining: int, seed: int = 0) -> VerifySequence:
    return VerifySequence(np.random.default_rng(seed), remaining)


def test_verdict_emits_accepted_tokens_and_one_final_token_never_special() -> None:
    chain, parents = [100, 101, 102, 103], [-1, 0, 1, 2]
    for seed in range(200):
        sequence = _sequence(1000, seed)
        decision = decide_verify(
            sequence, chain, parents, defer_bonus=False, acceptance=ACCEPTANCE, token_range=(32, VOCAB)
        )
        k = len(decision.accepted_path)
        assert decision.accepted_path == list(range(k))
        assert decision.emitted[:k] == chain[:k]
        assert len(decision.emitted) == k + 1
        assert 32 <= decision.emitted[-1] < VOCAB
        assert not decision.finished and not decision.bonus_deferred


def test_deferred_bonus_and_budget_follow_the_real_verifier() -> None:
    chain, parents = [100, 101, 102], [-1, 0, 1]
    sure = (1.0,)
    sequence = _sequence(10)
    decision = decide_verify(sequence, chain, parents, defer_bonus=True, acceptance=sure, token_range=(32, VOCAB))
    assert (decision.accepted_path, decision.emitted) == ([0, 1, 2], chain)
    assert decision.bonus_deferred and not decision.finished
    advance(sequence, decision)
    assert sequence.kept_row and sequence.remaining == 7
    # a rejection is never deferred: the recovered token is drawn now
    decision = decide_verify(sequence, chain, parents, defer_bonus=True, acceptance=(0.0,), token_range=(32, VOCAB))
    assert decision.accepted_path == [] and len(decision.emitted) == 1 and not decision.bonus_deferred
    # a bonus that would be the last token is drawn, not deferred
    last = _sequence(4)
    decision = decide_verify(last, chain, parents, defer_bonus=True, acceptance=sure, token_range=(32, VOCAB))
    assert len(decision.emitted) == 4 and decision.finished and not decision.bonus_deferred
    # the budget cuts the round: 2 tokens left of a chain of 3
    short = _sequence(2)
    decision = decide_verify(short, chain, parents, defer_bonus=True, acceptance=sure, token_range=(32, VOCAB))
    assert (decision.accepted_path, decision.emitted, decision.finished) == ([0, 1], [100, 101], True)


def _verifier(acceptance: tuple[float, ...], per_sequence_ms: float) -> SimVerifier:
    config = WorkerConfig("verifier", acceptance, LatencySpec("const", 1.0), per_sequence_ms, vocab_size=VOCAB)
    return SimVerifier(config)


def _chain_proposal(tokens: list[int]) -> common_pb2.Proposal:
    return common_pb2.Proposal(tree=common_pb2.TokenTree(tokens=tokens, parents=[-1, *range(len(tokens) - 1)]))


def test_verifier_reports_how_long_a_call_waited_for_its_batch() -> None:
    """A call that arrives while a batch sleeps waits for it to end: ``queued_ns``, as the real verifier reports."""

    async def scenario() -> None:
        config = WorkerConfig("verifier", (1.0,), LatencySpec("const", 40.0), 0.0, vocab_size=VOCAB)
        verifier = SimVerifier(config)
        verifier.batcher.start()
        for index in range(2):
            verifier.open(f"s{index}", [5, 6], seed=index, max_tokens=20)
        first = asyncio.ensure_future(verifier.verify("s0", _chain_proposal([40]), defer_bonus=True))
        await asyncio.sleep(0.01)  # s0's batch is sleeping its 40 ms
        second = await verifier.verify("s1", _chain_proposal([40]), defer_bonus=True)
        assert (await first).queued_ns < 10e6
        assert 20e6 < second.queued_ns < 40e6
        await verifier.batcher.stop()

    asyncio.run(scenario())


def test_verifier_batches_calls_and_resolves_a_kept_row_without_a_forward() -> None:
    async def scenario() -> None:
        verifier = _verifier((1.0,), per_sequence_ms=0.5)
        verifier.batcher.start()
        for index in range(8):
            verifier.open(f"s{index}", [5, 6], seed=index, max_tokens=20)
        answers = await asyncio.gather(
            *(verifier.verify(f"s{index}", _chain_proposal([40, 41]), defer_bonus=True) for index in range(8))
        )
        assert {answer.batch_size for answer in answers} == {8}  # one batch: the first call's forward took all
        assert {answer.latency_ns for answer in answers} == {round((1.0 + 8 * 0.5) * 1e6)}
        assert all(answer.result.bonus_deferred for answer in answers)
        bonus = await verifier.verify("s0", common_pb2.Proposal(), defer_bonus=False)
        assert (bonus.latency_ns, len(bonus.result.emitted), bonus.result.accepted_path) == (0, 1, [])
        assert verifier.batcher.batches == 1
        with pytest.raises(KeyError):
            await verifier.verify("unknown", common_pb2.Proposal(), defer_bonus=False)
        await verifier.batcher.stop()

    asyncio.run(scenario())


def _two_streams_on_a_simulated_verifier(arrival_wait: float, rounds: int = 6) -> list[int]:
    """Streams a and b on a simulated verifier whose batch sleeps 100 ms; a sends its next call at once, b 20 ms
    after its verdict. Returns the batch size each of b's calls ran in."""

    async def scenario() -> list[int]:
        config = WorkerConfig("verifier", (1.0,), LatencySpec("const", 100.0), arrival_wait=arrival_wait)
        verifier = SimVerifier(config)
        verifier.batcher.start()
        for name in ("a", "b"):
            verifier.open(name, [5, 6], seed=1, max_tokens=1000)
        sizes: list[int] = []

        async def stream(name: str, think_s: float, count: int) -> None:
            for _ in range(count):
                answer = await verifier.verify(name, common_pb2.Proposal(), defer_bonus=False)
                if name == "b":
                    sizes.append(answer.batch_size)
                await asyncio.sleep(think_s)

        await asyncio.gather(stream("a", 0.0, rounds + 3), stream("b", 0.02, rounds))  # a outlasts b
        await verifier.batcher.stop()
        return sizes

    return asyncio.run(scenario())


def test_the_simulated_device_waits_for_the_calls_it_expects_back_as_the_real_scheduler() -> None:
    assert _two_streams_on_a_simulated_verifier(arrival_wait=1.0)[-3:] == [2, 2, 2]  # b's habit learnt: joined
    assert _two_streams_on_a_simulated_verifier(arrival_wait=0.0)[2:].count(1) >= 3  # b misses a's forwards


def test_same_open_seed_replays_the_same_verdicts() -> None:
    def run(seed: int) -> list[list[int]]:
        sequence = _sequence(100, seed)
        out = []
        for _ in range(10):
            decision = decide_verify(
                sequence, [50, 51, 52], [-1, 0, 1], defer_bonus=False, acceptance=ACCEPTANCE, token_range=(32, VOCAB)
            )
            advance(sequence, decision)
            out.append(decision.emitted)
        return out

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_verifier_checks_the_real_wire_format() -> None:
    """A proposal encoded by the real ``proposal_to_wire`` passes; q(token) = 0 and bad trees are refused."""
    rows = torch.zeros(2, VOCAB)
    rows[0, [40, 41]] = torch.tensor([0.25, 0.75])
    rows[1, [42, 43, 44]] = torch.tensor([0.5, 0.25, 0.25])
    message = proposal_to_wire(Proposal(TokenTree((41, 43), (-1, 0)), rows, "iid"))
    assert check_proposal(message, VOCAB) == ([41, 43], [-1, 0])
    rows[1, 43] = 0.0
    rows[1, 44] = 0.5
    with pytest.raises(InvalidArgumentError, match=r"q\(token\) > 0"):
        check_proposal(proposal_to_wire(Proposal(TokenTree((41, 43), (-1, 0)), rows, "iid")), VOCAB)
    bad_tree = common_pb2.Proposal(tree=common_pb2.TokenTree(tokens=[1, 2], parents=[1, -1]))
    with pytest.raises(InvalidArgumentError, match=r"proposal\.tree"):
        check_proposal(bad_tree, VOCAB)


# --- the drafter --------------------------------------------------------------------------------------------


def _drafter(support: int = 4) -> SimDrafter:
    return SimDrafter(
        WorkerConfig("drafter", ACCEPTANCE, LatencySpec("const", 1.0), vocab_size=VOCAB, draft_support=support)
    )


def _open(drafter: SimDrafter, temperature: float = 1.0, **shape: int) -> None:
    drafter.open(
        drafter_pb2.OpenDraftRequest(
            sequence_id="s",
            prompt_ids=[5, 6],
            seed=9,
            sampling=common_pb2.SamplingParams(temperature=temperature),
            shape=drafter_pb2.DraftShape(**shape),
        )
    )


def _propose(drafter: SimDrafter, max_tokens: int, assume: bool = False) -> common_pb2.Proposal:
    async def call() -> common_pb2.Proposal:
        drafter.batcher.start()
        try:
            return (await drafter.propose("s", max_tokens, assume)).result
        finally:
            await drafter.batcher.stop()

    return asyncio.run(call())


def test_drafter_proposals_decode_with_the_real_decoder() -> None:
    """Sparse uniform rows over ``support`` ids, shared by siblings, each node's token in its row."""
    drafter = _drafter(support=4)
    _open(drafter, num_draft_tokens=3, tree_width=2, tree_budget=6)
    message = _propose(drafter, 10)
    assert list(message.tree.parents) == [-1, -1, 0, 0, 2, 2]  # two children per level under the first node
    decoded = proposal_from_wire(message, VOCAB)
    assert decoded.scheme == "without_replacement"
    assert decoded.draft_probs is not None
    assert torch.allclose(decoded.draft_probs.sum(dim=-1), torch.ones(6))
    assert all(decoded.draft_probs[node, token] == 0.25 for node, token in enumerate(message.tree.tokens))
    assert len(message.draft.rows) == 3
    assert check_proposal(message, VOCAB) == (list(message.tree.tokens), list(message.tree.parents))


def test_drafter_chain_budget_greedy_and_one_hot() -> None:
    drafter = _drafter()
    _open(drafter, temperature=0.0)
    greedy = _propose(drafter, 2)
    assert list(greedy.tree.parents) == [-1, 0] and not greedy.HasField("draft")
    one_hot = _drafter(support=0)
    _open(one_hot, num_draft_tokens=5)
    assert len(one_hot.sequences["s"].text) == 2
    chain = _propose(one_hot, 10)
    assert len(chain.tree.tokens) == 5 and not chain.HasField("draft")
    assert _propose(one_hot, 0).tree.tokens == []


def test_drafter_assume_and_commit_keep_the_text() -> None:
    drafter = _drafter()
    _open(drafter, num_draft_tokens=2)
    first = list(_propose(drafter, 10).tree.tokens)
    second = list(_propose(drafter, 10, assume=True).tree.tokens)  # drafted on top of the assumed first chain
    assert drafter.sequences["s"].text == [5, 6, *first]
    drafter.commit("s", 2, first)  # all of the first accepted, bonus deferred: nothing changes
    assert drafter.sequences["s"].assumed == second
    drafter.commit("s", 4, [second[0], 7])  # second[1] rejected, correction 7: rolled back, nothing outstanding
    assert drafter.sequences["s"].text == [5, 6, *first, second[0], 7]
    assert drafter.sequences["s"].assumed is None
    with pytest.raises(InvalidArgumentError, match="assume_previous_accepted"):
        _propose(drafter, 10, assume=True)
    with pytest.raises(InvalidArgumentError, match="base_length"):
        drafter.commit("s", 99, [1])


# --- end to end ---------------------------------------------------------------------------------------------


def test_simulated_stack_serves_concurrent_sdk_requests(tmp_path: Path) -> None:
    """20 concurrent streamed requests through two real routers sharing one verifier and one drafter (requests
    alternate between the routers), each to exactly ``max_tokens``; the measured mean accepted length within 0.3 of
    ``1 + Σ Π a`` (the last rounds of each request draft short chains, which pulls it down by about 0.1; the sampling
    error of ~440 rounds is about 0.07). The workers refuse to open a sequence id that is open already, so all 20
    succeeding, 10 on each router, means the two routers' ids never collided on a worker."""
    config = SimulationConfig(
        acceptance=ACCEPTANCE,
        draft_latency=LatencySpec("const", 1.0),
        verify_latency=LatencySpec("uniform", 2.0, 4.0),
        verify_per_seq_ms=0.05,
        num_routers=2,
    )

    async def drive(addresses: tuple[str, ...]) -> list:
        clients = [AsyncClient(address, timeout_s=60) for address in addresses]
        try:
            return await asyncio.gather(
                *(
                    clients[index % 2].generate("Tell me a story.", max_tokens=64, seed=index, speculation="pipelined")
                    for index in range(20)
                )
            )
        finally:
            for client in clients:
                await client.close()

    with simulated_stack(config, log_dir=tmp_path) as stack:
        assert len(set(stack.grpc_addresses)) == 2
        results = asyncio.run(drive(stack.grpc_addresses))
        served = [
            _counter(f"http://{address}/metrics", "vllm:request_success_total") for address in stack.http_addresses
        ]
        services = list(stack.services.started)
    assert served == [10, 10]
    assert all(service.process.returncode == 0 for service in services)
    assert [(len(r.token_ids), r.usage.completion_tokens, r.finish_reason) for r in results] == [
        (64, 64, "length")
    ] * 20
    assert all(r.text for r in results)
    rounds = sum(r.stats.rounds for r in results)
    mean_length = 1 + sum(r.stats.accepted_tokens for r in results) / rounds
    assert mean_length == pytest.approx(config.expected_accepted_length, abs=0.3)
    assert sum(r.stats.pipeline_hits for r in results) > 0
    assert not any(r.stats.drafter_fallback for r in results)


def _counter(url: str, name: str) -> float:
    """The sum over labels of counter sample ``name`` at a ``/metrics`` ``url``."""
    from bench.load.metrics import counter_total, parse_metrics

    with urllib.request.urlopen(url, timeout=10) as response:
        return counter_total(parse_metrics(response.read().decode()), name) or 0.0


def test_the_simulated_batch_stream_answers_finished_batches_and_drops_cancelled_ones() -> None:
    """As on the real workers: batches start as they arrive and are answered as they finish; ``cancel_batch_ids``
    (a batch past the router's deadline) cancels one, which is never answered, and the stream still ends."""
    close = verifier_pb2.VerifierCall(close=verifier_pb2.CloseVerifyRequest(sequence_id="s"))

    async def run() -> list[list[int]]:
        released = asyncio.Event()

        async def answer(request: verifier_pb2.VerifierBatchRequest) -> verifier_pb2.VerifierBatchReply:
            if request.batch_id == 2:
                await asyncio.Event().wait()  # held until cancelled
            await released.wait()
            return verifier_pb2.VerifierBatchReply(batch_id=request.batch_id)

        async def requests():
            for batch_id in (1, 2, 3):
                yield verifier_pb2.VerifierBatchRequest(calls=[close], batch_id=batch_id)
            yield verifier_pb2.VerifierBatchRequest(cancel_batch_ids=[2])
            released.set()

        answers = stream_batches(requests(), answer, verifier_pb2.VerifierBatchReplies)
        return await asyncio.wait_for(_batch_ids(answers), timeout=10)

    assert sorted(batch_id for message in asyncio.run(run()) for batch_id in message) == [1, 3]


async def _batch_ids(messages) -> list[list[int]]:
    return [[reply.batch_id for reply in message.replies] async for message in messages]
