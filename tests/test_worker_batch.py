"""The workers' ``Batch`` RPC and the router's side of it (:mod:`router.batching`), and stream chunk merging.

A Batch must mean exactly what its calls would mean as unary RPCs in the same order: the same replies, each
failure confined to its own call with the status its RPC would have had.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import weakref
from concurrent.futures import Future

import grpc
import pytest
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from drafter_service.server import start_drafter
from grpc_common.batch import StartedBatch, Submitted, message_groups, stream_batches
from grpc_common.convert import tree_from_wire
from grpc_common.convert_rows import proposal_to_wire
from router.batching import CallBatcher
from router.errors import WorkerBusyError, WorkerError, WorkerUnavailableError
from router.pipeline import Chunk, SequenceSpec
from router.requests import DraftShape
from router.servicer import merge_chunks
from router.workers import GrpcDrafter, Worker, call_failure
from specdec.drafters.base import Proposal
from specdec.sampling import SamplingParams, TopLogprobs
from specdec.tree import TokenTree
from tests.test_drafter_service import config_for
from tests.test_drafter_service import open_request as open_draft_request
from tests.test_verifier_service import TIMEOUT_S, VOCAB, hf_greedy, open_request
from tests.tiny_models import tiny_draft, tiny_llama
from verifier_service.config import VerifierConfig
from verifier_service.server import start_verifier
from verifier_service.servicer import VERIFIER_BATCH

PROMPT = [1, 2, 3, 4]


def verify_call(sequence_id: str, tokens: list[int] = ()) -> verifier_pb2.VerifierCall:
    proposal = proposal_to_wire(Proposal(TokenTree.chain(list(tokens)), None))
    return verifier_pb2.VerifierCall(verify=verifier_pb2.VerifyRequest(sequence_id=sequence_id, proposal=proposal))


def test_verifier_batch_answers_each_call_as_its_own_rpc_would() -> None:
    target = tiny_llama(seed=21, vocab_size=VOCAB, num_layers=2)
    truth = hf_greedy(target, PROMPT, 3)
    running = start_verifier(VerifierConfig(max_batch_size=16, max_sequences=8, max_seq_len=64), model=target)
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            calls = [
                verifier_pb2.VerifierCall(open=open_request("a", PROMPT)),
                verifier_pb2.VerifierCall(open=open_request("b", PROMPT)),
                verify_call("a"),
                verify_call("nobody"),
                verify_call("b", truth[:2]),  # both draft tokens right: 3 tokens in one round
                verify_call("a"),  # after a's first round, in order
                verifier_pb2.VerifierCall(close=verifier_pb2.CloseVerifyRequest(sequence_id="a")),
                verifier_pb2.VerifierCall(open=open_request("a", PROMPT)),  # reopened after its close
                verifier_pb2.VerifierCall(),
            ]
            reply = stub.Batch(verifier_pb2.VerifierBatchRequest(calls=calls), timeout=TIMEOUT_S)
            kinds = [result.WhichOneof("result") for result in reply.results]
            assert kinds == ["open", "open", "verify", "error", "verify", "verify", "close", "open", "error"]
            results = reply.results
            assert list(results[2].verify.verdict.emitted) == truth[:1]
            assert list(results[5].verify.verdict.emitted) == truth[1:2]
            assert list(results[4].verify.verdict.emitted) == truth
            assert results[3].error.code == grpc.StatusCode.NOT_FOUND.value[0]
            assert "nobody" in results[3].error.message
            assert results[8].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert running.scheduler.status().result(TIMEOUT_S).open_sequences == 2  # a (reopened) and b
    finally:
        running.stop(grace_s=0)


def test_verifier_batch_stream_answers_batches_by_id_and_refuses_an_oversized_one_alone() -> None:
    target = tiny_llama(seed=22, vocab_size=VOCAB, num_layers=2)
    truth = hf_greedy(target, PROMPT, 2)
    config = VerifierConfig(max_batch_size=16, max_sequences=8, max_seq_len=64, max_batch_calls=3)
    running = start_verifier(config, model=target)
    close = verifier_pb2.VerifierCall(close=verifier_pb2.CloseVerifyRequest(sequence_id="b"))
    batches = [
        [
            verifier_pb2.VerifierCall(open=open_request("a", PROMPT)),
            verifier_pb2.VerifierCall(open=open_request("b", PROMPT)),
        ],
        [verify_call("a"), verify_call("b", truth[:1])],  # after the opens: batches start in the order they arrive
        [close] * 4,  # over the bound: every call refused, the stream and the other batches unharmed
        [verify_call("a")],
    ]
    requests = [verifier_pb2.VerifierBatchRequest(calls=calls, batch_id=10 + i) for i, calls in enumerate(batches)]
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            assert stub.Status(verifier_pb2.VerifierStatusRequest(), timeout=TIMEOUT_S).batch_stream
            replies = {
                reply.batch_id: [result for result in reply.results]
                for message in stub.BatchStream(iter(requests), timeout=TIMEOUT_S)
                for reply in message.replies
            }
        assert sorted(replies) == [10, 11, 12, 13]
        assert [result.WhichOneof("result") for result in replies[10]] == ["open", "open"]
        assert list(replies[11][0].verify.verdict.emitted) == truth[:1]
        assert list(replies[11][1].verify.verdict.emitted) == truth
        assert all(result.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for result in replies[12])
        assert "calls" in replies[12][0].error.message and len(replies[12]) == 4
        assert list(replies[13][0].verify.verdict.emitted) == truth[1:2]
    finally:
        running.stop(grace_s=0)


class _Context:
    def add_callback(self, callback) -> None:
        self.callback = callback


def test_a_batch_the_router_gave_up_on_drops_its_calls_not_started() -> None:
    """``cancel_batch_ids`` (sent when a batch's deadline passes) cancels the jobs of that batch still queued, as a
    cancelled unary Batch RPC does; the message itself is no batch."""
    queued: list[Future] = []

    def submit(kind: str, request) -> Submitted:
        queued.append(Future())  # a job that never runs unless dropped
        return Submitted(queued[-1], lambda reply: reply)

    def start(request: verifier_pb2.VerifierBatchRequest) -> StartedBatch:
        return StartedBatch.start(request.calls, submit)

    requests = [
        verifier_pb2.VerifierBatchRequest(calls=[verify_call("a"), verify_call("b")], batch_id=1),
        verifier_pb2.VerifierBatchRequest(cancel_batch_ids=[1]),
    ]
    messages: list = []
    answers = stream_batches(iter(requests), start, VERIFIER_BATCH, _Context())
    answering = threading.Thread(target=lambda: messages.extend(answers), daemon=True)
    answering.start()
    answering.join(timeout=TIMEOUT_S)
    assert not answering.is_alive(), "the given-up batch was never answered: its jobs were not dropped"
    [message] = messages
    [answer] = message.replies
    assert answer.batch_id == 1 and all(future.cancelled() for future in queued)
    assert [result.error.code for result in answer.results] == [grpc.StatusCode.CANCELLED.value[0]] * 2


def test_drafter_batch_keeps_a_sequences_calls_in_order() -> None:
    target = tiny_llama(seed=51, vocab_size=VOCAB, num_layers=2)
    draft = tiny_draft(target, seed=52, num_layers=1, noise=0.2)
    running = start_drafter(config_for("model"), target=target, draft=draft)
    sampled = SamplingParams(temperature=0.8)
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)

            def batch(*calls: drafter_pb2.DrafterCall) -> list[drafter_pb2.DrafterResult]:
                request = drafter_pb2.DrafterBatchRequest(calls=calls)
                return list(stub.Batch(request, timeout=TIMEOUT_S).results)

            propose = drafter_pb2.DrafterCall(propose=drafter_pb2.ProposeRequest(sequence_id="s", max_tokens=3))
            opened, first = batch(drafter_pb2.DrafterCall(open=open_draft_request("s", PROMPT, sampled)), propose)
            assert opened.WhichOneof("result") == "open" and first.WhichOneof("result") == "propose"
            drafted = list(tree_from_wire(first.propose.proposal.tree).tokens)
            commit = drafter_pb2.DraftCommitRequest(sequence_id="s", base_length=len(PROMPT), emitted=drafted[:1])
            close = drafter_pb2.CloseDraftRequest(sequence_id="s")
            results = batch(
                drafter_pb2.DrafterCall(commit=commit),
                propose,
                drafter_pb2.DrafterCall(close=close),
                propose,  # after the close: NOT_FOUND, alone
            )
            assert [result.WhichOneof("result") for result in results] == ["commit", "propose", "close", "error"]
            assert results[1].propose.proposal.ByteSize() > 0
            assert results[3].error.code == grpc.StatusCode.NOT_FOUND.value[0]
    finally:
        running.stop(grace_s=0)


def test_call_batcher_sends_one_batch_per_tick_and_fails_calls_alone() -> None:
    sent: list[list[str]] = []

    async def send(calls: list[str]) -> list[str]:
        sent.append(calls)
        if "down" in calls:
            raise WorkerUnavailableError("w", "UNAVAILABLE", "gone")
        return [call.upper() for call in calls]

    async def run() -> None:
        batcher: CallBatcher[str, str] = CallBatcher("w", send, max_calls=3)
        results = await asyncio.gather(*(batcher.submit(call) for call in "abcd"))
        assert results == ["A", "B", "C", "D"]
        assert sent == [["a", "b", "c"], ["d"]]  # one tick, split at max_calls
        assert await batcher.submit("e") == "E"  # a later tick: its own batch
        assert sent[-1] == ["e"]
        down = await asyncio.gather(batcher.submit("down"), batcher.submit("f"), return_exceptions=True)
        assert all(isinstance(result, WorkerUnavailableError) for result in down)
        assert (batcher.batches, batcher.calls) == (4, 7)

    asyncio.run(run())


def test_call_batcher_keeps_each_batch_within_the_workers_bound_on_nodes() -> None:
    """Calls weigh their length (a verifier's proposal nodes): a batch holds at most 5, a heavier call goes alone."""
    sent: list[list[str]] = []

    async def send(calls: list[str]) -> list[str]:
        sent.append(calls)
        return [call.upper() for call in calls]

    async def run() -> None:
        batcher: CallBatcher[str, str] = CallBatcher("w", send, max_calls=3, limits=[5])
        calls = ["aa", "bb", "c", "dddddd", "e", "f", "g", "h"]
        submitted = (batcher.submit(call, [len(call)]) for call in calls)
        assert await asyncio.gather(*submitted) == [call.upper() for call in calls]
        assert sent == [["aa", "bb", "c"], ["dddddd"], ["e", "f", "g"], ["h"]]

    asyncio.run(run())


def test_call_batcher_keeps_each_batch_within_every_bound() -> None:
    """Two bounds (length at most 5, at most two "x"): a batch closes when the next call would break either."""
    sent: list[list[str]] = []

    async def send(calls: list[str]) -> list[str]:
        sent.append(calls)
        return calls

    async def run() -> None:
        batcher: CallBatcher[str, str] = CallBatcher("w", send, max_calls=8, limits=[5, 2])
        calls = ["x", "ax", "x", "bb", "ccc", "d", "e"]
        weights = [[len(call), call.count("x")] for call in calls[:-1]] + [[]]  # "e" gives none: it weighs nothing
        await asyncio.gather(*(batcher.submit(call, weight) for call, weight in zip(calls, weights, strict=True)))
        assert sent == [["x", "ax"], ["x", "bb"], ["ccc", "d", "e"]]

    asyncio.run(run())


def test_call_batcher_never_splits_a_group_between_batches() -> None:
    """Two batches of one tick travel concurrently and a worker may run the second first, so a group (a Commit and
    the Propose drafting from it) stays in one batch: the batch before it closes early instead."""
    sent: list[list[str]] = []

    async def send(calls: list[str]) -> list[str]:
        sent.append(calls)
        return [call.upper() for call in calls]

    async def run() -> None:
        batcher: CallBatcher[str, str] = CallBatcher("w", send, max_calls=3)
        singles = [batcher.submit("a"), batcher.submit("b")]
        group = batcher.submit_group(["commit", "propose"])
        last = batcher.submit("c")
        assert await asyncio.gather(*singles, *group, last) == ["A", "B", "COMMIT", "PROPOSE", "C"]
        assert sent == [["a", "b"], ["commit", "propose", "c"]]

    asyncio.run(run())


def test_a_calls_error_maps_to_the_router_error_of_its_status() -> None:
    def failure(code: grpc.StatusCode) -> WorkerError:
        return call_failure("w", drafter_pb2.DrafterResult(error={"code": code.value[0], "message": "m"}).error)

    assert isinstance(failure(grpc.StatusCode.RESOURCE_EXHAUSTED), WorkerBusyError)
    assert isinstance(failure(grpc.StatusCode.INVALID_ARGUMENT), ValueError)
    assert isinstance(failure(grpc.StatusCode.NOT_FOUND), WorkerUnavailableError)


@pytest.mark.parametrize("logprobs", [False, True])
def test_merged_chunks_carry_the_same_tokens_text_and_logprobs(logprobs: bool) -> None:
    def top(token: int) -> tuple[TopLogprobs, ...]:
        return (TopLogprobs((token, 0), (-0.1 * token, -3.0)),) if logprobs else ()

    chunks = [
        Chunk((1, 2), "ab", (-0.1, -0.2) if logprobs else (), top(1) + top(2)),
        Chunk((3,), "", (-0.3,) if logprobs else (), top(3)),
        Chunk((4,), "cd", (-0.4,) if logprobs else (), top(4)),
    ]
    merged = merge_chunks(chunks)
    assert merged.token_ids == (1, 2, 3, 4) and merged.text == "abcd"
    assert merged.logprobs == ((-0.1, -0.2, -0.3, -0.4) if logprobs else ())
    assert merged.top_logprobs == top(1) + top(2) + top(3) + top(4)
    assert merge_chunks(chunks[:1]) is chunks[0]


def test_a_commit_carried_on_a_propose_is_one_message_with_the_same_effect() -> None:
    target = tiny_llama(seed=51, vocab_size=VOCAB, num_layers=2)
    running = start_drafter(config_for("model"), target=target, draft=tiny_draft(target, seed=52, num_layers=1))
    spec = SequenceSpec(tuple(PROMPT), SamplingParams(temperature=0.8), 16, False, False, DraftShape(3))

    async def run() -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
        worker = Worker("drafter", running.address, grpc.aio.insecure_channel(running.address), TIMEOUT_S)
        drafter = GrpcDrafter(worker)
        try:
            for sequence_id in ("apart", "carried", "uncommitted"):
                await drafter.open(sequence_id, spec, seed=5)
                first = await drafter.propose(sequence_id, 3, assume_previous_accepted=False)
            emitted = (first.tree.tokens[0], (first.tree.tokens[0] + 1) % VOCAB)
            await drafter.commit("apart", len(PROMPT), emitted)
            apart = await drafter.propose("apart", 3, assume_previous_accepted=False)
            batches = drafter.batcher.batches
            carried = await drafter.propose("carried", 3, assume_previous_accepted=False, commit=(len(PROMPT), emitted))
            batches = drafter.batcher.batches - batches
            uncommitted = await drafter.propose("uncommitted", 3, assume_previous_accepted=False)
            return apart.tree.tokens, carried.tree.tokens, uncommitted.tree.tokens, batches
        finally:
            await worker.channel.close()

    try:
        apart, carried, uncommitted, batches = asyncio.run(run())
    finally:
        running.stop(grace_s=0)
    assert carried == apart and batches == 1
    assert uncommitted != apart  # the commit changed what is drafted, so the equality above means something


def test_replies_that_would_outgrow_a_message_go_in_several() -> None:
    """Batches answered together travel in one message, unless their replies outgrow ``max_message_bytes``: then in
    as many as keep each under it, in order; one reply alone over it still goes, alone."""
    rows = [verifier_pb2.VerifyReply(features=common_pb2.FeatureRows(width=1, data=b"x" * n)) for n in (4000, 100)]
    replies = [
        verifier_pb2.VerifierBatchReply(results=[verifier_pb2.VerifierResult(verify=rows[i % 2])], batch_id=i)
        for i in range(5)
    ]  # 4 kB, 0.1 kB, 4 kB, 0.1 kB, 4 kB
    assert message_groups(replies, None) == [replies]
    groups = message_groups(replies, 9000)
    assert [[reply.batch_id for reply in group] for group in groups] == [[0, 1, 2, 3], [4]]
    assert all(verifier_pb2.VerifierBatchReplies(replies=group).ByteSize() <= 9000 for group in groups)
    assert [[reply.batch_id for reply in group] for group in message_groups(replies, 1000)] == [[0], [1], [2], [3], [4]]
    assert message_groups([], 9000) == []


def test_commits_relaying_megabytes_of_feature_rows_go_in_batches_that_fit_a_message() -> None:
    """Three Commits made in one tick go in one Batch, unless the feature rows they relay (a long prompt's) would
    outgrow half a message: then in as many Batches as keep each within it."""
    from router.workers import FEATURE_KILOBYTES_PER_BATCH

    async def batches_for(row_bytes: int) -> int:
        worker = Worker("drafter", "127.0.0.1:1", grpc.aio.insecure_channel("127.0.0.1:1"), TIMEOUT_S)
        drafter = GrpcDrafter(worker)
        rows = common_pb2.FeatureRows(width=1, data=b"\0" * row_bytes)
        try:
            commits = [drafter.commit(f"s{i}", 1, [2], features=rows) for i in range(3)]
            outcomes = await asyncio.gather(*commits, return_exceptions=True)
            assert all(isinstance(outcome, WorkerUnavailableError) for outcome in outcomes)  # nobody listens
            return drafter.batcher.batches
        finally:
            await worker.channel.close()

    large = FEATURE_KILOBYTES_PER_BATCH * 1024 * 2 // 3  # two of them are over the bound
    assert asyncio.run(batches_for(1024)) == 1
    assert asyncio.run(batches_for(large)) == 3


def test_prefills_whose_verdicts_bring_megabytes_of_feature_rows_go_in_batches_that_fit_a_message() -> None:
    """A verifier's first verdict for an eagle sequence brings its prompt's feature rows (those of at most the
    drafter's feature_context positions): three such prefills in one tick go in as many Batches as keep the rows
    they bring within half a message; without features, or once prefilled, they share one."""
    from router.workers import FEATURE_KILOBYTES_PER_BATCH, GrpcVerifier

    width = 3 * 576
    positions = FEATURE_KILOBYTES_PER_BATCH * 1024 * 2 // 3 // (2 * width)  # two prefills are over the bound

    async def batches_for(features: bool, prompt_length: int, context: int) -> tuple[int, int]:
        worker = Worker("verifier", "127.0.0.1:1", grpc.aio.insecure_channel("127.0.0.1:1"), TIMEOUT_S)
        verifier = GrpcVerifier(worker)
        spec = SequenceSpec(
            (1,) * prompt_length,
            SamplingParams(),
            8,
            False,
            False,
            DraftShape(3),
            features=features,
            feature_context=context,
            feature_width=width if features else 0,
        )
        try:
            for index in range(3):
                with contextlib.suppress(WorkerUnavailableError):  # nobody listens: the open fails, the sequence stays
                    await verifier.open(f"s{index}", spec, seed=0)
            before = verifier.batcher.batches
            first = [verifier.verify(f"s{i}", None, defer_bonus=False) for i in range(3)]
            await asyncio.gather(*first, return_exceptions=True)
            prefills = verifier.batcher.batches - before
            later = [verifier.verify(f"s{i}", None, defer_bonus=False) for i in range(3)]
            await asyncio.gather(*later, return_exceptions=True)
            return prefills, verifier.batcher.batches - before - prefills
        finally:
            await worker.channel.close()

    assert asyncio.run(batches_for(True, positions, 0)) == (3, 1)
    assert asyncio.run(batches_for(True, 10 * positions, positions)) == (3, 1)  # the context, not the prompt, counts
    assert asyncio.run(batches_for(True, 10 * positions, positions // 4)) == (1, 1)
    assert asyncio.run(batches_for(False, positions, 0)) == (1, 1)


def test_an_answered_batch_is_freed_without_waiting_for_the_cyclic_collector() -> None:
    """Once a batch is answered nothing keeps it (or its request, which may carry megabytes of feature rows): no
    reference cycle between its jobs' Futures and their done callbacks leaves it to the collector's rare full
    passes (a drafter's RSS grew by them under load)."""
    batches: list[weakref.ref] = []

    def submit(kind: str, request) -> Submitted:
        future: Future = Future()
        threading.Timer(0.01, future.set_result, args=(verifier_pb2.VerifyReply(),)).start()  # runs later
        return Submitted(future, lambda reply: reply)

    def start(request: verifier_pb2.VerifierBatchRequest) -> StartedBatch:
        batch = StartedBatch.start(request.calls, submit)
        batches.append(weakref.ref(batch))
        return batch

    requests = [
        verifier_pb2.VerifierBatchRequest(calls=[verify_call("a"), verify_call("b")], batch_id=batch_id)
        for batch_id in range(1, 4)
    ]
    gc.disable()
    try:
        replies = [
            reply.batch_id
            for message in stream_batches(iter(requests), start, VERIFIER_BATCH, _Context())
            for reply in message.replies
        ]
        assert sorted(replies) == [1, 2, 3]
        assert [batch() for batch in batches] == [None, None, None]
    finally:
        gc.enable()
