"""How many requests ``specdec check`` needs to detect a given distortion of the law with 95 % power (SmolLM2-135M).

The check compares a configuration's sample with a speculation-off sample of the same router. A deployment that
distorts the law looks, to the check, like a sample drawn from another law; so the power against a distortion is
measured without any speculation, on the real served stack (:func:`bench.stack.model_stack`: verifier, one ngram
drafter, router as subprocesses): one large pool of speculation-off generations at the reference setting and one
at each distorted setting (T 0.8 instead of 1.0; top-p 0.9 instead of 1.0), ``--tokens`` tokens each, one prompt.
For every sample size ``n`` the check's own statistic (:func:`specdec.check.stats.sequence_test`: per-prefix
tables, tail pooled, χ²/exact, Holm) is run on ``--reps`` random disjoint draws of ``n`` from the pools, and the
power is the fraction rejected at the check's significance — for one configuration alone, and Bonferroni-adjusted
for a whole default run (``--family`` configurations). The level is measured the same way with both samples drawn
from the reference pool. Draws are without replacement from finite pools, so sizes close to the pool size reuse
generations across repetitions (the estimate is then of *this* pool); sizes are capped at pool / 2.

The request rate of speculation on (pipelined ngram) and off, at ``--concurrency``, turns requests into minutes.

    nice -n 5 python -m bench.check_power --pool 1200 --sizes 50,100,200,400,600 --output-dir bench/results

Sampling through the services is slow on a shared CPU, so ``--simulate`` extends the table to large ``n``
without them: it computes the target's exact first-token law at each setting in this process (one forward of the
prompt, :func:`specdec.sampling.logits_to_probs`), reports the exact TV, and draws the samples from those laws —
the check's position-0 table alone (``--tokens`` is ignored), which is where most of its evidence comes from on
a 49k vocabulary; the deeper tables add evidence and multiplicity. Writes ``NAME-simulated.{md,json}``.

    nice -n 5 python -m bench.check_power --simulate --sizes 100,200,400,800,1600,3200 --reps 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.stack import ModelStack, StackOptions, model_stack
from specdec import eventloop
from specdec.check.backends import GrpcBackend, Prompt
from specdec.check.stats import Outcome, bonferroni, empirical_tv, outcome, sequence_test

PROMPT = "Once upon a time, in a small village by the sea,"
REFERENCE = {"temperature": 1.0, "top_p": 1.0}
DISTORTIONS = {
    "T 0.8 vs 1.0": {"temperature": 0.8, "top_p": 1.0},
    "top-p 0.9 vs 1.0": {"temperature": 1.0, "top_p": 0.9},
}


async def draw(
    stack: ModelStack, options: dict, count: int, tokens: int, seed: int, concurrency: int
) -> tuple[list[Outcome], float]:
    """``count`` generations with ``options``; returns the outcomes and the wall time."""
    backend = GrpcBackend(stack.grpc_address, tls=False, bearer_token=None, timeout_s=300)
    semaphore = asyncio.Semaphore(concurrency)
    prompt = Prompt("p", text=PROMPT)

    async def one(index: int) -> Outcome:
        async with semaphore:
            request = options | {"max_tokens": tokens, "seed": seed + index}
            generation = await backend.generate(prompt, chat=False, options=request)
            return outcome(generation.tokens, tokens, generation.finished)

    started = time.perf_counter()
    try:
        outcomes = await asyncio.gather(*(one(index) for index in range(count)))
    finally:
        await backend.close()
    return list(outcomes), time.perf_counter() - started


def power(
    sample_pool: list[Outcome],
    reference_pool: list[Outcome],
    n: int,
    *,
    tokens: int,
    reps: int,
    significance: float,
    family: int,
    seed: int,
) -> dict[str, float]:
    """Fraction of ``reps`` tests rejected (alone / Bonferroni over ``family``) on random draws of ``n`` per side.

    With ``sample_pool is reference_pool`` the two draws are disjoint halves of one shuffle (the level)."""
    rng = random.Random(seed)
    alone = whole = 0
    for rep in range(reps):
        if sample_pool is reference_pool:
            picked = rng.sample(reference_pool, 2 * n)
            sample, reference = picked[:n], picked[n:]
        else:
            sample, reference = rng.sample(sample_pool, n), rng.sample(reference_pool, n)
        p_value = sequence_test(sample, reference, tokens, seed=rep).p_value
        alone += p_value < significance
        whole += bonferroni(p_value, family) < significance
    return {"alone": alone / reps, "family": whole / reps}


def report_markdown(payload: dict) -> str:
    lines = [
        "# How many requests `specdec check` needs (SmolLM2-135M)",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"{payload['machine']}; {payload['date']}. Prompt {json.dumps(PROMPT)}, {payload['tokens']} tokens per "
        f"generation, speculation off, pools of {payload['pool']} generations per law, {payload['reps']} "
        f"repetitions per size, significance {payload['significance']} (alone: one configuration; run: "
        f"Bonferroni over {payload['family']} configurations, the default run's family for one drafter kind).",
        "",
        "Empirical TV between the pools (plug-in estimates, biased upward by sampling noise): "
        + "; ".join(
            f"{name}: first token {d['tv_first']:.3f}, whole outcome {d['tv_outcome']:.3f}"
            for name, d in payload["distortions"].items()
        )
        + f". Reference pool against its own second half (noise floor): first token {payload['tv_noise_first']:.3f}.",
        "",
        "| n per sample | level (alone / run) | "
        + " | ".join(f"power {name} (alone / run)" for name in payload["distortions"])
        + " |",
        "|---|---|" + "---|" * len(payload["distortions"]),
    ]
    for row in payload["rows"]:
        cells = [f"{row['n']}", f"{row['level']['alone']:.2f} / {row['level']['family']:.2f}"]
        cells += [
            f"{row['power'][name]['alone']:.2f} / {row['power'][name]['family']:.2f}" for name in payload["distortions"]
        ]
        lines.append("| " + " | ".join(cells) + " |")
    rates = payload["rates"]
    lines += [
        "",
        f"Request rates at concurrency {payload['concurrency']}: speculation off {rates['off_per_min']:.0f}/min, "
        f"pipelined ngram {rates['on_per_min']:.0f}/min ({payload['tokens']}-token requests).",
        "",
        "A configuration at n per sample costs n speculation-on requests, plus the shared n off and n wrong-law "
        "requests of its (prompt, setting). Smallest tested n reaching 95 % power, and what a default run "
        "(2 prompts × 3 settings × 3 modes, one drafter kind) would cost at that n:",
        "",
        "| distortion | n for 95 % (alone) | n for 95 % (run) | run requests | run minutes |",
        "|---|---|---|---|---|",
    ]
    for name, sizing in payload["sizing"].items():
        lines.append(
            f"| {name} | {sizing['n_alone'] or '> ' + str(payload['rows'][-1]['n'])} | "
            f"{sizing['n_family'] or '> ' + str(payload['rows'][-1]['n'])} | {sizing['run_requests'] or '–'} | "
            f"{sizing['run_minutes'] if sizing['run_minutes'] is not None else '–'} |"
        )
    lines += ["", payload["notes"], ""]
    return "\n".join(lines)


def simulate(args: argparse.Namespace, sizes: list[int], command: str) -> None:
    """Power of the position-0 table on samples drawn from the exact first-token laws (module docstring)."""
    import numpy as np
    import torch

    from specdec.models import load_model
    from specdec.sampling import SamplingParams, logits_to_probs

    target = load_model(args.target)
    ids = torch.tensor([target.tokenizer.encode(PROMPT, add_special_tokens=False)])
    with torch.inference_mode():
        logits = target.model(ids).logits[0, -1].double()

    def law(setting: dict) -> np.ndarray:
        params = SamplingParams(temperature=setting["temperature"], top_p=setting["top_p"])
        probs = logits_to_probs(logits, params).double().numpy()
        return probs / probs.sum()

    reference = law(REFERENCE)
    laws = {name: law(setting) for name, setting in DISTORTIONS.items()}
    rng = np.random.default_rng(0)

    def draws(probs: np.ndarray, n: int) -> list[Outcome]:
        return [(int(token),) for token in rng.choice(len(probs), size=n, p=probs)]

    rows = []
    for n in sizes:
        row: dict = {"n": n, "power": {}}
        for name, probs in [("level", reference), *laws.items()]:
            alone = whole = 0
            for rep in range(args.reps):
                p_value = sequence_test(draws(probs, n), draws(reference, n), 1, seed=rep).p_value
                alone += p_value < args.significance
                whole += bonferroni(p_value, args.family) < args.significance
            row["power"][name] = {"alone": alone / args.reps, "family": whole / args.reps}
        rows.append(row)
        print(json.dumps(row), flush=True)
    tv = {name: float(0.5 * np.abs(probs - reference).sum()) for name, probs in laws.items()}
    sizing = {
        name: {
            key: next((row["n"] for row in rows if row["power"][name][key] >= 0.95), None)
            for key in ("alone", "family")
        }
        for name in laws
    }
    payload = {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "target": args.target,
        "prompt": PROMPT,
        "reps": args.reps,
        "significance": args.significance,
        "family": args.family,
        "exact_tv_first_token": tv,
        "rows": rows,
        "sizing": sizing,
    }
    names = list(laws)
    lines = [
        "# `specdec check` power from the exact first-token laws (SmolLM2-135M, simulated samples)",
        "",
        f"Command: `{command}`",
        "",
        f"{payload['date']}. Prompt {json.dumps(PROMPT)}. Exact first-token TV to the reference (T 1, top-p 1): "
        + "; ".join(f"{name} {value:.4f}" for name, value in tv.items())
        + f". The check's position-0 table only, {args.reps} repetitions per size, significance "
        f"{args.significance} (alone: one configuration; run: Bonferroni over {args.family} configurations).",
        "",
        "| n per sample | level (alone / run) | " + " | ".join(f"power {name} (alone / run)" for name in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for row in rows:
        cells = [str(row["n"])] + [
            f"{row['power'][name]['alone']:.2f} / {row['power'][name]['family']:.2f}" for name in ["level", *names]
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Smallest tested n with power ≥ 0.95 (alone / run): "]
    lines[-1] += "; ".join(
        f"{name}: {sizing[name]['alone'] or '> ' + str(sizes[-1])} / {sizing[name]['family'] or '> ' + str(sizes[-1])}"
        for name in names
    )
    lines.append("")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / f"{args.name}-simulated.json").write_text(json.dumps(payload, indent=2) + "\n")
    (args.output_dir / f"{args.name}-simulated.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=3)
    parser.add_argument("--pool", type=int, default=1200, help="generations per law")
    parser.add_argument("--sizes", default="50,100,200,400,600", help="samples per side to test")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--significance", type=float, default=0.01)
    parser.add_argument("--family", type=int, default=18, help="configurations of a run (Bonferroni)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rate-requests", type=int, default=120, help="requests per rate measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service")
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="check-power")
    parser.add_argument("--simulate", action="store_true", help="exact first-token laws, no services (docstring)")
    args = parser.parse_args(argv)
    command = "nice -n 5 python -m bench.check_power " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.simulate:
        simulate(args, [int(x) for x in args.sizes.split(",")], command)
        return
    sizes = [n for n in (int(x) for x in args.sizes.split(",")) if 2 * n <= args.pool]
    options = StackOptions(
        target=args.target, drafter_kinds=("ngram",), verifier_threads=args.threads, drafter_threads=args.threads
    )
    started = time.perf_counter()
    with model_stack(options) as stack:
        off = {"speculation": "off"}
        reference, off_s = eventloop.run(draw(stack, off | REFERENCE, args.pool, args.tokens, 1, args.concurrency))
        pools = {}
        for index, (name, setting) in enumerate(DISTORTIONS.items(), start=2):
            pools[name], _ = eventloop.run(
                draw(stack, off | setting, args.pool, args.tokens, index * 10**6, args.concurrency)
            )
        on = {"speculation": "pipelined", "drafter": "ngram"} | REFERENCE
        _, on_s = eventloop.run(draw(stack, on, args.rate_requests, args.tokens, 9 * 10**6, args.concurrency))
    sampled_s = time.perf_counter() - started
    rates = {"off_per_min": 60 * args.pool / off_s, "on_per_min": 60 * args.rate_requests / on_s}
    rows = []
    for n in sizes:
        common = {"tokens": args.tokens, "reps": args.reps, "significance": args.significance, "family": args.family}
        row = {"n": n, "level": power(reference, reference, n, seed=n, **common), "power": {}}
        for name, pool in pools.items():
            row["power"][name] = power(pool, reference, n, seed=n + 1, **common)
        rows.append(row)
        print(json.dumps(row), flush=True)
    sizing = {}
    for name in pools:
        n_alone = next((row["n"] for row in rows if row["power"][name]["alone"] >= 0.95), None)
        n_family = next((row["n"] for row in rows if row["power"][name]["family"] >= 0.95), None)
        requests = minutes = None
        if n_family is not None:
            # per (prompt, setting): 3 modes × n on + n off + n wrong law; 2 prompts × 3 settings
            on_requests, off_requests = 6 * 3 * n_family, 6 * 2 * n_family
            requests = on_requests + off_requests
            minutes = round(on_requests / rates["on_per_min"] + off_requests / rates["off_per_min"], 1)
        sizing[name] = {"n_alone": n_alone, "n_family": n_family, "run_requests": requests, "run_minutes": minutes}
    half = len(reference) // 2
    payload = {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), torch threads {args.threads}/service",
        "target": args.target,
        "tokens": args.tokens,
        "pool": args.pool,
        "reps": args.reps,
        "significance": args.significance,
        "family": args.family,
        "concurrency": args.concurrency,
        "sampling_s": sampled_s,
        "rates": rates,
        "tv_noise_first": empirical_tv([o[0] for o in reference[:half]], [o[0] for o in reference[half:]]),
        "distortions": {
            name: {
                "tv_first": empirical_tv([o[0] for o in pool], [o[0] for o in reference]),
                "tv_outcome": empirical_tv(pool, reference),
            }
            for name, pool in pools.items()
        },
        "rows": rows,
        "sizing": sizing,
        "notes": (
            "Power is that of the check's statistic on draws from the two laws; the check itself also spends "
            "requests on greedy identity (prompts × (1 + modes), 32 tokens) and on the wrong-law control."
        ),
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / f"{args.name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (args.output_dir / f"{args.name}.md").write_text(report_markdown(payload))
    print(report_markdown(payload))


if __name__ == "__main__":
    main()
