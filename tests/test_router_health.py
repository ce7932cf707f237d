"""The router's health checks: when a worker leaves rotation and when it comes back (a slow worker is not a dead one:
timed-out calls and checks count together toward one threshold).

A real ``grpc.aio`` server answers ``grpc.health.v1`` Check as a test sets it: SERVING, NOT_SERVING, or too
late for the check's deadline. The pool is the router's own (:class:`router.workers.WorkerPool`); its
background loop is set far apart, and the test runs each round of checks itself.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specdec_wire.v1 import verifier_pb2, verifier_pb2_grpc

from bench.load.simulated.server import stream_batches
from router.config import RouterConfig
from router.errors import WorkerUnavailableError
from router.workers import WorkerPool

DEADLINE_S = 0.2


class SettableHealth(health_pb2_grpc.HealthServicer):
    """Answers Check with ``status``, or after twice the router's deadline when ``late``."""

    def __init__(self) -> None:
        self.status = health_pb2.HealthCheckResponse.SERVING
        self.late = False

    async def Check(self, request, context) -> health_pb2.HealthCheckResponse:
        if self.late:
            await asyncio.sleep(2 * DEADLINE_S)
        return health_pb2.HealthCheckResponse(status=self.status)


async def _pool_over(health: SettableHealth, verifier: verifier_pb2_grpc.VerifierServicer | None = None):
    """A loopback gRPC server with ``health`` (and ``verifier``) and a router pool over it as its one verifier,
    checking health only when told, ejecting after 3 timeouts in a row; returns (server, pool)."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if verifier is not None:
        verifier_pb2_grpc.add_VerifierServicer_to_server(verifier, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = RouterConfig(
        model="m",
        verifiers=(f"127.0.0.1:{port}",),
        verifier_deadline_s=DEADLINE_S,
        health_interval_s=3600,
        health_timeouts_to_eject=3,
    )
    return server, await WorkerPool.start(config)


async def _health_rounds() -> list[bool]:
    health = SettableHealth()
    server, pool = await _pool_over(health)
    [worker] = pool.workers()
    seen = [worker.healthy]

    async def check() -> None:
        await pool.check_health()
        seen.append(worker.healthy)

    try:
        health.late = True
        for _ in range(3):  # two late answers keep it; the third in a row takes it out
            await check()
        health.late = False
        await check()  # one answer in time brings it back
        health.late = True
        await check()  # and the count starts again
        health.late = False
        health.status = health_pb2.HealthCheckResponse.NOT_SERVING
        await check()  # a worker that says it is not serving (draining) leaves at once
        health.status = health_pb2.HealthCheckResponse.SERVING
        await check()
        await server.stop(0)
        await check()  # nothing listening: leaves at once
    finally:
        await pool.close()
        await server.stop(0)
    return seen


def test_timeouts_eject_only_in_a_row_and_refusals_at_once() -> None:
    assert asyncio.run(_health_rounds()) == [True, True, True, False, True, True, False, True, False]


class LateVerifier(verifier_pb2_grpc.VerifierServicer):
    """Answers every call of a Batch (as a close), after twice the router's deadline when ``late``."""

    def __init__(self) -> None:
        self.late = False

    async def Batch(self, request, context) -> verifier_pb2.VerifierBatchReply:
        if self.late:
            await asyncio.sleep(2 * DEADLINE_S)
        results = [verifier_pb2.VerifierResult(close=verifier_pb2.CloseVerifyReply()) for _ in request.calls]
        return verifier_pb2.VerifierBatchReply(results=results, batch_id=request.batch_id)

    async def BatchStream(self, requests, context):
        """Each batch answered as ``Batch`` answers it, independently: a late one holds back no later one."""
        bundle = verifier_pb2.VerifierBatchReplies
        async for replies in stream_batches(requests, lambda request: self.Batch(request, context), bundle):
            yield replies

    async def Status(self, request, context) -> verifier_pb2.VerifierStatusReply:
        return verifier_pb2.VerifierStatusReply(model="m", batch_stream=True)


async def _slow_calls() -> list[bool]:
    health, verifier = SettableHealth(), LateVerifier()
    server, pool = await _pool_over(health, verifier)
    [client] = pool.verifiers
    seen = []

    async def call() -> None:
        """One call, its failure reported to placement as a session would."""
        try:
            await client.close("a")
        except WorkerUnavailableError as error:
            assert error.code == "DEADLINE_EXCEEDED"
            pool.report_failure(client, error)
        seen.append(client.worker.healthy)

    async def check() -> None:
        await pool.check_health()
        seen.append(client.worker.healthy)

    try:
        verifier.late = health.late = True
        await call()  # one slow answer does not make a dead worker ...
        await call()
        verifier.late = False
        await call()  # ... and one in time resets the count
        verifier.late = True
        await call()
        await check()  # a late health check counts with the late calls
        await call()  # the third in a row takes it out
    finally:
        await pool.close()
        await server.stop(0)
    return seen


def test_call_timeouts_count_with_health_check_timeouts_toward_one_threshold() -> None:
    """A Verify that times out used to take its verifier out of rotation at once."""
    assert asyncio.run(_slow_calls()) == [True, True, True, True, True, False]
