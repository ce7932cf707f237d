"""Drive a backend at a load: open loop (arrivals at a rate, whatever the server does) or closed loop (N users,
each sending the next request when the previous one finished), after uncounted warm-up requests.

Open loop is what production traffic looks like and what shows saturation (queues grow, latency explodes);
closed loop at concurrency N measures the server at exactly N in flight, for comparing configurations at equal
concurrency. ``max_concurrency`` caps an open loop the way ``vllm bench serve --max-concurrency`` does (requests
then wait client-side; ``scheduled_s`` vs ``start_s`` shows how long). The measured window starts when the first
timed request is due and ends when the last one finished; the router's ``/metrics`` is scraped around exactly
that window (each router's, when several serve the load: their samples are summed as one router's would be).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from tqdm import tqdm

from bench.load.arrivals import ArrivalProcess, arrival_offsets
from bench.load.backends import Backend
from bench.load.metrics import Sample, metrics_delta, scrape
from bench.load.records import RequestRecord
from bench.load.workload import Prompt, PromptCycle, RequestOptions


@dataclass(frozen=True)
class LoadSpec:
    """The load of one measured run. Give ``qps`` (open loop) or ``concurrency`` (closed loop), and
    ``num_requests`` and/or ``duration_s`` (whichever ends first; no new request starts after the duration)."""

    qps: float | None = None
    concurrency: int | None = None
    arrival: ArrivalProcess = "poisson"
    burstiness: float = 1.0
    num_requests: int | None = None
    duration_s: float | None = None
    warmup_requests: int = 0
    seed: int = 0
    max_concurrency: int | None = None

    def check(self) -> None:
        """Raise ValueError for a spec that cannot run."""
        if (self.qps is None) == (self.concurrency is None):
            raise ValueError("give exactly one of qps (open loop) and concurrency (closed loop)")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("give num_requests, duration_s or both")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.qps is not None and math.isinf(self.qps) and self.num_requests is None:
            raise ValueError("an infinite rate needs num_requests")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclass
class LoadRun:
    """What one run produced: every record (warm-up first, flagged), the measured window, the metrics delta."""

    spec: LoadSpec
    options: RequestOptions
    backend: str
    records: list[RequestRecord]
    duration_s: float
    metrics: list[Sample] | None = None
    metrics_error: str | None = None
    label: str = ""

    @property
    def measured(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.warmup]


async def run_load(
    backend: Backend,
    prompts: Sequence[Prompt],
    options: RequestOptions,
    spec: LoadSpec,
    *,
    progress: bool = True,
    metrics_urls: Sequence[str] = (),
    label: str = "",
) -> LoadRun:
    """Warm up, scrape, run the measured window, scrape again; request i uses prompt cycle[i], seed + i."""
    spec.check()
    cycle = PromptCycle(prompts, spec.seed)
    async with backend:
        warmup = await _warm_up(backend, cycle, options, spec)
        before, error = await _scrape(metrics_urls)
        with tqdm(total=spec.num_requests, desc=label or "requests", unit="req", disable=not progress) as bar:
            origin = time.perf_counter()
            if spec.concurrency is not None:
                records = await _closed_loop(backend, cycle, options, spec, origin, bar.update)
            else:
                records = await _open_loop(backend, cycle, options, spec, origin, bar.update)
            duration = time.perf_counter() - origin
        after, error_after = await _scrape(metrics_urls)
    delta = metrics_delta(before, after) if before is not None and after is not None else None
    records.sort(key=lambda record: record.index)
    return LoadRun(spec, options, backend.name, warmup + records, duration, delta, error or error_after, label)


async def _scrape(urls: Sequence[str]) -> tuple[list[Sample] | None, str | None]:
    """Every router's samples, each series labelled with its router's URL when there are several (so that the
    delta subtracts per router and the sums over labels add the routers up)."""
    if not urls:
        return None, None
    samples: list[Sample] = []
    for url in urls:
        try:
            scraped = await scrape(url)
        except Exception as error:  # the load numbers stand without the server's metrics
            return None, f"{url}: {type(error).__name__}: {error}"
        if len(urls) > 1:
            scraped = [Sample(s.name, (*s.labels, ("router", url)), s.value, s.kind) for s in scraped]
        samples += scraped
    return samples, None


async def _warm_up(
    backend: Backend, cycle: PromptCycle, options: RequestOptions, spec: LoadSpec
) -> list[RequestRecord]:
    """``warmup_requests`` requests (at most the run's concurrency at once), excluded from every statistic."""
    limit = asyncio.Semaphore(spec.concurrency or spec.max_concurrency or max(1, spec.warmup_requests))
    origin = time.perf_counter()

    async def one(index: int) -> RequestRecord:
        async with limit:
            record = await backend.send(cycle[index], options.for_request(index))
        return record.rebased(origin, index=index, scheduled_s=0.0, warmup=True)

    return list(await asyncio.gather(*(one(index) for index in range(spec.warmup_requests))))


async def _open_loop(
    backend: Backend,
    cycle: PromptCycle,
    options: RequestOptions,
    spec: LoadSpec,
    origin: float,
    done: Callable[[int], object],
) -> list[RequestRecord]:
    assert spec.qps is not None
    offsets = arrival_offsets(
        spec.qps,
        count=spec.num_requests,
        duration_s=spec.duration_s,
        process=spec.arrival,
        burstiness=spec.burstiness,
        seed=spec.seed,
    )
    limit = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None

    async def one(index: int, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, origin + offset - time.perf_counter()))
        send: Awaitable[RequestRecord] = backend.send(cycle[index], options.for_request(index))
        if limit is None:
            record = await send
        else:
            async with limit:
                record = await send
        done(1)
        return record.rebased(origin, index=index, scheduled_s=offset, warmup=False)

    return list(await asyncio.gather(*(one(index, offset) for index, offset in enumerate(offsets))))


async def _closed_loop(
    backend: Backend,
    cycle: PromptCycle,
    options: RequestOptions,
    spec: LoadSpec,
    origin: float,
    done: Callable[[int], object],
) -> list[RequestRecord]:
    assert spec.concurrency is not None
    indices = itertools.count()
    deadline = math.inf if spec.duration_s is None else origin + spec.duration_s
    records: list[RequestRecord] = []

    async def user() -> None:
        while (index := next(indices)) < (spec.num_requests or math.inf) and time.perf_counter() < deadline:
            record = await backend.send(cycle[index], options.for_request(index))
            records.append(record.rebased(origin, index=index, scheduled_s=record.start_s - origin, warmup=False))
            done(1)

    await asyncio.gather(*(user() for _ in range(spec.concurrency)))
    return records
