"""The gRPC face of a simulated worker: the servicers over the simulated cores, and the serve loop.

The cores (:mod:`.verifier`, :mod:`.drafter`) hold no gRPC so their rules can be tested directly; here their
answers become replies. The verifier reports its batch's sleep as ``verify_ns`` and ``state_ns = 0``; the drafter
as ``draft_ns``. Once serving, the process prints one JSON line ``{"address": "HOST:PORT", "role": ROLE, ...}``
(what :meth:`bench.services.Service.wait_ready` reads) and stops on SIGTERM / SIGINT.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from bench.load.simulated.config import WorkerConfig
from bench.load.simulated.drafter import SimDrafter
from bench.load.simulated.verifier import SimVerifier
from grpc_common.batch import call_error
from grpc_common.errors import error_message, status_for
from grpc_common.server import DEFAULT_MAX_MESSAGE_BYTES, MAX_PENDING_CALLS

LOG = logging.getLogger("bench.load.simulated")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


class _CallAborted(Exception):
    """A batched call's handler aborted: that call fails alone with ``code``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _BatchedCallContext:
    """What a unary handler sees when it runs as one call of a ``Batch``: aborting fails that call, not the batch."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _CallAborted(code, details)


async def _answer_batch(
    calls: Sequence[Any], handlers: dict[str, Handler], servicer: Any, result_type: Callable[..., Any]
) -> list[Any]:
    """One ``result_type`` per call of a ``Batch``, as :func:`grpc_common.batch.answer_batch` answers on the real
    services: each call runs through its unary handler ``handlers[kind]``, failing alone; the calls start in order
    (so one sequence's calls reach the core in order) and run concurrently."""

    async def run(call: Any) -> Any:
        kind = call.WhichOneof("call")
        if kind is None:
            return result_type(error=call_error(grpc.StatusCode.INVALID_ARGUMENT, "call: no call set"))
        try:
            reply = await handlers[kind](servicer, getattr(call, kind), _BatchedCallContext())
        except _CallAborted as aborted:
            return result_type(error=call_error(aborted.code, aborted.details))
        return result_type(**{kind: reply})

    return list(await asyncio.gather(*(run(call) for call in calls)))


async def stream_batches(
    requests: AsyncIterator[Any], answer: Callable[[Any], Awaitable[Any]], bundle: Callable[..., Any]
) -> AsyncIterator[Any]:
    """The replies of a ``grpc.aio`` ``BatchStream``, as :func:`grpc_common.batch.stream_batches` gives them on the
    real (threaded) services: every batch starts as it arrives (``answer(request)``, which names its ``batch_id``)
    and is answered as it finishes, those finished together in one message (``bundle(replies=[...])``); when the
    request stream ends, the batches still running are answered first. A request's ``cancel_batch_ids`` cancel
    those batches (no reply); one with no calls is no batch."""
    done: asyncio.Queue[tuple[int, asyncio.Task[Any]] | int] = asyncio.Queue()
    running: dict[int, asyncio.Task[Any]] = {}  # by batch_id

    async def read() -> None:
        count = 0
        try:
            async for request in requests:
                for batch_id in request.cancel_batch_ids:
                    if batch_id in running:
                        running[batch_id].cancel()
                if request.cancel_batch_ids and not request.calls:
                    continue
                task = asyncio.ensure_future(answer(request))
                running[request.batch_id] = task
                task.add_done_callback(functools.partial(_finished, done, request.batch_id))
                count += 1
        finally:
            done.put_nowait(count)

    reader = asyncio.ensure_future(read())
    answered, total = 0, None
    try:
        while total is None or answered < total:
            items = [await done.get()]
            while not done.empty():
                items.append(done.get_nowait())
            replies = []
            for item in items:
                if isinstance(item, int):
                    total = item
                    continue
                batch_id, task = item
                answered += 1
                running.pop(batch_id, None)
                if not task.cancelled():
                    replies.append(task.result())
            if replies:
                yield bundle(replies=replies)
    finally:
        reader.cancel()
        for task in running.values():
            task.cancel()


def _finished(done: asyncio.Queue[tuple[int, asyncio.Task[Any]] | int], batch_id: int, task: asyncio.Task[Any]) -> None:
    done.put_nowait((batch_id, task))


def _mapped(handler: Handler) -> Handler:
    """Domain errors → status codes with :func:`grpc_common.errors.status_for`, as the real (sync) services'
    interceptor does; that interceptor does not apply to a ``grpc.aio`` server."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except Exception as error:
            code = status_for(error)
            if code == grpc.StatusCode.INTERNAL:
                LOG.exception("internal error")
            await context.abort(code, error_message(error))

    return wrapper


class SimVerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """``specdec.v1.Verifier`` over a :class:`SimVerifier`."""

    def __init__(self, verifier: SimVerifier) -> None:
        self.verifier = verifier

    @_mapped
    async def OpenSequence(
        self, request: verifier_pb2.OpenVerifyRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.OpenVerifyReply:
        self.verifier.open(request.sequence_id, request.prompt_ids, request.seed, request.max_tokens)
        return verifier_pb2.OpenVerifyReply()

    @_mapped
    async def Verify(
        self, request: verifier_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.VerifyReply:
        answer = await self.verifier.verify(
            request.sequence_id, request.proposal, request.defer_bonus, request.assumed_path
        )
        decision = answer.result
        verdict = common_pb2.Verdict(
            accepted_path=decision.accepted_path,
            emitted=decision.emitted,
            finished=decision.finished,
            bonus_deferred=decision.bonus_deferred,
        )
        return verifier_pb2.VerifyReply(
            verdict=verdict,
            verify_ns=answer.latency_ns,
            state_ns=0,
            batch_size=answer.batch_size,
            queued_ns=answer.queued_ns,
        )

    @_mapped
    async def CloseSequence(
        self, request: verifier_pb2.CloseVerifyRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.CloseVerifyReply:
        self.verifier.close(request.sequence_id)
        return verifier_pb2.CloseVerifyReply()

    async def Touch(self, request: common_pb2.TouchRequest, context: grpc.aio.ServicerContext) -> common_pb2.TouchReply:
        """Simulated sequences hold no KV and are never reclaimed: a lease renewal has nothing to do."""
        return common_pb2.TouchReply()

    async def Batch(
        self, request: verifier_pb2.VerifierBatchRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.VerifierBatchReply:
        cls = type(self)
        handlers = {"open": cls.OpenSequence, "verify": cls.Verify, "close": cls.CloseSequence, "touch": cls.Touch}
        results = await _answer_batch(request.calls, handlers, self, verifier_pb2.VerifierResult)
        return verifier_pb2.VerifierBatchReply(results=results, batch_id=request.batch_id)

    async def BatchStream(
        self, requests: AsyncIterator[verifier_pb2.VerifierBatchRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[verifier_pb2.VerifierBatchReplies]:
        answer = functools.partial(self.Batch, context=context)
        async for replies in stream_batches(requests, answer, verifier_pb2.VerifierBatchReplies):
            yield replies

    @_mapped
    async def Status(
        self, request: verifier_pb2.VerifierStatusRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.VerifierStatusReply:
        count = len(self.verifier.sequences)
        return verifier_pb2.VerifierStatusReply(
            model=self.verifier.config.model,
            open_sequences=count,
            runner_sequences=count,
            world_size=1,
            batch_stream=True,
        )


class SimDrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """``specdec.v1.Drafter`` over a :class:`SimDrafter`."""

    def __init__(self, drafter: SimDrafter) -> None:
        self.drafter = drafter

    @_mapped
    async def OpenSequence(
        self, request: drafter_pb2.OpenDraftRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.OpenDraftReply:
        self.drafter.open(request)
        return drafter_pb2.OpenDraftReply(open_ns=0)

    @_mapped
    async def Propose(
        self, request: drafter_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.ProposeReply:
        answer = await self.drafter.propose(
            request.sequence_id, request.max_tokens, request.assume_previous_accepted, request.propose_id
        )
        proposal = answer.result
        return drafter_pb2.ProposeReply(
            proposal=proposal, draft_ns=answer.latency_ns, wire_bytes=proposal.ByteSize(), queued_ns=answer.queued_ns
        )

    @_mapped
    async def Commit(
        self, request: drafter_pb2.DraftCommitRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DraftCommitReply:
        self.drafter.commit(request.sequence_id, request.base_length, request.emitted, request.cancel_through)
        return drafter_pb2.DraftCommitReply()

    @_mapped
    async def CloseSequence(
        self, request: drafter_pb2.CloseDraftRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.CloseDraftReply:
        self.drafter.close(request.sequence_id)
        return drafter_pb2.CloseDraftReply()

    async def Touch(self, request: common_pb2.TouchRequest, context: grpc.aio.ServicerContext) -> common_pb2.TouchReply:
        """Simulated sequences hold no KV and are never reclaimed: a lease renewal has nothing to do."""
        return common_pb2.TouchReply()

    async def Batch(
        self, request: drafter_pb2.DrafterBatchRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DrafterBatchReply:
        cls = type(self)
        handlers = {
            "open": cls.OpenSequence,
            "propose": cls.Propose,
            "commit": cls.Commit,
            "close": cls.CloseSequence,
            "touch": cls.Touch,
        }
        results = await _answer_batch(request.calls, handlers, self, drafter_pb2.DrafterResult)
        return drafter_pb2.DrafterBatchReply(results=results, batch_id=request.batch_id)

    async def BatchStream(
        self, requests: AsyncIterator[drafter_pb2.DrafterBatchRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[drafter_pb2.DrafterBatchReplies]:
        answer = functools.partial(self.Batch, context=context)
        async for replies in stream_batches(requests, answer, drafter_pb2.DrafterBatchReplies):
            yield replies

    @_mapped
    async def Status(
        self, request: drafter_pb2.DrafterStatusRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DrafterStatusReply:
        batcher = self.drafter.batcher
        return drafter_pb2.DrafterStatusReply(
            kind=self.drafter.config.kind,
            open_sequences=len(self.drafter.sequences),
            runner_sequences=0,
            proposals=batcher.calls,
            batches=batcher.batches,
            max_batch=batcher.max_batch,
            batch_stream=True,
        )


async def serve(config: WorkerConfig) -> None:
    """Serve until SIGTERM / SIGINT, then drain: health NOT_SERVING, in-flight calls get ``grace_s``."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            # a router at a thousand streams has a thousand calls in flight here: none may be CANCELLED by core
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
        ]
    )
    core: SimVerifier | SimDrafter
    if config.role == "verifier":
        core = SimVerifier(config)
        verifier_pb2_grpc.add_VerifierServicer_to_server(SimVerifierServicer(core), server)
        service, extra = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name, {"model": config.model}
    else:
        core = SimDrafter(config)
        drafter_pb2_grpc.add_DrafterServicer_to_server(SimDrafterServicer(core), server)
        service, extra = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name, {"kind": config.kind}
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    core.batcher.start()
    await server.start()
    for name in ("", service):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(json.dumps({"address": f"{config.host}:{port}", "role": config.role, **extra}), flush=True)
    await stop.wait()
    await health.enter_graceful_shutdown()
    await server.stop(config.grace_s)
    await core.batcher.stop()
    batcher = core.batcher
    LOG.info("answered %d calls in %d batches (largest %d)", batcher.calls, batcher.batches, batcher.max_batch)
