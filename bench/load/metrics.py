"""The router's Prometheus ``/metrics`` around a measured window: scrape, parse, subtract, read histograms.

The bench scrapes once before and once after the window and keeps the difference, so counters and histograms
describe exactly the requests of the window (warm-up excluded) while the server's own lifetime totals do not leak
in; gauges (``vllm:num_requests_running``) keep their value at the end. Quantiles of a histogram delta follow
Prometheus' ``histogram_quantile``: find the bucket holding rank q·count, interpolate linearly inside it (from 0
for the first bucket); a rank in the +Inf bucket returns the highest finite bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Sample:
    """One time series value: sample name (``…_total``, ``…_bucket``), labels, value, its family's type."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    kind: str

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "labels": dict(self.labels), "value": self.value}


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition."""
    return [
        Sample(sample.name, tuple(sorted(sample.labels.items())), float(sample.value), family.type)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def metrics_delta(before: Sequence[Sample], after: Sequence[Sample]) -> list[Sample]:
    """``after − before`` per series (a series absent before counts from 0); gauges keep their ``after`` value."""
    earlier = {(s.name, s.labels): s.value for s in before}
    return [
        s if s.kind == "gauge" else Sample(s.name, s.labels, s.value - earlier.get((s.name, s.labels), 0.0), s.kind)
        for s in after
    ]


def counter_total(samples: Sequence[Sample], name: str) -> float | None:
    """The sum over labels of sample ``name`` (e.g. ``vllm:spec_decode_num_drafts_total``); None if absent."""
    values = [s.value for s in samples if s.name == name]
    return sum(values) if values else None


def histogram_mean(samples: Sequence[Sample], name: str) -> float | None:
    """Sum / count of histogram ``name``, summed over its labels; None if it has no observations."""
    count = counter_total(samples, f"{name}_count")
    total = counter_total(samples, f"{name}_sum")
    return total / count if count and total is not None else None


def histogram_buckets(samples: Sequence[Sample], name: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of histogram ``name``, summed over its other labels, by bound."""
    counts: dict[float, float] = {}
    for sample in samples:
        if sample.name == f"{name}_bucket":
            bound = float(dict(sample.labels)["le"])
            counts[bound] = counts.get(bound, 0.0) + sample.value
    return sorted(counts.items())


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile(q, …)`` of cumulative ``buckets`` (must end with +Inf); None if empty."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]) or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, (end, count) = 0.0, buckets[b]
    if b > 0:
        start, below = buckets[b - 1]
        count -= below
        rank -= below
    return start + (end - start) * (rank / count) if count > 0 else start


async def scrape(url: str) -> list[Sample]:
    """GET ``url`` (a ``/metrics`` endpoint) and parse it; raises on HTTP or connection errors."""
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as response:
        response.raise_for_status()
        return parse_metrics(await response.text())
