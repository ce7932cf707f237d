"""The router's batch transport (:mod:`router.calls`): batches on one stream per worker, matched to their replies by id,
each with the worker's deadline (past it the worker is told to drop the batch); a failed stream fails its batches as
their unary RPCs would have failed and the next batch opens a new stream; a worker whose Status does not offer
``BatchStream`` gets unary ``Batch`` RPCs.

The worker is a real loopback ``grpc.aio`` server whose verifier answers every call as a close, as a test tells it:
``BatchStream`` answering the batches of one message in reverse order, holding one batch past the deadline, or
ending the stream with UNAVAILABLE on a marked batch.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc
from specdec_wire.v1 import verifier_pb2, verifier_pb2_grpc

from router.calls import BatchTransport, Worker
from router.config import RouterConfig
from router.errors import WorkerUnavailableError
from router.workers import WorkerPool
from tests.test_router_health import SettableHealth

DEADLINE_S = 0.5


def close_call(sequence_id: str) -> verifier_pb2.VerifierCall:
    return verifier_pb2.VerifierCall(close=verifier_pb2.CloseVerifyRequest(sequence_id=sequence_id))


def answer(request: verifier_pb2.VerifierBatchRequest) -> verifier_pb2.VerifierBatchReply:
    """Every call answered as a close, under the request's batch id (callers tell their batches apart by size)."""
    results = [verifier_pb2.VerifierResult(close=verifier_pb2.CloseVerifyReply()) for _ in request.calls]
    return verifier_pb2.VerifierBatchReply(results=results, batch_id=request.batch_id)


class ScriptedVerifier(verifier_pb2_grpc.VerifierServicer):
    """Counts what arrives; on the stream, answers the batches of every two messages in reverse order, never answers
    a batch whose first call closes ``hold``, and ends the stream UNAVAILABLE on one that closes ``fail``."""

    def __init__(self, advertises: bool = True) -> None:
        self.advertises = advertises
        self.unary_batches = 0
        self.streamed_batches = 0
        self.streams = 0
        self.cancelled: list[int] = []  # batch ids the router gave up on

    async def Status(self, request, context) -> verifier_pb2.VerifierStatusReply:
        return verifier_pb2.VerifierStatusReply(model="m", batch_stream=self.advertises)

    async def Batch(self, request, context) -> verifier_pb2.VerifierBatchReply:
        self.unary_batches += 1
        return answer(request)

    async def BatchStream(self, requests, context):
        self.streams += 1
        waiting: list[verifier_pb2.VerifierBatchRequest] = []
        async for request in requests:
            self.cancelled += request.cancel_batch_ids
            if not request.calls:
                continue
            self.streamed_batches += 1
            first = request.calls[0].close.sequence_id
            if first == "fail":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker going away")
            if first == "hold":
                continue
            waiting.append(request)
            if len(waiting) == 2 or first == "alone":
                yield verifier_pb2.VerifierBatchReplies(replies=[answer(r) for r in reversed(waiting)])
                waiting = []


async def _serve(add) -> tuple[grpc.aio.Server, BatchTransport, Worker]:
    server = grpc.aio.server()
    add(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    worker = Worker("verifier", address, grpc.aio.insecure_channel(address), DEADLINE_S, batch_stream=True)
    stub = verifier_pb2_grpc.VerifierStub(worker.channel)
    return server, BatchTransport(worker, stub.BatchStream, stub.Batch, verifier_pb2.VerifierBatchRequest), worker


async def _scripted() -> None:
    verifier = ScriptedVerifier()
    server, transport, worker = await _serve(lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(verifier, s))
    try:
        # two batches in flight, answered in one message in reverse order: each caller gets its own results
        one, three = await asyncio.gather(
            transport.send([close_call("a")]), transport.send([close_call("b"), close_call("c"), close_call("d")])
        )
        assert (len(one), len(three)) == (1, 3)
        # a batch the worker never answers fails at the deadline, counted as a timeout; the stream stays up
        started = asyncio.get_running_loop().time()
        with pytest.raises(WorkerUnavailableError) as timed_out:
            await transport.send([close_call("hold")])
        assert timed_out.value.code == "DEADLINE_EXCEEDED" and worker.timeouts == 1
        assert DEADLINE_S * 0.9 <= asyncio.get_running_loop().time() - started < DEADLINE_S * 4
        assert len(await transport.send([close_call("alone")])) == 1 and worker.timeouts == 0
        assert verifier.cancelled == [3]  # the worker was told to drop the held batch (the third sent)
        # the worker ends the stream: the batch on it fails as its RPC would have; the next opens a new stream
        with pytest.raises(WorkerUnavailableError) as failed:
            await transport.send([close_call("fail")])
        assert failed.value.code == "UNAVAILABLE"
        assert len(await transport.send([close_call("alone"), close_call("x")])) == 2
        assert (verifier.streams, verifier.unary_batches) == (2, 0)
    finally:
        await transport.close()
        await worker.channel.close()
        await server.stop(0)


def test_batches_on_one_stream_get_their_own_replies_deadlines_and_failures() -> None:
    asyncio.run(_scripted())


async def _transport_used(advertises: bool, worker_streams: bool) -> tuple[int, int]:
    """(streams opened, unary batches) for two calls to a verifier whose Status says ``advertises``."""
    verifier = ScriptedVerifier(advertises)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(SettableHealth(), server)
    verifier_pb2_grpc.add_VerifierServicer_to_server(verifier, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = RouterConfig(
        model="m", verifiers=(f"127.0.0.1:{port}",), health_interval_s=3600, worker_streams=worker_streams
    )
    pool = await WorkerPool.start(config)
    try:
        [client] = pool.verifiers
        await asyncio.gather(client.close("alone"), client.close("alone"))
        await client.close("alone")
    finally:
        await pool.close()
        await server.stop(0)
    return verifier.streams, verifier.unary_batches


def test_batches_go_on_a_stream_only_to_a_worker_whose_status_offers_one_unless_turned_off() -> None:
    assert asyncio.run(_transport_used(advertises=True, worker_streams=True)) == (1, 0)
    assert asyncio.run(_transport_used(advertises=False, worker_streams=True)) == (0, 2)  # an older worker
    assert asyncio.run(_transport_used(advertises=True, worker_streams=False)) == (0, 2)  # --no-worker-streams
