"""What the router costs per round, on the simulated stack (real router process, simulated workers), by event loop,
workers' arrival wait, router-to-worker transport, the router's garbage collector policy and its code.

Two measurements, each configuration a short closed-loop run (``--duration`` seconds after one uncounted wave of
warm-up requests), the variants (every combination of ``--event-loop``, ``--arrival-wait``, ``--transport``,
``--gc`` and ``--router-source``) interleaved at every stream count (one stack per variant, all started up front,
so machine drift hits each alike):

1. **Router CPU and overhead per round** at ``--streams`` concurrent streams, the default simulated latencies
   (:class:`bench.load.simulate.SimulationConfig`). CPU per round = the router process's own CPU clock (utime +
   stime of ``/proc/PID/stat``, every thread: the loop, gRPC's C threads) over the measured window, divided by the
   rounds of the requests of that window (their speculation stats). It counts everything the router does (request
   setup, tokenisation, detokenisation, two ``/metrics`` scrapes), and is less sensitive than wall time to other
   work on the machine. Overhead per round p50 / p99 is the router's ``specdec:router_overhead_seconds`` over the
   window (round wall time less the exposed draft, verify and state time: what the router, the wire and queueing
   add), as ``specdec bench`` reports it.
2. **Per-token time against the pipeline's bound** at ``--bound-streams`` streams with GPU-like latencies: verify
   ``--bound-verify-latency`` (15 ms, flat in the batch: a forward costs about the same for a batch as for one
   sequence), draft ``--bound-draft-latency`` (1–3 ms). Bound = ``max(draft, verify) / E[N]`` with the latency
   means and ``E[N]`` = tokens the run's rounds really committed; the ratio bound / TPOT (mean time per output
   token after the first) is what the pipeline achieves of it (1 = the bound).

The simulated devices sleep once per batch (:mod:`bench.load.simulated.device`), so a batch of N costs what a batch
of one does plus ``verify_per_seq_ms`` per sequence (0 in part 2). The load generator runs in this process on its
own (uvloop) loop; ``--event-loop`` sets ``SPECDEC_EVENT_LOOP`` of the stack's processes (router and workers),
``--gc`` the router's ``SPECDEC_GC`` (:mod:`specdec.gc_policy`), ``--router-source`` the checkouts the router runs
from (``git worktree add DIR COMMIT``: two commits' routers in one interleaved run).
Writes ``NAME.json`` and ``NAME.md`` into ``--result-dir``.

    nice -n 5 python -m bench.overhead --streams 1,64,500 --bound-streams 1,8,32,128 --event-loop uvloop,asyncio
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.arguments import comma_ints
from bench.load.backends import GrpcBackend
from bench.load.report import elide_option, run_metadata, write_report
from bench.load.runner import LoadSpec, run_load
from bench.load.simulate import LatencySpec, SimulatedStack, SimulationConfig, simulated_stack
from bench.load.summary import QUANTILE_KEYS, summarize
from bench.load.workload import RequestOptions, load_prompts
from bench.services import process_cpu_s
from grpc_common.arrivals import DEFAULT_FRACTION
from specdec import eventloop, gc_policy

PROMPTS = Path(__file__).resolve().parent / "prompts" / "load.jsonl"
TARGET_CPU_MS = 0.2  # router CPU per round (issue 15)
TARGET_OVERHEAD_P50_MS = 1.0  # at the largest stream count
TARGET_BOUND_RATIO = 0.9


def router_pid(stack: SimulatedStack) -> int:
    return next(service.process.pid for service in stack.services.started if service.name == "router")


async def measure(
    stack: SimulatedStack, prompts: Sequence[Any], options: RequestOptions, streams: int, duration_s: float
) -> dict[str, Any]:
    """One warm-up wave of ``streams`` requests, then ``duration_s`` of closed loop at ``streams``; the summary of the
    measured window plus the router's CPU over it."""
    warm = LoadSpec(concurrency=streams, num_requests=streams, seed=1)
    await run_load(GrpcBackend(list(stack.grpc_addresses)), prompts, options, warm, progress=False)
    pid = router_pid(stack)
    spec = LoadSpec(concurrency=streams, duration_s=duration_s, seed=2)
    metrics_urls = [f"http://{stack.http_addresses[0]}/metrics"]
    cpu_before = process_cpu_s(pid)
    run = await run_load(
        GrpcBackend(list(stack.grpc_addresses)), prompts, options, spec, progress=False, metrics_urls=metrics_urls
    )
    cpu_s = process_cpu_s(pid) - cpu_before
    summary = summarize(run)
    rounds = summary["num_rounds"]
    return {
        "streams": streams,
        "window_s": run.duration_s,
        "completed": summary["completed"],
        "failed": summary["failed"],
        "errors_by_kind": summary["errors_by_kind"],
        "rounds": rounds,
        "router_cpu_s": cpu_s,
        "router_cpu_ms_per_round": 1e3 * cpu_s / rounds if rounds else None,
        "router_cpu_fraction": cpu_s / run.duration_s,
        **{key: summary[key] for key in QUANTILE_KEYS},  # the overhead's and its queue parts' p50 / p99
        "requests_per_s": summary["request_throughput"],
        "output_tokens_per_s": summary["output_throughput"],
        "tokens_per_round": summary["tokens_per_round"],
        "draft_ms_per_round": summary["draft_ms_per_round"],
        "verify_ms_per_round": summary["verify_ms_per_round"],
        "mean_tpot_ms": summary["mean_tpot_ms"],
        "median_tpot_ms": summary["median_tpot_ms"],
        "pipeline_hit_rate": summary["pipeline_hit_rate"],
    }


async def run_part(
    configs: dict[str, SimulationConfig],
    streams: Sequence[int],
    options: RequestOptions,
    duration_s: float,
    log_dir: Path,
) -> list[dict[str, Any]]:
    """Every stream count on every stack of ``configs`` (one per variant: event loop, arrival wait, transport, garbage
    collector), the variants' order alternating."""
    prompts = load_prompts(PROMPTS)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stacks:
        started = {
            label: stacks.enter_context(simulated_stack(config, log_dir=log_dir / label))
            for label, config in configs.items()
        }
        for step, count in enumerate(streams):
            order = list(started) if step % 2 == 0 else list(reversed(started))
            for label in order:
                row = await measure(started[label], prompts, options, count, duration_s)
                row["event_loop"] = configs[label].event_loop
                row["arrival_wait"] = configs[label].arrival_wait
                row["transport"] = _transport(configs[label])
                row["gc"] = configs[label].gc_policy
                row["router_source"] = configs[label].router_source or "."
                rows.append(row)
                print(json.dumps(_rounded(row)), file=sys.stderr, flush=True)
    return rows


def add_bound(rows: list[dict[str, Any]], draft: LatencySpec, verify: LatencySpec) -> None:
    """Each row's bound ``max(draft, verify) / E[N]`` (latency means, E[N] measured) and TPOT's share of it."""
    for row in rows:
        per_round = max(draft.mean_ms, verify.mean_ms)
        row["bound_ms_per_token"] = per_round / row["tokens_per_round"] if row["tokens_per_round"] else None
        tpot = row["mean_tpot_ms"]
        row["bound_ratio"] = row["bound_ms_per_token"] / tpot if tpot and row["bound_ms_per_token"] else None


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def _f(value: Any, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _wait(row: dict[str, Any]) -> str:
    return format(row["arrival_wait"], "g")


def _gc(row: dict[str, Any]) -> str:
    return row.get("gc") or "default"  # rows of runs before the router's policy existed


def _source(row: dict[str, Any]) -> str:
    return row.get("router_source") or "."  # this checkout (rows of runs before the axis existed too)


def _transport(config: SimulationConfig) -> str:
    return "stream" if config.worker_streams else "unary"


def markdown(document: dict[str, Any]) -> str:
    env, config = document["environment"], document["config"]
    lines = [
        f"# bench.overhead {document['name']}",
        "",
        f"{document['date']} · {env['cpu']} ({env['cpus']} CPUs, load {env['load_average'][0]:.2f} at the start) · "
        f"specdec {env['versions'].get('specdec_commit')} · grpcio {env['versions'].get('grpcio')}",
        "",
        f"Command: `{' '.join(document['command'])}`. {config['note']}",
    ]
    if document["overhead"]:
        lines += _overhead_section(document)
    if document["bound"]:
        lines += _bound_section(document)
    return "\n".join(lines) + "\n"


def _burst_ms(row: dict[str, Any]) -> float | None:
    """Streams × router CPU per round: how long the router takes over the rounds of one forward's verdicts."""
    cpu = row["router_cpu_ms_per_round"]
    return None if cpu is None else row["streams"] * cpu


def _overhead_section(document: dict[str, Any]) -> list[str]:
    config = document["config"]
    lines = [
        "",
        f"## Router CPU and overhead per round (default simulated latencies: draft {config['draft_latency']}, "
        f"verify {config['verify_latency']} + {config['verify_per_seq_ms']} ms per sequence)",
        "",
        "Targets (issue 15): router CPU ≤ 0.2 ms per round, overhead p50 ≤ 1 ms at the largest stream count. "
        "**Burst** = streams × router CPU per round: a forward answers every stream at once and the router runs "
        "their rounds one after another, so the median overhead follows it (`bench/results/overhead-split/`).",
        "",
        "| streams | event loop | arrival wait | transport | gc | router code | rounds | router CPU ms / round "
        "| router CPU (cores) | burst ms | overhead ms p50 / p99 | of which verifier queue ms p50 / p99 "
        "| of which drafter queue ms p50 / p99 | requests/s | tokens/round | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in document["overhead"]:
        lines.append(
            f"| {row['streams']} | {row['event_loop']} | {_wait(row)} | {row['transport']} | {_gc(row)} "
            f"| {_source(row)} | {row['rounds']} "
            f"| {_f(row['router_cpu_ms_per_round'], '.3f')} "
            f"| {_f(row['router_cpu_fraction'])} | {_f(_burst_ms(row))} | {_f(row['router_overhead_ms_p50'])} / "
            f"{_f(row['router_overhead_ms_p99'])} | {_f(row['verifier_queue_ms_p50'])} / "
            f"{_f(row['verifier_queue_ms_p99'])} | {_f(row['drafter_queue_ms_p50'])} / "
            f"{_f(row['drafter_queue_ms_p99'])} | {_f(row['requests_per_s'], '.1f')} | "
            f"{_f(row['tokens_per_round'])} | {row['failed']} |"
        )
    return lines


def _bound_section(document: dict[str, Any]) -> list[str]:
    config = document["config"]
    lines = [
        "",
        f"## Per-token time against the bound (draft {config['bound_draft_latency']}, verify "
        f"{config['bound_verify_latency']} per batch, flat)",
        "",
        "Bound = max(draft, verify) / E[N] (latency means; E[N] = tokens committed per round, measured). "
        "Target (issue 15): bound / TPOT ≥ 0.9 at every stream count.",
        "",
        "| streams | event loop | arrival wait | transport | gc | router code | tokens/round | bound ms/token "
        "| TPOT ms mean (median) | bound / TPOT | router CPU ms / round | overhead ms p50 / p99 | pipeline hit rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in document["bound"]:
        lines.append(
            f"| {row['streams']} | {row['event_loop']} | {_wait(row)} | {row['transport']} | {_gc(row)} "
            f"| {_source(row)} | {_f(row['tokens_per_round'])} | "
            f"{_f(row['bound_ms_per_token'])} | {_f(row['mean_tpot_ms'])} ({_f(row['median_tpot_ms'])}) | "
            f"{_f(row['bound_ratio'])} | {_f(row['router_cpu_ms_per_round'], '.3f')} | "
            f"{_f(row['router_overhead_ms_p50'])} / {_f(row['router_overhead_ms_p99'])} | "
            f"{_f(row['pipeline_hit_rate'])} |"
        )
    return lines


def variants(
    config: SimulationConfig,
    loops: Sequence[str],
    waits: Sequence[float],
    transports: Sequence[str] = ("stream",),
    collectors: Sequence[str] = ("server",),
    sources: Sequence[str] = ("",),
) -> dict[str, SimulationConfig]:
    """``config`` with each event loop, arrival wait, router-to-worker transport, garbage collector policy and router
    checkout ('': this one), by a label that names all."""
    return {
        f"{loop}-wait{wait:g}-{transport}-gc{collector}-{source or '.'}": replace(
            config,
            event_loop=loop,
            arrival_wait=wait,
            worker_streams=transport == "stream",
            gc_policy=collector,
            router_source=source or None,
        )
        for loop in loops
        for wait in waits
        for transport in transports
        for collector in collectors
        for source in sources
    }


def _transports(text: str) -> list[str]:
    transports = [part.strip() for part in text.split(",") if part.strip()]
    for transport in transports:
        if transport not in ("stream", "unary"):
            raise argparse.ArgumentTypeError(f"transport must be stream or unary, got {transport!r}")
    return transports


def _collectors(text: str) -> list[str]:
    collectors = [part.strip() for part in text.split(",") if part.strip()]
    for collector in collectors:
        try:
            gc_policy.choice_from({gc_policy.ENV: collector})
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return collectors


def _sources(text: str) -> list[str]:
    sources = [part.strip() for part in text.split(",")]
    for source in sources:
        if source and not (Path(source) / "router" / "__main__.py").is_file():
            raise argparse.ArgumentTypeError(f"{source!r} is not a checkout of this repository (no router/__main__.py)")
    return sources


def _fractions(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def _loops(text: str) -> list[str]:
    loops = [part.strip() for part in text.split(",") if part.strip()]
    for loop in loops:
        eventloop.loop_factory(loop)  # an unknown name, or uvloop not installed: fail before any stack starts
    return loops


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--streams", type=comma_ints, default=[1, 64, 500], help="part 1 stream counts ('': skip part 1)"
    )
    parser.add_argument(
        "--bound-streams",
        type=comma_ints,
        default=[1, 8, 32, 128],
        help="part 2 stream counts (default 1,8,32,128; none: '')",
    )
    parser.add_argument(
        "--event-loop", type=_loops, default=["uvloop", "asyncio"], help="SPECDEC_EVENT_LOOP values, interleaved"
    )
    parser.add_argument(
        "--arrival-wait",
        type=_fractions,
        default=[DEFAULT_FRACTION],
        help="the workers' wait for calls they expect back, as a fraction of a batch (0: none), interleaved",
    )
    parser.add_argument(
        "--transport",
        type=_transports,
        default=["stream"],
        help="how the router sends batches to workers: stream (one per worker), unary (an RPC each); interleaved",
    )
    parser.add_argument(
        "--gc",
        type=_collectors,
        default=["server"],
        help="the router's SPECDEC_GC values (server: startup heap frozen, rarer passes; default: CPython's), "
        "interleaved",
    )
    parser.add_argument(
        "--router-source",
        type=_sources,
        default=[""],
        help="checkouts the router runs from, comma-separated ('': this one; e.g. a git worktree of the parent "
        "commit); interleaved",
    )
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds per configuration")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speculation", default="pipelined", help="the requests' speculation mode")
    parser.add_argument("--bound-verify-latency", type=LatencySpec.parse, default=LatencySpec("const", 15.0))
    parser.add_argument("--bound-draft-latency", type=LatencySpec.parse, default=LatencySpec("uniform", 1.0, 3.0))
    parser.add_argument("--note", default="", help="a sentence for the report (what else shared the machine)")
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="overhead")
    args = parser.parse_args(argv)

    options = RequestOptions(max_tokens=args.max_tokens, speculation=args.speculation)
    base = SimulationConfig()
    bound = replace(
        base, draft_latency=args.bound_draft_latency, verify_latency=args.bound_verify_latency, verify_per_seq_ms=0.0
    )
    config = {
        "streams": args.streams,
        "bound_streams": args.bound_streams,
        "event_loops": args.event_loop,
        "arrival_waits": args.arrival_wait,
        "transports": args.transport,
        "gc_policies": args.gc,
        "router_sources": args.router_source,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "speculation": args.speculation,
        "draft_latency": str(base.draft_latency),
        "verify_latency": str(base.verify_latency),
        "verify_per_seq_ms": base.verify_per_seq_ms,
        "bound_draft_latency": str(bound.draft_latency),
        "bound_verify_latency": str(bound.verify_latency),
        "acceptance": list(base.acceptance),
        "num_draft_tokens": base.num_draft_tokens,
        "note": args.note,
    }
    command = ["python", "-m", "bench.overhead", *elide_option(argv if argv is not None else sys.argv[1:], "--note")]
    document = run_metadata(args.name, command, config)
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as logs:
        log_dir = Path(logs)

        axes = (args.event_loop, args.arrival_wait, args.transport, args.gc, args.router_source)

        async def both() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            overhead, rows = [], []
            if args.streams:
                configs = variants(base, *axes)
                overhead = await run_part(configs, args.streams, options, args.duration, log_dir / "overhead")
            if args.bound_streams:
                configs = variants(bound, *axes)
                rows = await run_part(configs, args.bound_streams, options, args.duration, log_dir / "bound")
            return overhead, rows

        document["overhead"], document["bound"] = eventloop.run(both())
    add_bound(document["bound"], bound.draft_latency, bound.verify_latency)
    write_report(args.result_dir, args.name, _rounded(document), markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
