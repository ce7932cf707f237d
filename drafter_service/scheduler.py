"""The drafter's scheduler: one thread owns the drafter; Propose calls from many sequences that wait together run
as one ``drafter.propose`` call.

The machinery (queue, thread, per-sequence order, cancelled jobs skipped, the wait for the calls expected back,
stop: later calls fail with :class:`~grpc_common.scheduler.SchedulerStoppedError`) is the shared
:class:`~grpc_common.scheduler.BatchScheduler`; here are what a Propose batch is (at most ``max_batch_size``
sequences: each open and, when asked, assumed accepted, then one drafter call, retried job by job if it fails), the
OpenSequence / Commit / CloseSequence / Status jobs run between batches, and the service's metrics
(:class:`~drafter_service.metrics.DrafterMetrics`).

A pre-draft (Propose with ``assume_previous_accepted``) first drafts for the previous proposal's rejection verdicts
(``drafter.pre_draft``, multi-outcome pre-drafting; nothing when the drafter's ``predraft_outcomes`` is 1), then
assumes and proposes with the batch. **Cancellation** (a pipeline miss never waits for the pre-draft it will throw
away): a Commit with ``cancel_through`` raises that sequence's cancel watermark on the handler thread, at once, not
as a queued job. A Propose numbered at or below it is answered :class:`~specdec.errors.CancelledByCallerError`
without running if it has not started, and one running is dropped by the drafter at its next forward (its
``stop`` check reads the watermark); the Commit, queued behind it, then rolls the sequence back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import torch

from drafter_service.metrics import DrafterMetrics
from grpc_common.arrivals import DEFAULT_FRACTION
from grpc_common.memory import IdleTrim
from grpc_common.scheduler import BatchJob, BatchScheduler
from specdec.drafters import DraftConfig, Drafter
from specdec.drafters.base import Proposal
from specdec.errors import CancelledByCallerError, CapacityError, InvalidArgumentError
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
    cancelled: int  # Propose jobs cancelled by a Commit (answered CANCELLED)


@dataclass(frozen=True)
class _Propose:
    max_tokens: int
    assume_previous_accepted: bool
    propose_id: int = 0  # 0: never cancelled


class Drafted(NamedTuple):
    """What a Propose job answers: the proposal, the proposals pre-drafted for the previous proposal's rejection
    verdicts (in their order), the drafting time and how long the job waited for its batch to start, in
    nanoseconds."""

    proposal: Proposal
    outcome_proposals: list[Proposal]
    draft_ns: int
    queued_ns: int = 0


class _Ready(NamedTuple):
    """A Propose job whose sequence is open (and assumed, when asked), waiting for the drafter call."""

    job: BatchJob[_Propose]  # -> Drafted
    handle: int
    outcome_proposals: list[Proposal]
    predraft_ns: int


class DraftScheduler(BatchScheduler[_Propose]):
    """Serialises every call on ``drafter`` onto one thread and batches Propose calls.

    ``metrics`` (default: a fresh, unserved set) receives the scheduler's series. ``idle_timeout_s`` (None: never)
    is a sequence's lease: one no call has named for that long is closed. ``idle_trim`` (None: never) hands freed
    heap memory back to the OS once the scheduler has had no job for a while (:mod:`grpc_common.memory`).
    """

    def __init__(
        self,
        drafter: Drafter,
        *,
        max_batch_size: int,
        batch_wait_s: float = 0.0,
        arrival_wait: float = DEFAULT_FRACTION,
        max_open_sequences: int = 4096,
        metrics: DrafterMetrics | None = None,
        idle_timeout_s: float | None = None,
        idle_trim: IdleTrim | None = None,
    ) -> None:
        super().__init__(
            "drafter",
            max_batch_size=max_batch_size,
            batch_wait_s=batch_wait_s,
            arrival_wait=arrival_wait,
            idle_timeout_s=idle_timeout_s,
            idle_trim=idle_trim,
        )
        self.drafter = drafter
        self.metrics = DrafterMetrics() if metrics is None else metrics
        self.max_open_sequences = max_open_sequences
        self._handles: dict[str, int] = {}  # sequence id -> drafter handle; scheduler thread only
        self._proposals = self._batches = self._max_batch = self._cancelled = 0
        self._cancel_lock = threading.Lock()  # guards _cancelled_through: written by handler threads
        self._cancelled_through: dict[str, int] = {}  # sequence id -> highest cancelled propose id

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

        return self.submit(sequence_id, run)

    def propose(self, sequence_id: str, max_tokens: int, assume_previous_accepted: bool, propose_id: int = 0) -> Future:
        """Candidates for ``sequence_id``, batched with other sequences'; -> :class:`Drafted`."""
        _check_id(sequence_id)
        if max_tokens < 0:
            raise InvalidArgumentError("max_tokens", f"must be >= 0, got {max_tokens}")
        return self.submit_batched(sequence_id, _Propose(max_tokens, assume_previous_accepted, propose_id))

    def commit(
        self,
        sequence_id: str,
        base_length: int,
        emitted: list[int],
        features: tuple[int, torch.Tensor] | None = None,
        cancel_through: int = 0,
    ) -> Future:
        """The committed text of ``sequence_id`` is now ``text[:base_length] + emitted``; -> nanoseconds it took.

        ``features`` (``start, rows``: the verdict's target feature rows) are given to the drafter first.
        ``cancel_through`` > 0 cancels the sequence's unanswered Proposes numbered up to it, now (module docstring).
        """
        _check_id(sequence_id)
        if cancel_through > 0:
            with self._cancel_lock:
                previous = self._cancelled_through.get(sequence_id, 0)
                self._cancelled_through[sequence_id] = max(previous, cancel_through)

        def run() -> int:
            started = time.perf_counter_ns()
            if sequence_id not in self._handles:  # a Commit after the sequence closed leaves no cancellation behind
                self._forget_cancellations(sequence_id)
            handle = self._handle(sequence_id)
            if features is not None:
                self.drafter.add_features(handle, *features)
            self.drafter.sync(handle, base_length, emitted)
            return time.perf_counter_ns() - started

        return self.submit(sequence_id, run)

    def close(self, sequence_id: str) -> Future:
        """Free ``sequence_id`` (unknown ids are fine); -> None."""

        def run() -> None:
            handle = self._handles.pop(sequence_id, None)
            self._forget_cancellations(sequence_id)
            if handle is not None:
                self.drafter.close(handle)

        return self.submit(sequence_id, run)

    def status(self) -> Future:
        """-> :class:`SchedulerStatus`."""

        def run() -> SchedulerStatus:
            return SchedulerStatus(
                len(self._handles),
                self.drafter.runner_sequences,
                self._proposals,
                self._batches,
                self._max_batch,
                self._cancelled,
            )

        return self.submit("", run)

    # --- the scheduler thread -----------------------------------------------------------------------------------

    def _open_sequences(self) -> Collection[str]:
        return self._handles.keys()

    def _after_pass(self) -> None:
        self.metrics.open_sequences.set(len(self._handles))

    def _waited(self, seconds: float) -> None:
        self.metrics.arrival_wait_seconds.observe(seconds)

    def _on_stop(self) -> None:
        for handle in self._handles.values():
            self.drafter.close(handle)
        self._handles.clear()

    def _reclaim(self, sequence_id: str) -> None:
        self.drafter.close(self._handles.pop(sequence_id))
        self._forget_cancellations(sequence_id)
        self.metrics.sequences_reclaimed.inc()

    def _forget_cancellations(self, sequence_id: str) -> None:
        """Drop a closed sequence's cancelled propose ids: a sequence opened again under its id starts clean."""
        with self._cancel_lock:
            self._cancelled_through.pop(sequence_id, None)

    def _run_batch(self, jobs: list[BatchJob[_Propose]]) -> None:
        """Pre-draft, assume and propose for the jobs whose sequences are ready, in one drafter call per step; a
        failing proposal batch is retried job by job."""
        started = time.monotonic()
        live: list[tuple[BatchJob[_Propose], int]] = []
        for job in jobs:
            try:
                self._check_cancelled(job)
                live.append((job, self._handle(job.sequence_id)))
            except Exception as error:
                job.future.set_exception(error)
        assumed = {
            id(entry.job): entry for entry in self._pre_draft([e for e in live if e[0].item.assume_previous_accepted])
        }
        ready = [  # in arrival order; a pre-draft whose assumption failed has failed already
            assumed[id(job)] if job.item.assume_previous_accepted else _Ready(job, handle, [], 0)
            for job, handle in live
            if not job.item.assume_previous_accepted or id(job) in assumed
        ]
        if not ready:
            return
        try:
            self._propose(ready, started)
        except Exception as error:
            if len(ready) == 1:
                ready[0].job.future.set_exception(error)
                return
            LOG.warning("a batch of %d proposals failed; proposing one sequence at a time", len(ready), exc_info=True)
            for entry in ready:
                try:
                    self._propose([entry], started)
                except Exception as single_error:
                    entry.job.future.set_exception(single_error)

    def _pre_draft(self, jobs: list[tuple[BatchJob[_Propose], int]]) -> list[_Ready]:
        """Draft for the previous proposals' rejection verdicts (one batched ``pre_draft``), then assume each job's
        previous proposal accepted; a job whose assumption fails fails alone. A failed ``pre_draft`` only loses the
        rejection outcomes (it leaves every sequence as it was)."""
        if not jobs:
            return []
        started = time.perf_counter_ns()
        handles = [handle for _, handle in jobs]
        try:
            outcomes = self.drafter.pre_draft(handles, [job.item.max_tokens for job, _ in jobs], self._stop_check(jobs))
        except Exception:
            LOG.warning("pre-drafting rejection outcomes failed; pre-drafting for full acceptance only", exc_info=True)
            outcomes = [[] for _ in jobs]
        predraft_ns = time.perf_counter_ns() - started
        ready = []
        for (job, handle), proposals in zip(jobs, outcomes, strict=True):
            try:
                self._check_cancelled(job)
                self.drafter.assume_accepted(handle)
                ready.append(_Ready(job, handle, proposals, predraft_ns))
            except Exception as error:
                job.future.set_exception(error)
        return ready

    def _propose(self, ready: list[_Ready], batch_started: float) -> None:
        """One drafter call for ``ready``; answers each job with its proposal, the call's duration and the job's wait
        until ``batch_started`` (monotonic), or CANCELLED."""
        started = time.perf_counter_ns()
        proposals = self.drafter.propose(
            [entry.handle for entry in ready],
            [entry.job.item.max_tokens for entry in ready],
            self._stop_check([(entry.job, entry.handle) for entry in ready]),
        )
        draft_ns = time.perf_counter_ns() - started
        self.metrics.batch_size.observe(len(ready))
        self.metrics.propose_seconds.observe(draft_ns / 1e9)
        self._batches += 1
        self._max_batch = max(self._max_batch, len(ready))
        for entry, proposal in zip(ready, proposals, strict=True):
            if self._is_cancelled(entry.job):
                self._count_cancelled()
                entry.job.future.set_exception(_cancelled(entry.job))
                continue
            self.metrics.proposals.inc()
            self.metrics.draft_tokens.inc(len(proposal.tree) + sum(len(p.tree) for p in entry.outcome_proposals))
            self._proposals += 1
            queued_ns = round(entry.job.queued_s(batch_started) * 1e9)
            drafted = Drafted(proposal, entry.outcome_proposals, draft_ns + entry.predraft_ns, queued_ns)
            entry.job.future.set_result(drafted)

    def _is_cancelled(self, job: BatchJob[_Propose]) -> bool:
        propose_id = job.item.propose_id
        if not propose_id:
            return False
        with self._cancel_lock:
            return propose_id <= self._cancelled_through.get(job.sequence_id, 0)

    def _check_cancelled(self, job: BatchJob[_Propose]) -> None:
        if self._is_cancelled(job):
            self._count_cancelled()
            raise _cancelled(job)

    def _count_cancelled(self) -> None:
        self.metrics.cancelled.inc()
        self._cancelled += 1

    def _stop_check(self, jobs: list[tuple[BatchJob[_Propose], int]]) -> Callable[[int], bool]:
        """The drafter's ``stop``: whether the job of a handle has been cancelled meanwhile."""
        job_of = {handle: job for job, handle in jobs}
        return lambda handle: self._is_cancelled(job_of[handle])

    def _handle(self, sequence_id: str) -> int:
        handle = self._handles.get(sequence_id)
        if handle is None:
            raise KeyError(f"sequence_id: no open sequence {sequence_id!r}")
        return handle


def _cancelled(job: BatchJob[_Propose]) -> CancelledByCallerError:
    return CancelledByCallerError(f"propose {job.item.propose_id} of {job.sequence_id!r} was cancelled by a Commit")


def _check_id(sequence_id: str) -> None:
    if not sequence_id:
        raise InvalidArgumentError("sequence_id", "must not be empty")
