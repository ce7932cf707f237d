"""The serving processes' garbage collector policy (:mod:`specdec.gc_policy`): ``server`` freezes what startup built
and makes passes rarer, ``default`` leaves CPython's collector alone, and ``SPECDEC_GC`` chooses."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from bench.gc_pause import markdown, measure
from specdec import gc_policy
from specdec.errors import InvalidArgumentError


@pytest.fixture
def restored_collector() -> Iterator[None]:
    """Whatever a test does to this process's collector is undone after it."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_the_choice_defaults_to_server_and_a_bad_one_names_the_variable() -> None:
    assert gc_policy.choice_from({}) == "server"
    assert gc_policy.choice_from({gc_policy.ENV: " Default "}) == "default"
    with pytest.raises(InvalidArgumentError, match=f"{gc_policy.ENV}: must be one of server, default, got 'off'"):
        gc_policy.choice_from({gc_policy.ENV: "off"})


@pytest.mark.usefixtures("restored_collector")
def test_server_freezes_what_exists_and_raises_the_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gc_policy.ENV, raising=False)
    gc.unfreeze()
    survivor = [object()]  # a container made before the process serves
    assert gc_policy.settle() == "server"
    assert gc.get_threshold() == gc_policy.SERVER_THRESHOLDS
    assert gc.get_freeze_count() > 0
    assert all(tracked is not survivor for tracked in gc.get_objects())  # frozen: no generation holds it now


@pytest.mark.usefixtures("restored_collector")
def test_a_worker_freezes_but_keeps_cpythons_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gc_policy.ENV, raising=False)
    gc.unfreeze()
    before = gc.get_threshold()
    assert gc_policy.settle(thresholds=None) == "server"
    assert gc.get_threshold() == before and gc.get_freeze_count() > 0


@pytest.mark.usefixtures("restored_collector")
def test_cyclic_garbage_is_still_collected_under_server() -> None:
    gc_policy.settle("server")

    class Node:
        def __init__(self) -> None:
            self.other: Node | None = None

    collected = []
    first, second = Node(), Node()
    first.other, second.other = second, first
    gc.callbacks.append(lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
    try:
        del first, second
        gc.collect(0)
    finally:
        gc.callbacks.pop()
    assert sum(collected) >= 2


@pytest.mark.usefixtures("restored_collector")
def test_default_leaves_the_collector_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    monkeypatch.setenv(gc_policy.ENV, "default")
    assert gc_policy.settle() == "default"
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


@pytest.mark.usefixtures("restored_collector")
def test_the_pause_bench_sees_a_routers_startup_heap_leave_the_collector() -> None:
    row = measure("router", "smollm2-135m", repeats=1)
    assert row["default"]["tracked_objects"] > 10_000 and row["frozen_objects"] > 10_000
    assert row["server"]["tracked_objects"] < row["default"]["tracked_objects"] // 10
    document = {"name": "t", "date": "d", "environment": {"cpu": "cpu"}, "config": {"model": "m"}, "command": ["c"]}
    text = markdown({**document, "rows": [row]})
    assert f"| router | default | {row['default']['tracked_objects']} |" in text and "| router | server |" in text
