"""Adaptive speculation co-located: speculation off vs a fixed γ vs ``auto`` (the goodput controller), by batch size.

The trained eagle head (``--draft-model``, default the cached head of the target) drafts; the held-out prompts of the
distillation set go through the chat template in groups of ``--batch-sizes`` (a group is one ``Engine.generate``
call: every sequence of the group verified in one forward per round, the co-located analogue of load). One engine per
configuration lives through the whole run, so ``auto``'s controller learns from every group as a server's would;
configurations are interleaved group by group (drifting machine load hits all alike), after one uncounted warm-up
group each. Greedy outputs must be identical across configurations (they are checked), sampled ones follow the
same law. Writes ``adaptive.json`` and ``adaptive.md`` into ``--output-dir``.

    python -m bench.adaptive --num-prompts 16 --max-tokens 64 --batch-sizes 1,8 --output-dir bench/results
    python -m bench.adaptive ... --tree-width 3 --tree-depth 3 --tree-budget 4   # a tree, fixed and under auto, too
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from bench.eagle import heldout_prompts
from specdec.adaptive import SpeculationController
from specdec.drafters import DraftConfig, build_drafter
from specdec.engine import Engine, GenerationRequest
from specdec.models import load_model, quiet_model_loading
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams

SAMPLINGS = {"greedy": SamplingParams(temperature=0.0), "T=0.7": SamplingParams(temperature=0.7)}


def engines(target, draft_model: str | None, gamma: int, tree: DraftConfig | None = None) -> dict[str, Engine]:
    """Speculation off, eagle at a fixed γ, eagle with γ chosen every round (up to the same γ); with a ``tree``
    shape, that tree fixed and under ``auto`` too (a greedy tree cut to its best nodes by rank every round)."""

    def eagle(config: DraftConfig) -> object:
        return build_drafter("eagle", target, config, draft_model=draft_model)

    def engine(drafter=None, controller=None) -> Engine:
        return Engine(KVRunner(target.model), target.eos_token_ids, drafter, controller)

    chain = DraftConfig(num_draft_tokens=gamma)
    configs = {
        "off": engine(),
        f"eagle γ={gamma}": engine(eagle(chain)),
        f"eagle auto (γ≤{gamma})": engine(eagle(chain), SpeculationController(gamma)),
    }
    if tree is not None:
        shape = f"d{tree.num_draft_tokens} w{tree.tree_width} b{tree.max_nodes}"
        configs[f"eagle tree {shape}"] = engine(eagle(tree))
        configs[f"eagle tree auto ({shape})"] = engine(eagle(tree), SpeculationController(tree.num_draft_tokens))
    return configs


def run_point(
    configs: dict[str, Engine], groups: list[list[list[int]]], params: SamplingParams, max_tokens: int
) -> dict[str, dict[str, Any]]:
    """Every configuration on every group (interleaved); tokens/s, rounds and the draft lengths chosen."""
    totals = {name: {"tokens": 0, "seconds": 0.0, "rounds": 0, "accepted": 0, "sizes": Counter()} for name in configs}
    outputs: dict[str, list[list[int]]] = {name: [] for name in configs}

    def generate(engine: Engine, group: list[list[int]], first_seed: int):
        requests = [GenerationRequest(ids, params, max_tokens, seed=first_seed + i) for i, ids in enumerate(group)]
        started = time.perf_counter()
        results = engine.generate(requests)
        return results, time.perf_counter() - started

    for engine in configs.values():  # warm-up, not counted (auto's controller learns from it, as a server's would)
        generate(engine, groups[0], 0)
    for index, group in enumerate(groups):
        for name, engine in configs.items():
            results, seconds = generate(engine, group, 1000 * index)
            total = totals[name]
            total["seconds"] += seconds
            for result in results:
                total["tokens"] += len(result.token_ids)
                total["rounds"] += result.stats.rounds
                total["accepted"] += result.stats.accepted_tokens
                total["sizes"].update(dict(enumerate(result.stats.rounds_per_draft_size)))
                outputs[name].append(result.token_ids)
    if params.greedy:
        reference = outputs["off"]
        for name, produced in outputs.items():
            if produced != reference:
                raise AssertionError(f"{name}: greedy output differs from speculation off")
    off = totals["off"]["tokens"] / totals["off"]["seconds"]
    rows = {}
    for name, total in totals.items():
        rate = total["tokens"] / total["seconds"]
        sizes = {str(size): count for size, count in sorted(total["sizes"].items()) if count}
        rows[name] = {
            "tokens_per_s": round(rate, 2),
            "vs_off": round(rate / off, 3),
            "mean_accepted_length": round(1 + total["accepted"] / total["rounds"], 3) if total["rounds"] else None,
            "rounds_per_draft_size": sizes,
        }
    return rows


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        "# Adaptive speculation, co-located (off vs fixed γ vs auto)",
        "",
        f"`{payload['command']}`",
        "",
        f"{payload['num_prompts']} held-out prompts, {payload['max_tokens']} tokens, {payload['threads']} threads; "
        "configurations interleaved group by group; greedy outputs checked identical.",
        "",
        "| batch | sampling | configuration | tokens/s | vs off | mean accepted length | rounds per draft size |",
        "|---|---|---|---|---|---|---|",
    ]
    for point in payload["points"]:
        for name, row in point["rows"].items():
            sizes = ", ".join(f"{size}: {count}" for size, count in row["rounds_per_draft_size"].items())
            length = row["mean_accepted_length"]
            lines.append(
                f"| {point['batch']} | {point['sampling']} | {name} | {row['tokens_per_s']:.1f} | "
                f"{row['vs_off']:.2f}× | {'–' if length is None else f'{length:.2f}'} | {sizes} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.adaptive", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft-model", help="eagle head directory (default: the cached head of --target)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--tree-width", type=int, default=1, help="children per node of a tree row too (1: none)")
    parser.add_argument("--tree-depth", type=int, default=3)
    parser.add_argument("--tree-budget", type=int, default=0, help="the tree's nodes (0: width x depth)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--samplings", default="greedy,T=0.7", help=f"comma-separated of {', '.join(SAMPLINGS)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_model_loading()
    target = load_model(args.target)
    prompts = [prompt.token_ids for prompt in heldout_prompts(target, args.num_prompts)]
    tree = None
    if args.tree_width > 1:
        tree = DraftConfig(num_draft_tokens=args.tree_depth, tree_width=args.tree_width, tree_budget=args.tree_budget)
    configs = engines(target, args.draft_model, args.num_draft_tokens, tree)
    payload: dict[str, Any] = {
        "command": "python -m bench.adaptive " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "points": [],
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for batch in (int(size) for size in args.batch_sizes.split(",")):
        groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        for sampling in args.samplings.split(","):
            rows = run_point(configs, groups, SAMPLINGS[sampling], args.max_tokens)
            payload["points"].append({"batch": batch, "sampling": sampling, "rows": rows})
            print(f"batch {batch} {sampling}: {json.dumps(rows)}", file=sys.stderr, flush=True)
            (args.output_dir / "adaptive.json").write_text(json.dumps(payload, indent=2) + "\n")
            (args.output_dir / "adaptive.md").write_text(markdown(payload))


if __name__ == "__main__":
    main()
