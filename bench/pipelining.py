"""Pipelining on the real stack: multi-outcome vs single-outcome pre-drafting, and pipelined vs sequential trees.

One verifier, two drafters of ``--drafter-kind`` (default eagle, with its trained head) that differ only in
``--predraft-outcomes`` (1 and ``--outcomes``), and one router per drafter, all subprocesses on 127.0.0.1. Greedy,
float32, EOS honoured, the chat-templated prompts of ``bench/prompts/colocated.jsonl``, one stream; every
configuration runs each prompt once per repeat, configurations interleaved prompt by prompt (so drifting machine
load hits all alike), and each repeat is reported on its own so the noise is visible. Writes
``pipelining-<kind>.json`` and ``.md``.

    python -m bench.pipelining --max-tokens 40 --num-prompts 5 --repeats 2 --output-dir bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.distill.prompts import interleave_categories

if TYPE_CHECKING:
    from specdec.client import Stats


@dataclass(frozen=True)
class Config:
    """One configuration: which router (``multi``: the multi-outcome drafter's) and the request's speculation."""

    name: str
    speculation: str
    multi: bool = False
    tree: bool = False


CONFIGS = (
    Config("off", "off"),
    Config("chain sequential", "sequential"),
    Config("chain pipelined, 1 outcome", "pipelined"),
    Config("chain pipelined, multi-outcome", "pipelined", multi=True),
    Config("tree sequential", "sequential", tree=True),
    Config("tree pipelined, 1 outcome", "pipelined", tree=True),
    Config("tree pipelined, multi-outcome", "pipelined", multi=True, tree=True),
)


@dataclass
class Tally:
    """One configuration's sums over the requests of one repeat."""

    tokens: int = 0
    e2e_s: float = 0.0
    rounds: int = 0
    hits: int = 0
    rejection_hits: int = 0
    misses: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, token_ids: list[int], e2e_s: float, stats: Stats) -> None:
        self.tokens += len(token_ids)
        self.e2e_s += e2e_s
        self.rounds += stats.rounds
        self.hits += stats.pipeline_hits
        self.rejection_hits += stats.pipeline_rejection_hits
        self.misses += stats.pipeline_misses
        self.outputs.append(list(token_ids))

    def summary(self) -> dict:
        pipelined = self.hits + self.misses
        return {
            "tokens": self.tokens,
            "wall_s": round(self.e2e_s, 3),
            "tokens_per_s": round(self.tokens / self.e2e_s, 3) if self.e2e_s else None,
            "rounds": self.rounds,
            "tokens_per_round": round(self.tokens / self.rounds, 3) if self.rounds else None,
            "pipelined_rounds": pipelined,
            "hit_rate": round(self.hits / pipelined, 3) if pipelined else None,
            "full_hit_rate": round((self.hits - self.rejection_hits) / pipelined, 3) if pipelined else None,
            "rejection_hit_rate": round(self.rejection_hits / pipelined, 3) if pipelined else None,
        }


def options(config: Config, args: argparse.Namespace) -> dict:
    base = {"max_tokens": args.max_tokens, "temperature": 0.0, "speculation": config.speculation}
    if config.speculation == "off":
        return base
    base |= {"drafter": args.drafter_kind, "num_draft_tokens": args.tree_depth if config.tree else args.gamma}
    return base | (
        {"tree_width": args.tree_width, "tree_budget": args.tree_budget} if config.tree else {"tree_width": 1}
    )


def fmt(value: object) -> str:
    """A table cell: two decimals for a float, – for None."""
    return "–" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def machine_meta(module: str, argv: list[str] | None, load_before: str) -> dict:
    """When, on what and by which command a bench ran (``load_before``: the load average at its start)."""
    import torch

    from bench.load.report import cpu_model

    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_average(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:]),
    }


def load_average() -> str:
    return "/".join(f"{value:.2f}" for value in os.getloadavg())


def report(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Pipelining on `{meta['target']}` with the {meta['drafter_kind']} drafter",
        "",
        f"{meta['date']} · {meta['cpu']} ({meta['cpus']} CPUs, load {meta['load_before']} before, "
        f"{meta['load_after']} after; the machine is shared) · Python {meta['python']} · torch {meta['torch']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Greedy, float32, EOS honoured, max {meta['max_tokens']} new tokens, {meta['num_prompts']} chat prompts, "
        f"1 stream, {meta['repeats']} interleaved repeats. Chains: γ = {meta['gamma']}; trees: depth "
        f"{meta['tree_depth']}, width {meta['tree_width']}, at most {meta['tree_budget']} nodes. "
        f"Multi-outcome: the drafter pre-drafts for full acceptance and {meta['outcomes'] - 1} rejection verdicts "
        f"(`--predraft-outcomes {meta['outcomes']}`). Torch threads: verifier 1, each drafter 1.",
        "",
        f"Greedy outputs identical to speculation off in every configuration and repeat: "
        f"**{'yes' if meta['all_identical'] else 'NO'}**.",
        "",
        "| repeat | configuration | tokens | wall s | tokens/s | tokens/round | pipelined rounds | hit rate | "
        "full-acceptance hits | rejection-outcome hits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    for row in rows:
        lines.append(
            f"| {row['repeat']} | {row['config']} | {row['tokens']} | {fmt(row['wall_s'])} | "
            f"{fmt(row['tokens_per_s'])} | {fmt(row['tokens_per_round'])} | {row['pipelined_rounds']} | "
            f"{fmt(row['hit_rate'])} | {fmt(row['full_hit_rate'])} | {fmt(row['rejection_hit_rate'])} |"
        )
    lines += [
        "",
        "tokens/s = output tokens / Σ end-to-end request time (client-measured). Hit rates are per pipelined round "
        "(hits + misses): a full-acceptance hit verifies the proposal pre-drafted on the whole assumed path, a "
        "rejection-outcome hit the one pre-drafted for the verdict that came (accepted prefix + the guessed "
        "correction). Every miss cancels its pre-draft in the drafter and commits at once.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter-kind", choices=("eagle", "early-exit"), default="eagle")
    parser.add_argument("--draft-model", help="eagle: the head directory (default: the head cached for --target)")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=4, help="chain length")
    parser.add_argument("--tree-depth", type=int, default=3)
    parser.add_argument("--tree-width", type=int, default=2)
    parser.add_argument("--tree-budget", type=int, default=6)
    parser.add_argument("--outcomes", type=int, default=3, help="--predraft-outcomes of the multi-outcome drafter")
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "specdec-bench-pipelining")
    args = parser.parse_args(argv)

    from bench.colocated import PROMPTS, load_prompts
    from bench.services import Services
    from specdec.cli import encode_prompt
    from specdec.client import Client
    from specdec.models import load_model, quiet_model_loading

    quiet_model_loading()
    load_before = load_average()
    with Services(args.log_dir) as services:
        verifier = services.spawn(
            "verifier", "verifier_service", ["--model", args.target, "--dtype", "float32", "--torch-threads", "1"]
        )
        drafter_args = ["--kind", args.drafter_kind, "--target", args.target, "--torch-threads", "1"]
        drafter_args += ["--draft-model", args.draft_model] if args.draft_model else []
        drafters = {
            multi: services.spawn(
                f"drafter-{'multi' if multi else 'single'}",
                "drafter_service",
                [*drafter_args, "--predraft-outcomes", str(args.outcomes if multi else 1)],
            )
            for multi in (False, True)
        }
        target = load_model(args.target)
        rows = interleave_categories(load_prompts(PROMPTS, None), args.num_prompts)
        prompts = [encode_prompt(target, row["prompt"], chat=True) for _, row in rows]
        routers = {}
        for multi, drafter in drafters.items():
            router_args = ["--model", args.target, "--grpc-port", "0", "--http-port", "0"]
            router_args += [
                "--verifier",
                verifier.wait_ready()["address"],
                "--drafter",
                drafter.wait_ready()["address"],
            ]
            routers[multi] = services.start(f"router-{'multi' if multi else 'single'}", "router", router_args)
        clients = {multi: Client(router.ready["grpc"], timeout_s=600) for multi, router in routers.items()}
        try:
            for config in CONFIGS:  # warm-up, uncounted
                clients[config.multi].generate(prompt_ids=prompts[0][:16], **options(config, args) | {"max_tokens": 4})
            tallies = {(repeat, config.name): Tally() for repeat in range(args.repeats) for config in CONFIGS}
            for repeat in range(args.repeats):
                for ids in prompts:
                    for config in CONFIGS:
                        started = time.perf_counter()
                        result = clients[config.multi].generate(prompt_ids=ids, **options(config, args))
                        tallies[repeat, config.name].add(result.token_ids, time.perf_counter() - started, result.stats)
                print(f"repeat {repeat} done", flush=True)
        finally:
            for client in clients.values():
                client.close()

    reference = {repeat: tallies[repeat, "off"].outputs for repeat in range(args.repeats)}
    table = [
        {"repeat": repeat, "config": name, **tally.summary(), "same_as_off": tally.outputs == reference[repeat]}
        for (repeat, name), tally in tallies.items()
    ]
    meta = {
        "target": args.target,
        "drafter_kind": args.drafter_kind,
        **machine_meta("bench.pipelining", argv, load_before),
        "max_tokens": args.max_tokens,
        "num_prompts": len(prompts),
        "repeats": args.repeats,
        "gamma": args.gamma,
        "tree_depth": args.tree_depth,
        "tree_width": args.tree_width,
        "tree_budget": args.tree_budget,
        "outcomes": args.outcomes,
        "all_identical": all(row["same_as_off"] for row in table),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stem = args.output_dir / f"pipelining-{args.drafter_kind}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": table}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(report(meta, table))
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
