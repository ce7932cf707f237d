"""One ``Batch`` RPC per worker per tick of the router's event loop, instead of one RPC per call.

Every session's round makes its calls (Propose, Verify, Commit, ...) as its own coroutine. Sent one by one, each
``grpc.aio`` unary call costs the router ~100 µs of Python, which at a few hundred streams is most of its CPU and
caps it near a thousand rounds a second. A :class:`CallBatcher` queues the calls made to one worker and, once
the loop has run every callback ready in this tick (``call_soon``), sends them as one ``Batch``; each caller gets
its own result back. A session's calls to one worker keep their order: a later call is queued after, and a
batch lists its calls in queue order, which the worker keeps per sequence. Two batches of one tick travel
concurrently, though, and a worker may run the second first; calls that must not be reordered (a Commit and the
Propose that drafts from it) are queued as one group (:meth:`CallBatcher.submit_group`), which is never split.
A batch also stays within the worker's bounds on one message: at most ``max_calls`` calls and, for each of the
``bounds`` (a verifier's proposal nodes, the kilobytes of feature rows a batch's calls or their answers carry), at
most its limit of that weight (a group heavier than that alone goes alone), since a worker refuses a Batch over
its bound as a whole and gRPC fails a message over its limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from router.errors import WorkerError, WorkerUnavailableError

CallT = TypeVar("CallT")
ResultT = TypeVar("ResultT")

MAX_CALLS_PER_BATCH = 512  # bounds one message (a proposal with q rows is ~100 B - 2 kB)
MAX_NODES_PER_BATCH = 4096  # half a verifier's default --max-batch-nodes

Send = Callable[[list[CallT]], Awaitable[Sequence[ResultT]]]
Bound = tuple[Callable[[CallT], int], int]  # (a call's weight, the most a batch holds)


class CallBatcher(Generic[CallT, ResultT]):
    """Gathers the calls to one worker made in one loop tick into ``send`` calls of at most ``max_calls`` each (and,
    for each ``(weight, limit)`` of ``bounds``, at most ``limit`` of ``weight(call)``).

    ``send(calls)`` makes the RPC and returns one result per call, in order, or raises a WorkerError that then
    fails every call of that batch. Create and use on the event loop that runs the sessions.
    """

    def __init__(
        self,
        address: str,
        send: Send[CallT, ResultT],
        max_calls: int = MAX_CALLS_PER_BATCH,
        *,
        bounds: Sequence[Bound[CallT]] = (),
    ) -> None:
        self.address = address
        self._send = send
        self.max_calls = max_calls
        self.bounds = tuple(bounds)
        self._queued: list[list[tuple[CallT, asyncio.Future[ResultT]]]] = []  # groups, each sent in one batch
        self._flush_scheduled = False
        self._sending: set[asyncio.Task[Any]] = set()
        self.batches = 0  # Batch RPCs sent
        self.calls = 0  # calls they carried

    def submit(self, call: CallT) -> asyncio.Future[ResultT]:
        """Queue ``call`` for this tick's batch; the Future resolves to its result."""
        [future] = self.submit_group([call])
        return future

    def submit_group(self, calls: Sequence[CallT]) -> list[asyncio.Future[ResultT]]:
        """Queue ``calls`` for this tick, in order and all in the same batch (a group over the bounds goes alone);
        one Future per call."""
        loop = asyncio.get_running_loop()
        group: list[tuple[CallT, asyncio.Future[ResultT]]] = [(call, loop.create_future()) for call in calls]
        self._queued.append(group)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return [future for _, future in group]

    def _flush(self) -> None:
        self._flush_scheduled = False
        queued, self._queued = self._queued, []
        batch: list[tuple[CallT, asyncio.Future[ResultT]]] = []
        limits = [limit for _, limit in self.bounds]
        totals = [0] * len(limits)
        for group in queued:
            weights = [sum(weight(call) for call, _ in group) for weight, _ in self.bounds]
            over = any(t + w > limit for t, w, limit in zip(totals, weights, limits, strict=True))
            if batch and (len(batch) + len(group) > self.max_calls or over):
                self._start(batch)
                batch, totals = [], [0] * len(limits)
            batch.extend(group)
            totals = [total + weight for total, weight in zip(totals, weights, strict=True)]
        if batch:
            self._start(batch)

    def _start(self, batch: list[tuple[CallT, asyncio.Future[ResultT]]]) -> None:
        task = asyncio.ensure_future(self._send_batch(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_batch(self, batch: list[tuple[CallT, asyncio.Future[ResultT]]]) -> None:
        self.batches += 1
        self.calls += len(batch)
        try:
            results = await self._send([call for call, _ in batch])
            if len(results) != len(batch):
                raise WorkerUnavailableError(
                    self.address, "INTERNAL", f"a batch of {len(batch)} calls got {len(results)} results"
                )
        except WorkerError as error:
            for _, future in batch:
                if not future.done():  # a caller that has gone cancelled its Future
                    future.set_exception(error)
            return
        except BaseException:  # cancelled (the router is closing): nobody may wait forever
            for _, future in batch:
                future.cancel()
            raise
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)
