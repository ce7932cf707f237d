"""Typed domain errors -> gRPC status codes, in one server interceptor (DESIGN §10).

:class:`DomainErrorInterceptor` wraps the threaded servers' handlers, :class:`AsyncDomainErrorInterceptor` the
``grpc.aio`` ones (the router's public API); both use the one table :data:`STATUS_OF`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import grpc.aio

from specdec.errors import (
    CancelledByCallerError,
    CapacityError,
    IncompatibleDraftError,
    InvalidArgumentError,
    ModelNotFoundError,
    SpecdecError,
)

LOG = logging.getLogger(__name__)

STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
    (IncompatibleDraftError, grpc.StatusCode.FAILED_PRECONDITION),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (CancelledByCallerError, grpc.StatusCode.CANCELLED),
    (KeyError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (SpecdecError, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_for(error: BaseException) -> grpc.StatusCode:
    """The status code for ``error``: the first matching type above, INTERNAL otherwise."""
    for error_type, code in STATUS_OF:
        if isinstance(error, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def error_message(error: BaseException) -> str:
    """The status details for ``error`` (a KeyError's message without repr quotes)."""
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    """Abort with the mapped status, unless the handler already aborted on purpose."""
    if context.code() not in (None, grpc.StatusCode.OK):
        raise error
    code = status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        LOG.exception("internal error")
    context.abort(code, error_message(error))


def _wrap_unary(behavior: Callable) -> Callable:
    def handler(request, context: grpc.ServicerContext):
        try:
            return behavior(request, context)
        except Exception as error:
            _abort(context, error)

    return handler


def _wrap_stream(behavior: Callable) -> Callable:
    def handler(request, context: grpc.ServicerContext):
        try:
            yield from behavior(request, context)
        except Exception as error:
            _abort(context, error)

    return handler


class DomainErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions escaping a (sync) handler to status codes; aborts raised on purpose pass through."""

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
        return handler


async def _abort_async(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """Abort with the mapped status, unless the handler already aborted on purpose."""
    if isinstance(error, grpc.aio.AbortError):
        raise error
    code = status_for(error)
    if code == grpc.StatusCode.INTERNAL:
        LOG.exception("internal error")
    await context.abort(code, error_message(error))


def _wrap_unary_async(behavior: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
    async def handler(request, context: grpc.aio.ServicerContext):
        try:
            return await behavior(request, context)
        except Exception as error:
            await _abort_async(context, error)

    return handler


def _wrap_stream_async(behavior: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
    async def handler(request, context: grpc.aio.ServicerContext):
        try:
            async for response in behavior(request, context):
                yield response
        except Exception as error:
            await _abort_async(context, error)

    return handler


class AsyncDomainErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping a ``grpc.aio`` handler to status codes; aborts raised on purpose pass through."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
        handler_call_details: grpc.HandlerCallDetails,
    ):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary_async(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream_async(handler.unary_stream))
        return handler
