"""The one batching scheduler of both workers (:mod:`grpc_common.scheduler`) over a fake batch function.

Most cases queue their jobs before :meth:`~grpc_common.scheduler.BatchScheduler.start`: the thread then takes them
all in one pass, so the batches are deterministic. The batch-window cases start first and give the window far more
than the timeout a result is waited for, so a window that waits when it must not fails instead of passing slowly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterator
from concurrent.futures import Future

import pytest

from grpc_common.scheduler import BatchJob, BatchScheduler, Budget, SchedulerStoppedError
from specdec.errors import CapacityError

TIMEOUT_S = 10.0
LONG_WINDOW_S = 60.0


class FakeWorker(BatchScheduler[object]):
    """Logs each batch as ``[(sequence, item), ...]`` (and plain jobs as they run, through ``note``); every batched
    job's result is the number of its batch; ``open`` are the open sequences the window looks at."""

    def __init__(self, open_sequences: Collection[str] = (), **kwargs) -> None:
        super().__init__("fake", **kwargs)
        self.open = set(open_sequences)
        self.log: list = []

    def note(self, entry: str) -> str:
        self.log.append(entry)
        return entry

    def _run_batch(self, jobs: list[BatchJob[object]]) -> None:
        self.log.append([(job.sequence_id, job.item) for job in jobs])
        for job in jobs:
            job.future.set_result(sum(isinstance(entry, list) for entry in self.log))

    def _open_sequences(self) -> Collection[str]:
        return self.open

    def _on_stop(self) -> None:
        self.log.append("stopped")


@pytest.fixture
def make() -> Iterator:
    """``make(**kwargs)`` builds a FakeWorker (not started); every one is stopped after the test."""
    made: list[FakeWorker] = []

    def build(**kwargs) -> FakeWorker:
        made.append(FakeWorker(**kwargs))
        return made[-1]

    yield build
    for worker in made:
        worker.stop()


def results(futures: list[Future]) -> list:
    return [future.result(TIMEOUT_S) for future in futures]


def test_jobs_of_one_sequence_run_in_arrival_order_and_others_batch_around_them(make) -> None:
    worker = make(max_batch_size=8)
    futures = [worker.submit_batched("a", 1), worker.submit_batched("b", 1)]
    futures.append(worker.submit("a", lambda: worker.note("a's plain job")))  # runs after a's batched job ...
    futures += [worker.submit_batched("a", 2), worker.submit_batched("b", 2)]  # ... and before its next one
    futures.append(worker.submit("", lambda: worker.note("no sequence")))  # orders against no batch
    futures.append(worker.submit_batched("c", 1))
    worker.start()
    assert results(futures) == [1, 1, "a's plain job", 2, 2, "no sequence", 2]
    assert worker.log == [[("a", 1), ("b", 1)], "a's plain job", "no sequence", [("a", 2), ("b", 2), ("c", 1)]]


def test_a_batch_holds_one_job_per_sequence_and_at_most_max_batch_size(make) -> None:
    worker = make(max_batch_size=2)
    futures = [worker.submit_batched(name, 0) for name in ["a", "b", "c", "c", "d"]]
    worker.start()
    assert results(futures) == [1, 1, 2, 3, 3]
    assert worker.log == [[("a", 0), ("b", 0)], [("c", 0)], [("c", 0), ("d", 0)]]


def test_cancelled_jobs_are_skipped(make) -> None:
    worker = make(max_batch_size=8)
    futures = [worker.submit("a", lambda: worker.note("must not run")), worker.submit_batched("b", 0)]
    futures += [worker.submit_batched("c", 0), worker.submit_batched("c", 1), worker.submit_batched("d", 0)]
    assert all(future.cancel() for future in futures[:3])
    worker.start()
    assert results(futures[3:]) == [1, 1]
    assert worker.log == [[("c", 1), ("d", 0)]]  # c's cancelled job holds no place: c's next one joins the batch


def test_an_exception_in_a_job_fails_only_that_jobs_future(make) -> None:
    worker = make(max_batch_size=8)

    def broken() -> None:
        raise ValueError("broken job")

    futures = [worker.submit_batched("a", 0), worker.submit("a", broken), worker.submit("a", lambda: "next")]
    futures.append(worker.submit_batched("a", 1))
    worker.start()
    assert futures[0].result(TIMEOUT_S) == 1
    with pytest.raises(ValueError, match="broken job"):
        futures[1].result(TIMEOUT_S)
    assert results([futures[2], futures[3]]) == ["next", 2]


def test_stop_runs_what_was_submitted_then_fails_later_jobs(make) -> None:
    worker = make(max_batch_size=8)
    worker.start()
    before = [worker.submit_batched("a", 0), worker.submit("a", lambda: "ran")]
    worker.stop()
    assert [future.result(0) for future in before] == [1, "ran"]
    assert worker.log[-1] == "stopped"
    for late in (worker.submit("a", lambda: "late"), worker.submit_batched("a", 0)):
        assert isinstance(late.exception(0), SchedulerStoppedError)
    worker.stop()  # a second stop does nothing
    assert worker.log.count("stopped") == 1


def test_at_most_max_queued_batched_jobs_wait(make) -> None:
    worker = make(max_batch_size=8, max_queued=2)
    futures = [worker.submit_batched("a", 0), worker.submit_batched("b", 0)]
    with pytest.raises(CapacityError):
        worker.submit_batched("c", 0)
    futures.append(worker.submit("c", lambda: "plain jobs are not counted"))
    worker.start()
    results(futures)
    assert worker.submit_batched("c", 0).result(TIMEOUT_S) == 2  # taken jobs no longer count


def test_a_budget_bounds_the_cost_of_a_batch_and_a_job_over_it_runs_alone(make) -> None:
    worker = make(max_batch_size=8, budget=Budget(3, cost=lambda item: item, carry=lambda item: False))
    futures = [worker.submit_batched(name, cost) for name, cost in [("a", 1), ("b", 2), ("c", 5), ("d", 1)]]
    worker.start()
    assert results(futures) == [1, 1, 2, 3]
    assert worker.log == [[("a", 1), ("b", 2)], [("c", 5)], [("d", 1)]]


class Prefiller(FakeWorker):
    """Items are their sequences' ids. A job of sequence ``s`` costs 1 plus ``remaining[s]``; one with something
    remaining is carried (``s == "bad"`` fails the carry check), and each batch spends the room it leaves of the
    budget on the carried sequences in arrival order (logged as a dict after the batch)."""

    def __init__(self, remaining: dict[str, int], limit: int) -> None:
        self.remaining = remaining
        super().__init__(max_batch_size=8, budget=Budget(limit, self.cost, self.carry))

    def cost(self, sequence_id: object) -> int:
        return 1 + self.remaining[str(sequence_id)]

    def carry(self, sequence_id: object) -> bool:
        if sequence_id == "bad":
            raise ValueError("cannot carry")
        return self.remaining[str(sequence_id)] > 0

    def _run_batch(self, jobs: list[BatchJob[object]]) -> None:
        assert self.budget is not None
        room = self.budget.limit - sum(self.cost(job.item) for job in jobs)
        progress = {}
        for sequence_id in self._carrying:
            progress[sequence_id] = min(room, self.remaining[sequence_id])
            self.remaining[sequence_id] -= progress[sequence_id]
            room -= progress[sequence_id]
        super()._run_batch(jobs)
        self.log.append(progress)


def test_a_carried_job_makes_progress_in_the_room_batches_leave_and_its_sequence_waits_behind_it() -> None:
    worker = Prefiller({"1": 5, "2": 0}, limit=3)  # sequence "1" costs 6 at first, over the budget of 3
    futures = [worker.submit_batched(name, name) for name in ["1", "2", "1"]]
    worker.start()
    assert results(futures) == [3, 1, 4]
    worker.stop()
    assert worker.log == [
        [("2", "2")],
        {"1": 2},  # the room "2" left
        [],
        {"1": 3},  # a batch of carried work alone, without waiting for a new job
        [("1", "1")],
        {},
        [("1", "1")],  # the later job of "1", behind the carried one
        {},
        "stopped",
    ]
    assert worker.arrivals.timed_forwards == 2  # the forwards that prefilled carried prompts are no cost samples


def test_a_job_that_fails_its_carry_check_fails_alone() -> None:
    worker = Prefiller({"bad": 5, "2": 0}, limit=3)
    failing, other = worker.submit_batched("bad", "bad"), worker.submit_batched("2", "2")
    worker.start()
    with pytest.raises(ValueError, match="cannot carry"):
        failing.result(TIMEOUT_S)
    assert other.result(TIMEOUT_S) == 1
    worker.stop()


def test_the_window_waits_for_an_open_sequence_with_nothing_queued(make) -> None:
    worker = make(open_sequences={"a", "b"}, max_batch_size=8, batch_wait_s=LONG_WINDOW_S)
    worker.start()
    first = worker.submit_batched("a", 0)
    second = worker.submit_batched("b", 0)  # completes the batch: every open sequence is in it
    assert results([first, second]) == [1, 1]


def test_a_fixed_window_replaces_the_arrival_wait_which_then_tracks_nothing(make) -> None:
    worker = make(open_sequences={"a", "b"}, max_batch_size=8, batch_wait_s=0.001)
    worker.start()
    for round_ in range(3):
        with worker.together():
            futures = [worker.submit_batched("a", round_), worker.submit_batched("b", round_)]
        results(futures)
    assert worker.arrivals.fraction == 0 and worker.arrivals.tracked == 0


def test_the_window_never_delays_a_lone_sequence_or_a_full_batch(make) -> None:
    alone = make(open_sequences={"a"}, max_batch_size=8, batch_wait_s=LONG_WINDOW_S)
    alone.start()
    assert alone.submit_batched("a", 0).result(TIMEOUT_S) == 1
    full = make(open_sequences={"a", "b"}, max_batch_size=1, batch_wait_s=LONG_WINDOW_S)
    full.start()
    assert full.submit_batched("a", 0).result(TIMEOUT_S) == 1


def test_the_window_does_not_wait_for_a_sequence_whose_plain_job_is_queued(make) -> None:
    worker = make(open_sequences={"a", "b"}, max_batch_size=8, batch_wait_s=LONG_WINDOW_S)
    futures = [worker.submit_batched("a", 0), worker.submit("b", lambda: "b's next call follows this batch")]
    worker.start()
    assert results(futures) == [1, "b's next call follows this batch"]


class GatedWorker(FakeWorker):
    """A FakeWorker whose first batch blocks until ``release`` is set (``started`` says it is running): jobs
    submitted meanwhile are what has arrived when the next forward starts."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.started, self.release = threading.Event(), threading.Event()

    def _run_batch(self, jobs: list[BatchJob[object]]) -> None:
        if not self.started.is_set():
            self.started.set()
            assert self.release.wait(TIMEOUT_S)
        super()._run_batch(jobs)


def test_the_step_loop_starts_each_forward_with_whatever_has_arrived() -> None:
    worker = GatedWorker(open_sequences={"a", "b", "c"}, max_batch_size=8)  # the default: no window
    worker.start()
    try:
        first = worker.submit_batched("a", 0)
        assert worker.started.wait(TIMEOUT_S)  # started without b and c, open with nothing queued: no wait for them
        later = [worker.submit_batched("b", 1), worker.submit_batched("c", 2)]  # arrive during the forward
        worker.release.set()
        assert results([first, *later]) == [1, 2, 2]
        assert worker.log == [[("a", 0)], [("b", 1), ("c", 2)]]
    finally:
        worker.release.set()
        worker.stop()


def test_jobs_submitted_together_share_one_pass_and_fail_if_the_scheduler_stopped(make) -> None:
    worker = make(open_sequences={"a", "b", "c"}, max_batch_size=8)
    worker.start()  # idle: without together() the thread could wake for "a" and run it alone
    with worker.together():
        futures = [worker.submit("a", lambda: worker.note("a's plain job")), worker.submit_batched("a", 0)]
        futures += [worker.submit_batched("b", 1), worker.submit_batched("c", 2)]
        assert worker.log == []  # held until the block ends
    assert results(futures) == ["a's plain job", 1, 1, 1]
    assert worker.log == ["a's plain job", [("a", 0), ("b", 1), ("c", 2)]]
    with worker.together():
        held = worker.submit_batched("a", 3)
        worker.stop()
    with pytest.raises(SchedulerStoppedError):
        held.result(TIMEOUT_S)


class SleepingWorker(FakeWorker):
    """A FakeWorker whose forward sleeps ``forward_s``, like a GPU's: as long for one sequence as for several."""

    def __init__(self, forward_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.forward_s = forward_s

    def _run_batch(self, jobs: list[BatchJob[object]]) -> None:
        time.sleep(self.forward_s)
        super()._run_batch(jobs)


def run_two_streams(arrival_wait: float, rounds: int = 6) -> list[list[str]]:
    """Streams a and b each keep one call in flight; a sends its next call at once, b 40 ms after its result (it
    drafts first), and a outlasts b. Returns the sequences of each forward that served b."""
    worker = SleepingWorker(0.2, open_sequences={"a", "b"}, max_batch_size=8, arrival_wait=arrival_wait)
    worker.start()

    def stream(name: str, think_s: float, count: int) -> None:
        for index in range(count):
            worker.submit_batched(name, index).result(TIMEOUT_S)
            time.sleep(think_s)

    try:
        with worker.together():  # the first round arrives together
            worker.submit_batched("a", "first"), worker.submit_batched("b", "first")
        threads = [threading.Thread(target=stream, args=args) for args in (("a", 0.0, rounds + 3), ("b", 0.04, rounds))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
    finally:
        worker.stop()
    forwards = [[name for name, _ in entry] for entry in worker.log if isinstance(entry, list)]
    return [names for names in forwards if "b" in names]


def test_a_pass_waits_for_a_sequence_it_expects_back_within_a_fraction_of_a_forward() -> None:
    served_b = run_two_streams(arrival_wait=0.5)  # waits up to 100 ms for b, due 40 ms after a forward
    # once b's habit is learnt, b joins a's forwards (a hiccup of a loaded machine may cost it one)
    assert sum("a" in names for names in served_b[-5:]) >= 4


def test_without_the_arrival_wait_a_late_stream_misses_every_forward() -> None:
    served_b = run_two_streams(arrival_wait=0.0)  # a starts each forward alone; b waits it out, then runs alone
    assert sum("a" in names for names in served_b[-5:]) <= 1  # (a thread switch can let a and b meet once)
