"""The drafter's scheduler: one thread owns the drafter; Propose calls from many sequences that wait together run
as one ``drafter.propose`` call.

The machinery (queue, thread, per-sequence order, cancelled jobs skipped, the batch window up to ``batch_wait_s``,
stop: later calls fail with :class:`~grpc_common.scheduler.SchedulerStoppedError`) is the shared
:class:`~grpc_common.scheduler.BatchScheduler`; here are what a Propose batch is (at most ``max_batch_size``
sequences: each open and, when asked, assumed accepted, then one drafter call, retried job by job if it fails), the
OpenSequence / Commit / CloseSequence / Status jobs run between batches, and the service's metrics
(:class:`~drafter_service.metrics.DrafterMetrics`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import torch

from drafter_service.metrics import DrafterMetrics
from grpc_common.scheduler import BatchJob, BatchScheduler
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
class _Propose:
    max_tokens: int
    assume_previous_accepted: bool


class _Ready(NamedTuple):
    """A Propose job whose sequence is open (and assumed, when asked), waiting for the drafter call."""

    job: BatchJob[_Propose]  # -> (Proposal, draft_ns)
    handle: int
    assume_ns: int


class DraftScheduler(BatchScheduler[_Propose]):
    """Serialises every call on ``drafter`` onto one thread and batches Propose calls.

    ``metrics`` (default: a fresh, unserved set) receives the scheduler's series. ``idle_timeout_s`` (None: never)
    is a sequence's lease: one no call has named for that long is closed.
    """

    def __init__(
        self,
        drafter: Drafter,
        *,
        max_batch_size: int,
        batch_wait_s: float = 0.0,
        max_open_sequences: int = 4096,
        metrics: DrafterMetrics | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        super().__init__(
            "drafter", max_batch_size=max_batch_size, batch_wait_s=batch_wait_s, idle_timeout_s=idle_timeout_s
        )
        self.drafter = drafter
        self.metrics = DrafterMetrics() if metrics is None else metrics
        self.max_open_sequences = max_open_sequences
        self._handles: dict[str, int] = {}  # sequence id -> drafter handle; scheduler thread only
        self._proposals = self._batches = self._max_batch = 0

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

    def propose(self, sequence_id: str, max_tokens: int, assume_previous_accepted: bool) -> Future:
        """Candidates for ``sequence_id``, batched with other sequences'; -> ``(Proposal, draft_ns)``."""
        _check_id(sequence_id)
        if max_tokens < 0:
            raise InvalidArgumentError("max_tokens", f"must be >= 0, got {max_tokens}")
        return self.submit_batched(sequence_id, _Propose(max_tokens, assume_previous_accepted))

    def commit(
        self,
        sequence_id: str,
        base_length: int,
        emitted: list[int],
        features: tuple[int, torch.Tensor] | None = None,
    ) -> Future:
        """The committed text of ``sequence_id`` is now ``text[:base_length] + emitted``; -> None.

        ``features`` (``start, rows``: the verdict's target feature rows) are given to the drafter first.
        """
        _check_id(sequence_id)

        def run() -> None:
            handle = self._handle(sequence_id)
            if features is not None:
                self.drafter.add_features(handle, *features)
            self.drafter.sync(handle, base_length, emitted)

        return self.submit(sequence_id, run)

    def close(self, sequence_id: str) -> Future:
        """Free ``sequence_id`` (unknown ids are fine); -> None."""

        def run() -> None:
            handle = self._handles.pop(sequence_id, None)
            if handle is not None:
                self.drafter.close(handle)

        return self.submit(sequence_id, run)

    def status(self) -> Future:
        """-> :class:`SchedulerStatus`."""

        def run() -> SchedulerStatus:
            return SchedulerStatus(
                len(self._handles), self.drafter.runner_sequences, self._proposals, self._batches, self._max_batch
            )

        return self.submit("", run)

    # --- the scheduler thread -----------------------------------------------------------------------------------

    def _open_sequences(self) -> Collection[str]:
        return self._handles.keys()

    def _after_pass(self) -> None:
        self.metrics.open_sequences.set(len(self._handles))

    def _on_stop(self) -> None:
        for handle in self._handles.values():
            self.drafter.close(handle)
        self._handles.clear()

    def _reclaim(self, sequence_id: str) -> None:
        self.drafter.close(self._handles.pop(sequence_id))
        self.metrics.sequences_reclaimed.inc()

    def _run_batch(self, jobs: list[BatchJob[_Propose]]) -> None:
        """One ``drafter.propose`` for the jobs whose sequences are ready; a failing batch is retried job by job."""
        ready: list[_Ready] = []
        for job in jobs:
            try:
                started = time.perf_counter_ns()
                handle = self._handle(job.sequence_id)
                if job.item.assume_previous_accepted:
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
        proposals = self.drafter.propose(
            [entry.handle for entry in ready], [entry.job.item.max_tokens for entry in ready]
        )
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
