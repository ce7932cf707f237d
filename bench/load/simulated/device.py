"""The simulated device: one per process, batching calls as the real schedulers do.

Calls queue while a batched call runs, and the next batch takes every call queued (up to ``--max-batch-size``),
like the real schedulers' continuous batching: after a fixed ``--batch-wait-ms`` if one is set, else after waiting
as the real scheduler does for the sequences it expects back (:class:`grpc_common.arrivals.ArrivalWait`,
``--arrival-wait``). A batch of ``n`` sleeps
``latency + n × per_sequence_ms``, the latency drawn from ``--latency`` (see
:class:`bench.load.simulate.LatencySpec`) with a generator seeded by ``--seed``. So the router sees batch sizes
and latencies that grow with its load, which a fixed per-call sleep would not show.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from bench.load.simulate import LatencySpec
from grpc_common.arrivals import DEFAULT_FRACTION, ArrivalWait


class SequenceJob(Protocol):
    @property
    def sequence_id(self) -> str: ...


J = TypeVar("J", bound=SequenceJob)
R = TypeVar("R")


@dataclass(frozen=True)
class Batched(Generic[R]):
    """A job's result with the batch it ran in: the batch's sleep and size, and how long the job waited for that
    batch to start (as the real verifier reports ``queued_ns``)."""

    result: R
    latency_ns: int
    batch_size: int
    queued_ns: int = 0


Entry = tuple[J, float, asyncio.Future[Batched[R]]]  # a job, when it was submitted (monotonic), its caller's Future


class Batcher(Generic[J, R]):
    """Continuous batching on one simulated device: jobs queued while a batch sleeps form the next batch.

    ``decide`` answers one job when its batch starts (a job whose caller has gone by then is skipped, as the
    real schedulers skip cancelled jobs); its exception goes to that job's caller alone.
    """

    def __init__(
        self,
        decide: Callable[[J], R],
        latency: LatencySpec,
        *,
        per_sequence_ms: float,
        rng: np.random.Generator,
        max_batch_size: int,
        batch_wait_s: float,
        open_ids: Callable[[], Collection[str]],
        arrival_wait: float = DEFAULT_FRACTION,
    ) -> None:
        self.decide = decide
        self.latency = latency
        self.per_sequence_ms = per_sequence_ms
        self.rng = rng
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.open_ids = open_ids
        self.arrivals = ArrivalWait(0.0 if batch_wait_s else arrival_wait)  # a fixed window replaces it
        self.calls = self.batches = self.max_batch = 0
        self._queue: asyncio.Queue[Entry[J, R]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the device loop (on the running event loop)."""
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def submit(self, job: J) -> Batched[R]:
        future: asyncio.Future[Batched[R]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((job, time.monotonic(), future))
        return await future

    async def _loop(self) -> None:
        while True:
            entries = await self._take()
            live = [(job, submitted, future) for job, submitted, future in entries if not future.done()]
            if not live:
                continue
            latency_ns = round((self.latency.sample_ms(self.rng) + self.per_sequence_ms * len(live)) * 1e6)
            outcomes: list[R | Exception] = []
            for job, _, _ in live:
                try:
                    outcomes.append(self.decide(job))
                except Exception as error:  # this job's caller gets it; the batch goes on
                    outcomes.append(error)
            self.calls += len(live)
            self.batches += 1
            self.max_batch = max(self.max_batch, len(live))
            started = time.monotonic()
            await asyncio.sleep(latency_ns / 1e9)
            ended = time.monotonic()
            self.arrivals.served([job.sequence_id for job, _, _ in live], ended)
            self.arrivals.timed(len(live), ended - started)
            for (_, submitted, future), outcome in zip(live, outcomes, strict=True):
                if future.done():
                    continue
                if isinstance(outcome, Exception):
                    future.set_exception(outcome)
                else:
                    queued_ns = max(round((started - submitted) * 1e9), 0)
                    future.set_result(Batched(outcome, latency_ns, len(live), queued_ns))

    async def _take(self) -> list[Entry[J, R]]:
        """The next batch: the first call to come, then every call queued after the fixed window, or once the
        sequences expected back have arrived or the wait stops paying."""
        entries = [self._arrive(await self._queue.get())]
        if self.batch_wait_s:
            await asyncio.sleep(self.batch_wait_s)
        else:
            deadline: float | None = None
            while len(entries) < self.max_batch_size:
                while not self._queue.empty() and len(entries) < self.max_batch_size:
                    entries.append(self._arrive(self._queue.get_nowait()))
                now = time.monotonic()
                until = self.arrivals.until({job.sequence_id for job, _, _ in entries}, self.open_ids(), now)
                deadline = until if deadline is None else min(until, deadline)
                if deadline <= now:
                    break
                try:
                    entries.append(self._arrive(await asyncio.wait_for(self._queue.get(), deadline - now)))
                except TimeoutError:
                    break
        while len(entries) < self.max_batch_size and not self._queue.empty():
            entries.append(self._arrive(self._queue.get_nowait()))
        return entries

    def _arrive(self, entry: Entry[J, R]) -> Entry[J, R]:
        job, submitted, _ = entry
        self.arrivals.arrived(job.sequence_id, submitted)
        return entry
