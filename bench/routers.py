"""Requests/s of 1, 2 and 4 router processes sharing the same simulated workers, in one run, interleaved.

One :func:`bench.load.simulate.simulated_stack` with ``max(--routers)`` routers serves every point: a point with
``N`` routers drives the first ``N`` of them (closed loop at ``--concurrency`` requests in flight in all, request
``i`` to router ``i mod N``), so the workers, prompts and load are the same for every count and the counts take
turns (``--repeats`` rounds of 1, 2, 4, ...), which spreads the drift of a shared machine over all of them. Idle
routers cost only their health checks.

Per point: completed requests/s and output tokens/s, and each process's own CPU time over the measured window
(``/proc/PID/stat`` utime + stime, which machine contention distorts much less than wall time): router CPU
seconds per request and per round, each driven router's busy fraction, the workers' and this load generator's,
and how busy the whole machine was (``/proc/stat``). A router whose busy fraction nears 1.0 is saturated; when the
sum over all processes nears the machine's cores, adding routers cannot add throughput.

    python -m bench.routers --routers 1,2,4 --repeats 2 --concurrency 256 --duration 30 --max-tokens 32 \\
        --name routers-sim

Writes ``NAME.json`` and ``NAME.md`` under ``--result-dir``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.load.backends import GrpcBackend
from bench.load.report import run_metadata, write_report
from bench.load.runner import LoadSpec, run_load
from bench.load.simulate import SimulatedStack, add_simulation_arguments, simulated_stack, simulation_config_from_args
from bench.load.summary import summarize
from bench.load.workload import RequestOptions, load_prompts
from bench.services import Service, process_cpu_s
from specdec import eventloop


def machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs so far (``/proc/stat``; idle and iowait count as not busy)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def _processes(stack: SimulatedStack) -> dict[str, Service]:
    return {service.name: service for service in stack.services.started}


async def measure(
    stack: SimulatedStack, routers: int, args: argparse.Namespace, prompts: list, label: str
) -> dict[str, Any]:
    """One point: the first ``routers`` routers under the closed loop; summary plus CPU accounting."""
    processes = _processes(stack)
    router_names = [name for name in processes if name.startswith("router")]
    addresses = list(stack.grpc_addresses[:routers])
    metrics_urls = [f"http://{address}/metrics" for address in stack.http_addresses[:routers]]
    options = RequestOptions(max_tokens=args.max_tokens, temperature=0.0, seed=args.seed, ignore_eos=True)
    spec = LoadSpec(
        concurrency=args.concurrency,
        duration_s=args.duration,
        warmup_requests=args.warmup,
        seed=args.seed,
    )
    before = {name: process_cpu_s(service.process.pid) for name, service in processes.items()}
    own_before, machine_before, wall_before = time.process_time(), machine_ticks(), time.perf_counter()
    run = await run_load(
        GrpcBackend(addresses, timeout_s=300), prompts, options, spec, progress=False, metrics_urls=metrics_urls
    )
    wall = time.perf_counter() - wall_before
    own = time.process_time() - own_before
    machine_after = machine_ticks()
    cpu = {name: process_cpu_s(service.process.pid) - before[name] for name, service in processes.items()}
    summary = summarize(run)
    # CPU over the whole call (warm-up and scrapes included) against requests and rounds of the measured window,
    # rescaled to the window's share of the call's wall time
    share = run.duration_s / wall
    driven = router_names[:routers]
    router_cpu = sum(cpu[name] for name in driven) * share
    completed, rounds = summary["completed"], summary["num_rounds"] or 0
    busy = machine_after[0] - machine_before[0]
    total = machine_after[1] - machine_before[1]
    return {
        "label": label,
        "routers": routers,
        "concurrency": args.concurrency,
        "duration_s": run.duration_s,
        "completed": completed,
        "failed": summary["failed"],
        "errors_by_kind": summary["errors_by_kind"],
        "requests_per_s": summary["request_throughput"],
        "output_tokens_per_s": summary["output_throughput"],
        "rounds": rounds,
        "tokens_per_round": summary["tokens_per_round"],
        "router_overhead_ms_p50": summary.get("router_overhead_ms_p50"),
        "router_overhead_ms_p99": summary.get("router_overhead_ms_p99"),
        "e2el_ms_median": summary.get("median_e2el_ms"),
        "router_cpu_ms_per_request": 1e3 * router_cpu / completed if completed else None,
        "router_cpu_ms_per_round": 1e3 * router_cpu / rounds if rounds else None,
        "router_busy": [cpu[name] / wall for name in driven],
        "idle_router_busy": [cpu[name] / wall for name in router_names[routers:]],
        "workers_busy": {name: cpu[name] / wall for name in processes if not name.startswith("router")},
        "load_generator_busy": own / wall,
        "machine_busy_cores": os.cpu_count() * busy / total if total else None,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def aggregate(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per router count: the mean over its repeats of the headline numbers, and each repeat's requests/s."""
    rows = []
    for routers in sorted({p["routers"] for p in points}):
        mine = [p for p in points if p["routers"] == routers]
        rows.append(
            {
                "routers": routers,
                "requests_per_s": _mean([p["requests_per_s"] for p in mine]),
                "requests_per_s_each": [p["requests_per_s"] for p in mine],
                "output_tokens_per_s": _mean([p["output_tokens_per_s"] for p in mine]),
                "router_cpu_ms_per_request": _mean([p["router_cpu_ms_per_request"] for p in mine]),
                "router_cpu_ms_per_round": _mean([p["router_cpu_ms_per_round"] for p in mine]),
                "router_busy_max": max(max(p["router_busy"]) for p in mine),
                "router_busy_sum": _mean([sum(p["router_busy"]) for p in mine]),
                "workers_busy_sum": _mean([sum(p["workers_busy"].values()) for p in mine]),
                "load_generator_busy": _mean([p["load_generator_busy"] for p in mine]),
                "machine_busy_cores": _mean([p["machine_busy_cores"] for p in mine]),
                "router_overhead_ms_p50": _mean([p["router_overhead_ms_p50"] for p in mine]),
                "router_overhead_ms_p99": _mean([p["router_overhead_ms_p99"] for p in mine]),
                "failed": sum(p["failed"] for p in mine),
            }
        )
    return rows


def _f(value: Any, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def markdown(document: dict[str, Any]) -> str:
    meta, rows = document["meta"], document["summary"]
    env = meta["environment"]
    lines = [
        f"# `bench.routers` {meta['name']}",
        "",
        f"{meta['date']} · {env['cpu']} ({env['cpus']} CPUs, load {env['load_average'][0]:.2f}) · commit "
        f"{env['versions']['specdec_commit']}",
        "",
        f"Command: `{' '.join(meta['command'])}`",
        "",
        "| routers | requests/s (each repeat) | output tok/s | router CPU ms / request | router CPU ms / round "
        "| busiest router (cores) | routers (cores) | workers (cores) | load generator (cores) | machine busy (cores) "
        "| overhead ms p50 / p99 | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        each = ", ".join(_f(v, ".1f") for v in row["requests_per_s_each"])
        lines.append(
            f"| {row['routers']} | {_f(row['requests_per_s'], '.1f')} ({each}) "
            f"| {_f(row['output_tokens_per_s'], '.0f')} "
            f"| {_f(row['router_cpu_ms_per_request'])} | {_f(row['router_cpu_ms_per_round'], '.3f')} "
            f"| {_f(row['router_busy_max'])} | {_f(row['router_busy_sum'])} | {_f(row['workers_busy_sum'])} "
            f"| {_f(row['load_generator_busy'])} | {_f(row['machine_busy_cores'])} "
            f"| {_f(row['router_overhead_ms_p50'], '.1f')} / {_f(row['router_overhead_ms_p99'], '.1f')} "
            f"| {row['failed']} |"
        )
    lines += ["", "Points in the order they ran:", "", "| # | routers | requests/s | router busy (each) | loadavg |"]
    lines.append("|---|---|---|---|---|")
    for index, point in enumerate(document["points"]):
        busy = ", ".join(_f(b) for b in point["router_busy"])
        lines.append(
            f"| {index} | {point['routers']} | {_f(point['requests_per_s'], '.1f')} | {busy} "
            f"| {' '.join(point['loadavg'])} |"
        )
    return "\n".join(lines) + "\n"


async def run_points(stack: SimulatedStack, args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts = load_prompts(args.prompts, None)
    points = []
    for repeat in range(args.repeats):
        for routers in args.routers:
            label = f"{routers} router{'s' if routers > 1 else ''}, repeat {repeat}"
            point = await measure(stack, routers, args, prompts, label)
            busy = [round(b, 2) for b in point["router_busy"]]
            print(
                f"{label}: {point['requests_per_s']:.1f} requests/s, router CPU "
                f"{_f(point['router_cpu_ms_per_request'])} ms/request, busy {busy}",
                file=sys.stderr,
            )
            points.append(point)
    return points


def main(argv: list[str] | None = None) -> int:
    from bench.load.cli import default_prompts

    parser = argparse.ArgumentParser(prog="python -m bench.routers", description=__doc__.splitlines()[0])
    parser.add_argument("--routers", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the router counts (default 2)")
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight, all routers together")
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds per point")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=Path, default=default_prompts())
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="routers-sim")
    add_simulation_arguments(parser)
    args = parser.parse_args(argv)
    args.sim_routers = max(args.routers)
    config = simulation_config_from_args(args)
    meta = run_metadata(args.name, sys.argv, {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})
    meta["config"].update({key: str(value) for key, value in meta["config"].items() if key.startswith("sim_")})
    log_dir = Path(tempfile.gettempdir()) / "specdec-bench-routers"
    with simulated_stack(config, log_dir=log_dir) as stack:
        points = eventloop.run(run_points(stack, args))
    document = {"meta": meta, "summary": aggregate(points), "points": points}
    write_report(args.result_dir, args.name, document, markdown(document))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
