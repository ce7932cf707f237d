"""The event loop of every asyncio process we run: uvloop where it is installed, else asyncio's own.

A router holding hundreds of streams spends most of its CPU in the loop (callbacks, futures, socket reads), and
uvloop runs that part in libuv and Cython instead of pure Python. grpc.aio and aiohttp run on it unchanged (grpc.aio
drives its completion queue from whatever loop is running). The choice is one environment variable,
``SPECDEC_EVENT_LOOP``, read when a loop is made, so a bench can start the same process both ways:

- ``auto`` (or unset): uvloop if it imports, else the default loop;
- ``uvloop``: uvloop, and an error if it does not import (a comparison must not silently measure asyncio twice);
- ``asyncio``: the default loop.

Every entry point goes through :func:`run` (instead of ``asyncio.run``) or :func:`new_event_loop` (a loop in a
thread of its own, as the router's).
"""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
ENV = "SPECDEC_EVENT_LOOP"
CHOICES = ("auto", "uvloop", "asyncio")


def loop_factory(choice: str | None = None, environ: Mapping[str, str] | None = None) -> Callable[[], Any]:
    """What makes a new loop for ``choice`` (None: ``$SPECDEC_EVENT_LOOP``, default ``auto``).

    Raises ValueError for an unknown choice, ImportError for ``uvloop`` where it is not installed.
    """
    environ = os.environ if environ is None else environ
    choice = (choice if choice is not None else environ.get(ENV, "")).strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        if choice == "uvloop":
            raise
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def new_event_loop(choice: str | None = None) -> asyncio.AbstractEventLoop:
    """A new loop of ``choice`` (see :func:`loop_factory`), not set as any thread's current loop."""
    return loop_factory(choice)()


def run(main: Coroutine[Any, Any, T], choice: str | None = None) -> T:
    """``asyncio.run(main)`` on a loop of ``choice`` (see :func:`loop_factory`)."""
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: which kind ``loop`` is (for logs and bench records)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
