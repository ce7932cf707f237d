"""One thread owns the drafter; Propose calls from many sequences that wait together run as one batch.

gRPC handlers never touch the drafter: they submit a job and wait on its Future. The scheduler thread
takes every job queued (waiting up to ``batch_wait_s`` after a Propose for more), gathers the Propose
jobs into one ``drafter.propose`` call (at most ``max_batch_size``, one per sequence) and runs
OpenSequence / Commit / CloseSequence jobs in between, so the drafter and all torch work stay on one
thread. Jobs of one sequence run in arrival order: a batch is flushed before a job for a sequence it
already holds. A job whose caller has gone (its Future cancelled) before it starts is skipped and has
no effect. The scheduler records the service's metrics (:class:`~drafter_service.metrics.DrafterMetrics`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

from drafter_service.metrics import DrafterMetrics
from specdec.drafters import DraftConfig, Drafter
from specdec.errors import CapacityError, InvalidArgumentError
from specdec.sampling import SamplingParams, make_generator

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerStatus:
    """A consistent snapshot, taken on the scheduler thread."""

    open_sequences: int
    runner_sequences: int
    proposals: int  # Propose jobs answered
    batches: int  # drafter.propose calls that answered them
    max_batch: int  # largest number of Propose jobs in one drafter call


@dataclass(frozen=True)
class _Job:
    """Any call but Propose; ``sequence_id`` (empty: none) orders it against a pending batch."""

    sequence_id: str
    run: Callable[[], Any]
    future: Future


@dataclass(frozen=True)
class _ProposeJob:
    sequence_id: str
    max_tokens: int
    assume_previous_accepted: bool
    future: Future  # -> (Proposal, draft_ns)


class _Ready(NamedTuple):
    """A Propose job whose sequence is open (and assumed, when asked), waiting for the drafter call."""

    job: _ProposeJob
    handle: int
    assume_ns: int


_STOP = object()


class DraftScheduler:
    """Serialises every call on ``drafter`` onto one thread and batches Propose calls.

    ``metrics`` (default: a fresh, unserved set) receives the scheduler's series.
    """

    def __init__(
        self,
        drafter: Drafter,
        *,
        max_batch_size: int,
        batch_wait_s: float = 0.0,
        max_open_sequences: int = 4096,
        metrics: DrafterMetrics | None = None,
    ) -> None:
        self.drafter = drafter
        self.metrics = DrafterMetrics() if metrics is None else metrics
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_open_sequences = max_open_sequences
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, int] = {}  # sequence id -> drafter handle; scheduler thread only
        self._proposals = self._batches = self._max_batch = 0
        self._thread = threading.Thread(target=self._loop, name="drafter-scheduler", daemon=True)
        self._lock = threading.Lock()  # orders _submit against stop: no job is queued after _STOP
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Run every job already queued, refuse new ones, then close every open sequence."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._queue.put(_STOP)  # the last item: _submit refuses jobs from now on
        self._thread.join()
        for handle in self._handles.values():
            self.drafter.close(handle)
        self._handles.clear()

    # --- called from handler threads; each returns a Future ---------------------------------------------------

    def open(
        self, sequence_id: str, prompt: list[int], params: SamplingParams, seed: int, shape: DraftConfig
    ) -> Future:
        """Open ``sequence_id`` on ``prompt`` with its own sampling, seed and candidate shape; -> None."""
        _check_id(sequence_id)

        def run() -> None:
            if sequence_id in self._handles:
                raise InvalidArgumentError("sequence_id", f"{sequence_id!r} is already open")
            if len(self._handles) >= self.max_open_sequences:
                raise CapacityError(
                    f"{self.max_open_sequences} sequences are open on this drafter; retry later or use another one"
                )
            self._handles[sequence_id] = self.drafter.open(prompt, params, make_generator(seed), shape)

        return self._submit(_Job(sequence_id, run, Future()))

    def propose(self, sequence_id: str, max_tokens: int, assume_previous_accepted: bool) -> Future:
        """Candidates for ``sequence_id``, batched with other sequences'; -> ``(Proposal, draft_ns)``."""
        _check_id(sequence_id)
        if max_tokens < 0:
            raise InvalidArgumentError("max_tokens", f"must be >= 0, got {max_tokens}")
        return self._submit(_ProposeJob(sequence_id, max_tokens, assume_previous_accepted, Future()))

    def commit(self, sequence_id: str, base_length: int, emitted: list[int]) -> Future:
        """The committed text of ``sequence_id`` is now ``text[:base_length] + emitted``; -> None."""
        _check_id(sequence_id)
        return self._submit(
            _Job(sequence_id, lambda: self.drafter.sync(self._handle(sequence_id), base_length, emitted), Future())
        )

    def close(self, sequence_id: str) -> Future:
        """Free ``sequence_id`` (unknown ids are fine); -> None."""

        def run() -> None:
            handle = self._handles.pop(sequence_id, None)
            if handle is not None:
                self.drafter.close(handle)

        return self._submit(_Job(sequence_id, run, Future()))

    def status(self) -> Future:
        """-> :class:`SchedulerStatus`."""

        def run() -> SchedulerStatus:
            return SchedulerStatus(
                len(self._handles), self.drafter.runner_sequences, self._proposals, self._batches, self._max_batch
            )

        return self._submit(_Job("", run, Future()))

    def _submit(self, job: _Job | _ProposeJob) -> Future:
        with self._lock:
            if self._stopped:
                raise RuntimeError("the drafter scheduler is stopped")
            self._queue.put(job)
        return job.future

    # --- the scheduler thread -----------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            jobs = self._take()
            if jobs[-1] is _STOP:
                self._execute(jobs[:-1])
                return
            self._execute(jobs)
            self.metrics.open_sequences.set(len(self._handles))

    def _take(self) -> list:
        """Block for one job, then take every job queued; after a Propose, wait up to ``batch_wait_s`` for more."""
        jobs = [self._queue.get()]
        deadline = time.monotonic() + self.batch_wait_s if isinstance(jobs[0], _ProposeJob) else 0.0
        while jobs[-1] is not _STOP:
            wait = deadline - time.monotonic()
            proposes = sum(isinstance(job, _ProposeJob) for job in jobs)
            try:
                if wait > 0 and proposes < self.max_batch_size:
                    jobs.append(self._queue.get(timeout=wait))
                else:
                    jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return jobs

    def _execute(self, jobs: list[_Job | _ProposeJob]) -> None:
        """Run ``jobs``: Propose jobs gathered into batches, the others in order between them."""
        batch: list[_ProposeJob] = []
        for job in jobs:
            in_batch = any(pending.sequence_id == job.sequence_id for pending in batch)
            if in_batch or (isinstance(job, _ProposeJob) and len(batch) == self.max_batch_size):
                self._run_batch(batch)
                batch = []
            if isinstance(job, _ProposeJob):
                batch.append(job)
            elif job.future.set_running_or_notify_cancel():
                _settle(job.future, job.run)
        self._run_batch(batch)

    def _run_batch(self, batch: list[_ProposeJob]) -> None:
        """One ``drafter.propose`` for every live job of ``batch``; a failing batch is retried job by job."""
        ready: list[_Ready] = []
        for job in batch:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                started = time.perf_counter_ns()
                handle = self._handle(job.sequence_id)
                if job.assume_previous_accepted:
                    self.drafter.assume_accepted(handle)
                ready.append(_Ready(job, handle, time.perf_counter_ns() - started))
            except Exception as error:
                job.future.set_exception(error)
        if not ready:
            return
        try:
            self._propose(ready)
        except Exception as error:
            if len(ready) == 1:
                ready[0].job.future.set_exception(error)
                return
            LOG.warning("a batch of %d proposals failed; proposing one sequence at a time", len(ready), exc_info=True)
            for entry in ready:
                try:
                    self._propose([entry])
                except Exception as single_error:
                    entry.job.future.set_exception(single_error)

    def _propose(self, ready: list[_Ready]) -> None:
        """One drafter call for ``ready``; answers each job with its proposal and the call's duration."""
        started = time.perf_counter_ns()
        proposals = self.drafter.propose([entry.handle for entry in ready], [entry.job.max_tokens for entry in ready])
        draft_ns = time.perf_counter_ns() - started
        self.metrics.batch_size.observe(len(ready))
        self.metrics.propose_seconds.observe(draft_ns / 1e9)
        self.metrics.proposals.inc(len(ready))
        self.metrics.draft_tokens.inc(sum(len(proposal.tree) for proposal in proposals))
        self._proposals += len(ready)
        self._batches += 1
        self._max_batch = max(self._max_batch, len(ready))
        for entry, proposal in zip(ready, proposals, strict=True):
            entry.job.future.set_result((proposal, draft_ns + entry.assume_ns))

    def _handle(self, sequence_id: str) -> int:
        handle = self._handles.get(sequence_id)
        if handle is None:
            raise KeyError(f"sequence_id: no open sequence {sequence_id!r}")
        return handle


def _check_id(sequence_id: str) -> None:
    if not sequence_id:
        raise InvalidArgumentError("sequence_id", "must not be empty")


def _settle(future: Future, run: Callable[[], Any]) -> None:
    """Run ``run`` and put its result or exception into the running ``future``."""
    try:
        future.set_result(run())
    except Exception as error:
        future.set_exception(error)
