"""``specdec bench``: a load generator for the router, in the manner of ``vllm bench serve``.

    specdec bench --qps 0.5,1,2,4 --sweep-speculation off,pipelined --num-requests 100 \\
        --slo-ttft-ms 2000 --slo-itl-ms 200 --result-dir bench/results --name sweep

Without ``--router`` / ``--base-url`` it finds the routers of ``specdec up`` (its state file); with ``--simulate``
it starts routers (``--sim-routers``) over simulated workers (:mod:`bench.load.simulate`) for the run and stops them
afterwards. Several routers (repeated ``--router`` / ``--base-url``, or all those of the deployment) take the
requests in turn, and their ``/metrics`` are summed.
Only argparse is imported here: gRPC, aiohttp and matplotlib load inside :func:`run`. The command plugs into
``specdec`` through the ``specdec.commands`` entry point :func:`register`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.arguments import comma_floats, comma_names

_PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prompts"


def default_prompts() -> Path:
    shipped = _PROMPTS_DIR / "load.jsonl"
    return shipped if shipped.exists() else _PROMPTS_DIR / "colocated.jsonl"


def register(subparsers: argparse._SubParsersAction) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add ``bench`` and return its run function (a :data:`specdec.cli.Register`); the ``--sim-*`` options come
    from :mod:`bench.load.simulate`."""
    from bench.load.simulate import add_simulation_arguments
    from bench.load.workload import MODES

    parser = subparsers.add_parser("bench", help="load-test the router (open or closed loop, sweeps, reports)")
    target = parser.add_argument_group("routers (default: those `specdec up` started)")
    target.add_argument("--backend", choices=("grpc", "http"), default="grpc", help="API to load (default grpc)")
    target.add_argument(
        "--router", action="append", metavar="HOST:PORT", help="router gRPC address (--backend grpc; repeat)"
    )
    target.add_argument(
        "--base-url",
        action="append",
        metavar="http://HOST:PORT",
        help="router HTTP address (--backend http, metrics; repeat)",
    )
    target.add_argument(
        "--metrics-url", action="append", help="Prometheus endpoint to scrape (repeat; default BASE_URL/metrics)"
    )
    target.add_argument("--timeout", type=float, default=600.0, help="deadline per request, s (default 600)")
    target.add_argument("--simulate", action="store_true", help="start a router over simulated workers for the run")

    load = parser.add_argument_group("load")
    load.add_argument("--qps", type=comma_floats, help="arrival rate(s), comma-separated for a sweep; inf: all at once")
    load.add_argument("--arrival", choices=("poisson", "constant", "gamma"), default="poisson")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: <1 burstier, >1 smoother")
    load.add_argument("--concurrency", type=int, help="closed loop: N users, each sending when the last finished")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight for --qps (client-side queue)")
    load.add_argument("--num-requests", type=int, help="measured requests per point (default 100 without --duration)")
    load.add_argument("--duration", type=float, help="seconds per point (no new request after it)")
    load.add_argument("--warmup", type=int, default=2, help="uncounted requests before each point (default 2)")
    load.add_argument("--seed", type=int, default=0, help="schedule and prompt order; request i samples with seed+i")

    work = parser.add_argument_group("requests")
    work.add_argument("--prompts", type=Path, default=default_prompts(), help="JSONL of {id, category, prompt}")
    work.add_argument("--categories", type=comma_names, help="only these prompt categories (comma-separated)")
    work.add_argument("--completions", action="store_true", help="raw prompt, no chat template (/v1/completions)")
    work.add_argument("--max-tokens", type=int, default=128)
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--top-p", type=float)
    work.add_argument("--top-k", type=int)
    work.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    work.add_argument("--speculation", choices=MODES, help="default: the router's")
    work.add_argument(
        "--sweep-speculation", type=comma_names, help="repeat every point per mode, e.g. off,sequential,auto"
    )
    work.add_argument("--drafter", help="drafter kind (default: the router's)")
    work.add_argument("--num-draft-tokens", type=int)
    work.add_argument("--tree-width", type=int)
    work.add_argument("--tree-budget", type=int)

    out = parser.add_argument_group("results")
    out.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    out.add_argument("--name", help="file name stem (default bench-BACKEND-DATE)")
    out.add_argument("--slo-ttft-ms", type=float, help="SLO: p95 TTFT bound (target QPS, goodput)")
    out.add_argument("--slo-itl-ms", type=float, help="SLO: p95 ITL bound (target QPS, goodput)")
    out.add_argument("--slo-tpot-ms", type=float, help="SLO: per-request TPOT bound (goodput only)")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    add_simulation_arguments(parser)
    return {"bench": run}


def _check(args: argparse.Namespace) -> None:
    from bench.load.workload import MODES

    if args.qps is not None and args.concurrency is not None:
        raise ValueError("give --qps (open loop) or --concurrency (closed loop), not both")
    for mode in args.sweep_speculation or ():
        if mode not in MODES:
            raise ValueError(f"--sweep-speculation: {mode!r} is not one of {', '.join(MODES)}")
    if args.sweep_speculation and args.speculation:
        raise ValueError("give --speculation or --sweep-speculation, not both")


def _addresses(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(gRPC addresses, HTTP base URLs): the flags, else the routers of ``specdec up``."""
    if args.router or args.base_url:
        return args.router or [], args.base_url or []
    from launcher.cluster import ClusterState, state_file

    routers = ClusterState.load(state_file()).routers
    return [r["grpc"] for r in routers if r.get("grpc")], [f"http://{r['http']}" for r in routers if r.get("http")]


def run(args: argparse.Namespace) -> int:
    """Run the bench; 0 when it ran (failed requests are results), 1 when no request completed."""
    _check(args)
    if not args.simulate:
        grpc_addresses, base_urls = _addresses(args)
        return _bench(args, grpc_addresses, base_urls, model=None)
    from bench.load.simulate import simulated_stack, simulation_config_from_args

    config = simulation_config_from_args(args)
    log_dir = Path(tempfile.gettempdir()) / "specdec-bench-sim"
    with simulated_stack(config, log_dir=log_dir) as stack:
        base_urls = [f"http://{address}" for address in stack.http_addresses]
        return _bench(args, list(stack.grpc_addresses), base_urls, model=stack.model)


def _bench(args: argparse.Namespace, grpc_addresses: list[str], base_urls: list[str], model: str | None) -> int:
    from bench.load.backends import make_backend
    from bench.load.report import point_stem, run_metadata, write_point, write_results
    from bench.load.runner import LoadSpec
    from bench.load.summary import Slo
    from bench.load.sweep import Point, run_sweep
    from bench.load.workload import RequestOptions, load_prompts
    from specdec import eventloop

    addresses = grpc_addresses if args.backend == "grpc" else base_urls
    if not addresses:
        flag = "--router" if args.backend == "grpc" else "--base-url"
        raise ValueError(f"--backend {args.backend} needs {flag} (or a `specdec up` deployment)")
    metrics_urls = args.metrics_url or [f"{url.rstrip('/')}/metrics" for url in base_urls]
    prompts = load_prompts(args.prompts, args.categories)
    options = RequestOptions(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        speculation=args.speculation,
        drafter=args.drafter,
        num_draft_tokens=args.num_draft_tokens,
        tree_width=args.tree_width,
        tree_budget=args.tree_budget,
        chat=not args.completions,
    )
    rates = args.qps if args.qps is not None else ([] if args.concurrency else [float("inf")])
    spec = LoadSpec(
        qps=rates[0] if rates else None,
        concurrency=args.concurrency,
        arrival=args.arrival,
        burstiness=args.burstiness,
        num_requests=args.num_requests if args.num_requests or args.duration else 100,
        duration_s=args.duration,
        warmup_requests=args.warmup,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
    )
    slo = None
    if any(bound is not None for bound in (args.slo_ttft_ms, args.slo_itl_ms, args.slo_tpot_ms)):
        slo = Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms, itl_ms=args.slo_itl_ms)
    token = os.environ.get("SPECDEC_BEARER_TOKEN") or None
    name = args.name or f"bench-{args.backend}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    config: dict[str, Any] = {
        key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items() if key != "command"
    }
    config.update(model=model, router_grpc=grpc_addresses, router_http=base_urls, metrics_url=metrics_urls)
    config["qps"] = None if args.qps is None else [str(q) if math.isinf(q) else q for q in args.qps]  # JSON has no inf
    config.update({key: str(value) for key, value in config.items() if key.startswith("sim_")})
    meta = run_metadata(name, sys.argv, config)
    modes = args.sweep_speculation or [args.speculation]
    sweep = len(rates) > 1 or len(modes) > 1

    def keep_point(point: Point) -> None:
        write_point(args.result_dir, point_stem(name, point), point, meta)

    points, stopped = eventloop.run(
        run_sweep(
            lambda: make_backend(args.backend, addresses, args.timeout, token),
            prompts,
            options,
            spec,
            rates=rates if len(rates) > 1 else None,
            modes=modes,
            slo=slo,
            progress=not args.no_progress,
            metrics_urls=metrics_urls,
            report=keep_point if sweep else None,
        )
    )
    markdown, written = write_results(
        args.result_dir, name, points, meta, slo=slo, stopped=stopped, plots=not args.no_plots
    )
    print(markdown)
    print("wrote " + ", ".join(str(path) for path in written), file=sys.stderr)
    return 0 if any(summary["completed"] for _, summary in points) else 1
