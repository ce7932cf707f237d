"""Prometheus plumbing the services share: a ``/metrics`` HTTP server per process, bucket bounds, the port flag.

Each service keeps its series in a :class:`~prometheus_client.CollectorRegistry` of its own (DESIGN §10: no module
globals; tests run several services in one process), made by :func:`service_registry`, and serves it on a port of
its own when ``--metrics-port`` is given. Every registry also carries the process's own ``process_*`` series (CPU
seconds, resident memory, open files): the router's CPU per round is what says when to add a router (README,
"Router replicas").
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, start_http_server

from specdec.errors import InvalidArgumentError

# Sequences per batched call: every size up to 4, then about 1.5x apart.
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)


class BisectHistogram(Histogram):
    """prometheus_client's Histogram, an observation's bucket found by binary search rather than by trying every
    bound in turn: the router observes six histograms a round, of up to 44 buckets, and that scan was most of what
    its metrics cost it. Same series, same counts. It reads prometheus_client's own attributes (``_sum``, ``_buckets``,
    ``_upper_bounds``: the pinned version's); ``tests/test_metrics.py`` compares the two histograms' counts."""

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar:
            super().observe(amount, exemplar)
            return
        self._raise_if_not_observable()
        self._sum.inc(amount)
        if amount == amount:  # a NaN falls in no bucket, as with the scan
            self._buckets[bisect.bisect_left(self._upper_bounds, amount)].inc(1)


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
