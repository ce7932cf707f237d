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
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Sequence
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


def answer_batch(
    calls: Sequence[Message],
    submit: Submit,
    result_type: Callable[..., Message],
    context: grpc.ServicerContext,
    unavailable: tuple[type[BaseException], ...] = (),
    together: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> list[Message]:
    """One ``result_type`` per call of a ``Batch`` (each call a message with a ``call`` oneof), in order.

    Every call is submitted, inside ``together()`` (the scheduler's :meth:`~grpc_common.scheduler.BatchScheduler.
    together`), before any is waited for, so calls of different sequences share the scheduler's batches.
    A call that fails (when submitted or when run) gets a ``CallError`` with the status its own RPC would have had;
    if the Batch RPC ends first, the jobs that have not started are dropped.
    """
    submitted: list[tuple[str, Submitted | common_pb2.CallError]] = []
    with together():
        for call in calls:
            kind = call.WhichOneof("call")
            if kind is None:
                submitted.append(("", call_error(grpc.StatusCode.INVALID_ARGUMENT, "call: no call set")))
                continue
            try:
                submitted.append((kind, submit(kind, getattr(call, kind))))
            except Exception as error:  # this call's own failure, as its unary RPC would have reported it
                submitted.append((kind, _error_of(error, unavailable)))
    futures = [item.future for _, item in submitted if isinstance(item, Submitted)]
    context.add_callback(lambda: [future.cancel() for future in futures])
    results = []
    for kind, item in submitted:
        if isinstance(item, common_pb2.CallError):
            results.append(result_type(error=item))
            continue
        try:
            reply = item.reply(item.future.result())
        except CancelledError:
            results.append(result_type(error=call_error(grpc.StatusCode.CANCELLED, "the batch ended first")))
        except Exception as error:
            results.append(result_type(error=_error_of(error, unavailable)))
        else:
            results.append(result_type(**{kind: reply}))
    return results


def _error_of(error: BaseException, unavailable: tuple[type[BaseException], ...]) -> common_pb2.CallError:
    code = grpc.StatusCode.UNAVAILABLE if isinstance(error, unavailable) else status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        LOG.error("internal error in a batched call", exc_info=error)
    return call_error(code, error_message(error))
