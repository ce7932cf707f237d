"""Comparisons on the real stack, each in one run: a QPS sweep with speculation off vs on, a γ sweep checked
against the cost model, and chain vs tree at the same verify budget (DESIGN §7).

Starts :func:`bench.stack.model_stack` (verifier, n-gram and early-exit drafters, router as loopback
subprocesses) and drives it with the load generator (:mod:`bench.load`).

* **QPS sweep** (``qps``): open-loop Poisson arrivals at each ``--qps`` rate, ``off`` and ``pipelined``
  interleaved at every rate, until saturation; the target QPS of each mode under ``--slo-ttft-ms`` /
  ``--slo-itl-ms``. Written by the bench's own report as ``NAME-qps-sweep.*`` (plus one file per point).

The other two sections run at concurrency 1 (low-load latency: one request in
flight, so round times are the configuration's own, not queueing). Every configuration runs the same
prompts: the measured requests are split into blocks and the configurations take turns block by block, so
drift in the machine's load hits all of them alike.

* **γ sweep** (n-gram drafter, ``sequential`` rounds, greedy): per γ the measured α (accepted / drafted),
  tokens committed per round, round time and ms per committed token, next to the cost model's
  ``E[N] = 1 + α + … + α^γ`` and ``round time / E[N]`` with the round time fitted as ``fixed + per_token · γ``
  (:mod:`bench.cost_model`); the best γ measured vs predicted.
* **chain vs tree** (early-exit drafter, sequential, ``--tree-temperature``): a chain of γ = B tokens against
  trees with B nodes, i.e. the same number of positions verified per round.

    python -m bench.compare --sections qps,gamma,tree --qps 0.25,0.5,1,1.5 --duration 60 \\
        --slo-ttft-ms 3000 --slo-itl-ms 250 --blocks 3 --block-size 4 --result-dir bench/results

Writes ``NAME.json`` and ``NAME.md`` (γ and tree sections) and the QPS sweep's files.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.cost_model import expected_tokens_per_round, fit_round_cost, predicted_ms_per_token
from bench.stack import StackOptions, model_stack
from specdec import eventloop

GAMMAS = (1, 2, 3, 4, 6, 8)


@dataclass(frozen=True)
class Config:
    """One configuration of a comparison: a label and the request options it overrides."""

    label: str
    overrides: dict[str, Any]


def gamma_configs(gammas: tuple[int, ...]) -> list[Config]:
    base = {"speculation": "sequential", "drafter": "ngram", "tree_width": 1}
    return [Config("off", {"speculation": "off"})] + [
        Config(f"γ={gamma}", {**base, "num_draft_tokens": gamma}) for gamma in gammas
    ]


def tree_configs(budget: int) -> list[Config]:
    """A chain of ``budget`` tokens, a flat tree of ``budget`` siblings, and a width-2 tree of ``budget`` nodes."""
    base = {"speculation": "sequential", "drafter": "early-exit"}
    return [
        Config("off", {"speculation": "off"}),
        Config(f"chain γ={budget}", {**base, "num_draft_tokens": budget, "tree_width": 1}),
        Config(
            f"tree width {budget} depth 1", {**base, "num_draft_tokens": 1, "tree_width": budget, "tree_budget": budget}
        ),
        Config(
            f"tree width 2 depth {budget - 1}, {budget} nodes",
            {**base, "num_draft_tokens": budget - 1, "tree_width": 2, "tree_budget": budget},
        ),
    ]


async def run_interleaved(
    grpc_address: str, prompts: list, options: Any, configs: list[Config], blocks: int, block_size: int
) -> dict[str, dict[str, Any]]:
    """Every config on the same prompts, block by block in turn; returns each config's merged summary."""
    from bench.load.backends import GrpcBackend
    from bench.load.runner import LoadRun, LoadSpec, run_load
    from bench.load.summary import summarize

    runs: dict[str, list[LoadRun]] = {config.label: [] for config in configs}
    for block in range(blocks):
        spec = LoadSpec(concurrency=1, num_requests=block_size, warmup_requests=1 if block == 0 else 0, seed=block)
        for config in configs:
            config_options = replace(options, **config.overrides)
            run = await run_load(GrpcBackend(grpc_address), prompts, config_options, spec, progress=False)
            runs[config.label].append(run)
            done = sum(record.ok for record in run.measured)
            print(f"  block {block} {config.label}: {done}/{block_size} in {run.duration_s:.1f} s", flush=True)
    summaries = {}
    for label, parts in runs.items():
        merged = replace(
            parts[0],
            records=[record for run in parts for record in run.records],
            duration_s=sum(run.duration_s for run in parts),
            label=label,
        )
        summaries[label] = summarize(merged)
    return summaries


def _f(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def ms_per_token(summary: dict[str, Any]) -> float | None:
    wall, tokens = summary["wall_ms_per_round"], summary["tokens_per_round"]
    return wall / tokens if wall and tokens else None


def gamma_analysis(summaries: dict[str, dict[str, Any]], gammas: tuple[int, ...]) -> dict[str, Any]:
    """The cost model with measured α and fitted round costs, beside the measured numbers, per γ."""
    measured = {gamma: summaries[f"γ={gamma}"] for gamma in gammas}
    cost = fit_round_cost(list(gammas), [measured[g]["wall_ms_per_round"] for g in gammas])
    drafted = sum(s["draft_tokens"] for s in measured.values())
    pooled_alpha = sum(s["accepted_tokens"] for s in measured.values()) / drafted if drafted else 0.0
    rows = []
    for gamma in gammas:
        s = measured[gamma]
        alpha = s["acceptance_rate"] or 0.0
        rows.append(
            {
                "gamma": gamma,
                "alpha": alpha,
                "drafted_per_round": s["draft_tokens"] / s["num_rounds"] if s["num_rounds"] else None,
                "tokens_per_round": s["tokens_per_round"],
                "model_tokens_per_round": expected_tokens_per_round(alpha, gamma),
                "round_ms": s["wall_ms_per_round"],
                "fitted_round_ms": cost.round_ms(gamma),
                "ms_per_token": ms_per_token(s),
                "model_ms_per_token": predicted_ms_per_token(alpha, gamma, cost),
                "pooled_model_ms_per_token": predicted_ms_per_token(pooled_alpha, gamma, cost),
                "output_throughput": s["output_throughput"],
            }
        )
    best_measured = min(rows, key=lambda row: row["ms_per_token"] or float("inf"))["gamma"]
    best_model = min(rows, key=lambda row: row["model_ms_per_token"])["gamma"]
    best_pooled = min(rows, key=lambda row: row["pooled_model_ms_per_token"])["gamma"]
    return {
        "cost": {"fixed_ms": cost.fixed_ms, "per_token_ms": cost.per_token_ms},
        "pooled_alpha": pooled_alpha,
        "rows": rows,
        "best_gamma": {"measured": best_measured, "model": best_model, "model_pooled_alpha": best_pooled},
    }


def gamma_markdown(analysis: dict[str, Any], off: dict[str, Any]) -> str:
    cost = analysis["cost"]
    lines = [
        "### γ sweep (n-gram, sequential rounds, greedy, concurrency 1)",
        "",
        f"Round cost fitted over the measured γ: {cost['fixed_ms']:.1f} ms + {cost['per_token_ms']:.2f} ms · γ. "
        f"Pooled α = {analysis['pooled_alpha']:.3f}. Speculation off: {_f(off['output_throughput'], '.1f')} tok/s, "
        f"{_f(ms_per_token(off), '.1f')} ms/token.",
        "",
        "| γ | α measured | drafted/round | E[N] measured | E[N] model | round ms | fitted round ms "
        "| ms/token measured | ms/token model | ms/token model (pooled α) | tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in analysis["rows"]:
        lines.append(
            f"| {row['gamma']} | {row['alpha']:.3f} | {_f(row['drafted_per_round'])} | {_f(row['tokens_per_round'])} "
            f"| {row['model_tokens_per_round']:.2f} | {_f(row['round_ms'], '.1f')} | {row['fitted_round_ms']:.1f} "
            f"| {_f(row['ms_per_token'], '.1f')} | {row['model_ms_per_token']:.1f} "
            f"| {row['pooled_model_ms_per_token']:.1f} | {_f(row['output_throughput'], '.1f')} |"
        )
    best = analysis["best_gamma"]
    lines += [
        "",
        f"Best γ: measured {best['measured']}, model with each γ's α {best['model']}, "
        f"model with the pooled α {best['model_pooled_alpha']}.",
    ]
    return "\n".join(lines) + "\n"


def tree_markdown(summaries: dict[str, dict[str, Any]], budget: int, temperature: float) -> str:
    lines = [
        f"### chain vs tree at {budget} verified positions (early-exit drafter, sequential, "
        f"temperature {temperature:g}, concurrency 1)",
        "",
        "| configuration | drafted/round | mean acc. len | tokens/round | acceptance rate | draft ms/round "
        "| verify ms/round | ms/token | tok/s | p95 ITL ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, s in summaries.items():
        drafted = s["draft_tokens"] / s["num_rounds"] if s["num_rounds"] else None
        lines.append(
            f"| {label} | {_f(drafted)} | {_f(s['mean_accepted_length'])} | {_f(s['tokens_per_round'])} "
            f"| {_f(s['acceptance_rate'], '.3f')} | {_f(s['draft_ms_per_round'], '.1f')} "
            f"| {_f(s['verify_ms_per_round'], '.1f')} | {_f(ms_per_token(s), '.1f')} "
            f"| {_f(s['output_throughput'], '.1f')} | {_f(s['p95_itl_ms'], '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def qps_sweep(stack: Any, args: argparse.Namespace, prompts: list, options: Any) -> dict[str, Any]:
    """Open-loop sweep, off vs pipelined interleaved, through the bench's own sweep and report."""
    from bench.load.backends import GrpcBackend
    from bench.load.cli import default_prompts
    from bench.load.report import point_stem, run_metadata, targets, write_point, write_results
    from bench.load.runner import LoadSpec
    from bench.load.summary import Slo
    from bench.load.sweep import run_sweep

    rates = [float(rate) for rate in args.qps.split(",")]
    slo = Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=None, itl_ms=args.slo_itl_ms)
    spec = LoadSpec(qps=rates[0], duration_s=args.duration, warmup_requests=2, seed=0)
    name = f"{args.name}-qps"
    labels = {
        "model": StackOptions().target,
        "backend": "grpc",
        "prompts": str(args.prompts or default_prompts()),
        "max_tokens": options.max_tokens,
        "temperature": options.temperature,
        "ignore_eos": options.ignore_eos,
        "seed": spec.seed,
        "result_dir": str(args.result_dir),
    }
    meta = run_metadata(name, sys.argv, vars(args) | labels)

    def finished(point: Any) -> None:
        write_point(args.result_dir, point_stem(name, point), point, meta)
        print(f"  {point[1]['label']}: {point[1]['completed']} done", flush=True)

    points, stopped = eventloop.run(
        run_sweep(
            lambda: GrpcBackend(stack.grpc_address),
            prompts,
            options,
            spec,
            rates=rates,
            modes=["off", "pipelined"],
            slo=slo,
            progress=False,
            metrics_urls=[f"{stack.base_url}/metrics"],
            report=finished,
        )
    )
    write_results(args.result_dir, name, points, meta, slo=slo, stopped=stopped)
    return {"target_qps": targets(points, slo), "stopped": stopped}


def _brief(summary: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in summary.items() if key not in ("input_lens", "output_lens", "ttfts", "itls")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="qps,gamma,tree", help="comma-separated: qps, gamma, tree")
    parser.add_argument("--qps", default="0.25,0.5,1,1.5,2", help="QPS sweep rates")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per QPS point")
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=250.0)
    parser.add_argument("--qps-categories", help="prompt categories of the QPS sweep (default: all)")
    parser.add_argument("--gammas", default=",".join(map(str, GAMMAS)))
    parser.add_argument("--tree-budget", type=int, default=3, help="verified positions per round, chain and trees")
    parser.add_argument("--tree-temperature", type=float, default=0.0)
    parser.add_argument("--early-exit-layers", type=int, default=15)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, help="the verifier's per-forward token budget")
    parser.add_argument("--max-concurrent-requests", type=int, default=64, help="the router's running cap")
    parser.add_argument("--device", default="cpu", help="torch device of the verifier and the model drafters")
    parser.add_argument("--dtype", default="float32", help="dtype of the verifier and the model drafters")
    parser.add_argument("--categories", default="chat,summarise,rewrite,code")
    parser.add_argument("--prompts", type=Path)
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="compare")
    args = parser.parse_args(argv)
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    gammas = tuple(int(g) for g in args.gammas.split(","))

    from bench.load.cli import default_prompts
    from bench.load.report import run_metadata
    from bench.load.workload import RequestOptions, load_prompts

    prompts = load_prompts(args.prompts or default_prompts(), args.categories.split(","))
    options = RequestOptions(max_tokens=args.max_tokens, temperature=0.0, seed=0)
    kinds = ("ngram", "early-exit") if "tree" in sections else ("ngram",)
    stack_options = StackOptions(
        device=args.device,
        dtype=args.dtype,
        drafter_kinds=kinds,
        early_exit_layers=args.early_exit_layers,
        max_batch_tokens=args.max_batch_tokens,
        max_concurrent_requests=args.max_concurrent_requests,
    )
    document: dict[str, Any] = run_metadata(args.name, sys.argv, vars(args) | {"result_dir": str(args.result_dir)})
    parts = [f"# Comparisons ({document['date']})", "", f"Command: `{' '.join(sys.argv)}`", ""]
    with model_stack(stack_options) as stack:
        if "qps" in sections:
            print("QPS sweep", flush=True)
            categories = args.qps_categories.split(",") if args.qps_categories else None
            sweep = qps_sweep(stack, args, load_prompts(args.prompts or default_prompts(), categories), options)
            document["qps"] = sweep
            parts.append(f"QPS sweep: see `{args.name}-qps-sweep.md`; target QPS {sweep['target_qps']}.\n")
        if "gamma" in sections:
            print("γ sweep", flush=True)
            summaries = eventloop.run(
                run_interleaved(
                    stack.grpc_address, prompts, options, gamma_configs(gammas), args.blocks, args.block_size
                )
            )
            analysis = gamma_analysis(summaries, gammas)
            document["gamma"] = {"analysis": analysis, "summaries": {k: _brief(v) for k, v in summaries.items()}}
            parts.append(gamma_markdown(analysis, summaries["off"]))
        if "tree" in sections:
            print("chain vs tree", flush=True)
            tree_options = replace(options, temperature=args.tree_temperature)
            summaries = eventloop.run(
                run_interleaved(
                    stack.grpc_address,
                    prompts,
                    tree_options,
                    tree_configs(args.tree_budget),
                    args.blocks,
                    args.block_size,
                )
            )
            document["tree"] = {k: _brief(v) for k, v in summaries.items()}
            parts.append(tree_markdown(summaries, args.tree_budget, args.tree_temperature))
    environment = document["environment"]
    parts.append(f"Environment: `{json.dumps(environment)}`\n")
    markdown = "\n".join(parts)
    args.result_dir.mkdir(parents=True, exist_ok=True)
    (args.result_dir / f"{args.name}.md").write_text(markdown)
    (args.result_dir / f"{args.name}.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
