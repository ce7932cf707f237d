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
``limits`` (a verifier's proposal nodes, the kilobytes of feature rows a batch's calls or their answers carry), at
most that much of the weight its callers give each call (a group heavier than that alone goes alone), since a worker
refuses a Batch over its bound as a whole and gRPC fails a message over its limit. Callers weigh their calls from
what they already hold (a proposal's node count, the size of the rows it relays): reading it back out of the
messages at every flush cost the router more than the rest of the batching.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

from router.errors import WorkerError, WorkerUnavailableError

CallT = TypeVar("CallT")
ResultT = TypeVar("ResultT")

MAX_CALLS_PER_BATCH = 512  # bounds one message (a proposal with q rows is ~100 B - 2 kB)
MAX_NODES_PER_BATCH = 4096  # half a verifier's default --max-batch-nodes

Send = Callable[[list[CallT]], Awaitable[Sequence[ResultT]]]


class Group(NamedTuple, Generic[CallT, ResultT]):
    """Calls queued together (never split between batches), their Futures and their weights."""

    calls: Sequence[CallT]
    futures: list[asyncio.Future[ResultT]]
    weights: Sequence[int]


class CallBatcher(Generic[CallT, ResultT]):
    """Gathers the calls to one worker made in one loop tick into ``send`` calls of at most ``max_calls`` each (and,
    for each of ``limits``, at most that much of the matching entry of the calls' ``weights``).

    ``send(calls)`` makes the RPC and returns one result per call, in order, or raises a WorkerError that then
    fails every call of that batch. Create and use on the event loop that runs the sessions.
    """

    def __init__(
        self,
        address: str,
        send: Send[CallT, ResultT],
        max_calls: int = MAX_CALLS_PER_BATCH,
        *,
        limits: Sequence[int] = (),
    ) -> None:
        self.address = address
        self._send = send
        self.max_calls = max_calls
        self.limits = tuple(limits)
        self._queued: list[Group[CallT, ResultT]] = []  # each sent in one batch
        self._flush_scheduled = False
        self._sending: set[asyncio.Task[Any]] = set()
        self.batches = 0  # Batch RPCs sent
        self.calls = 0  # calls they carried

    def submit(self, call: CallT, weights: Sequence[int] = ()) -> asyncio.Future[ResultT]:
        """Queue ``call`` for this tick's batch (``weights``: its weight for each of the limits, 0 where left out);
        the Future resolves to its result."""
        [future] = self.submit_group([call], weights)
        return future

    def submit_group(self, calls: Sequence[CallT], weights: Sequence[int] = ()) -> list[asyncio.Future[ResultT]]:
        """Queue ``calls`` for this tick, in order and all in the same batch (a group over the limits goes alone);
        ``weights``: the group's, as in :meth:`submit`. One Future per call."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[ResultT]] = [loop.create_future() for _ in calls]
        if len(weights) != len(self.limits):
            weights = (*weights, *[0] * (len(self.limits) - len(weights)))
        self._queued.append(Group(calls, futures, weights))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return futures

    def _flush(self) -> None:
        self._flush_scheduled = False
        queued, self._queued = self._queued, []
        calls: list[CallT] = []
        futures: list[asyncio.Future[ResultT]] = []
        totals = [0] * len(self.limits)
        for group in queued:
            over = any(
                total + weight > limit for total, weight, limit in zip(totals, group.weights, self.limits, strict=True)
            )
            if calls and (len(calls) + len(group.calls) > self.max_calls or over):
                self._start(calls, futures)
                calls, futures, totals = [], [], [0] * len(self.limits)
            calls.extend(group.calls)
            futures.extend(group.futures)
            for index, weight in enumerate(group.weights):
                totals[index] += weight
        if calls:
            self._start(calls, futures)

    def _start(self, calls: list[CallT], futures: list[asyncio.Future[ResultT]]) -> None:
        task = asyncio.ensure_future(self._send_batch(calls, futures))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_batch(self, calls: list[CallT], futures: list[asyncio.Future[ResultT]]) -> None:
        self.batches += 1
        self.calls += len(calls)
        try:
            results = await self._send(calls)
            if len(results) != len(calls):
                raise WorkerUnavailableError(
                    self.address, "INTERNAL", f"a batch of {len(calls)} calls got {len(results)} results"
                )
        except WorkerError as error:
            for future in futures:
                if not future.done():  # a caller that has gone cancelled its Future
                    future.set_exception(error)
            return
        except BaseException:  # cancelled (the router is closing): nobody may wait forever
            for future in futures:
                future.cancel()
            raise
        for future, result in zip(futures, results, strict=True):
            if not future.done():
                future.set_result(result)
