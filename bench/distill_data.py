"""How fast ``specdec distill``'s target writes training data, by dtype and batch size: what ``--data-dtype`` and
``--batch-size`` buy.

The target answers the same ``--prompts`` training prompts of the shipped set (greedy, at most ``--max-tokens``
tokens each, with the feature rows an EAGLE-3 head trains on) through :func:`specdec.distill.data.generate_examples`,
once per (dtype, batch size) in each of ``--repeats`` interleaved repeats: float32 is the target as loaded, bfloat16 a
copy of it (what ``--data-dtype bfloat16`` runs). A cell is response tokens per second (median over repeats) and the
fraction of responses identical to float32's at the same batch size: bfloat16 rounds differently, and a greedy
answer that meets a near-tie follows another path from there (the rows stay the target's, up to bfloat16).

    python -m bench.distill_data --batch-sizes 48,96 --result-dir bench/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.arguments import comma_ints, comma_names
from bench.load.report import run_metadata, write_report
from specdec.distill.data import encode_chat, generate_examples, model_in_dtype
from specdec.distill.prompts import load_prompt_set
from specdec.drafters.eagle_head import eagle3_layers
from specdec.models import load_model, quiet_model_loading
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (dtype, batch size): tokens/s per repeat, and responses identical to float32's."""
    target = load_model(args.target, device=args.device)
    runners = {name: KVRunner(model_in_dtype(target.model, getattr(torch, name))) for name in args.dtypes}
    prompts = [(row.id, encode_chat(target.tokenizer, row.messages)) for row in load_prompt_set("train")]
    prompts = prompts[: args.prompts]
    speeds: dict[tuple[str, int], list[float]] = {}
    responses: dict[tuple[str, int], dict[str, list[int]]] = {}
    for _ in range(args.repeats):
        for batch_size in args.batch_sizes:
            for name, runner in runners.items():
                start, tokens, answers = time.perf_counter(), 0, {}
                for example in generate_examples(
                    runner,
                    target.eos_token_ids,
                    prompts,
                    max_tokens=args.max_tokens,
                    batch_size=batch_size,
                    sampling_for=lambda _: SamplingParams(temperature=0.0),
                    seed=args.seed,
                    fused_layers=eagle3_layers(runner.num_layers),
                ):
                    tokens += example.response_length
                    answers[example.id] = example.token_ids.tolist()
                speeds.setdefault((name, batch_size), []).append(tokens / (time.perf_counter() - start))
                responses[name, batch_size] = answers
                print(f"{name} batch {batch_size}: {speeds[name, batch_size][-1]:.0f} tokens/s", file=sys.stderr)
    rows = []
    for (name, batch_size), samples in speeds.items():
        reference = responses.get(("float32", batch_size))
        answers = responses[name, batch_size]
        same = None if reference is None else sum(answers[key] == reference.get(key) for key in answers) / len(answers)
        rows.append(
            {
                "dtype": name,
                "batch_size": batch_size,
                "tokens_per_s": statistics.median(samples),
                "tokens_per_s_samples": samples,
                "identical_to_float32": same,
            }
        )
    return rows


def markdown(document: dict[str, Any]) -> str:
    environment, config = document["environment"], document["config"]
    rows = document["rows"]
    baseline = next((row for row in rows if row["dtype"] == "float32"), None)
    against = f"× float32 batch {baseline['batch_size']}" if baseline else "×"
    lines = [
        f"# Distillation data: the target's tokens/s by dtype and batch size (`{config['target']}`)",
        "",
        f"{document['date']} · {environment['cpu']} ({environment['cpus']} CPUs, load average "
        f"{environment['load_average'][0]:.2f} before) · torch {environment['versions']['torch']} · specdec "
        f"{environment['versions']['specdec_commit']}",
        "",
        f"Command: `{' '.join(document['command'])}`",
        "",
        f"{config['prompts']} training prompts, greedy, at most {config['max_tokens']} tokens each, with EAGLE-3 "
        f"feature rows; median of {config['repeats']} interleaved repeats.",
        "",
        f"| dtype | batch | response tokens/s | {against} | responses identical to float32's | repeats (tokens/s) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = f"{row['tokens_per_s'] / baseline['tokens_per_s']:.2f}" if baseline else "–"
        same = "–" if row["identical_to_float32"] is None else f"{row['identical_to_float32']:.0%}"
        samples = " ".join(f"{value:.0f}" for value in row["tokens_per_s_samples"])
        lines.append(
            f"| {row['dtype']} | {row['batch_size']} | {row['tokens_per_s']:.0f} | {ratio} | {same} | {samples} |"
        )
    if document["note"]:
        lines += ["", document["note"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.distill_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", type=comma_names, default=["float32", "bfloat16"], help="float32 and/or bfloat16")
    parser.add_argument("--batch-sizes", type=comma_ints, default=[48, 96], help="comma-separated sequences at once")
    parser.add_argument("--prompts", type=int, default=192, help="training prompts answered per run")
    parser.add_argument("--max-tokens", type=int, default=160, help="longest response (specdec distill's default)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="a paragraph for the report")
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="distill-data")
    args = parser.parse_args(argv)
    if not args.dtypes or set(args.dtypes) - {"float32", "bfloat16"}:
        parser.error("--dtypes: give float32, bfloat16 or both")
    quiet_model_loading()
    config = {key: value for key, value in vars(args).items() if key not in ("note", "result_dir", "name")}
    command = ["python", "-m", "bench.distill_data", *(argv if argv is not None else sys.argv[1:])]
    document = {**run_metadata(args.name, command, config), "note": args.note, "rows": measure(args)}
    write_report(args.result_dir, args.name, document, markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
