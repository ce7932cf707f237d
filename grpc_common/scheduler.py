"""The one batching scheduler of both worker kinds (DESIGN §10): one thread owns the model and runs a step loop,
like a continuous-batching engine: each pass (one forward) starts as soon as the previous one ends, with every job
that has arrived meanwhile.

gRPC handlers never touch the model: they submit a job and wait on its Future. A *plain* job (OpenSequence, Commit,
CloseSequence, Status) is a function run on the scheduler thread; a *batched* job (Propose, Verify) is an item that
a subclass runs together with other sequences' items in :meth:`BatchScheduler._run_batch`. The scheduler thread
takes every job queued when it is free and runs them as one pass:

- Jobs of one sequence run in arrival order: a pending batch is run before a job for a sequence it already holds,
  so a batch holds one job per sequence, and at most ``max_batch_size`` jobs.
- A job whose Future was cancelled (its caller has gone) before it starts is skipped and has no effect.
- A plain job that raises fails its own Future only; a batch run fails what the subclass decides (each job's own
  checks fail that job alone).
- With a :class:`Budget`, a batch also holds at most ``limit`` of cost (the verifier's positions per forward). A job
  that does not fit what the batch leaves is either *carried* (``Budget.carry`` says it can make progress on its
  own: the verifier prefills its prompt a chunk at a time in the room batches leave), or runs in the next batch,
  alone if it alone exceeds the limit. A carried job, and every later batched job of its sequence, waits in
  ``_carried`` from pass to pass; each pass plans the carried jobs first, runs a batch even when only carried
  work is left, and takes new jobs without blocking, so other sequences' batches go on meanwhile.
- Jobs submitted inside :meth:`BatchScheduler.together` (a ``Batch`` RPC's calls, :mod:`grpc_common.batch`) reach
  the thread at once, when the block ends, so a router tick's calls share one pass: the thread cannot wake for the
  first call of a Batch and start a forward without the others.
- **When waiting pays.** A forward costs about the same for one sequence as for a batch (a GPU's forward is bound
  by reading the weights), so a call that just misses a forward waits for all of it and then runs in the next. By
  default (``arrival_wait``, :mod:`grpc_common.arrivals`) the thread learns when each sequence comes back after being
  served. After the first batched job of a pass it waits for the open sequences expected back within
  ``arrival_wait`` of a forward's duration, and no longer than the wait pays. A pass with nothing expected starts at
  once: a lone stream, or the calls of one router tick, which arrive together. A fixed window ``batch_wait_s`` > 0
  replaces that prediction: after the first batched job of a pass, the thread waits up to that long for more while
  the batch can still grow, that is, while it holds fewer than ``max_batch_size`` sequences and some open sequence
  has no job queued. ``python -m bench.verifier_window`` (this scheduler over a sleeping forward;
  ``bench/results/verifier-window.md``) measures both.
- With ``idle_trim`` the thread, once it has waited that long for a job after some work, returns the heap memory
  the model's work freed to the OS (:mod:`grpc_common.memory`).
- With ``idle_timeout_s`` every open sequence is *leased* to the router that opened it (DESIGN §9): a sequence no
  job and no :meth:`BatchScheduler.touch` has named for that long, and that has nothing queued or carried, is
  reclaimed (:meth:`BatchScheduler._reclaim`: the subclass closes it and frees its KV). A router that died leaves
  its sequences behind, and nothing else would ever close them; a live router touches the sequences it keeps
  waiting. A reaper thread submits the check as a plain job every quarter of the timeout, so it runs on the
  scheduler thread between batches like any other job.
- :meth:`BatchScheduler.stop` runs every job submitted before it and finishes the carried ones; later submissions
  fail with :class:`SchedulerStoppedError`.

Nothing here knows gRPC or a model: a subclass says what is batched, how a batch runs, and keeps its own metrics.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from grpc_common.arrivals import DEFAULT_FRACTION, ArrivalWait
from grpc_common.memory import IdleTrim
from specdec.errors import CapacityError, SpecdecError

LOG = logging.getLogger(__name__)
T = TypeVar("T")  # the item of a batched job


class SchedulerStoppedError(SpecdecError):
    """The worker is shutting down; the call was not run (mapped to UNAVAILABLE by the servicer)."""


@dataclass(frozen=True)
class Job:
    """A plain job: ``run`` on the scheduler thread; ``sequence_id`` (empty: none) orders it against a batch."""

    sequence_id: str
    run: Callable[[], Any]
    future: Future


@dataclass(frozen=True)
class BatchJob(Generic[T]):
    """A batched job: ``item`` of ``sequence_id``, run in a batch with other sequences' items; ``submitted`` is when
    it was queued (monotonic)."""

    sequence_id: str
    item: T
    future: Future
    submitted: float = field(default_factory=time.monotonic)

    def queued_s(self, started: float) -> float:
        """How long the job waited for the pass that ``started`` (monotonic) to run it."""
        return max(started - self.submitted, 0.0)


@dataclass(frozen=True)
class Budget(Generic[T]):
    """At most ``limit`` of ``cost(item)`` in one batch; ``carry(item)``: whether an item that does not fit can make
    progress while carried over (it may raise: the error fails that job alone)."""

    limit: int
    cost: Callable[[T], int]
    carry: Callable[[T], bool]


_STOP = object()


class BatchScheduler(ABC, Generic[T]):
    """Serialises every job onto one thread named ``{name}-scheduler`` and batches the batched jobs.

    At most ``max_queued`` batched jobs (None: no bound) wait at once; beyond that :meth:`submit_batched` raises
    CapacityError. ``idle_timeout_s`` (None: never) is the lease of an open sequence. Call :meth:`start` once,
    :meth:`stop` when done.
    """

    def __init__(
        self,
        name: str,
        *,
        max_batch_size: int,
        batch_wait_s: float = 0.0,
        arrival_wait: float = DEFAULT_FRACTION,
        max_queued: int | None = None,
        budget: Budget[T] | None = None,
        idle_trim: IdleTrim | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0 or None, got {idle_timeout_s}")
        self.name = name
        self.idle_timeout_s = idle_timeout_s
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        # scheduler thread only; a fixed window replaces it (and then nothing is tracked)
        self.arrivals = ArrivalWait(0.0 if batch_wait_s > 0 else arrival_wait)
        self.max_queued = max_queued
        self.budget = budget
        self._idle_trim = idle_trim
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _queued, _stopped and _named: no job is queued after _STOP
        self._queued = 0  # batched jobs submitted and not yet taken
        self._stopped = False
        self._named: dict[str, float] = {}  # sequence -> when a job or touch last named it (leases only); the lock
        self._reaper_stop = threading.Event()
        self._held = threading.local()  # .jobs: the jobs this thread submits inside together(), else None
        self._reaper = threading.Thread(target=self._reap_loop, name=f"{name}-reaper", daemon=True)
        # scheduler thread only: batched jobs taken but not answered, in arrival order; and, during a pass, the
        # sequences whose first carried job makes progress on its own, in arrival order
        self._carried: list[BatchJob[T]] = []
        self._carrying: list[str] = []
        self._thread = threading.Thread(target=self._loop, name=f"{name}-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if self.idle_timeout_s is not None:
            self._reaper.start()

    def stop(self) -> None:
        """Run every job submitted before, fail later ones (SchedulerStoppedError), then :meth:`_on_stop`."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._queue.put(_STOP)  # the last item
        self._reaper_stop.set()
        if self._reaper.is_alive():
            self._reaper.join()
        self._thread.join()
        self._on_stop()

    # --- called from handler threads; each returns a Future -------------------------------------------------------

    def submit(self, sequence_id: str, run: Callable[[], Any]) -> Future:
        """Queue a plain job; -> ``run()``'s result (or its error)."""
        return self._put(Job(sequence_id, run, Future()))

    def submit_batched(self, sequence_id: str, item: T) -> Future:
        """Queue ``item`` for a batch; -> what :meth:`_run_batch` sets."""
        return self._put(BatchJob(sequence_id, item, Future()))

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Jobs this thread submits inside the block reach the scheduler at once, when it ends, in submission order
        (so they share one pass); if the scheduler stopped meanwhile they fail with SchedulerStoppedError. Wait for
        their Futures after the block. Nested blocks join the outermost."""
        if getattr(self._held, "jobs", None) is not None:
            yield
            return
        held: list[Job | BatchJob[T]] = []
        self._held.jobs = held
        try:
            yield
        finally:
            self._held.jobs = None
            with self._lock:
                stopped = self._stopped
                if held and not stopped:
                    self._queue.put(held)
                elif held:
                    self._queued -= sum(isinstance(job, BatchJob) for job in held)
            if held and stopped:
                for job in held:
                    job.future.set_exception(SchedulerStoppedError(f"the {self.name} is shutting down"))

    def touch(self, sequence_ids: Collection[str]) -> None:
        """Renew the leases of ``sequence_ids`` (ids not open are ignored)."""
        self._renew(sequence_ids)

    def _put(self, job: Job | BatchJob[T]) -> Future:
        """Queue ``job``; once stopping, its Future fails at once with SchedulerStoppedError."""
        with self._lock:
            if not self._stopped:
                if self.idle_timeout_s is not None and job.sequence_id:
                    self._named[job.sequence_id] = time.monotonic()
                if isinstance(job, BatchJob):
                    if self.max_queued is not None and self._queued >= self.max_queued:
                        raise CapacityError(
                            f"{self.max_queued} batched calls already wait on the {self.name}; retry shortly"
                        )
                    self._queued += 1
                    self._waiting(self._queued)
                held = getattr(self._held, "jobs", None)
                if held is None:
                    self._queue.put(job)
                else:
                    held.append(job)
                return job.future
        job.future.set_exception(SchedulerStoppedError(f"the {self.name} is shutting down"))
        return job.future

    # --- what a subclass says (called on the scheduler thread) ----------------------------------------------------

    @abstractmethod
    def _run_batch(self, jobs: list[BatchJob[T]]) -> None:
        """Run ``jobs`` (running, one per sequence; possibly none while jobs are carried) and settle each Future."""

    @abstractmethod
    def _open_sequences(self) -> Collection[str]:
        """The sequences open now (the batch window waits only while one of them has nothing queued)."""

    def _ran(self, job: Job) -> None:
        """After the plain ``job`` ran (or was skipped)."""

    def _after_pass(self) -> None:
        """After each pass of jobs but the last."""

    def _on_stop(self) -> None:
        """After the thread has finished its last job (free every sequence here)."""

    def _waiting(self, queued: int) -> None:
        """``queued`` batched jobs now wait (called under the submit lock)."""

    def _waited(self, seconds: float) -> None:
        """A pass of batched jobs waited ``seconds`` for more after its first (0 when it waited for none)."""

    def _reclaim(self, sequence_id: str) -> None:
        """Close the open ``sequence_id``, whose lease ran out, and free its state (with ``idle_timeout_s``)."""
        raise NotImplementedError(f"the {self.name} scheduler has no leases")

    # --- leases -----------------------------------------------------------------------------------------------------

    def _renew(self, sequence_ids: Collection[str]) -> None:
        if self.idle_timeout_s is not None and sequence_ids:
            now = time.monotonic()
            with self._lock:
                for sequence_id in sequence_ids:
                    self._named[sequence_id] = now

    def _reap_loop(self) -> None:
        """Every quarter of the lease, queue a check of every lease; a sequence is reclaimed within 1.25 leases."""
        assert self.idle_timeout_s is not None
        while not self._reaper_stop.wait(self.idle_timeout_s / 4):
            self.submit("", self._reap)

    def _reap(self) -> None:
        """On the scheduler thread: reclaim every open sequence whose lease ran out and that nothing waits for
        (queued jobs renewed it when submitted; a carried job is still being served)."""
        assert self.idle_timeout_s is not None
        now = time.monotonic()
        open_ids = set(self._open_sequences())
        busy = {job.sequence_id for job in self._carried}
        with self._lock:
            for sequence_id in [name for name in self._named if name not in open_ids]:
                del self._named[sequence_id]  # closed since; an id touched but never opened
            expired = [
                sequence_id
                for sequence_id in open_ids
                if sequence_id not in busy and now - self._named.get(sequence_id, now) >= self.idle_timeout_s
            ]
            for sequence_id in expired:
                del self._named[sequence_id]
            for sequence_id in open_ids.difference(self._named):  # opened without a lease entry: starts now
                self._named[sequence_id] = now
        for sequence_id in expired:
            LOG.warning("reclaiming sequence %r: no call for %.1f s", sequence_id, self.idle_timeout_s)
            try:
                self._reclaim(sequence_id)
            except Exception:  # one sequence's failure must not keep the others leaked
                LOG.exception("reclaiming sequence %r failed", sequence_id)

    def _fail_carried(self, sequence_id: str, error: Exception) -> None:
        """Deliver ``error`` to every carried job of ``sequence_id`` and stop carrying it."""
        self._carrying.remove(sequence_id)
        kept = []
        for job in self._carried:
            if job.sequence_id != sequence_id:
                kept.append(job)
            elif job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
        self._carried = kept

    # --- the scheduler thread ---------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            jobs = self._take()
            stopping = bool(jobs) and jobs[-1] is _STOP  # nothing is submitted after it
            self._run_pass(jobs[:-1] if stopping else jobs)
            if stopping:
                while self._carried:
                    self._run_pass([])
                return
            self._after_pass()

    def _take(self) -> list:
        """Every job queued (a group from :meth:`together` counts as its jobs). With nothing carried, block for one
        item; then, after a batched job, wait for more while it pays (the fixed ``batch_wait_s`` window, else the
        sequences :attr:`arrivals` expects back); with carried jobs wait for nothing."""
        carrying = bool(self._carried)
        jobs: list = []
        item = None if carrying else self._queue.get() if self._idle_trim is None else self._idle_trim.get(self._queue)
        deadline = None  # set by the first batched job taken
        first_batched = 0.0  # when it was taken
        while True:
            if item is not None:
                new = item if isinstance(item, list) else [item]
                jobs.extend(new)
                if jobs[-1] is _STOP:
                    return jobs
                for job in new:
                    if isinstance(job, BatchJob):
                        self.arrivals.arrived(job.sequence_id, job.submitted)
                if not carrying and any(isinstance(job, BatchJob) for job in new):
                    first_batched = first_batched or time.monotonic()
                    deadline = self._deadline(jobs, deadline)
            wait = 0.0 if deadline is None else deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=wait) if wait > 0 and self._can_grow(jobs) else self._queue.get_nowait()
            except queue.Empty:
                if deadline is not None:
                    self._waited(time.monotonic() - first_batched)
                return jobs

    def _deadline(self, jobs: list[Job | BatchJob[T]], deadline: float | None) -> float:
        """When the pass of ``jobs`` stops waiting for more: ``batch_wait_s`` after its first batched job, else when
        :attr:`arrivals` says, never later than an earlier ``deadline``."""
        now = time.monotonic()
        if self.batch_wait_s > 0:
            return now + self.batch_wait_s if deadline is None else deadline
        present = {job.sequence_id for job in jobs}
        until = self.arrivals.until(present, self._open_sequences(), now)
        return until if deadline is None else min(until, deadline)

    def _can_grow(self, jobs: list[Job | BatchJob[T]]) -> bool:
        """Whether a batched job could still join the first batch of ``jobs``: it holds fewer than ``max_batch_size``
        sequences and some open sequence has no job queued (a plain job queued orders its sequence's next batched
        job after this batch)."""
        batched = {job.sequence_id for job in jobs if isinstance(job, BatchJob)}
        if len(batched) >= self.max_batch_size:
            return False
        busy = batched.union(job.sequence_id for job in jobs if isinstance(job, Job))
        return any(sequence_id not in busy for sequence_id in self._open_sequences())

    def _run_pass(self, jobs: list[Job | BatchJob[T]]) -> None:
        """Run the carried jobs, then ``jobs``: plain jobs in order, batched ones gathered into batches."""
        taken = sum(isinstance(job, BatchJob) for job in jobs)
        if taken:
            with self._lock:
                self._queued -= taken
                self._waiting(self._queued)
        served = [job.sequence_id for job in [*self._carried, *jobs] if job.sequence_id]
        self._renew(served)  # what is served now is not idle, however long it waited in the queue
        carried, self._carried, self._carrying = self._carried, [], []
        batch: list[BatchJob[T]] = []
        cost = 0
        for job in [*carried, *jobs]:
            if isinstance(job, Job):
                if job.sequence_id and any(pending.sequence_id == job.sequence_id for pending in batch):
                    self._flush(batch)
                    batch, cost = [], 0
                if job.future.set_running_or_notify_cancel():
                    _settle(job.future, job.run)
                self._ran(job)
                continue
            if job.future.cancelled():
                continue
            if job.sequence_id in self._carrying:  # behind its sequence's carried job
                self._carried.append(job)
                continue
            if len(batch) == self.max_batch_size or any(pending.sequence_id == job.sequence_id for pending in batch):
                self._flush(batch)
                batch, cost = [], 0
            job_cost = 0 if self.budget is None else self.budget.cost(job.item)
            if self.budget is None or cost + job_cost <= self.budget.limit:
                batch.append(job)
                cost += job_cost
            elif not self._carry(
                job, self.budget
            ):  # the job waits for the next batch, alone if it exceeds the budget alone
                if batch:
                    self._flush(batch)
                batch, cost = [job], job_cost
        if batch or self._carrying:
            self._flush(batch)
        self._renew(served)  # nor is it idle when the pass ends, however long the pass took

    def _carry(self, job: BatchJob[T], budget: Budget[T]) -> bool:
        """Carry ``job`` over if ``budget`` says it can make progress; False: it cannot (and was left alone)."""
        try:
            if not budget.carry(job.item):
                return False
        except Exception as error:  # this job's own failure
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
            return True
        self._carrying.append(job.sequence_id)
        self._carried.append(job)
        return True

    def _flush(self, batch: list[BatchJob[T]]) -> None:
        """Run the jobs of ``batch`` still wanted, if any or if carried work goes on."""
        live = [job for job in batch if job.future.set_running_or_notify_cancel()]
        if live or self._carrying:
            started = time.monotonic()
            self._run_batch(live)
            ended = time.monotonic()
            self.arrivals.served([job.sequence_id for job in live if job.future.done()], ended)
            if not self._carrying:  # a forward that also prefilled carried prompts tells little of a round's cost
                self.arrivals.timed(len(live), ended - started)


def _settle(future: Future, run: Callable[[], Any]) -> None:
    """Run ``run`` and deliver its result or error to the running ``future`` (errors are the caller's to map)."""
    try:
        future.set_result(run())
    except Exception as error:
        future.set_exception(error)
