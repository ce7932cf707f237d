"""The router's public gRPC API and the client SDK, over loopback, with fake workers behind real gRPC servers.

The fake verifier and drafter of ``test_router_pipeline`` are served by ``grpc_common.server`` (so the router
talks to them exactly as to real workers) and can be slowed down, which makes overload and cancellation
deterministic. Real workers are exercised in ``test_router_services``.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specdec_wire.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)
from transformers import PreTrainedTokenizerBase

from drafter_service.servicer import DRAFTER_BATCH
from grpc_common.batch import StartedBatch, Submitted, stream_batches
from grpc_common.convert import sampling_from_wire, tree_from_wire, tree_to_wire
from grpc_common.server import RunningServer, start_server
from router.config import RouterConfig
from router.errors import WorkerError
from router.pipeline import Drafted, SequenceSpec
from router.requests import DraftShape
from router.server import RunningRouter, start_router
from specdec.client import (
    AsyncClient,
    Client,
    ClientError,
    DeadlineExceeded,
    InvalidArgument,
    Overloaded,
    Unauthenticated,
    Unavailable,
)
from specdec.errors import CancelledByCallerError
from tests.test_router_pipeline import EOS, PROMPT, FakeDrafter, FakeVerifier, reference, target_next
from verifier_service.servicer import VERIFIER_BATCH


class FakeVerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """``specdec.v1.Verifier`` around a FakeVerifier; every Verify takes at least ``delay_s``."""

    def __init__(self, fake: FakeVerifier, delay_s: float = 0.0) -> None:
        self.fake = fake
        self.delay_s = delay_s

    def OpenSequence(self, request, context):
        spec = SequenceSpec(
            tuple(request.prompt_ids),
            sampling_from_wire(request.sampling),
            request.max_tokens,
            request.ignore_eos,
            request.logprobs,
            DraftShape(1),
        )
        asyncio.run(self.fake.open(request.sequence_id, spec, request.seed))
        return verifier_pb2.OpenVerifyReply()

    def Verify(self, request, context):
        time.sleep(self.delay_s)
        return self._verify(request, context)

    def _verify(self, request, context):
        tree = tree_from_wire(request.proposal.tree)
        drafted = Drafted(tree, None, 0, 0) if len(tree) else None
        verified = asyncio.run(self.fake.verify(request.sequence_id, drafted, defer_bonus=request.defer_bonus))
        verdict = common_pb2.Verdict(
            accepted_path=verified.accepted_path,
            emitted=verified.emitted,
            finished=verified.finished,
            bonus_deferred=verified.bonus_deferred,
            logprobs=[-0.5] * len(verified.emitted),
            top_logprobs=[common_pb2.TopLogprobs(token_ids=[token], logprobs=[-0.5]) for token in verified.emitted],
        )
        return verifier_pb2.VerifyReply(verdict=verdict, verify_ns=verified.verify_ns, state_ns=verified.state_ns)

    def CloseSequence(self, request, context):
        asyncio.run(self.fake.close(request.sequence_id))
        return verifier_pb2.CloseVerifyReply()

    def Status(self, request, context):
        return verifier_pb2.VerifierStatusReply(
            model="fake", open_sequences=len(self.fake.sequences), batch_stream=True
        )

    def Batch(self, request, context):
        results = self._start(request, context).results(verifier_pb2.VerifierResult)
        return verifier_pb2.VerifierBatchReply(results=results)

    def BatchStream(self, requests, context):
        return stream_batches(requests, lambda request: self._start(request, context), VERIFIER_BATCH, context)

    def _start(self, request, context) -> StartedBatch:
        verifies = any(call.WhichOneof("call") == "verify" for call in request.calls)
        handlers = {"open": self.OpenSequence, "verify": self._verify, "close": self.CloseSequence}
        return start_in_order(request.calls, handlers, context, self.delay_s if verifies else 0.0)  # one forward


class FakeDrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """``specdec.v1.Drafter`` (kind ngram) around a FakeDrafter; every Propose takes at least ``delay_s``."""

    def __init__(self, fake: FakeDrafter, delay_s: float = 0.0) -> None:
        self.fake = fake
        self.delay_s = delay_s

    def OpenSequence(self, request, context):
        shape = DraftShape(request.shape.num_draft_tokens)
        spec = SequenceSpec(tuple(request.prompt_ids), sampling_from_wire(request.sampling), 0, False, False, shape)
        asyncio.run(self.fake.open(request.sequence_id, spec, request.seed))
        return drafter_pb2.OpenDraftReply()

    def Propose(self, request, context):
        time.sleep(self.delay_s)
        return self._propose(request, context)

    def _propose(self, request, context):
        try:
            drafted = asyncio.run(
                self.fake.propose(
                    request.sequence_id,
                    request.max_tokens,
                    assume_previous_accepted=request.assume_previous_accepted,
                    propose_id=request.propose_id,
                )
            )
        except WorkerError as error:  # the fake speaks the router's errors; a drafter answers a cancelled one so
            if error.code == "CANCELLED":
                raise CancelledByCallerError(str(error)) from error
            raise
        proposal = common_pb2.Proposal(tree=tree_to_wire(drafted.tree))
        return drafter_pb2.ProposeReply(proposal=proposal, draft_ns=drafted.draft_ns, wire_bytes=proposal.ByteSize())

    def Commit(self, request, context):
        asyncio.run(
            self.fake.commit(
                request.sequence_id, request.base_length, list(request.emitted), cancel_through=request.cancel_through
            )
        )
        return drafter_pb2.DraftCommitReply()

    def CloseSequence(self, request, context):
        asyncio.run(self.fake.close(request.sequence_id))
        return drafter_pb2.CloseDraftReply()

    def Status(self, request, context):
        return drafter_pb2.DrafterStatusReply(kind="ngram", open_sequences=len(self.fake.sequences), batch_stream=True)

    def Batch(self, request, context):
        results = self._start(request, context).results(drafter_pb2.DrafterResult)
        return drafter_pb2.DrafterBatchReply(results=results)

    def BatchStream(self, requests, context):
        return stream_batches(requests, lambda request: self._start(request, context), DRAFTER_BATCH, context)

    def _start(self, request, context) -> StartedBatch:
        proposes = any(call.WhichOneof("call") == "propose" for call in request.calls)
        handlers = {
            "open": self.OpenSequence,
            "propose": self._propose,
            "commit": self.Commit,
            "close": self.CloseSequence,
        }
        return start_in_order(request.calls, handlers, context, self.delay_s if proposes else 0.0)  # one draft step


def start_in_order(
    calls, handlers: dict[str, Callable], context: grpc.ServicerContext, delay_s: float = 0.0
) -> StartedBatch:
    """A batch whose calls run one after another (after ``delay_s``) on a thread of the batch's own, as a real
    worker's scheduler runs them: submitting never blocks, so a call that waits (a held pre-draft) holds back only
    its own batch, never the reading of the next one on a batch stream."""
    runner = ThreadPoolExecutor(max_workers=1)
    runner.submit(time.sleep, delay_s)

    def submit(kind: str, request) -> Submitted:
        return Submitted(runner.submit(handlers[kind], request, context), lambda reply: reply)

    batch = StartedBatch.start(calls, submit)
    runner.shutdown(wait=False)  # the thread ends once the batch's calls have run
    return batch


def serve_verifier(fake: FakeVerifier, delay_s: float = 0.0) -> RunningServer:
    servicer = FakeVerifierServicer(fake, delay_s)
    return start_server(
        lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s), ["specdec.v1.Verifier"]
    )


def serve_drafter(fake: FakeDrafter, delay_s: float = 0.0) -> RunningServer:
    servicer = FakeDrafterServicer(fake, delay_s)
    return start_server(lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s), ["specdec.v1.Drafter"])


def router_config(verifiers: list[str], drafters: list[str], **overrides) -> RouterConfig:
    config = RouterConfig(
        model="fake-target",
        verifiers=tuple(verifiers),
        drafters=tuple(drafters),
        tokenizer=None,
        grpc_port=0,
        http_port=0,
        eos_token_ids=(EOS,),
        health_interval_s=0.2,
        max_concurrent_requests=8,
        shutdown_grace_s=0.5,
    )
    return replace(config, **overrides)


class Stack:
    """Fake verifier + drafter servers (the target's greedy choice: ``next_token``) and a router over them."""

    def __init__(
        self,
        delay_s: float = 0.0,
        drafter_delay_s: float = 0.0,
        tokenizer: PreTrainedTokenizerBase | None = None,
        next_token: Callable[[Sequence[int]], int] = target_next,
        **overrides,
    ) -> None:
        self.verifier = FakeVerifier(next_token=next_token)
        self.drafter = FakeDrafter(wrong_every=3, next_token=next_token)
        self.verifier_server = serve_verifier(self.verifier, delay_s)
        self.drafter_server = serve_drafter(self.drafter, drafter_delay_s)
        self.config = router_config([self.verifier_server.address], [self.drafter_server.address], **overrides)
        self.router: RunningRouter = start_router(self.config, tokenizer=tokenizer)

    def client(self, **kwargs) -> Client:
        return Client(self.router.grpc_address, timeout_s=kwargs.pop("timeout_s", 20), **kwargs)

    def stop(self) -> None:
        self.router.stop(0.5)
        self.verifier_server.stop(0)
        self.drafter_server.stop(0)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    stack = Stack()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def slow_stack() -> Iterator[Stack]:
    """Each Verify takes 20 ms; at most 2 requests at once."""
    stack = Stack(delay_s=0.02, max_concurrent_requests=2, retry_after_s=2.5)
    yield stack
    stack.stop()


@pytest.mark.slow
def test_a_burst_of_thousands_of_streams_is_refused_not_cancelled(slow_stack: Stack) -> None:
    """2500 streams at once against a router admitting 2: every refusal is RESOURCE_EXHAUSTED from the router's
    admission control. (gRPC core used to CANCEL the calls past its 1000 pending ones.)"""

    async def burst(count: int) -> collections.Counter:
        codes: collections.Counter = collections.Counter()

        async def one() -> None:
            try:
                async for _ in client.stream(prompt_ids=list(PROMPT), max_tokens=2):
                    pass
                codes["OK"] += 1
            except ClientError as error:
                codes[error.code.name] += 1

        client = AsyncClient(slow_stack.router.grpc_address, timeout_s=60)
        try:
            await asyncio.gather(*(one() for _ in range(count)))
        finally:
            await client.close()
        return codes

    codes = asyncio.run(burst(2500))
    assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
    assert sum(codes.values()) == 2500


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# --- generation ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("speculation", ["off", "sequential", "pipelined"])
def test_generate_equals_the_targets_greedy_output(stack: Stack, speculation: str) -> None:
    with stack.client() as client:
        result = client.generate(
            prompt_ids=PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, speculation=speculation, seed=3
        )
    assert result.token_ids == reference(PROMPT, 40)[0]
    assert result.finish_reason == "length"
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(PROMPT), 40)
    stats = result.stats
    assert stats.rounds >= 1 and sum(stats.accepted_per_position) == stats.accepted_tokens
    assert stats.mean_accepted_length == pytest.approx(1 + stats.accepted_tokens / stats.rounds)
    if speculation == "off":
        assert stats.draft_tokens == 0 and stats.rounds == 40
    else:
        assert stats.draft_tokens > 0 and stats.accepted_tokens > 0 and stats.wire_bytes > 0
    if speculation == "pipelined":
        assert stats.pipeline_hits + stats.pipeline_misses > 0
    assert not stats.drafter_fallback
    assert wait_until(lambda: not stack.verifier.sequences and not stack.drafter.sequences)


def test_a_cancelled_predraft_keeps_the_drafter_over_the_wire(stack: Stack) -> None:
    """Every guess wrong and every pre-draft answering only once a Commit cancels it: each miss's CANCELLED answer
    crosses the wire as CANCELLED (the drafter's own status for it), so the router keeps its drafter."""
    stack.drafter.wrong_every, stack.drafter.hold_predrafts = 1, True
    cancelled = stack.drafter.cancelled
    try:
        with stack.client() as client:
            result = client.generate(
                prompt_ids=PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True, speculation="pipelined", seed=3
            )
    finally:
        stack.drafter.wrong_every, stack.drafter.hold_predrafts = 3, False
    assert result.token_ids == reference(PROMPT, 20)[0]
    assert result.stats.pipeline_misses > 3 and stack.drafter.cancelled > cancelled
    assert not result.stats.drafter_fallback


def test_stream_yields_chunks_then_the_final_message(stack: Stack) -> None:
    with stack.client() as client:
        chunks = list(client.stream(prompt_ids=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True))
    assert len(chunks) >= 2
    assert all(chunk.finish_reason is None for chunk in chunks[:-1])
    final = chunks[-1]
    assert final.finish_reason == "length" and final.usage is not None and final.stats is not None
    tokens = [token for chunk in chunks for token in chunk.token_ids]
    assert tokens == reference(PROMPT, 12)[0]
    assert [lp for chunk in chunks for lp in chunk.logprobs] == [-0.5] * 12


def test_eos_finishes_with_stop(stack: Stack) -> None:
    stack.verifier.eos_at_8 = True
    try:
        with stack.client() as client:
            result = client.generate(prompt_ids=PROMPT, max_tokens=30, temperature=0.0)
    finally:
        stack.verifier.eos_at_8 = False
    assert (result.token_ids, result.finish_reason) == reference(PROMPT, 30, eos=EOS)


def test_async_client(stack: Stack) -> None:
    async def main() -> tuple[list, list]:
        async with AsyncClient(stack.router.grpc_address, timeout_s=20) as client:
            results = await asyncio.gather(
                *(
                    client.generate(prompt_ids=PROMPT, max_tokens=20 + i, temperature=0.0, ignore_eos=True)
                    for i in range(4)
                )
            )
            chunks = [chunk async for chunk in client.stream(prompt_ids=PROMPT, max_tokens=5, ignore_eos=True)]
        return results, chunks

    results, chunks = asyncio.run(main())
    for i, result in enumerate(results):
        assert result.token_ids == reference(PROMPT, 20 + i)[0]
    assert chunks[-1].finish_reason == "length"


# --- bad input ----------------------------------------------------------------------------------------------

BAD = {
    "no prompt": ({"max_tokens": 4}, "prompt"),
    "prompt and ids": ({"prompt_ids": [1], "prompt": "x", "max_tokens": 4}, "prompt_ids"),
    "max_tokens 0": ({"prompt_ids": [1], "max_tokens": 0}, "max_tokens"),
    "max_tokens negative": ({"prompt_ids": [1], "max_tokens": -2}, "max_tokens"),
    "temperature": ({"prompt_ids": [1], "max_tokens": 4, "temperature": -1.0}, "temperature"),
    "top_p 0": ({"prompt_ids": [1], "max_tokens": 4, "top_p": 0.0}, "top_p"),
    "top_p 1.5": ({"prompt_ids": [1], "max_tokens": 4, "top_p": 1.5}, "top_p"),
    "top_k": ({"prompt_ids": [1], "max_tokens": 4, "top_k": -2}, "top_k"),
    "model": ({"prompt_ids": [1], "max_tokens": 4, "model": "gpt-9"}, "model"),
    "drafter kind": ({"prompt_ids": [1], "max_tokens": 4, "drafter": "magic"}, "drafter"),
    "drafter not served": ({"prompt_ids": [1], "max_tokens": 4, "drafter": "model"}, "drafter"),
    "num_draft_tokens": ({"prompt_ids": [1], "max_tokens": 4, "num_draft_tokens": 1000}, "num_draft_tokens"),
    "text without tokenizer": ({"prompt": "hello", "max_tokens": 4}, "prompt"),
    "stop without tokenizer": ({"prompt_ids": [1], "max_tokens": 4, "stop": ["x"]}, "stop"),
    "negative token id": ({"prompt_ids": [1, -3], "max_tokens": 4}, "prompt_ids"),
    "temperature NaN": ({"prompt_ids": [1], "max_tokens": 4, "temperature": float("nan")}, "temperature"),
    "top_logprobs 21": ({"prompt_ids": [1], "max_tokens": 4, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "top_logprobs alone": ({"prompt_ids": [1], "max_tokens": 4, "top_logprobs": 2}, "top_logprobs"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_is_invalid_argument_naming_the_field(stack: Stack, case: str) -> None:
    fields, name = BAD[case]
    fields = dict(fields)
    prompt = fields.pop("prompt", None)
    prompt_ids = fields.pop("prompt_ids", None)
    with stack.client() as client:
        with pytest.raises(InvalidArgument) as raised:
            client.generate(prompt, prompt_ids=prompt_ids, **fields)
        assert raised.value.details.startswith(f"{name}: "), raised.value
        assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # the server stays up
        assert client.generate(prompt_ids=PROMPT, max_tokens=3, temperature=0.0).finish_reason == "length"


def test_unset_max_tokens_is_refused_by_the_wire_api(stack: Stack) -> None:
    with grpc.insecure_channel(stack.router.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.Generate(router_pb2.GenerateRequest(prompt_ids=[1, 2]), timeout=5))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("max_tokens")


def test_malformed_utf8_is_invalid_argument(stack: Stack) -> None:
    raw = b"\x0a\x02\xff\xfe" + b"\x30\x04"  # prompt = bytes ff fe (not UTF-8), max_tokens = 4
    with grpc.insecure_channel(stack.router.grpc_address) as channel:
        generate = channel.unary_stream("/specdec.v1.Router/Generate", request_serializer=bytes)
        with pytest.raises(grpc.RpcError) as raised:
            list(generate(raw, timeout=5))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in raised.value.details()


def test_unknown_option_is_a_type_error(stack: Stack) -> None:
    with stack.client() as client, pytest.raises(TypeError, match="temprature"):
        client.generate(prompt_ids=[1], temprature=0.5)  # type: ignore[call-arg]


# --- overload, cancellation, failures -----------------------------------------------------------------------


def test_overload_is_resource_exhausted_with_a_retry_hint(slow_stack: Stack) -> None:
    started = threading.Barrier(3)
    results: list = []

    def long_request() -> None:
        with slow_stack.client() as client:
            stream = client.stream(
                prompt_ids=PROMPT, max_tokens=60, temperature=0.0, ignore_eos=True, speculation="off"
            )
            results.append(next(stream).token_ids)
            started.wait()
            results.append(list(stream)[-1].finish_reason)

    threads = [threading.Thread(target=long_request) for _ in range(2)]
    for thread in threads:
        thread.start()
    started.wait(timeout=10)
    with slow_stack.client() as client, pytest.raises(Overloaded) as raised:
        client.generate(prompt_ids=PROMPT, max_tokens=4)
    assert raised.value.retry_after_s == pytest.approx(2.5)
    assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    for thread in threads:
        thread.join(timeout=20)
    assert sorted(map(str, results))[-2:] == ["length", "length"]
    with slow_stack.client() as client:  # capacity is back
        assert client.generate(prompt_ids=PROMPT, max_tokens=2, temperature=0.0).finish_reason == "length"


def test_requests_past_the_running_cap_wait_in_order_and_past_the_queue_are_refused() -> None:
    """1 running + 2 waiting: of 4 requests sent at once, 3 finish (the waiting ones as the slot frees, in arrival
    order) and 1 is refused; a waiting request whose client leaves gives its place up."""
    stack = Stack(delay_s=0.02, max_concurrent_requests=1, max_waiting_requests=2)

    async def run() -> tuple[list[str], list[int], list[tuple[int, int]]]:
        status_channel = grpc.aio.insecure_channel(stack.router.grpc_address)
        router = router_pb2_grpc.RouterStub(status_channel)

        async def running_and_waiting() -> tuple[int, int]:
            status = await router.Status(router_pb2.RouterStatusRequest(), timeout=5)
            return status.running, status.waiting

        async with status_channel, AsyncClient(stack.router.grpc_address, timeout_s=20) as client:
            finished: list[int] = []

            async def one(index: int, max_tokens: int = 6) -> str:
                try:
                    await client.generate(prompt_ids=list(PROMPT), max_tokens=max_tokens, ignore_eos=True)
                except Overloaded:
                    return "RESOURCE_EXHAUSTED"
                finished.append(index)
                return "OK"

            tasks = []
            for index in range(4):
                tasks.append(asyncio.ensure_future(one(index, max_tokens=30)))  # each runs for >= 0.2 s
                await asyncio.sleep(0.03)  # arrival order 0, 1, 2, 3
            codes = list(await asyncio.gather(*tasks))

            running = asyncio.ensure_future(one(10, max_tokens=40))
            await asyncio.sleep(0.1)
            leaving = asyncio.ensure_future(one(11))
            await asyncio.sleep(0.1)
            queue_lengths = [await running_and_waiting()]
            leaving.cancel()
            await asyncio.sleep(0.1)
            queue_lengths.append(await running_and_waiting())
            await running
            queue_lengths.append(await running_and_waiting())
            return codes, finished, queue_lengths

    try:
        codes, finished, queue_lengths = asyncio.run(run())
    finally:
        stack.stop()
    assert sorted(codes) == ["OK", "OK", "OK", "RESOURCE_EXHAUSTED"], codes
    assert finished == [0, 1, 2, 10]
    assert queue_lengths == [(1, 1), (1, 0), (0, 0)]  # (running, waiting) over the public Status


def test_cancelling_a_stream_frees_both_workers(slow_stack: Stack) -> None:
    with slow_stack.client() as client:
        stream = client.stream(prompt_ids=PROMPT, max_tokens=5000, temperature=0.0, ignore_eos=True)
        first = next(stream)
        assert first.token_ids
        assert slow_stack.verifier.sequences and slow_stack.drafter.sequences
        stream.close()  # leaving the loop early cancels the call
    assert wait_until(lambda: not slow_stack.verifier.sequences and not slow_stack.drafter.sequences, 2.0)
    with grpc.insecure_channel(slow_stack.router.grpc_address) as channel:
        status = router_pb2_grpc.RouterStub(channel).Status(router_pb2.RouterStatusRequest(), timeout=5)
    assert status.running == 0
    assert all(worker.outstanding == 0 for worker in status.workers)


def test_client_deadline(slow_stack: Stack) -> None:
    with slow_stack.client(timeout_s=0.2) as client, pytest.raises(DeadlineExceeded):
        client.generate(prompt_ids=PROMPT, max_tokens=100, speculation="off", ignore_eos=True)
    assert wait_until(lambda: not slow_stack.verifier.sequences and not slow_stack.drafter.sequences, 2.0)


def test_a_stalled_drafter_falls_back_to_target_only() -> None:
    stack = Stack(drafter_delay_s=2.0, drafter_deadline_s=0.3)
    try:
        with stack.client() as client:
            started = time.monotonic()
            result = client.generate(prompt_ids=PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True)
            elapsed = time.monotonic() - started
        assert result.token_ids == reference(PROMPT, 20)[0]
        assert result.stats.drafter_fallback and result.stats.draft_tokens == 0
        assert elapsed < 1.5
    finally:
        stack.stop()


def test_verifier_down_is_unavailable_fast() -> None:
    verifier = FakeVerifier()
    server = serve_verifier(verifier)
    address = server.address
    server.stop(0)
    router = start_router(router_config([address], []))
    try:
        with Client(router.grpc_address, timeout_s=10) as client:
            started = time.monotonic()
            with pytest.raises(Unavailable):
                client.generate(prompt_ids=PROMPT, max_tokens=4)
            assert time.monotonic() - started < 2
    finally:
        router.stop(0)


def test_verifier_dying_mid_request_is_unavailable(slow_stack: Stack) -> None:
    verifier = FakeVerifier()
    server = serve_verifier(verifier, delay_s=0.02)
    router = start_router(router_config([server.address], []))
    try:
        with Client(router.grpc_address, timeout_s=10) as client:
            stream = client.stream(prompt_ids=PROMPT, max_tokens=500, ignore_eos=True, speculation="off")
            next(stream)
            server.stop(0)
            started = time.monotonic()
            with pytest.raises(Unavailable):
                list(stream)
            assert time.monotonic() - started < 2
    finally:
        router.stop(0)


def test_bearer_token() -> None:
    stack = Stack(bearer_token="s3cret")
    try:
        with stack.client() as client, pytest.raises(Unauthenticated):
            client.generate(prompt_ids=PROMPT, max_tokens=2)
        with stack.client(bearer_token="wrong") as client, pytest.raises(Unauthenticated):
            client.generate(prompt_ids=PROMPT, max_tokens=2)
        with stack.client(bearer_token="s3cret") as client:
            assert client.generate(prompt_ids=PROMPT, max_tokens=2).finish_reason == "length"
        with grpc.insecure_channel(stack.router.grpc_address) as channel:  # probes need no token
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        stack.stop()


def test_status_and_health(stack: Stack) -> None:
    with grpc.insecure_channel(stack.router.grpc_address) as channel:
        status = router_pb2_grpc.RouterStub(channel).Status(router_pb2.RouterStatusRequest(), timeout=5)
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="specdec.v1.Router"), timeout=5
        )
    assert status.model == "fake-target"
    roles = {(w.role, w.address, w.kind, w.healthy) for w in status.workers}
    assert roles == {
        ("drafter", stack.drafter_server.address, "ngram", True),
        ("verifier", stack.verifier_server.address, "", True),
    }
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_client_errors_share_one_base() -> None:
    for error in (InvalidArgument, Overloaded, Unavailable, DeadlineExceeded, Unauthenticated):
        assert issubclass(error, ClientError)
