"""Errors of the router's own making, beside the core's :mod:`specdec.errors`.

Worker failures are classified once, where a gRPC status arrives (:mod:`router.workers`), into these types;
the round loop decides what each means for the request (a drafter's failure never fails it) and the public
servers map what escapes to a status code / HTTP status in one place each.
"""

from __future__ import annotations

from specdec.errors import CapacityError, SpecdecError


class WorkerError(SpecdecError):
    """A call to a drafter or verifier failed; ``address`` names the worker, ``code`` the gRPC status name."""

    def __init__(self, address: str, code: str, message: str) -> None:
        super().__init__(f"{address}: {code}: {message}")
        self.address = address
        self.code = code
        self.detail = message


class WorkerUnavailableError(WorkerError):
    """The worker is down, stalled past its deadline, lost the sequence or failed internally."""


class WorkerRejectedError(WorkerError, ValueError):
    """The worker refused the request's arguments (e.g. prompt + max_tokens over its context).

    The message is the worker's own (``"field: reason"``), passed on to the client unchanged.
    """

    def __str__(self) -> str:
        return self.detail


class WorkerBusyError(WorkerError, CapacityError):
    """The worker is at capacity (no free sequence slot); the client may retry later."""

    def __str__(self) -> str:
        return self.detail


class NoWorkerError(SpecdecError):
    """No healthy verifier is available for a request."""


class UnauthenticatedError(SpecdecError):
    """The public API requires a bearer token and the request did not carry the right one."""


class OverloadedError(CapacityError):
    """The router already runs its maximum number of concurrent requests; retry after ``retry_after_s``."""

    def __init__(self, running: int, retry_after_s: float) -> None:
        super().__init__(f"the router is at capacity ({running} requests running); retry after {retry_after_s:g} s")
        self.retry_after_s = retry_after_s
