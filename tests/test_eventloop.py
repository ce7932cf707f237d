"""The one event-loop helper (:mod:`specdec.eventloop`): uvloop where it imports, the default loop otherwise, and
``SPECDEC_EVENT_LOOP`` to choose."""

from __future__ import annotations

import asyncio
import importlib

import pytest

from router.server import EventLoopThread
from specdec import eventloop


async def _running_loop_name() -> str:
    return eventloop.loop_name(asyncio.get_running_loop())


def test_auto_runs_on_uvloop_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.delenv(eventloop.ENV, raising=False)
    assert eventloop.run(_running_loop_name()) == "uvloop"
    assert eventloop.run(_running_loop_name(), "uvloop") == "uvloop"


def test_the_environment_opts_out_and_a_bad_choice_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.ENV, "asyncio")
    assert eventloop.run(_running_loop_name()) == "asyncio"
    thread = EventLoopThread()  # the router's loop comes from the same helper
    try:
        assert eventloop.loop_name(thread.loop) == "asyncio"
    finally:
        thread.stop()
    with pytest.raises(ValueError, match=eventloop.ENV):
        eventloop.loop_factory("tokio")


def test_without_uvloop_auto_falls_back_and_uvloop_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module

    def no_uvloop(name: str, *args: object) -> object:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_uvloop)
    monkeypatch.delenv(eventloop.ENV, raising=False)
    assert eventloop.run(_running_loop_name()) == "asyncio"
    with pytest.raises(ImportError):
        eventloop.loop_factory("uvloop")
