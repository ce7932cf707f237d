"""Several load points in one invocation: every QPS of ``--qps``, each repeated per speculation mode, modes
interleaved at every QPS point so off vs on share the machine's state; then the target QPS per mode.

Saturation rule (checked per mode after each point; that mode stops, the others go on): a point is saturated when
any request failed, or when the measured window outlasted the arrival schedule by more than a quarter plus one
median request latency, ``duration − median e2el > span / 0.8`` — i.e. the completion rate over the schedule fell
below 0.8 × the realised arrival rate, so requests were queueing up faster than they were served. (Comparing
completed / duration with the nominal QPS instead would flag short runs, whose last request's latency and the
randomness of a Poisson schedule's span alone push it down.)

Target QPS of a mode: the highest swept QPS at which that mode had no failed request and p95 TTFT and p95 ITL were
within ``--slo-ttft-ms`` / ``--slo-itl-ms`` (pooled over the point's requests; each bound only if given).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from bench.load.backends import Backend
from bench.load.runner import LoadRun, LoadSpec, run_load
from bench.load.summary import Slo, summarize
from bench.load.workload import Prompt, RequestOptions

SATURATION_RATIO = 0.8
SATURATION_RULE = (
    "a mode stops after a point with a failed request, or whose window outlasted its arrival schedule: "
    f"duration − median e2el > schedule span / {SATURATION_RATIO} (completion rate < {SATURATION_RATIO} × "
    "arrival rate)"
)
Point = tuple[LoadRun, dict[str, Any]]


def mode_name(speculation: str | None) -> str:
    return speculation or "default"


def saturation(summary: dict[str, Any]) -> str | None:
    """Why the point of ``summary`` counts as saturated (the rule above), or None. Open loop only."""
    if summary["failed"]:
        return f"{summary['failed']} failed request(s)"
    if not isinstance(summary["request_rate"], float | int) or summary["median_e2el_ms"] is None:
        return None
    drain_s = summary["duration"] - summary["median_e2el_ms"] / 1e3
    span_s = summary["schedule_span_s"]
    if drain_s > span_s / SATURATION_RATIO:
        return (
            f"window − median e2el {drain_s:.1f} s > schedule span {span_s:.1f} s / {SATURATION_RATIO} "
            f"at {summary['request_rate']:g} QPS"
        )
    return None


def target_qps(summaries: Sequence[dict[str, Any]], slo: Slo) -> float | None:
    """The highest ``request_rate`` among ``summaries`` (one mode's points) within the SLO; None if none is."""

    def within(summary: dict[str, Any]) -> bool:
        if summary["failed"] or not isinstance(summary["request_rate"], float | int):
            return False
        for bound, key in ((slo.ttft_ms, "p95_ttft_ms"), (slo.itl_ms, "p95_itl_ms")):
            if bound is not None and (summary[key] is None or summary[key] > bound):
                return False
        return True

    rates = [summary["request_rate"] for summary in summaries if within(summary)]
    return max(rates, default=None)


def point_label(spec: LoadSpec, speculation: str | None, with_mode: bool) -> str:
    """``qps2``, ``c8``, ``qpsinf``, plus ``-pipelined`` when modes are swept."""
    load = f"c{spec.concurrency}" if spec.concurrency is not None else f"qps{spec.qps:g}"
    return f"{load}-{mode_name(speculation)}" if with_mode else load


async def run_sweep(
    make_backend: Callable[[], Backend],
    prompts: Sequence[Prompt],
    options: RequestOptions,
    spec: LoadSpec,
    *,
    rates: Sequence[float] | None = None,
    modes: Sequence[str | None] = (None,),
    slo: Slo | None = None,
    progress: bool = True,
    metrics_urls: Sequence[str] = (),
    report: Callable[[Point], None] | None = None,
) -> tuple[list[Point], dict[str, str]]:
    """Run every (rate, mode) point, rates ascending, modes interleaved; returns the points and, per mode that
    stopped early, why. ``rates`` None: the single load of ``spec``. ``report`` sees each point when done."""
    loads = [spec] if rates is None else [replace(spec, qps=rate) for rate in sorted(rates)]
    speculation_given = len(modes) > 1 or modes[0] is not None
    active = list(modes)
    stopped: dict[str, str] = {}
    points: list[Point] = []
    for load in loads:
        for mode in list(active):
            point_options = options if mode is None else replace(options, speculation=mode)
            label = point_label(load, point_options.speculation, speculation_given)
            run = await run_load(
                make_backend(), prompts, point_options, load, progress=progress, metrics_urls=metrics_urls, label=label
            )
            summary = summarize(run, slo)
            summary["saturation"] = saturation(summary) if load.qps is not None else None
            points.append((run, summary))
            if report is not None:
                report((run, summary))
            if summary["saturation"] is not None and rates is not None:
                active.remove(mode)
                stopped[mode_name(mode)] = f"after {label}: {summary['saturation']}"
        if not active:
            break
    return points, stopped
