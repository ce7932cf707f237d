"""Continuous batching: one thread owns the BatchVerifier; Verify calls that wait together share one forward.

gRPC handlers never touch the model: they submit a job and wait on its Future. The scheduler thread takes
every job queued when it is free (after the first Verify, waiting up to ``batch_wait_s`` for more while the
batch can still grow), gathers the Verify jobs into ``BatchVerifier.verify`` calls (at most ``max_batch_size``
each, one call per sequence) and runs OpenSequence / CloseSequence / Status jobs in between, so the runner and
all torch work stay on one thread. Jobs of one sequence run in arrival order: a pending batch is run before a
job for a sequence it already holds. A call that fails its own checks fails alone; the rest of its batch goes
on. A job whose caller has gone (Future cancelled) before it starts is skipped.

A forward also holds at most ``max_batch_tokens`` positions (pending tokens + draft nodes + prefill chunks; None:
no bound), as vLLM's ``max_num_batched_tokens`` does with chunked prefill: the first verification of a sequence
prefills its prompt, and one forward over a long prompt (or many) would stall every other sequence's round for
that long (on a CPU, tens of seconds: past the router's deadline). A Verify call that does not fit what the batch
leaves of the budget, while its prompt has tokens to spare, is carried over from forward to forward while its
prompt is prefilled a chunk at a time (:class:`~specdec.verification.PrefillChunk`): each forward takes its Verify
calls first and the chunks fill the room they leave, in arrival order, as vLLM schedules decodes before prefills.
Once the rest of the prompt fits, the call is verified like any other. Meanwhile jobs are taken between forwards
(without the batch window), so other sequences' rounds go on; a later Verify of the same sequence waits behind the
carried one; a CloseSequence frees the sequence at once and fails its carried calls as calls to an unknown
sequence; a carried call whose caller has gone is dropped. Only a call whose draft tree alone exceeds the budget
still runs alone, over it.

The batch can grow while it is below ``max_batch_size`` and some open sequence has nothing queued. The
scheduler cannot see a sequence busy elsewhere (at the drafter, in the router), so the window bounds the wait
for it; a lone open sequence, or a batch holding every open sequence, is never delayed.

With ``idle_trim`` the scheduler, once it has waited that long for a job after some work, returns the heap memory
that forwards freed to the OS (:mod:`grpc_common.memory`: glibc keeps it otherwise, and the idle RSS creeps up).

The scheduler records the service's metrics (:class:`~verifier_service.metrics.VerifierMetrics`): batch sizes
and forward times as batches run, queued calls as they come and go, open sequences after each set of jobs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from grpc_common.memory import IdleTrim
from specdec.errors import CapacityError, SpecdecError
from specdec.sampling import SamplingParams
from specdec.verification import BatchVerifier, PrefillChunk, SequenceNotFoundError, VerifyCall, VerifyOutcome
from verifier_service.metrics import VerifierMetrics

LOG = logging.getLogger(__name__)


class SchedulerStoppedError(SpecdecError):
    """The verifier is shutting down; the call was not run (mapped to UNAVAILABLE by the servicer)."""


@dataclass(frozen=True)
class SchedulerStatus:
    """A consistent snapshot, taken on the scheduler thread."""

    open_sequences: int
    runner_sequences: int
    verify_calls: int  # Verify jobs answered
    batches: int  # BatchVerifier.verify calls that answered them
    max_batch: int  # most Verify jobs in one forward


@dataclass(frozen=True)
class _Job:
    """Any call but Verify; ``sequence_id`` (empty: none) orders it against a pending batch."""

    sequence_id: str
    run: Callable[[], Any]
    future: Future


@dataclass(frozen=True)
class _VerifyJob:
    call: VerifyCall
    future: Future  # -> VerifyOutcome


_STOP = object()


class VerifyScheduler:
    """Serialises every call on ``verifier`` onto one thread and batches Verify calls.

    At most ``max_queued`` Verify calls wait at once; beyond that :meth:`verify` raises CapacityError.
    ``metrics`` (default: a fresh, unserved set) receives the scheduler's series. ``idle_trim`` (None: never)
    releases freed memory when the scheduler goes idle.
    """

    def __init__(
        self,
        verifier: BatchVerifier,
        *,
        max_batch_size: int,
        max_queued: int,
        batch_wait_s: float = 0.0,
        max_batch_tokens: int | None = None,
        metrics: VerifierMetrics | None = None,
        idle_trim: IdleTrim | None = None,
    ) -> None:
        self.verifier = verifier
        self.metrics = VerifierMetrics() if metrics is None else metrics
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.batch_wait_s = batch_wait_s
        self.max_queued = max_queued
        self._idle_trim = idle_trim
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _queued and _stopped
        self._queued = 0
        self._stopped = False
        self._calls = self._batches = self._max_batch = 0  # scheduler thread only
        # Verify jobs taken but not answered, in arrival order: calls whose prompts are being prefilled and the
        # later calls of their sequences (scheduler thread only)
        self._carried: list[_VerifyJob] = []
        self._thread = threading.Thread(target=self._loop, name="verifier-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Run every job submitted before, fail later ones (SchedulerStoppedError), then close every sequence."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._queue.put(_STOP)
        self._thread.join()
        LOG.info("answered %d Verify calls in %d batches (largest %d)", self._calls, self._batches, self._max_batch)
        for sequence_id in self.verifier.sequence_ids():
            self.verifier.close(sequence_id)

    # --- called from handler threads; each returns a Future ---------------------------------------------------

    def open(
        self,
        sequence_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        seed: int | None,
        max_tokens: int,
        eos_token_ids: Collection[int],
        ignore_eos: bool,
        logprobs: bool,
    ) -> Future:
        """:meth:`BatchVerifier.open` on the scheduler thread; -> None."""

        def run() -> None:
            self.verifier.open(
                sequence_id,
                prompt_ids,
                params,
                seed,
                max_tokens,
                eos_token_ids,
                ignore_eos=ignore_eos,
                logprobs=logprobs,
            )

        return self._submit(_Job(sequence_id, run, Future()))

    def verify(self, call: VerifyCall) -> Future:
        """Verify ``call`` in the next batch; -> :class:`VerifyOutcome`."""
        with self._lock:  # the count is only read while serving; after stop the job fails at once
            if self._queued >= self.max_queued:
                raise CapacityError(f"{self.max_queued} Verify calls are already waiting; retry shortly")
            self._queued += 1
            self.metrics.waiting.set(self._queued)
        return self._submit(_VerifyJob(call, Future()))

    def close(self, sequence_id: str) -> Future:
        """Free ``sequence_id`` (unknown ids are fine); -> None."""
        return self._submit(_Job(sequence_id, lambda: self.verifier.close(sequence_id), Future()))

    def status(self) -> Future:
        """-> :class:`SchedulerStatus`."""

        def run() -> SchedulerStatus:
            verifier = self.verifier
            return SchedulerStatus(
                verifier.num_open, verifier.runner.num_open, self._calls, self._batches, self._max_batch
            )

        return self._submit(_Job("", run, Future()))

    def _submit(self, job: _Job | _VerifyJob) -> Future:
        """Queue ``job``; once stopping, its Future fails at once with SchedulerStoppedError."""
        with self._lock:
            if not self._stopped:
                self._queue.put(job)
                return job.future
        job.future.set_exception(SchedulerStoppedError("the verifier is shutting down"))
        return job.future

    # --- the scheduler thread ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            jobs = self._take()
            stopping = bool(jobs) and jobs[-1] is _STOP  # nothing is submitted after it
            self._run(jobs[:-1] if stopping else jobs)
            if stopping:
                while self._carried:  # finish the prompts being prefilled
                    self._run([])
                return
            self.metrics.running.set(self.verifier.num_open)

    def _take(self) -> list:
        """Every job queued. With no call carried over, block for one job, then after a Verify wait up to
        ``batch_wait_s`` for more while the batch can still grow; with carried calls, wait for nothing: their
        prompts' next chunks go on at once."""
        if self._carried:
            jobs = []
        else:
            jobs = [self._queue.get() if self._idle_trim is None else self._idle_trim.get(self._queue)]
        deadline = None  # set by the first Verify taken
        while not jobs or jobs[-1] is not _STOP:
            if deadline is None and not self._carried and isinstance(jobs[-1], _VerifyJob):
                deadline = time.monotonic() + self.batch_wait_s
            wait = deadline - time.monotonic() if deadline is not None else 0.0
            try:
                if wait > 0 and self._can_grow(jobs):
                    jobs.append(self._queue.get(timeout=wait))
                else:
                    jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return jobs

    def _can_grow(self, jobs: list[_Job | _VerifyJob]) -> bool:
        """Whether a Verify could still join the first batch of ``jobs``: it holds fewer than ``max_batch_size``
        and some open sequence has no job queued (an OpenSequence or CloseSequence queued orders its sequence's
        next Verify after this batch)."""
        verifying = {job.call.sequence_id for job in jobs if isinstance(job, _VerifyJob)}
        if len(verifying) >= self.max_batch_size:
            return False
        busy = verifying.union(job.sequence_id for job in jobs if isinstance(job, _Job))
        return any(sequence_id not in busy for sequence_id in self.verifier.sequence_ids())

    def _run(self, jobs: list[_Job | _VerifyJob]) -> None:
        """Run the carried Verify jobs, then ``jobs``, in arrival order per sequence; Verify jobs batched (one per
        sequence per batch, within ``max_batch_size`` calls and ``max_batch_tokens`` positions), the prompts of
        calls that do not fit prefilled by chunks in the room the batches leave."""
        for job in jobs:
            if isinstance(job, _VerifyJob):
                with self._lock:
                    self._queued -= 1
                    self.metrics.waiting.set(self._queued)
        carried, self._carried = self._carried, []
        prefilling: list[str] = []  # sequences whose carried call waits for its prompt, in arrival order
        batch: list[_VerifyJob] = []
        batch_tokens = 0
        for job in [*carried, *jobs]:
            if isinstance(job, _VerifyJob):
                sequence_id = job.call.sequence_id
                if job.future.cancelled():
                    continue
                if sequence_id in prefilling:  # behind its sequence's carried call
                    self._carried.append(job)
                    continue
                if len(batch) == self.max_batch_size or any(j.call.sequence_id == sequence_id for j in batch):
                    self._run_batch(batch, prefilling)
                    batch, batch_tokens = [], 0
                tokens = self.verifier.forward_tokens(job.call)
                if self.max_batch_tokens is None or batch_tokens + tokens <= self.max_batch_tokens:
                    batch.append(job)
                    batch_tokens += tokens
                elif self.verifier.prefillable(sequence_id):
                    self._carry(job, prefilling)
                else:  # nothing to chunk: the call waits for the next batch, alone if its tree exceeds the budget
                    if batch:
                        self._run_batch(batch, prefilling)
                    batch, batch_tokens = [job], tokens
                continue
            if job.sequence_id and any(j.call.sequence_id == job.sequence_id for j in batch):
                self._run_batch(batch, prefilling)
                batch, batch_tokens = [], 0
            if job.future.set_running_or_notify_cancel():
                _settle(job.future, job.run)
            if job.sequence_id in prefilling and job.sequence_id not in self.verifier.sequence_ids():  # closed
                self._fail_carried(job.sequence_id, prefilling, SequenceNotFoundError(job.sequence_id))
        if batch or prefilling:
            self._run_batch(batch, prefilling)

    def _carry(self, job: _VerifyJob, prefilling: list[str]) -> None:
        """Carry ``job`` over while its prompt is prefilled; a call that fails its checks fails now instead."""
        try:
            self.verifier.check(job.call)
        except Exception as error:  # delivered to this caller; the interceptor maps it to a status
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
            return
        prefilling.append(job.call.sequence_id)
        self._carried.append(job)

    def _fail_carried(self, sequence_id: str, prefilling: list[str], error: Exception) -> None:
        """Deliver ``error`` to every carried call of ``sequence_id`` and stop prefilling its prompt."""
        prefilling.remove(sequence_id)
        kept = []
        for job in self._carried:
            if job.call.sequence_id != sequence_id:
                kept.append(job)
            elif job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
        self._carried = kept

    def _run_batch(self, batch: list[_VerifyJob], prefilling: list[str]) -> None:
        """One forward: ``verify`` over the jobs still wanted whose calls pass their checks (the others fail alone),
        plus chunks of the prompts of ``prefilling`` (arrival order) in the room those calls leave of the budget."""
        ready = []
        for job in batch:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                self.verifier.check(job.call)
            except Exception as error:  # delivered to this caller; the interceptor maps it to a status
                job.future.set_exception(error)
                continue
            ready.append(job)
        chunks = []
        if prefilling:  # only a bounded budget carries calls
            room = self.max_batch_tokens - sum(self.verifier.forward_tokens(job.call) for job in ready)
            for sequence_id in prefilling:
                size = min(room, self.verifier.prefillable(sequence_id))
                if size > 0:
                    chunks.append(PrefillChunk(sequence_id, size))
                    room -= size
        if not ready and not chunks:
            return
        started = time.perf_counter()
        try:
            outcomes: list[VerifyOutcome] = self.verifier.verify([job.call for job in ready], chunks)
        except Exception as error:  # delivered to every caller of the forward, carried ones included
            if not isinstance(error, SpecdecError):
                LOG.exception("verify failed for %d calls and %d prefill chunks", len(ready), len(chunks))
            for job in ready:
                job.future.set_exception(error)
            for chunk in chunks:
                self._fail_carried(chunk.sequence_id, prefilling, error)
            return
        self.metrics.forward_seconds.observe(time.perf_counter() - started)
        self.metrics.batch_size.observe(len(ready) + len(chunks))
        self.metrics.prefill_chunks.inc(len(chunks))
        if ready:
            self.metrics.verify_calls.inc(len(ready))
            self._calls += len(ready)
            self._batches += 1
            self._max_batch = max(self._max_batch, len(ready))
        for job, outcome in zip(ready, outcomes, strict=True):
            job.future.set_result(outcome)


def _settle(future: Future, run: Callable[[], Any]) -> None:
    """Run ``run`` and deliver its result or error to ``future`` (errors are the caller's to map)."""
    try:
        future.set_result(run())
    except Exception as error:
        future.set_exception(error)
