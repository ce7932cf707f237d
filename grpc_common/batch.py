"""The ``Batch`` RPC of the threaded services: many calls in one message, each answered or failed alone.

A router drives hundreds of sequences; one unary RPC per call per round costs it more CPU than everything else it
does (each ``grpc.aio`` call is ~100 µs of Python on the caller), so it sends what one tick of its loop gathers for a
worker as one ``Batch``. A servicer turns each call into a job on its scheduler (:class:`Submitted`: the job's
Future and how its result becomes the reply) in the order listed, which is the order the scheduler runs one
sequence's jobs in, then waits for all of them. The unary RPCs use the same ``submit`` functions, so a call means
the same thing either way. The calls are submitted inside the scheduler's ``together`` block, so they reach its
thread as one group and share its next pass (one forward) instead of the thread waking for the first call alone.
A ``Batch`` holds at most ``max_calls`` calls (checked before any is decoded); over it the whole RPC answers
INVALID_ARGUMENT naming ``calls``.

A router sends its batches on one ``BatchStream`` per worker instead (:func:`stream_batches`): a message on an
open stream costs both ends about half of a unary call (no call set-up, deadline timer or metadata per batch).
Each batch starts as it arrives and is answered, with its ``batch_id``, once all its calls are done; one over a
bound gets that error in every call's result instead, since failing the stream would fail every other batch on it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message
from specdec_wire.v1 import common_pb2

from grpc_common.errors import error_message, status_for
from specdec.errors import InvalidArgumentError

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submitted:
    """A call handed to a scheduler: its job's Future and how the job's result becomes the reply."""

    future: Future
    reply: Callable[[Any], Message]

    def answer(self, context: grpc.ServicerContext, unavailable: tuple[type[BaseException], ...] = ()) -> Message:
        """The reply of a unary call; a call that ends first (cancel, deadline) drops the job if it has not run,
        and ``unavailable`` errors (a scheduler shutting down) answer UNAVAILABLE."""
        context.add_callback(self.future.cancel)
        try:
            return self.reply(self.future.result())
        except CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, "the call ended before the worker ran it")
        except unavailable as error:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(error))


Submit = Callable[[str, Message], Submitted]  # (the call's oneof field name, its request) -> the job


class Leased(Protocol):
    """A scheduler whose open sequences are leased (:class:`~grpc_common.scheduler.BatchScheduler`)."""

    def touch(self, sequence_ids: Collection[str]) -> None: ...


def touched(scheduler: Leased, request: common_pb2.TouchRequest) -> Submitted:
    """A Touch call: the leases are renewed at once, no job is queued (a lease must not wait behind batches)."""
    scheduler.touch(request.sequence_ids)
    future: Future = Future()
    future.set_result(None)
    return Submitted(future, lambda _: common_pb2.TouchReply())


def check_batch_size(calls: Sequence[Message], max_calls: int) -> None:
    """Raise InvalidArgumentError naming ``calls`` when a Batch holds more than ``max_calls``."""
    if len(calls) > max_calls:
        raise InvalidArgumentError("calls", f"{len(calls)} calls in one Batch; at most {max_calls}")


def call_error(code: grpc.StatusCode, message: str) -> common_pb2.CallError:
    return common_pb2.CallError(code=code.value[0], message=message)


class StartedBatch:
    """A ``Batch``'s calls, each submitted to its scheduler (or failed at once), in order: what both the unary
    ``Batch`` and ``BatchStream`` answer from. Make one with :meth:`start` or :meth:`refused`."""

    def __init__(
        self, items: list[tuple[str, Submitted | common_pb2.CallError]], unavailable: tuple[type[BaseException], ...]
    ) -> None:
        self._items = items
        self._unavailable = unavailable

    @classmethod
    def start(
        cls,
        calls: Sequence[Message],
        submit: Submit,
        unavailable: tuple[type[BaseException], ...] = (),
        together: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> StartedBatch:
        """Submit every call inside ``together()`` (the scheduler's :meth:`~grpc_common.scheduler.BatchScheduler.
        together`) before any is waited for, so calls of different sequences share the scheduler's batches."""
        items: list[tuple[str, Submitted | common_pb2.CallError]] = []
        with together():
            for call in calls:
                kind = call.WhichOneof("call")
                if kind is None:
                    items.append(("", call_error(grpc.StatusCode.INVALID_ARGUMENT, "call: no call set")))
                    continue
                try:
                    items.append((kind, submit(kind, getattr(call, kind))))
                except Exception as error:  # this call's own failure, as its unary RPC would have reported it
                    items.append((kind, _error_of(error, unavailable)))
        return cls(items, unavailable)

    @classmethod
    def refused(cls, calls: Sequence[Message], error: BaseException) -> StartedBatch:
        """A batch none of whose calls is submitted: each fails with ``error`` (a bound on the whole batch)."""
        return cls([(call.WhichOneof("call") or "", _error_of(error, ())) for call in calls], ())

    @property
    def futures(self) -> list[Future]:
        """The submitted jobs' Futures."""
        return [item.future for _, item in self._items if isinstance(item, Submitted)]

    def cancel(self) -> None:
        """Drop the jobs that have not started (the caller has gone)."""
        for future in self.futures:
            future.cancel()

    def results(self, result_type: Callable[..., Message]) -> list[Message]:
        """One ``result_type`` per call, in order, waiting for each job: a call that failed (when submitted or when
        run) gets a ``CallError`` with the status its own RPC would have had."""
        results = []
        for kind, item in self._items:
            if isinstance(item, common_pb2.CallError):
                results.append(result_type(error=item))
                continue
            try:
                reply = item.reply(item.future.result())
            except CancelledError:
                results.append(result_type(error=call_error(grpc.StatusCode.CANCELLED, "the batch ended first")))
            except Exception as error:
                results.append(result_type(error=_error_of(error, self._unavailable)))
            else:
                results.append(result_type(**{kind: reply}))
        return results


def answer_batch(
    calls: Sequence[Message],
    submit: Submit,
    result_type: Callable[..., Message],
    context: grpc.ServicerContext,
    unavailable: tuple[type[BaseException], ...] = (),
    together: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> list[Message]:
    """One ``result_type`` per call of a unary ``Batch`` (each call a message with a ``call`` oneof), in order
    (:class:`StartedBatch`); if the RPC ends first, the jobs that have not started are dropped."""
    batch = StartedBatch.start(calls, submit, unavailable, together)
    context.add_callback(batch.cancel)
    return batch.results(result_type)


class _Ended:
    """The request stream has ended after ``batches`` batches."""

    def __init__(self, batches: int) -> None:
        self.batches = batches


@dataclass(frozen=True)
class BatchTypes:
    """A service's batch messages: one call's ``result``, a batch's ``reply`` (``results``, ``batch_id``) and a
    ``BatchStream`` message of ``replies``."""

    result: Callable[..., Message]
    reply: Callable[..., Message]
    replies: Callable[..., Message]


def stream_batches(
    requests: Iterator[Any],
    start: Callable[[Any], StartedBatch],
    types: BatchTypes,
    context: grpc.ServicerContext,
    max_message_bytes: int | None = None,
) -> Iterator[Message]:
    """The replies of a ``BatchStream``: every request is started (``start``) as soon as it arrives, on a reader
    thread of the stream's own, and answered (on the thread that writes the replies) once all its jobs are done, so
    a slow batch never holds back a later one: a drafter must see a Commit that cancels a pre-draft while that
    pre-draft is queued. ``start`` raising fails every call of that batch alone. The batches finished by the time a
    message goes out travel together in it: one forward finishes the batches of many router ticks, and the router
    then resumes all their sequences in one tick. With ``max_message_bytes``, replies that would together outgrow it
    go in several messages (a verdict carrying a prompt's feature rows can be megabytes; a message over the bound
    fails the stream and every batch on it); one reply over it alone still goes, and fails alone.
    A request's ``cancel_batch_ids`` drop the jobs not yet started of those earlier batches (the caller gave up on
    them); one with no calls is no batch. When the stream ends, unanswered batches are still answered; when the RPC
    ends first, jobs not started are dropped."""
    done: queue.SimpleQueue[tuple[Any, StartedBatch] | _Ended] = queue.SimpleQueue()
    unanswered: dict[int, StartedBatch] = {}  # by batch_id
    lock = threading.Lock()

    def when_done(request: Any, batch: StartedBatch) -> None:
        futures = batch.futures
        if not futures:
            done.put((request, batch))
            return
        # The Futures keep their callbacks and the batch keeps its Futures: the callbacks reach the batch only
        # through ``pending``, emptied once it is done, so that no cycle keeps an answered batch (and its request's
        # feature rows, megabytes a prompt) alive until one of the collector's rare full passes.
        pending: list[Any] = [request, batch]
        remaining = [len(futures)]

        def one_done(_: Future) -> None:
            with lock:
                remaining[0] -= 1
                finished = (pending.pop(0), pending.pop()) if remaining[0] == 0 else None
            if finished is not None:
                done.put(finished)

        for future in futures:
            future.add_done_callback(one_done)

    def read() -> None:
        count = 0
        try:
            for request in requests:
                if request.cancel_batch_ids:
                    with lock:
                        given_up = [unanswered.get(batch_id) for batch_id in request.cancel_batch_ids]
                    for batch in given_up:
                        if batch is not None:
                            batch.cancel()
                    if not request.calls:
                        continue
                try:
                    batch = start(request)
                except Exception as error:
                    batch = StartedBatch.refused(request.calls, error)
                with lock:
                    unanswered[request.batch_id] = batch
                count += 1
                when_done(request, batch)
        except Exception as error:  # the RPC ended (the caller cancelled or went away)
            LOG.debug("batch stream ended: %s", error)
        finally:
            done.put(_Ended(count))

    def cancel_unanswered() -> None:
        with lock:
            batches = list(unanswered.values())
        for batch in batches:
            batch.cancel()

    context.add_callback(cancel_unanswered)
    threading.Thread(target=read, name="batch-stream-reader", daemon=True).start()
    answered, total = 0, None
    while total is None or answered < total:
        items = [done.get()]
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(done.get_nowait())
        replies = []
        for item in items:
            if isinstance(item, _Ended):
                total = item.batches
                continue
            request, batch = item
            with lock:
                unanswered.pop(request.batch_id, None)
            replies.append(types.reply(results=batch.results(types.result), batch_id=request.batch_id))
        answered += len(replies)
        for group in message_groups(replies, max_message_bytes):
            yield types.replies(replies=group)


_REPLY_FRAMING_BYTES = 16  # a repeated message field's tag and length, with room to spare


def message_groups(replies: list[Message], max_message_bytes: int | None) -> list[list[Message]]:
    """``replies`` in order, in groups that each make a message of at most ``max_message_bytes`` (None: one group);
    a reply over it alone is a group of its own. No group is empty. A lone reply is never measured: it goes alone
    whatever its size, and sizing a message costs about what serialising it does."""
    if max_message_bytes is None or len(replies) <= 1:
        return [replies] if replies else []
    groups: list[list[Message]] = []
    size = 0
    for reply in replies:
        reply_size = reply.ByteSize() + _REPLY_FRAMING_BYTES
        if groups and size + reply_size <= max_message_bytes:
            groups[-1].append(reply)
            size += reply_size
        else:
            groups.append([reply])
            size = reply_size
    return groups


def _error_of(error: BaseException, unavailable: tuple[type[BaseException], ...]) -> common_pb2.CallError:
    code = grpc.StatusCode.UNAVAILABLE if isinstance(error, unavailable) else status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        LOG.error("internal error in a batched call", exc_info=error)
    return call_error(code, error_message(error))
