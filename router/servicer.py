"""The public ``specdec.v1.Router`` service: decode the proto, call the frontend, encode the stream.

The gRPC server is the ``grpc.aio`` one of :mod:`grpc_common.server`, on the router's event loop (its interceptor
maps domain errors to status codes). ``Generate`` parses its request itself (:func:`add_to_server`), so an
undecodable request (e.g. malformed UTF-8 in ``prompt``) is INVALID_ARGUMENT rather than the INTERNAL a failing
deserializer gives. The request runs as a task on the same loop and hands its chunks to the RPC through a queue;
when the RPC ends early (client cancel, disconnect, deadline) the handler is cancelled and cancels the request,
which closes its sequences on both workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio
from google.protobuf.message import DecodeError
from specdec_wire.v1 import router_pb2, router_pb2_grpc

from grpc_common.convert import top_logprobs_to_wire
from router.errors import NoWorkerError, OverloadedError, UnauthenticatedError, WorkerUnavailableError
from router.frontend import Frontend
from router.pipeline import Chunk, Final
from router.requests import GenerateInput
from specdec.errors import CapacityError, InvalidArgumentError

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's standard server pushback, read by retry policies and the SDK
_MODES = {
    router_pb2.SPECULATION_MODE_UNSPECIFIED: "",
    router_pb2.SPECULATION_MODE_OFF: "off",
    router_pb2.SPECULATION_MODE_SEQUENTIAL: "sequential",
    router_pb2.SPECULATION_MODE_PIPELINED: "pipelined",
    router_pb2.SPECULATION_MODE_AUTO: "auto",
}


def input_from_wire(request: router_pb2.GenerateRequest) -> GenerateInput:
    """The proto request as a :class:`GenerateInput` (unset optional fields become None)."""
    sampling = request.sampling
    return GenerateInput(
        prompt=request.prompt,
        prompt_ids=tuple(request.prompt_ids),
        chat=request.chat,
        model=request.model,
        temperature=sampling.temperature if sampling.HasField("temperature") else None,
        top_k=sampling.top_k,
        top_p=sampling.top_p if sampling.HasField("top_p") else None,
        min_p=sampling.min_p,
        max_tokens=request.max_tokens,
        seed=request.seed if request.HasField("seed") else None,
        stop=tuple(request.stop),
        ignore_eos=request.ignore_eos,
        speculation=_MODES.get(request.speculation, str(request.speculation)),
        drafter=request.drafter,
        num_draft_tokens=request.num_draft_tokens,
        tree_width=request.tree_width,
        tree_budget=request.tree_budget,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
    )


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """Consecutive chunks as one (the same tokens, text, log-probabilities and alternatives, in order)."""
    if len(chunks) == 1:
        return chunks[0]
    return Chunk(
        tuple(token for chunk in chunks for token in chunk.token_ids),
        "".join(chunk.text for chunk in chunks),
        tuple(logprob for chunk in chunks for logprob in chunk.logprobs),
        tuple(top for chunk in chunks for top in chunk.top_logprobs),
    )


def chunk_to_wire(chunk: Chunk) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(
        token_ids=chunk.token_ids,
        text=chunk.text,
        logprobs=chunk.logprobs,
        top_logprobs=[top_logprobs_to_wire(top) for top in chunk.top_logprobs],
    )


def final_to_wire(final: Final) -> router_pb2.GenerateResponse:
    stats = final.stats
    return router_pb2.GenerateResponse(
        finish_reason=final.finish_reason,
        usage=router_pb2.Usage(prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens),
        stats=router_pb2.SpeculationStats(
            rounds=stats.rounds,
            draft_tokens=stats.draft_tokens,
            accepted_tokens=stats.accepted_tokens,
            accepted_per_position=stats.accepted_per_position,
            rounds_per_draft_size=stats.rounds_per_draft_size,
            draft_ns=stats.draft_ns,
            verify_ns=stats.verify_ns,
            state_ns=stats.state_ns,
            pipeline_hits=stats.pipeline_hits,
            pipeline_rejection_hits=stats.pipeline_rejection_hits,
            pipeline_misses=stats.pipeline_misses,
            wire_bytes=stats.wire_bytes,
            feature_bytes=stats.feature_bytes,
            drafter_fallback=stats.drafter_fallback,
        ),
    )


class RouterServicer(router_pb2_grpc.RouterServicer):
    """``Generate`` and ``Status`` over a :class:`Frontend`, on the router's event loop."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        try:
            self.frontend.authorize(metadata.get("authorization"))
        except UnauthenticatedError as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        await self._authorize(context)
        plan = await asyncio.to_thread(self.frontend.plan, input_from_wire(request))  # tokenizing: off the loop
        queued: list[Chunk] = []  # emitted, not yet sent
        arrived = asyncio.Event()

        async def emit(chunk: Chunk) -> None:
            queued.append(chunk)
            arrived.set()

        task = asyncio.ensure_future(self.frontend.generate(plan, emit))
        task.add_done_callback(lambda _: arrived.set())
        try:
            while not task.done() or queued:
                await arrived.wait()
                arrived.clear()
                if queued:  # a stream that fell behind (slow reader, busy loop) catches up in one message
                    pending = queued.copy()
                    queued.clear()
                    yield chunk_to_wire(merge_chunks(pending))
        finally:
            task.cancel()  # the RPC ended early (or normally: then this does nothing)
        try:
            final = task.result()
        except CapacityError as error:
            seconds = error.retry_after_s if isinstance(error, OverloadedError) else self.frontend.config.retry_after_s
            context.set_trailing_metadata(((RETRY_PUSHBACK_KEY, str(round(seconds * 1000))),))
            raise
        except (WorkerUnavailableError, NoWorkerError) as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        yield final_to_wire(final)

    async def Status(
        self, request: router_pb2.RouterStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouterStatusReply:
        await self._authorize(context)
        workers = [
            router_pb2.WorkerStatus(
                role=w.role, address=w.address, healthy=w.healthy, outstanding=w.outstanding, kind=w.kind or ""
            )
            for w in self.frontend.workers()
        ]
        return router_pb2.RouterStatusReply(
            model=self.frontend.config.model,
            workers=workers,
            running=self.frontend.running,
            waiting=self.frontend.waiting,
        )


def parse_generate_request(raw: bytes) -> router_pb2.GenerateRequest:
    """Decode a GenerateRequest; raises InvalidArgumentError when the bytes are not one (e.g. bad UTF-8)."""
    try:
        return router_pb2.GenerateRequest.FromString(raw)
    except DecodeError as error:
        raise InvalidArgumentError("request", f"cannot be decoded ({error}); are all strings valid UTF-8?") from None


def add_to_server(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` as ``specdec.v1.Router``, with ``Generate`` receiving raw bytes to parse itself."""

    async def generate(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[router_pb2.GenerateResponse]:
        try:
            request = parse_generate_request(raw)
        except InvalidArgumentError as error:  # later failures are counted by the frontend
            servicer.frontend.metrics.request_failed(error)
            raise
        async for response in servicer.Generate(request, context):
            yield response

    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, response_serializer=router_pb2.GenerateResponse.SerializeToString
        ),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status,
            request_deserializer=router_pb2.RouterStatusRequest.FromString,
            response_serializer=router_pb2.RouterStatusReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
