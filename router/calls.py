"""How the router calls one worker: its record (:class:`Worker`), the mapping of failures to :mod:`router.errors`,
and the transport its ``Batch`` messages travel on (:class:`BatchTransport`).

The transport is one long-lived ``BatchStream`` per worker whose ``Status`` says it answers one (any other, an
older build, gets a unary ``Batch`` RPC per batch): on this machine a message on an open ``grpc.aio`` stream costs
the two ends about half of what a unary call costs (no call set-up, deadline timer or metadata per batch). Each
batch carries an id its reply names, so batches are answered as they finish, and the worker sends those finished
together in one message, so their sessions resume in one tick and their next calls again form one batch. Each batch
has the worker's deadline, kept here by a timer: a batch past it fails, the worker is told to drop its calls that
have not started (as a unary RPC's deadline cancels them) and its late reply is ignored. When the stream fails,
every batch on it fails as its unary RPC would have (the same status), and the next batch opens a new stream.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from specdec_wire.v1 import common_pb2

from router.errors import WorkerBusyError, WorkerError, WorkerRejectedError, WorkerUnavailableError

T = TypeVar("T")

_REJECTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
}


_CODE_OF_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def worker_error(address: str, code: grpc.StatusCode, details: str) -> WorkerError:
    """The :mod:`router.errors` type for a failed call: refused arguments, busy, or unavailable (all else)."""
    if code in _REJECTED:
        return WorkerRejectedError(address, code.name, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WorkerBusyError(address, code.name, details)
    return WorkerUnavailableError(address, code.name, details)


def call_failure(address: str, error: common_pb2.CallError) -> WorkerError:
    """The :mod:`router.errors` type for one failed call of a ``Batch``."""
    return worker_error(address, _CODE_OF_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN), error.message)


@dataclass
class Worker:
    """One worker as the router sees it."""

    role: str  # "drafter" or "verifier"
    address: str
    channel: grpc.aio.Channel
    deadline_s: float
    healthy: bool = False
    outstanding: int = 0
    chosen: int = 0
    kind: str | None = None  # drafters: ngram, model, early-exit or eagle, once known
    feature_width: int = 0  # drafters: width of the target feature rows it drafts from (0: none), once known
    feature_layers: tuple[int, ...] = ()  # drafters: the target layers of those rows (empty: the final norm's)
    feature_context: int = 0  # drafters: they read the rows of only that many latest positions (0: all)
    lookup_min_match: int = 0  # drafters: a text tail this long seen before makes a round a prompt-lookup chain
    timeouts: int = 0  # consecutive calls and health checks that timed out
    batch_stream: bool = False  # its Status says it answers BatchStream (learnt by the first health check)
    forward_costs: tuple[tuple[int, float], ...] = ()  # verifiers: (positions, seconds) of forwards timed at its start

    async def call(self, method: Callable[..., Awaitable[T]], request: object, deadline_s: float | None = None) -> T:
        """``method(request)`` with the deadline; a failure becomes a WorkerError. Counts consecutive timeouts."""
        try:
            reply = await method(request, timeout=deadline_s or self.deadline_s)
        except grpc.aio.AioRpcError as error:
            raise self.failed(error.code(), error.details() or "") from None
        self.timeouts = 0
        return reply

    def failed(self, code: grpc.StatusCode, details: str) -> WorkerError:
        """The error of a call that failed with ``code``, counted: a timeout adds one to ``timeouts``, any other
        answer resets them."""
        self.timeouts = self.timeouts + 1 if code == grpc.StatusCode.DEADLINE_EXCEEDED else 0
        return worker_error(self.address, code, details)


class BatchTransport:
    """Sends one worker's batches: ``send(calls)`` returns one result per call, in order, or raises a WorkerError
    (the :class:`~router.batching.CallBatcher`'s ``send``).

    ``open_stream`` is the stub's ``BatchStream`` and ``batch_method`` its ``Batch``; ``request_type`` the batch
    message (``calls=``, ``batch_id=``). With ``streams`` (and a worker that answers them) batches go on the stream,
    else as unary ``Batch`` RPCs. Use on one event loop.
    """

    def __init__(
        self,
        worker: Worker,
        open_stream: Callable[[AsyncIterator[Any]], Any],
        batch_method: Callable[..., Awaitable[Any]],
        request_type: Callable[..., Any],
        streams: bool = True,
    ) -> None:
        self.worker = worker
        self.streams = streams
        self._open_stream = open_stream
        self._batch_method = batch_method
        self._request_type = request_type
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Sequence[Any]]] = {}
        self._outbox: asyncio.Queue[Any] | None = None  # the open stream's requests (None: no stream open)
        self._call: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()  # the stream's reader

    async def send(self, calls: list[Any]) -> Sequence[Any]:
        if not (self.streams and self.worker.batch_stream):
            return await self._send_unary(calls)
        loop = asyncio.get_running_loop()
        outbox = self._outbox if self._outbox is not None else self._open()
        batch_id = next(self._ids)
        future: asyncio.Future[Sequence[Any]] = loop.create_future()
        self._pending[batch_id] = future
        timer = loop.call_later(self.worker.deadline_s, self._expire, batch_id)
        outbox.put_nowait(self._request_type(calls=calls, batch_id=batch_id))
        try:
            return await future
        finally:
            timer.cancel()
            self._pending.pop(batch_id, None)

    async def close(self) -> None:
        """End the stream (if open); its unanswered batches fail."""
        if self._call is not None:
            self._call.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _send_unary(self, calls: list[Any]) -> Sequence[Any]:
        reply = await self.worker.call(self._batch_method, self._request_type(calls=calls))
        return reply.results

    def _open(self) -> asyncio.Queue[Any]:
        outbox: asyncio.Queue[Any] = asyncio.Queue()

        async def requests() -> AsyncIterator[Any]:
            while (request := await outbox.get()) is not None:
                yield request

        self._outbox, self._call = outbox, self._open_stream(requests())
        self._keep(asyncio.ensure_future(self._read(self._call, outbox)))
        return outbox

    async def _read(self, call: Any, outbox: asyncio.Queue[Any]) -> None:
        """Hand each reply to its batch; when the stream ends, fail the batches still waiting."""
        try:
            async for message in call:
                for reply in message.replies:
                    future = self._pending.get(reply.batch_id)
                    if future is not None and not future.done():
                        self.worker.timeouts = 0
                        future.set_result(reply.results)
            code, details = grpc.StatusCode.UNAVAILABLE, "the worker ended the batch stream"
        except grpc.aio.AioRpcError as error:
            code, details = error.code(), error.details() or ""
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "the router closed the batch stream"
        # no await from here on: a batch sent now opens a new stream, and those waiting on this one end here
        if self._outbox is outbox:
            self._outbox = self._call = None
        outbox.put_nowait(None)
        waiting = [future for future in self._pending.values() if not future.done()]
        if waiting:
            error = self.worker.failed(code, details)
            for future in waiting:
                future.set_exception(error)

    def _expire(self, batch_id: int) -> None:
        """The batch's deadline passed: it fails, and the worker is told to drop its calls that have not started (a
        batch still waiting is on the open stream: one that failed with its stream is done)."""
        future = self._pending.pop(batch_id, None)
        if future is not None and not future.done():
            future.set_exception(self.worker.failed(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within the deadline"))
            if self._outbox is not None:
                self._outbox.put_nowait(self._request_type(cancel_batch_ids=[batch_id]))

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
