"""Continuous batching: one thread owns the BatchVerifier; Verify calls that wait together share one forward.

The machinery is the shared :class:`~grpc_common.scheduler.BatchScheduler`, a step loop: a forward starts as soon
as the previous one ends, with every Verify call that has arrived (a Batch RPC's calls arrive as one group); jobs of
one sequence run in arrival order, a job whose caller has gone (Future cancelled) before it starts is skipped, only
with ``batch_wait_s`` > 0 (default 0; when it pays: that module's docstring) the thread waits after the first Verify
for more while the batch can still grow, and with ``idle_trim`` freed heap memory goes back to the OS once the
thread goes idle (glibc keeps it otherwise, and the idle RSS creeps up). Here: a batch is one ``BatchVerifier.verify``
call over at most ``max_batch_size`` Verify calls, one per sequence; a call that fails its own checks fails alone and
the rest of its batch goes on; OpenSequence / CloseSequence / Status jobs run between batches.

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

Prefill is the one queue a count of calls does not bound: every open sequence's first Verify waits behind the prompts
opened before it, and on a CPU a few dozen long prompts are minutes of forwards, past the router's deadline, which then
fails those requests as if the verifier were gone. With ``max_prefill_backlog_s``, an OpenSequence whose prompt would
queue behind more than that many seconds of prefill (the open sequences' prompt tokens not yet prefilled, priced as
forwards of ``max_batch_tokens`` on the verifier's cost curve: :class:`~specdec.adaptive.CostCurve` over every forward
it has run, seeded from its start-up calibration) is refused with CapacityError (RESOURCE_EXHAUSTED, which the
router hands its client as "overloaded, retry later"); a prompt with nothing ahead of it is always taken.

A sequence opened with a feature dtype gets the target's feature rows with every outcome (an EAGLE drafter drafts from
them), on the host in that dtype, until a Verify asks to stop them (its drafter is gone; the rows the core still
computes are dropped from then on).

The scheduler records the service's metrics (:class:`~verifier_service.metrics.VerifierMetrics`): batch sizes
and forward times as batches run, the wait for calls expected back before each forward, queued calls as they come
and go, open sequences after each set of jobs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from grpc_common.arrivals import DEFAULT_FRACTION
from grpc_common.memory import IdleTrim
from grpc_common.scheduler import BatchJob, BatchScheduler, Budget, Job
from grpc_common.scheduler import SchedulerStoppedError as SchedulerStoppedError  # the servicer's UNAVAILABLE
from specdec.adaptive import CostCurve
from specdec.errors import CapacityError, SpecdecError
from specdec.sampling import SamplingParams
from specdec.verification import BatchVerifier, PrefillChunk, SequenceNotFoundError, VerifyCall, VerifyOutcome
from verifier_service.metrics import VerifierMetrics

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerStatus:
    """A consistent snapshot, taken on the scheduler thread."""

    open_sequences: int
    runner_sequences: int
    verify_calls: int  # Verify jobs answered
    batches: int  # BatchVerifier.verify calls that answered them
    max_batch: int  # most Verify jobs in one forward


class VerifyScheduler(BatchScheduler[VerifyCall]):
    """Serialises every call on ``verifier`` onto one thread and batches Verify calls.

    At most ``max_queued`` Verify calls wait at once; beyond that :meth:`verify` raises CapacityError.
    ``max_prefill_backlog_s`` (None: no bound) refuses an OpenSequence whose prompt would wait behind more prefill
    than that, priced on :attr:`forward_cost`, the cost curve of the forwards run, seeded with ``forward_costs``
    (``(positions, seconds)``, a calibration's; with none, nothing is refused until a forward has been timed).
    ``metrics`` (default: a fresh, unserved set) receives the scheduler's series. ``idle_trim`` (None: never)
    releases freed memory when the scheduler goes idle. ``idle_timeout_s`` (None: never) is a sequence's lease: one
    no call has named for that long is closed and its KV freed.
    """

    def __init__(
        self,
        verifier: BatchVerifier,
        *,
        max_batch_size: int,
        max_queued: int,
        batch_wait_s: float = 0.0,
        arrival_wait: float = DEFAULT_FRACTION,
        max_batch_tokens: int | None = None,
        max_prefill_backlog_s: float | None = None,
        forward_costs: Sequence[tuple[int, float]] = (),
        metrics: VerifierMetrics | None = None,
        idle_trim: IdleTrim | None = None,
        idle_timeout_s: float | None = None,
    ) -> None:
        budget = None if max_batch_tokens is None else Budget(max_batch_tokens, verifier.forward_tokens, self._prefills)
        super().__init__(
            "verifier",
            max_batch_size=max_batch_size,
            batch_wait_s=batch_wait_s,
            arrival_wait=arrival_wait,
            max_queued=max_queued,
            budget=budget,
            idle_trim=idle_trim,
            idle_timeout_s=idle_timeout_s,
        )
        self.verifier = verifier
        self.metrics = VerifierMetrics() if metrics is None else metrics
        self.max_batch_tokens = max_batch_tokens
        self.max_prefill_backlog_s = max_prefill_backlog_s
        self.forward_cost = CostCurve()  # updated on the scheduler thread
        for positions, seconds in forward_costs:
            self.forward_cost.observe(positions, seconds)
        self._calls = self._batches = self._max_batch = 0  # scheduler thread only
        self._feature_dtypes: dict[str, torch.dtype] = {}  # the dtype of each sequence's feature rows; ditto

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
        features: torch.dtype | None = None,
        top_logprobs: int = 0,
        feature_layers: tuple[int, ...] | None = None,
        feature_context: int = 0,
    ) -> Future:
        """:meth:`BatchVerifier.open` on the scheduler thread; -> None. ``features``: the dtype the sequence's feature
        rows are handed over in (None: it takes none), ``feature_layers`` their layers (None: the final norm's),
        ``feature_context`` how many last positions' rows an outcome keeps (0: all)."""

        def run() -> None:
            self._check_prefill_backlog(len(prompt_ids))
            self.verifier.open(
                sequence_id,
                prompt_ids,
                params,
                seed,
                max_tokens,
                eos_token_ids,
                ignore_eos=ignore_eos,
                logprobs=logprobs,
                features=features is not None,
                top_logprobs=top_logprobs,
                feature_layers=feature_layers,
                feature_context=feature_context,
            )
            if features is not None:
                self._feature_dtypes[sequence_id] = features

        return self.submit(sequence_id, run)

    def verify(self, call: VerifyCall, *, stop_features: bool = False) -> Future:
        """Verify ``call`` in the next batch (``stop_features``: after dropping the sequence's feature rows, from this
        outcome on); -> :class:`VerifyOutcome`."""
        if stop_features:
            self.submit(call.sequence_id, lambda: self._feature_dtypes.pop(call.sequence_id, None))
        return self.submit_batched(call.sequence_id, call)

    def close(self, sequence_id: str) -> Future:
        """Free ``sequence_id`` (unknown ids are fine); -> None."""

        def run() -> None:
            self._feature_dtypes.pop(sequence_id, None)
            self.verifier.close(sequence_id)

        return self.submit(sequence_id, run)

    def status(self) -> Future:
        """-> :class:`SchedulerStatus`."""

        def run() -> SchedulerStatus:
            verifier = self.verifier
            return SchedulerStatus(
                verifier.num_open, verifier.runner.num_open, self._calls, self._batches, self._max_batch
            )

        return self.submit("", run)

    # --- the scheduler thread ---------------------------------------------------------------------------------

    def _check_prefill_backlog(self, prompt_tokens: int) -> None:
        """Refuse a new prompt that would wait behind more than ``max_prefill_backlog_s`` of prefill."""
        bound = self.max_prefill_backlog_s
        if bound is None or not self.forward_cost.points():
            return
        backlog = self.verifier.prefill_backlog()
        if backlog and self._prefill_seconds(backlog + prompt_tokens) > bound:
            raise CapacityError(
                f"the verifier has {backlog} prompt tokens to prefill (~{self._prefill_seconds(backlog):.1f} s) "
                f"before this one, over its max_prefill_backlog_s of {bound:g} s; retry later"
            )

    def _prefill_seconds(self, positions: int) -> float:
        """What prefilling ``positions`` prompt tokens costs: forwards of at most ``max_batch_tokens`` each."""
        chunk = min(positions, self.max_batch_tokens or positions)
        return self.forward_cost.seconds(chunk) * positions / chunk

    def _waiting(self, queued: int) -> None:
        self.metrics.waiting.set(queued)

    def _waited(self, seconds: float) -> None:
        self.metrics.arrival_wait_seconds.observe(seconds)

    def _open_sequences(self) -> Collection[str]:
        return self.verifier.sequence_ids()

    def _after_pass(self) -> None:
        self.metrics.running.set(self.verifier.num_open)
        self.metrics.kv_cache_bytes.set(self.verifier.runner.kv_bytes)

    def _on_stop(self) -> None:
        LOG.info("answered %d Verify calls in %d batches (largest %d)", self._calls, self._batches, self._max_batch)
        for sequence_id in self.verifier.sequence_ids():
            self.verifier.close(sequence_id)
        self._feature_dtypes.clear()

    def _reclaim(self, sequence_id: str) -> None:
        self._feature_dtypes.pop(sequence_id, None)
        self.verifier.close(sequence_id)
        self.metrics.sequences_reclaimed.inc()

    def _prefills(self, call: VerifyCall) -> bool:
        """Whether ``call``, over the budget, can be carried while its prompt is prefilled; a call that fails its
        checks fails now instead."""
        if not self.verifier.prefillable(call.sequence_id):
            return False
        self.verifier.check(call)
        return True

    def _ran(self, job: Job) -> None:
        """A CloseSequence of a carried sequence fails its carried calls as calls to an unknown sequence."""
        if job.sequence_id in self._carrying and job.sequence_id not in self.verifier.sequence_ids():
            self._fail_carried(job.sequence_id, SequenceNotFoundError(job.sequence_id))

    def _run_batch(self, jobs: list[BatchJob[VerifyCall]]) -> None:
        """One forward: ``verify`` over the calls of ``jobs`` that pass their checks (the others fail alone), plus
        chunks of the carried calls' prompts (arrival order) in the room those calls leave of the budget."""
        ready = []
        for job in jobs:
            try:
                self.verifier.check(job.item)
            except Exception as error:  # delivered to this caller; the interceptor maps it to a status
                job.future.set_exception(error)
                continue
            ready.append(job)
        chunks = []
        if self._carrying:  # only a bounded budget carries calls
            room = self.max_batch_tokens - sum(self.verifier.forward_tokens(job.item) for job in ready)
            for sequence_id in self._carrying:
                size = min(room, self.verifier.prefillable(sequence_id))
                if size > 0:
                    chunks.append(PrefillChunk(sequence_id, size))
                    room -= size
        if not ready and not chunks:
            return
        started, started_at = time.perf_counter(), time.monotonic()
        try:
            outcomes: list[VerifyOutcome] = self.verifier.verify([job.item for job in ready], chunks)
        except Exception as error:  # delivered to every caller of the forward, carried ones included
            if not isinstance(error, SpecdecError):
                LOG.exception("verify failed for %d calls and %d prefill chunks", len(ready), len(chunks))
            for job in ready:
                job.future.set_exception(error)
            for chunk in chunks:
                self._fail_carried(chunk.sequence_id, error)
            return
        positions = outcomes[0].forward_positions if outcomes else sum(chunk.num_tokens for chunk in chunks)
        seconds = time.perf_counter() - started
        self.metrics.observe_forward(positions, seconds)
        self.forward_cost.observe(positions, seconds)
        self.metrics.batch_size.observe(len(ready) + len(chunks))
        self.metrics.prefill_chunks.inc(len(chunks))
        if ready:
            self.metrics.verify_calls.inc(len(ready))
            self._calls += len(ready)
            self._batches += 1
            self._max_batch = max(self._max_batch, len(ready))
        for job, outcome in zip(ready, outcomes, strict=True):
            job.future.set_result(self._handed_over(job, outcome, started_at))

    def _handed_over(self, job: BatchJob[VerifyCall], outcome: VerifyOutcome, started_at: float) -> VerifyOutcome:
        """``outcome`` with the time ``job`` waited for its forward (queued, carried while its prompt was prefilled, or
        held for calls expected back) and its feature rows on the host in the sequence's dtype, or none once it
        stopped them."""
        features = outcome.features
        if features is not None:
            dtype = self._feature_dtypes.get(job.sequence_id)
            features = None if dtype is None else features.to("cpu", dtype)
        return replace(outcome, features=features, queued_s=job.queued_s(started_at))
