"""The verifier service over loopback gRPC with a tiny model: open / verify / close, exact wire round trips,
bad input refused with the field named while the server stays up, concurrent calls batched into one forward,
health, no state left behind, and the ``python -m verifier_service`` process (DESIGN §5, §9)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specdec_wire.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

from grpc_common.convert import sampling_to_wire
from grpc_common.convert_rows import proposal_to_wire
from grpc_common.memory import IdleTrim
from specdec.drafters.base import Proposal
from specdec.errors import CapacityError, InvalidArgumentError
from specdec.models import LoadedModel
from specdec.runner import ForwardItem, KVRunner
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verification import BatchVerifier, SequenceNotFoundError, VerifyCall
from tests.tiny_models import tiny_llama
from verifier_service.config import VerifierConfig
from verifier_service.scheduler import SchedulerStatus, SchedulerStoppedError, VerifyScheduler
from verifier_service.server import SERVICE_NAME, RunningVerifier, start_verifier

VOCAB = 8
GREEDY = SamplingParams(temperature=0.0)
TIMEOUT_S = 30
PROMPT_S = 10  # far below a batch window a test sets, so a call that waited it out fails the test


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=21, vocab_size=VOCAB, num_layers=2)


@pytest.fixture(scope="module")
def verifier(target) -> Iterator[RunningVerifier]:
    running = start_verifier(VerifierConfig(max_batch_size=16, max_sequences=32, max_seq_len=64), model=target)
    yield running
    running.stop(grace_s=0)


@pytest.fixture(scope="module")
def channel(verifier) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(verifier.address) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel) -> verifier_pb2_grpc.VerifierStub:
    return verifier_pb2_grpc.VerifierStub(channel)


def open_request(sequence_id: str, prompt: list[int], params: SamplingParams = GREEDY, **fields) -> object:
    fields.setdefault("max_tokens", 12)
    fields.setdefault("ignore_eos", True)
    return verifier_pb2.OpenVerifyRequest(
        sequence_id=sequence_id, prompt_ids=prompt, sampling=sampling_to_wire(params), **fields
    )


def verify(stub, sequence_id: str, proposal: Proposal, defer_bonus: bool = False) -> verifier_pb2.VerifyReply:
    request = verifier_pb2.VerifyRequest(
        sequence_id=sequence_id, proposal=proposal_to_wire(proposal), defer_bonus=defer_bonus
    )
    return stub.Verify(request, timeout=TIMEOUT_S)


def hf_greedy(loaded: LoadedModel, prompt: list[int], count: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            ids.append(int(loaded.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def chain_along(truth: list[int], done: int, good: int, bad: int) -> Proposal:
    """A chain following ``truth`` for ``good`` tokens, then ``bad`` wrong ones, with a peaked q row per node."""
    tokens = truth[done : done + good] + [(token + 1) % VOCAB for token in truth[done + good : done + good + bad]]
    rows = torch.full((len(tokens), VOCAB), 0.3 / (VOCAB - 1))
    rows[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)] = 0.7
    return Proposal(TokenTree.chain(tokens), rows if tokens else None)


def generate_greedy(stub, sequence_id: str, prompt: list[int], truth: list[int], barrier=None) -> tuple[list, list]:
    """Open, verify pipelined chains until finished, close; returns (tokens, batch sizes seen)."""
    stub.OpenSequence(open_request(sequence_id, prompt, max_tokens=len(truth)), timeout=TIMEOUT_S)
    out, sizes, deferred = [], [], False
    try:
        for round_index in range(len(truth)):
            if barrier is not None and round_index < 2:
                barrier.wait(timeout=TIMEOUT_S)
            good, bad = (round_index % 3, round_index % 2) if not deferred else (2, 0)
            reply = verify(stub, sequence_id, chain_along(truth, len(out), good, bad), defer_bonus=True)
            out += reply.verdict.emitted
            sizes.append(reply.batch_size)
            deferred = reply.verdict.bonus_deferred
            if reply.verdict.finished:
                break
    finally:
        stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id=sequence_id), timeout=TIMEOUT_S)
    return out, sizes


def status(stub) -> verifier_pb2.VerifierStatusReply:
    return stub.Status(verifier_pb2.VerifierStatusRequest(), timeout=TIMEOUT_S)


def test_health_serving(channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_greedy_round_trip_equals_target(stub, target) -> None:
    prompt = [1, 2, 3, 1, 2]
    truth = hf_greedy(target, prompt, 12)
    out, _ = generate_greedy(stub, "greedy", prompt, truth)
    assert out == truth
    reply = status(stub)
    assert (reply.model, reply.open_sequences, reply.runner_sequences, reply.world_size) == (target.name, 0, 0, 1)


def test_sampled_over_the_wire_equals_in_process(stub, target) -> None:
    """Sparse q rows, sampling settings and seed cross the wire exactly: same verdicts as BatchVerifier itself."""
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    prompt = [4, 0, 6]
    local = BatchVerifier(KVRunner(target.model, max_seq_len=64))
    local.open("s", prompt, params, 1234, 16, target.eos_token_ids, ignore_eos=True, logprobs=True)
    stub.OpenSequence(open_request("s", prompt, params, seed=1234, max_tokens=16, logprobs=True), timeout=TIMEOUT_S)
    generator = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(VOCAB, generator=generator), dim=0)
    q[2] = 0.0
    q = q / q.sum()
    remaining, deferred = 16, False
    while remaining > 0:
        size = 0 if deferred else min(3, remaining - 1)
        tokens = torch.multinomial(q, size, replacement=True, generator=generator).tolist() if size else []
        proposal = Proposal(TokenTree.chain(tokens), q.expand(size, -1).clone() if size else None)
        [expected] = local.verify([VerifyCall("s", proposal, defer_bonus=True)])
        got = verify(stub, "s", proposal, defer_bonus=True).verdict
        assert list(got.emitted) == expected.verdict.emitted
        assert list(got.accepted_path) == expected.verdict.accepted_path
        assert got.bonus_deferred == expected.bonus_deferred and got.finished == expected.verdict.finished
        assert list(got.logprobs) == pytest.approx(expected.logprobs, abs=1e-6)
        remaining -= len(got.emitted)
        deferred = got.bonus_deferred
    stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id="s"), timeout=TIMEOUT_S)
    assert status(stub).runner_sequences == 0


def test_concurrent_calls_are_batched(stub, target) -> None:
    prompts = [[1 + i % 7, (3 * i) % 8, 2] for i in range(8)]
    truths = [hf_greedy(target, prompt, 14) for prompt in prompts]
    barrier = threading.Barrier(len(prompts))
    results: dict[int, tuple[list, list]] = {}
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            results[index] = generate_greedy(stub, f"c{index}", prompts[index], truths[index], barrier)
        except BaseException as error:  # reported below, on the test's thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not errors, errors
    for index, truth in enumerate(truths):
        assert results[index][0] == truth, f"sequence {index}"
    assert max(size for _, sizes in results.values() for size in sizes) > 1, "no two calls shared a forward"
    assert (status(stub).open_sequences, status(stub).runner_sequences) == (0, 0)


def rpc_error(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call(*args, timeout=TIMEOUT_S)
    return raised.value


def raw_proposal(tokens: list[int], parents: list[int], ids: bytes, probs: bytes, node_rows: list[int]):
    return common_pb2.Proposal(
        tree=common_pb2.TokenTree(tokens=tokens, parents=parents),
        draft=common_pb2.DraftDistributions(rows=[common_pb2.SparseRow(ids=ids, probs=probs)], node_rows=node_rows),
    )


def test_bad_input_names_the_field_and_the_server_stays_up(stub, channel) -> None:
    invalid, not_found = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
    opens = {
        "prompt": open_request("bad", []),
        "max_tokens": open_request("bad", [1], max_tokens=0),
        "temperature": verifier_pb2.OpenVerifyRequest(
            sequence_id="bad", prompt_ids=[1], max_tokens=4, sampling=common_pb2.SamplingParams(temperature=-1)
        ),
        "top_p": verifier_pb2.OpenVerifyRequest(
            sequence_id="bad", prompt_ids=[1], max_tokens=4, sampling=common_pb2.SamplingParams(top_p=1.5)
        ),
    }
    for field, request in opens.items():
        error = rpc_error(stub.OpenSequence, request)
        assert error.code() == invalid and error.details().startswith(f"{field}: "), (field, error.details())
    stub.OpenSequence(open_request("ok", [1, 2, 3]), timeout=TIMEOUT_S)
    error = rpc_error(stub.OpenSequence, open_request("ok", [1, 2, 3]))
    assert error.code() == invalid and "already open" in error.details()
    unknown = verifier_pb2.VerifyRequest(sequence_id="nope")
    error = rpc_error(stub.Verify, unknown)
    assert error.code() == not_found and error.details().startswith("sequence_id: ")
    one = torch.tensor([0], dtype=torch.int32).numpy().tobytes()
    half = torch.tensor([0.5], dtype=torch.float32).numpy().tobytes()
    full = torch.tensor([1.0], dtype=torch.float32).numpy().tobytes()
    malformed = {
        "ids of 3 bytes": (raw_proposal([0], [-1], b"\0\0\0", full, [0]), "proposal.draft.rows[0]: "),
        "ids and probs differ in length": (raw_proposal([0], [-1], one + one, full, [0]), "proposal.draft.rows[0]: "),
        "node_rows names no row": (raw_proposal([0], [-1], one, full, [1]), "proposal.draft.node_rows: "),
        "row sums to 0.5": (raw_proposal([0], [-1], one, half, [0]), "proposal.draft.rows: "),
        "q(token) = 0": (raw_proposal([3], [-1], one, full, [0]), "proposal.draft.rows: "),
        "parent after child": (
            common_pb2.Proposal(tree=common_pb2.TokenTree(tokens=[1], parents=[3])),
            "proposal.tree: ",
        ),
        "token out of vocabulary": (
            common_pb2.Proposal(tree=common_pb2.TokenTree(tokens=[9], parents=[-1])),
            "proposal",
        ),
    }
    for case, (proposal, prefix) in malformed.items():
        error = rpc_error(stub.Verify, verifier_pb2.VerifyRequest(sequence_id="ok", proposal=proposal))
        assert error.code() == invalid and error.details().startswith(prefix), (case, error.details())
    # nothing was consumed or broken: the sequence and the server go on
    reply = stub.Verify(verifier_pb2.VerifyRequest(sequence_id="ok"), timeout=TIMEOUT_S)
    assert len(reply.verdict.emitted) == 1
    stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id="ok"), timeout=TIMEOUT_S)
    stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id="ok"), timeout=TIMEOUT_S)  # idempotent
    test_health_serving(channel)
    assert (status(stub).open_sequences, status(stub).runner_sequences) == (0, 0)


def test_capacity_and_shutdown(target) -> None:
    running = start_verifier(VerifierConfig(max_sequences=2), model=target)
    with grpc.insecure_channel(running.address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        for name in ("a", "b"):
            stub.OpenSequence(open_request(name, [1, 2]), timeout=TIMEOUT_S)
        error = rpc_error(stub.OpenSequence, open_request("c", [1, 2]))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        verify(stub, "a", Proposal(TokenTree.empty(), None))
        running.stop(grace_s=0)
        assert running.scheduler.verifier.num_open == 0 and running.scheduler.verifier.runner.num_open == 0
        error = rpc_error(stub.Status, verifier_pb2.VerifierStatusRequest())
        assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_no_state_left_after_many_sequences(stub, target) -> None:
    params = SamplingParams(temperature=1.0)
    for index in range(40):
        name = f"leak{index}"
        stub.OpenSequence(open_request(name, [1 + index % 6, 2], params, seed=index, max_tokens=5), timeout=TIMEOUT_S)
        for _ in range(index % 4):  # some finish, some are abandoned mid-way, some never verified
            reply = verify(stub, name, Proposal(TokenTree.chain([index % VOCAB]), None), defer_bonus=index % 2 == 0)
            if reply.verdict.finished:
                break
        stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id=name), timeout=TIMEOUT_S)
    assert (status(stub).open_sequences, status(stub).runner_sequences) == (0, 0)


def test_scheduler_batches_what_waits_and_a_bad_call_fails_alone(target) -> None:
    """Jobs queued before the thread starts are taken together: a deterministic batch."""
    verifier = BatchVerifier(KVRunner(target.model))
    scheduler = VerifyScheduler(verifier, max_batch_size=8, max_queued=3)
    opened = [scheduler.open(name, [1, 2], GREEDY, 0, 4, frozenset(), True, False) for name in "abc"]
    good, bad = Proposal(TokenTree.chain([3]), None), Proposal(TokenTree.chain([VOCAB]), None)
    calls = [scheduler.verify(VerifyCall(name, good if name != "b" else bad)) for name in "abc"]
    with pytest.raises(CapacityError):  # max_queued Verify calls already wait
        scheduler.verify(VerifyCall("a", good))
    closed = scheduler.close("a")  # after a's Verify, which it follows in arrival order
    scheduler.start()
    for future in [*opened, closed]:
        assert future.result(TIMEOUT_S) is None
    first, failed, third = (future.exception(TIMEOUT_S) or future.result() for future in calls)
    assert isinstance(failed, InvalidArgumentError) and failed.field == "proposal.tree.tokens"
    assert first.batch_size == third.batch_size == 2 and first.verdict.emitted == third.verdict.emitted
    assert scheduler.status().result(TIMEOUT_S) == SchedulerStatus(2, 2, 2, 1, 2)
    scheduler.stop()
    assert verifier.num_open == 0 and verifier.runner.num_open == 0, "stop frees every sequence"
    assert isinstance(scheduler.status().exception(TIMEOUT_S), SchedulerStoppedError)


def test_a_prompt_behind_too_much_prefill_is_refused_until_that_prefill_is_done(target) -> None:
    """An open whose prompt would wait behind more than ``max_prefill_backlog_s`` of other prompts' prefill fails with
    CapacityError (RESOURCE_EXHAUSTED) instead of waiting past the router's deadline; one with nothing ahead of it is
    always taken. The prefill is priced as forwards of ``max_batch_tokens`` on the verifier's cost curve, seeded
    from a calibration (here 0.5 s for 1 position, 1 s for 16) and updated by every forward it runs."""
    long_prompt = [1 + index % (VOCAB - 2) for index in range(80)]

    def scheduler_behind_long_prompt(bound_s: float) -> VerifyScheduler:
        scheduler = VerifyScheduler(
            BatchVerifier(KVRunner(target.model)),
            max_batch_size=8,
            max_queued=8,
            max_batch_tokens=16,
            max_prefill_backlog_s=bound_s,
            forward_costs=[(1, 0.5), (16, 1.0)],
        )
        scheduler.start()
        assert scheduler.open("a", long_prompt, GREEDY, 0, 4, frozenset(), True, False).result(TIMEOUT_S) is None
        return scheduler

    roomy = scheduler_behind_long_prompt(5.2)  # 79 + 2 tokens to prefill: 81 / 16 forwards of 1 s = 5.06 s
    assert roomy.open("b", [1, 2], GREEDY, 0, 4, frozenset(), True, False).result(TIMEOUT_S) is None
    roomy.stop()
    scheduler = scheduler_behind_long_prompt(5.0)
    refused = scheduler.open("b", [1, 2], GREEDY, 0, 4, frozenset(), True, False).exception(TIMEOUT_S)
    assert isinstance(refused, CapacityError) and "79 prompt tokens to prefill (~4.9 s)" in str(refused)
    assert "max_prefill_backlog_s" in str(refused)
    scheduler.verify(VerifyCall("a", Proposal(TokenTree.chain([3]), None))).result(TIMEOUT_S)  # a's prompt prefilled
    assert scheduler.forward_cost.seconds(16) < 1.0  # its forwards were timed
    assert scheduler.open("b", [1, 2], GREEDY, 0, 4, frozenset(), True, False).result(TIMEOUT_S) is None
    scheduler.stop()


def test_each_outcome_says_how_long_its_call_waited_for_its_forward(target) -> None:
    """A call queued while the scheduler thread was not yet running waited until its forward started; the reply
    carries that wait (the router leaves it out of a round's fixed cost)."""
    scheduler = VerifyScheduler(BatchVerifier(KVRunner(target.model)), max_batch_size=8, max_queued=8)
    opened = scheduler.open("q", [1, 2], GREEDY, 0, 4, frozenset(), True, False)
    call = scheduler.verify(VerifyCall("q", Proposal(TokenTree.chain([3]), None)))
    time.sleep(0.2)
    scheduler.start()
    assert opened.result(TIMEOUT_S) is None
    assert call.result(TIMEOUT_S).queued_s >= 0.2
    again = scheduler.verify(VerifyCall("q", Proposal(TokenTree.chain([3]), None)))
    assert again.result(TIMEOUT_S).queued_s < 0.2
    scheduler.stop()


def test_token_budget_splits_prefills_over_forwards(target) -> None:
    """Each first Verify prefills its 2-token prompt plus 1 draft node: 3 positions. A budget of 6 runs them in
    one forward; a budget of 5 verifies one and prefills a token of the other's prompt in the room left, then
    verifies it; a budget of 2 prefills a token of each prompt, then verifies them in turn. Jobs queued before
    the thread starts are taken together, so the batches are deterministic."""
    good = Proposal(TokenTree.chain([3]), None)

    def batch_sizes(max_batch_tokens: int) -> list[int]:
        verifier = BatchVerifier(KVRunner(target.model))
        scheduler = VerifyScheduler(verifier, max_batch_size=8, max_queued=8, max_batch_tokens=max_batch_tokens)
        for name in "ab":
            scheduler.open(name, [1, 2], GREEDY, 0, 4, frozenset(), True, False)
        calls = [scheduler.verify(VerifyCall(name, good)) for name in "ab"]
        scheduler.start()
        sizes = [future.result(TIMEOUT_S).batch_size for future in calls]
        scheduler.stop()
        return sizes

    assert batch_sizes(6) == [2, 2]
    assert batch_sizes(5) == [1, 1]
    assert batch_sizes(2) == [1, 1]


class CountingRunner(KVRunner):
    """Records the positions of every forward, then calls ``on_forward(count of forwards)`` (scheduler thread)."""

    def __init__(self, model: torch.nn.Module, on_forward: Callable[[int], None] = lambda count: None) -> None:
        super().__init__(model)
        self.positions: list[int] = []
        self.on_forward = on_forward

    def forward(self, items: Sequence[ForwardItem], *, all_logits: bool = False) -> list[torch.Tensor]:
        self.positions.append(sum(len(item.pending) + len(item.tree) for item in items))
        logits = super().forward(items, all_logits=all_logits)
        self.on_forward(len(self.positions))
        return logits


LONG_PROMPT = [(5 * i + 1) % VOCAB for i in range(40)]
BUDGET = 4


def test_chunked_prefill_lets_short_rounds_go_first(target) -> None:
    """With a budget of 4, a 40-token prompt is prefilled in the room a short sequence's rounds leave: no forward
    holds more than 4 positions, every short round is answered before the long call, and both outputs are the
    target's greedy ones. Each short round is submitted as the last one is answered (on the scheduler thread)."""
    runner = CountingRunner(target.model)
    scheduler = VerifyScheduler(BatchVerifier(runner), max_batch_size=8, max_queued=8, max_batch_tokens=BUDGET)
    long_truth, short_truth = hf_greedy(target, LONG_PROMPT, 2), hf_greedy(target, [1, 2], 6)
    scheduler.open("long", LONG_PROMPT, GREEDY, 0, 2, frozenset(), True, False)
    scheduler.open("short", [1, 2], GREEDY, 0, 6, frozenset(), True, False)
    answered: list[str] = []
    short_out: list[int] = []
    short_done = threading.Event()

    def next_short(future: Future | None) -> None:
        if future is not None:
            answered.append("short")
            outcome = future.result()
            short_out.extend(outcome.verdict.emitted)
            if outcome.verdict.finished:
                short_done.set()
                return
        chain = Proposal(TokenTree.chain(short_truth[len(short_out) : len(short_out) + 1]), None)
        scheduler.verify(VerifyCall("short", chain)).add_done_callback(next_short)

    long_call = scheduler.verify(VerifyCall("long", Proposal(TokenTree.chain(long_truth[:1]), None)))
    long_call.add_done_callback(lambda future: answered.append("long"))
    next_short(None)
    scheduler.start()
    assert long_call.result(TIMEOUT_S).verdict.emitted == long_truth
    assert short_done.wait(TIMEOUT_S) and short_out == short_truth
    assert answered == ["short"] * 3 + ["long"], "the short rounds waited for the long prefill"
    assert max(runner.positions) <= BUDGET and sum(runner.positions) == len(LONG_PROMPT) + 1 + 3 + 2 * 2
    chunks = scheduler.metrics.registry.get_sample_value("specdec:verifier_prefill_chunks_total")
    assert chunks == len(runner.positions) - 1, "every forward but the long call's own prefilled a chunk"
    scheduler.stop()
    assert runner.num_open == 0


def test_close_or_cancel_during_a_chunked_prefill(target) -> None:
    """A Verify cancelled while its prompt is prefilled stops the prefill, and the next call goes on from the
    chunks already in place; a CloseSequence mid-prefill frees the runner's sequence at once and fails the
    waiting Verify as for an unknown sequence, and the id can be opened afresh; stop() finishes a prefill."""
    actions: dict[int, Callable[[], None]] = {}
    runner = CountingRunner(target.model, lambda count: actions.pop(count, lambda: None)())
    verifier = BatchVerifier(runner)
    scheduler = VerifyScheduler(verifier, max_batch_size=8, max_queued=8, max_batch_tokens=BUDGET)
    truth = hf_greedy(target, LONG_PROMPT, 2)
    chain = Proposal(TokenTree.chain(truth[:1]), None)

    scheduler.open("a", LONG_PROMPT, GREEDY, 0, 2, frozenset(), True, False)
    cancelled, seen = scheduler.verify(VerifyCall("a", chain)), threading.Event()
    actions[2] = lambda: seen.set() if cancelled.cancel() else None  # after the second chunk, between forwards
    scheduler.start()
    assert seen.wait(TIMEOUT_S)
    scheduler.status().result(TIMEOUT_S)  # a later pass: the cancelled call is dropped
    assert runner.positions == [BUDGET, BUDGET]
    assert scheduler.verify(VerifyCall("a", chain)).result(TIMEOUT_S).verdict.emitted == truth
    assert scheduler.close("a").result(TIMEOUT_S) is None and runner.num_open == 0

    scheduler.open("b", LONG_PROMPT, GREEDY, 0, 2, frozenset(), True, False).result(TIMEOUT_S)
    closed: list[Future] = []
    actions[len(runner.positions) + 2] = lambda: closed.append(scheduler.close("b"))
    waiting = scheduler.verify(VerifyCall("b", chain))
    assert isinstance(waiting.exception(TIMEOUT_S), SequenceNotFoundError)
    assert closed[0].result(TIMEOUT_S) is None and runner.num_open == 0 and verifier.num_open == 0
    scheduler.open("b", [1, 2], GREEDY, 0, 2, frozenset(), True, False).result(TIMEOUT_S)
    empty = Proposal(TokenTree.empty(), None)
    assert scheduler.verify(VerifyCall("b", empty)).result(TIMEOUT_S).verdict.emitted == hf_greedy(target, [1, 2], 1)
    scheduler.close("b").result(TIMEOUT_S)

    scheduler.open("c", LONG_PROMPT, GREEDY, 0, 2, frozenset(), True, False).result(TIMEOUT_S)
    last = scheduler.verify(VerifyCall("c", chain))
    scheduler.stop()
    assert last.result(0).verdict.emitted == truth and runner.num_open == 0
    assert max(runner.positions) <= BUDGET


def test_batch_window_gathers_late_calls_and_never_delays_a_lone_sequence(target) -> None:
    """A window far longer than the test: a batch that cannot grow is run at once, so only the batch sizes and
    a prompt answer depend on the window, never the timing."""
    window_s = 120.0
    good = Proposal(TokenTree.chain([3]), None)

    def scheduler_with(names: str, max_batch_size: int = 8) -> VerifyScheduler:
        scheduler = VerifyScheduler(
            BatchVerifier(KVRunner(target.model)), max_batch_size=max_batch_size, max_queued=8, batch_wait_s=window_s
        )
        scheduler.start()
        for name in names:
            scheduler.open(name, [1, 2], GREEDY, 0, 4, frozenset(), True, False).result(PROMPT_S)
        return scheduler

    def batch_size(future) -> int:
        return future.result(PROMPT_S).batch_size

    alone = scheduler_with("s")  # one open sequence: its Verify completes the batch
    assert batch_size(alone.verify(VerifyCall("s", good))) == 1
    alone.stop()

    late = scheduler_with("ab")  # b's Verify arrives while a's waits in the window: one forward
    first = late.verify(VerifyCall("a", good))
    time.sleep(0.05)
    assert not first.done(), "a's Verify did not wait for b's"
    second = late.verify(VerifyCall("b", good))
    assert batch_size(first) == batch_size(second) == 2
    late.stop()

    closing = scheduler_with("ab")  # b's CloseSequence arrives instead: the batch cannot grow
    first = closing.verify(VerifyCall("a", good))
    assert closing.close("b").result(PROMPT_S) is None and batch_size(first) == 1
    closing.stop()

    full = scheduler_with("ab", max_batch_size=1)  # the batch is full at max_batch_size
    assert batch_size(full.verify(VerifyCall("a", good))) == 1
    full.stop()


def test_idle_trim_runs_once_the_scheduler_goes_idle(target) -> None:
    trimmed = threading.Event()
    scheduler = VerifyScheduler(
        BatchVerifier(KVRunner(target.model)), max_batch_size=8, max_queued=8, idle_trim=IdleTrim(0.01, trimmed.set)
    )
    scheduler.start()
    scheduler.open("a", [1, 2], GREEDY, 0, 4, frozenset(), True, False).result(TIMEOUT_S)
    assert scheduler.verify(VerifyCall("a", Proposal(TokenTree.chain([3]), None))).result(TIMEOUT_S).verdict.emitted
    assert trimmed.wait(TIMEOUT_S), "no job for idle_s after work: trim"
    assert scheduler.status().result(TIMEOUT_S).verify_calls == 1, "the scheduler serves on after a trim"
    scheduler.stop()


def test_config_from_args_and_env() -> None:
    config = VerifierConfig.from_args(
        ["--port", "5050", "--max-batch-size", "4"], {"SPECDEC_VERIFIER_MODEL": "m", "SPECDEC_VERIFIER_PORT": "1"}
    )
    assert (config.model, config.port, config.max_batch_size, config.handler_threads) == ("m", 5050, 4, 264)
    with pytest.raises(ValueError, match="max_batch_size"):
        VerifierConfig(max_batch_size=0)
    assert VerifierConfig.from_args([], {"SPECDEC_VERIFIER_BATCH_WAIT_MS": "2.5"}).batch_wait_ms == 2.5
    assert VerifierConfig().batch_wait_ms == 0  # a step loop: no fixed window unless asked for
    assert VerifierConfig.from_args(["--batch-wait-ms", "3"], {}).batch_wait_ms == 3
    with pytest.raises(ValueError, match="batch_wait_ms"):
        VerifierConfig(batch_wait_ms=-1)
    assert VerifierConfig().malloc_trim_idle_s == 1.0
    assert VerifierConfig().malloc_mmap_threshold_mb == 16
    assert VerifierConfig.from_args(["--malloc-mmap-threshold-mb", "0"], {}).malloc_mmap_threshold_mb == 0
    assert VerifierConfig.from_args(["--malloc-trim-idle-s", "0"], {}).malloc_trim_idle_s == 0
    assert VerifierConfig.from_args([], {"SPECDEC_VERIFIER_MALLOC_TRIM_IDLE_S": "2.5"}).malloc_trim_idle_s == 2.5
    with pytest.raises(ValueError, match="malloc_trim_idle_s"):
        VerifierConfig(malloc_trim_idle_s=-1)
    assert VerifierConfig().max_prefill_backlog_s == 10.0
    assert VerifierConfig.from_args(["--max-prefill-backlog-s", "0"], {}).max_prefill_backlog_s == 0
    with pytest.raises(ValueError, match="max_prefill_backlog_s"):
        VerifierConfig(max_prefill_backlog_s=-1)


def test_module_entry_point_serves_and_stops_on_sigterm(tmp_path: Path, target) -> None:
    target.model.save_pretrained(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SPECDEC_VERIFIER_MAX_SEQUENCES": "4"}
    process = subprocess.Popen(
        [sys.executable, "-m", "verifier_service", "--model", str(tmp_path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        address = json.loads(process.stdout.readline())["address"]
        with grpc.insecure_channel(address) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            stub.OpenSequence(open_request("p", [1, 2, 3]), timeout=TIMEOUT_S)
            assert len(verify(stub, "p", Proposal(TokenTree.chain([4]), None)).verdict.emitted) >= 1
            assert status(stub).open_sequences == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_status_reports_the_forward_costs_timed_before_serving(stub) -> None:
    costs = status(stub).forward_costs  # calibrate_positions 64, but a 64-token context leaves 32 past the text
    assert [cost.positions for cost in costs] == [1, 2, 4, 8, 16, 32]
    assert all(cost.seconds > 0 for cost in costs)


def test_calibration_can_be_switched_off(target) -> None:
    assert VerifierConfig().calibrate_positions == 64
    with pytest.raises(InvalidArgumentError, match="calibrate_positions"):
        VerifierConfig(calibrate_positions=-1)
    running = start_verifier(VerifierConfig(calibrate_positions=0), model=target)
    try:
        with grpc.insecure_channel(running.address) as channel:
            assert not status(verifier_pb2_grpc.VerifierStub(channel)).forward_costs
    finally:
        running.stop(grace_s=0)
