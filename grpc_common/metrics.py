"""Prometheus plumbing the services share: a ``/metrics`` HTTP server per process, bucket bounds, the port flag.

Each service keeps its series in a :class:`~prometheus_client.CollectorRegistry` of its own (DESIGN §10: no module
globals; tests run several services in one process), made by :func:`service_registry`, and serves it on a port of
its own when ``--metrics-port`` is given. Every registry also carries the process's own ``process_*`` series (CPU
seconds, resident memory, open files): the router's CPU per round is what says when to add a router (README,
"Router replicas").
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from specdec.errors import InvalidArgumentError

# Sequences per batched call: every size up to 4, then about 1.5x apart.
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)


class LoopCounter:
    """One series of a :class:`LoopMetrics` counter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopHistogram:
    """One series of a :class:`LoopMetrics` histogram: each bucket's own count (not cumulative) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # ascending, +Inf last
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.sum += amount
        if amount == amount:  # a NaN falls in no bucket, as in prometheus_client
            self.counts[bisect.bisect_left(self.bounds, amount)] += 1


SeriesT = TypeVar("SeriesT", LoopCounter, LoopHistogram)


class LoopFamily(Generic[SeriesT]):
    """A :class:`LoopMetrics` counter or histogram: its series by label values."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], new_series: Callable[[], SeriesT]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._new_series = new_series
        self.series: dict[tuple[str, ...], SeriesT] = {}

    def labels(self, *values: str) -> SeriesT:
        """The series of these label values (made on first use); no values for a family without labels."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} is labelled {list(self.labelnames)}, got {list(values)}")
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = self._new_series()
        return series


class LoopMetrics(Collector):
    """Counters and histograms that one thread updates (the router's event loop, twenty-odd updates a round) and a
    scrape reads: plain numbers, no lock. prometheus_client's own take a lock and check the series on every update,
    which was about 5 % of the router's CPU per round (``bench/results/router-loop-metrics.md``). A scrape from
    another thread may see a histogram's sum a moment ahead of its buckets; no count ever goes back. Names, labels
    and exposition are prometheus_client's Counter and Histogram's, less their ``_created`` series. Registered with
    ``registry`` as one collector."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counters: list[LoopFamily[LoopCounter]] = []
        self._histograms: list[LoopFamily[LoopHistogram]] = []
        registry.register(self)

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> LoopFamily[LoopCounter]:
        family = LoopFamily(name, documentation, labelnames, LoopCounter)
        self._counters.append(family)
        return family

    def histogram(
        self, name: str, documentation: str, buckets: Sequence[float], labelnames: Sequence[str] = ()
    ) -> LoopFamily[LoopHistogram]:
        bounds = tuple(sorted(float(bound) for bound in buckets))
        if bounds[-1] != math.inf:
            bounds += (math.inf,)
        family = LoopFamily(name, documentation, labelnames, lambda: LoopHistogram(bounds))
        self._histograms.append(family)
        return family

    def collect(self) -> Iterator[Metric]:
        for counters in self._counters:
            counter = CounterMetricFamily(counters.name, counters.documentation, labels=counters.labelnames)
            for values, series in list(counters.series.items()):
                counter.add_metric(values, series.value)
            yield counter
        for histograms in self._histograms:
            histogram = HistogramMetricFamily(histograms.name, histograms.documentation, labels=histograms.labelnames)
            for values, series in list(histograms.series.items()):
                cumulative = itertools.accumulate(list(series.counts))
                buckets = [(floatToGoString(b), c) for b, c in zip(series.bounds, cumulative, strict=True)]
                histogram.add_metric(values, buckets, series.sum)
            yield histogram


def service_registry() -> CollectorRegistry:
    """A service's own registry, with the ``process_*`` series of the process that serves it."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


def log_buckets(low: float, high: float, per_decade: int) -> tuple[float, ...]:
    """Histogram bounds from ``low`` up to at least ``high``, ``per_decade`` per factor of ten, equal ratios apart.

    Equal ratios give every quantile the same relative resolution, e.g. ``log_buckets(1e-3, 1, 1)`` is
    ``(0.001, 0.01, 0.1, 1.0)``.
    """
    steps = math.ceil(round(math.log10(high / low) * per_decade, 6))
    return tuple(float(f"{low * 10 ** (step / per_decade):.3g}") for step in range(steps + 1))


def parse_metrics_port(value: str) -> int | None:
    """A ``--metrics-port`` value: a port number (0: any free port), or empty / ``none`` for no metrics server."""
    return None if value.strip().lower() in ("", "none") else int(value)


def check_metrics_port(port: int | None) -> None:
    """Raise InvalidArgumentError naming ``metrics_port`` unless it is None or a valid port."""
    if port is not None and not 0 <= port < 65536:
        raise InvalidArgumentError("metrics_port", f"must be in [0, 65536), got {port}")


@dataclass
class MetricsServer:
    """A started ``/metrics`` endpoint (prometheus_client's WSGI server in a daemon thread)."""

    server: WSGIServer
    thread: threading.Thread
    host: str

    @property
    def port(self) -> int:
        return self.server.server_port

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` (port 0: a free one, see ``MetricsServer.port``)."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread, host)
