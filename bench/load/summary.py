"""The numbers of one run, under ``vllm bench serve --save-result`` key names where vLLM has them.

Definitions (all over the measured, completed requests unless said otherwise; times in ms):

* ``duration``: the measured window (first request due → last request finished), s; ``schedule_span_s``: when the
  last request was due (closed loop: sent). ``request_throughput`` =
  completed / duration, ``output_throughput`` = output tokens / duration, ``total_token_throughput`` adds the
  prompt tokens. Token counts are the router's usage figures.
* ``ttft``: send → first chunk with tokens. ``e2el``: send → final message. ``tpot`` per request =
  (e2el − ttft) / (output tokens − 1), requests with ≥ 2 tokens. ``itl``: every gap between consecutive token
  chunks of every request, pooled (a chunk may hold several speculated tokens; see :mod:`bench.load.records`).
* ``mean``/``median``/``std`` (population) and ``p95``/``p99`` via :func:`percentile`.
* ``request_goodput``: requests per second that met the SLO, as ``vllm bench serve --goodput``: a completed
  request is good when ttft ≤ ``ttft_ms``, tpot ≤ ``tpot_ms`` and the p95 of its own ITL gaps ≤ ``itl_ms``
  (each bound only if set; no gaps or < 2 tokens pass that bound). Failed requests are never good.
* speculation: ``acceptance_rate`` = accepted / drafted tokens, ``mean_accepted_length`` = 1 + accepted / rounds
  (tree nodes count as drafted, never as accepted length), ``tokens_per_round`` = output tokens / rounds (what a
  round really commits), ``acceptance_by_position[k]`` = rounds accepting position k / rounds.
  ``draft/verify/state_ms_per_round``: the workers' timings / rounds; ``wall_ms_per_round`` = Σ e2el / Σ rounds;
  ``other_ms_per_round`` = wall − exposed draft − verify − state (exposed draft: all of it when rounds are
  sequential, the fresh proposals only when pipelined; see :func:`bench.disaggregated.exposed_draft_fraction`):
  what the router, the wire, queueing and prefill add per round.
* ``num_drafts``, ``router_overhead_ms_p50/_p99``, ``verifier_queue_ms_p50/_p99`` and ``drafter_queue_ms_p50/_p99``
  (the parts of the overhead a round's Verify waited at the verifier for its forward and its fresh proposal at the
  drafter for its batch) come from the router's ``/metrics`` delta when scraped.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.disaggregated import exposed_draft_fraction
from bench.load.metrics import counter_total, histogram_buckets, histogram_quantile
from bench.load.records import TIMEOUT_KINDS, RequestRecord
from bench.load.runner import LoadRun

LATENCIES = ("ttft", "tpot", "itl", "e2el")
SERVER_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:request_success_total",
    "specdec:pipeline_hits_total",
    "specdec:pipeline_misses_total",
    "specdec:wire_bytes_total",
)
QUANTILE_SERIES = {  # summary key -> the router's histogram
    "router_overhead": "specdec:router_overhead_seconds",
    "verifier_queue": "specdec:verifier_queue_seconds",
    "drafter_queue": "specdec:drafter_queue_seconds",
}
QUANTILE_KEYS = tuple(f"{key}_ms_p{q}" for key in QUANTILE_SERIES for q in (50, 99))


@dataclass(frozen=True)
class Slo:
    """Per-request latency bounds in ms (None: not bounded)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None  # on the p95 of the request's own ITL gaps


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0–100) by linear interpolation between closest ranks, numpy's default ("linear"):
    position h = (n − 1)·q/100 in the sorted values, interpolated between ⌊h⌋ and ⌈h⌉. None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    h = (len(ordered) - 1) * q / 100
    low = math.floor(h)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (h - low) * (ordered[high] - ordered[low])


def distribution_ms(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """``mean/median/std/p95/p99_{name}_ms`` of values given in seconds."""
    ms = [1e3 * v for v in values_s]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else None,
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": statistics.pstdev(ms) if ms else None,
        f"p95_{name}_ms": percentile(ms, 95),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """Whether a request is good under ``slo`` (see the module docstring)."""
    if not record.ok or record.ttft_s is None:
        return False
    if slo.ttft_ms is not None and 1e3 * record.ttft_s > slo.ttft_ms:
        return False
    tpot = record.tpot_s
    if slo.tpot_ms is not None and tpot is not None and 1e3 * tpot > slo.tpot_ms:
        return False
    itl_p95 = percentile(record.itl_s, 95)
    return slo.itl_ms is None or itl_p95 is None or 1e3 * itl_p95 <= slo.itl_ms


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def speculation_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Totals and per-round means of the requests' own speculation counters (completed requests)."""
    stats = [(r, r.speculation) for r in records if r.ok and r.speculation]
    timed = [(r, s) for r, s in stats if s.get("rounds")]
    rounds = sum(s["rounds"] for _, s in timed)
    drafted = sum(s.get("draft_tokens", 0) for _, s in stats)
    accepted = sum(s.get("accepted_tokens", 0) for _, s in stats)
    hits = sum(s.get("pipeline_hits", 0) for _, s in stats)
    misses = sum(s.get("pipeline_misses", 0) for _, s in stats)
    wire = sum(s.get("wire_bytes", 0) for _, s in stats)
    per_position: list[int] = []
    for _, s in stats:
        for position, count in enumerate(s.get("accepted_per_position", ())):
            per_position.extend([0] * (position + 1 - len(per_position)))
            per_position[position] += count

    def per_round_ms(key: str) -> float | None:
        return _ratio(1e3 * sum(s.get(key, 0.0) for _, s in timed), rounds)

    draft, verify, state = per_round_ms("draft_s"), per_round_ms("verify_s"), per_round_ms("state_s")
    wall = _ratio(1e3 * sum(r.e2el_s for r, _ in timed), rounds)
    mode = "pipelined" if hits + misses else "sequential"
    exposed = None if draft is None else draft * exposed_draft_fraction(mode, rounds, hits, misses)
    other = None if wall is None or exposed is None else wall - exposed - (verify or 0.0) - (state or 0.0)
    return {
        "num_rounds": rounds,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": _ratio(accepted, drafted),
        "mean_accepted_length": 1 + accepted / rounds if rounds else None,
        "tokens_per_round": _ratio(sum(r.output_tokens or 0 for r, _ in timed), rounds),
        "accepted_per_position": per_position,
        "acceptance_by_position": [count / rounds for count in per_position] if rounds else [],
        "draft_ms_per_round": draft,
        "verify_ms_per_round": verify,
        "state_ms_per_round": state,
        "wall_ms_per_round": wall,
        "exposed_draft_ms_per_round": exposed,
        "other_ms_per_round": other,
        "pipeline_hits": hits,
        "pipeline_misses": misses,
        "pipeline_hit_rate": _ratio(hits, hits + misses),
        "wire_bytes": wire,
        "wire_bytes_per_round": _ratio(wire, rounds),
        "drafter_fallbacks": sum(bool(s.get("drafter_fallback")) for _, s in stats),
    }


def server_summary(run: LoadRun) -> dict[str, Any]:
    """What the router's ``/metrics`` delta adds: draft count, its own overhead quantiles, counter totals."""
    if run.metrics is None:
        return {"num_drafts": None, **dict.fromkeys(QUANTILE_KEYS), "server": {}}
    counters = {name: counter_total(run.metrics, name) for name in SERVER_COUNTERS}
    drafts = counters["vllm:spec_decode_num_drafts_total"]
    quantiles = {}
    for key, series in QUANTILE_SERIES.items():
        buckets = histogram_buckets(run.metrics, series)
        for quantile in (50, 99):
            value = histogram_quantile(quantile / 100, buckets)
            quantiles[f"{key}_ms_p{quantile}"] = None if value is None else 1e3 * value
    return {
        "num_drafts": None if drafts is None else int(drafts),
        **quantiles,
        "server": {name: value for name, value in counters.items() if value is not None},
    }


def _rate(value: float | None) -> float | str | None:
    return "inf" if value is not None and math.isinf(value) else value


def summarize(run: LoadRun, slo: Slo | None = None) -> dict[str, Any]:
    """The summary of ``run`` (keys and definitions in the module docstring); warm-up requests excluded."""
    measured = run.measured
    done = [r for r in measured if r.ok]
    failed = [r for r in measured if not r.ok]
    duration = run.duration_s
    input_lens = [r.prompt_tokens or 0 for r in done]
    output_lens = [r.output_tokens or 0 for r in done]
    itls = [r.itl_s for r in done]
    summary: dict[str, Any] = {
        "label": run.label,
        "backend": run.backend,
        "speculation": run.options.speculation,
        "request_rate": _rate(run.spec.qps),
        "arrival": run.spec.arrival if run.spec.qps is not None else None,
        "burstiness": run.spec.burstiness,
        "concurrency": run.spec.concurrency,
        "max_concurrency": run.spec.max_concurrency,
        "num_prompts": len(measured),
        "warmup_requests": len(run.records) - len(measured),
        "duration": duration,
        "schedule_span_s": max((r.scheduled_s for r in measured), default=0.0),
        "completed": len(done),
        "failed": len(failed),
        "timeouts": sum(r.error is not None and r.error.kind in TIMEOUT_KINDS for r in failed),
        "completion_rate": _ratio(len(done), len(measured)),
        "errors": [f"{r.error.kind}: {r.error.message}" for r in failed if r.error],
        "errors_by_kind": dict(Counter(r.error.kind for r in failed if r.error)),
        "total_input_tokens": sum(input_lens),
        "total_output_tokens": sum(output_lens),
        "request_throughput": _ratio(len(done), duration) or 0.0,
        "output_throughput": _ratio(sum(output_lens), duration) or 0.0,
        "total_token_throughput": _ratio(sum(input_lens) + sum(output_lens), duration) or 0.0,
        "slo": None if slo is None else asdict(slo),
        "request_goodput": None if slo is None else _ratio(sum(meets_slo(r, slo) for r in done), duration),
        "input_len_stats": {
            "min": min(input_lens, default=None),
            "median": percentile(input_lens, 50),
            "p95": percentile(input_lens, 95),
            "max": max(input_lens, default=None),
        },
        "category_counts": dict(sorted(Counter(r.category for r in measured).items())),
        "input_lens": input_lens,
        "output_lens": output_lens,
        "ttfts": [r.ttft_s for r in done],
        "itls": itls,
    }
    series = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [t for r in done if (t := r.tpot_s) is not None],
        "itl": [gap for gaps in itls for gap in gaps],
        "e2el": [r.e2el_s for r in done],
    }
    for name in LATENCIES:
        summary.update(distribution_ms(name, series[name]))
    summary.update(speculation_summary(measured))
    summary.update(server_summary(run))
    summary["metrics_error"] = run.metrics_error
    return summary
