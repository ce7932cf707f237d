"""How fast ``specdec distill`` computes, by dtype: its target writing training data (by batch size too) and its head
training on them: what ``--data-dtype``, ``--batch-size`` and ``--train-dtype`` buy.

The target answers the same ``--prompts`` training prompts of the shipped set (greedy, at most ``--max-tokens``
tokens each, with the feature rows an EAGLE-3 head trains on) through :func:`specdec.distill.data.generate_examples`,
once per (dtype, batch size) in each of ``--repeats`` interleaved repeats: float32 is the target as loaded, bfloat16 a
copy of it (what ``--data-dtype bfloat16`` runs). A cell is response tokens per second (median over repeats) and the
fraction of responses identical to float32's at the same batch size: bfloat16 rounds differently, and a greedy
answer that meets a near-tie follows another path from there (the rows stay the target's, up to bfloat16).

Then a fresh EAGLE-3 head (``specdec distill``'s defaults) trains ``--train-steps`` steps on float32's examples (or,
with ``--cached-data``, on the data ``specdec distill`` cached, and no data section) in each dtype (bfloat16: under
autocast), in each repeat, the same batches in the same order: steps/s and response tokens trained per second. Prompts
are taken evenly spaced over the shipped set, which is sorted by category: its first hundred are all short chat
prompts, whose rows are nearly all response, and training cost depends on the share of prompt rows. The report
also gives :func:`~specdec.distill.dtypes.bfloat16_speedup` as measured here and what ``auto`` chooses from it for
``--data-dtype`` and ``--train-dtype``.

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
from specdec.cache import distill_data_dir
from specdec.distill.data import Example, encode_chat, generate_examples, read_shards
from specdec.distill.dtypes import (
    GENERATION_ROWS,
    TRAINING_ROWS,
    bfloat16_speedup,
    dtype_name,
    generation_dtype,
    model_in_dtype,
    training_dtype,
)
from specdec.distill.prompts import load_prompt_set
from specdec.distill.train import TrainConfig, choose_draft_vocab, make_batches, train
from specdec.drafters.eagle_head import EagleHead, eagle3_layers
from specdec.models import LoadedModel, load_model, quiet_model_loading
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams


def measure(args: argparse.Namespace, target: LoadedModel) -> tuple[list[dict[str, Any]], list[Example]]:
    """One row per (dtype, batch size): tokens/s per repeat, and responses identical to float32's; and the examples
    float32 wrote at its largest batch size (what the training section trains on)."""
    runners = {name: KVRunner(model_in_dtype(target.model, getattr(torch, name))) for name in args.dtypes}
    prompts = [(row.id, encode_chat(target.tokenizer, row.messages)) for row in load_prompt_set("train")]
    prompts = prompts[:: max(1, len(prompts) // args.prompts)][: args.prompts]  # every category: the set is sorted
    speeds: dict[tuple[str, int], list[float]] = {}
    responses: dict[tuple[str, int], dict[str, list[int]]] = {}
    examples: list[Example] = []
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
                    if name == "float32" and batch_size == max(args.batch_sizes) and len(examples) < len(prompts):
                        examples.append(example)
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
    return rows, examples


def measure_training(args: argparse.Namespace, target: LoadedModel, examples: list[Example]) -> list[dict[str, Any]]:
    """One row per dtype: a fresh head's ``--train-steps`` steps on ``examples``, timed in each repeat."""
    vocab = choose_draft_vocab(examples, args.draft_vocab, target.vocab_size, sorted(target.eos_token_ids))
    layers = eagle3_layers(int(target.model.config.num_hidden_layers))
    batches = make_batches(examples, TrainConfig.batch_tokens, TrainConfig.max_length, fused=True)
    tokens = sum(batch.num_tokens for batch in batches)
    seconds: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name in args.dtypes:
            head = EagleHead.from_target(target.model, vocab, feature_layers=layers)
            config = TrainConfig(
                steps=args.train_steps,
                bf16=name == "bfloat16",
                eval_every=args.train_steps + 1,
                unroll_steps=args.unroll_steps,
            )
            start = time.perf_counter()
            train(head, batches, [], config)
            seconds.setdefault(name, []).append(time.perf_counter() - start)
            print(f"training in {name}: {args.train_steps / seconds[name][-1]:.2f} steps/s", file=sys.stderr)
    tokens_per_step = tokens / len(batches)
    return [
        {
            "dtype": name,
            "steps_per_s": args.train_steps / statistics.median(samples),
            "tokens_per_s": args.train_steps * tokens_per_step / statistics.median(samples),
            "steps_per_s_samples": [args.train_steps / value for value in samples],
        }
        for name, samples in seconds.items()
    ]


def measure_all(args: argparse.Namespace) -> dict[str, Any]:
    """The data rows, the training rows (unless ``--train-steps 0``), and what ``auto`` picks on this machine."""
    target = load_model(args.target, device=args.device)
    speedups = {"decode": bfloat16_speedup(target.model), "training": bfloat16_speedup(target.model, TRAINING_ROWS)}
    if args.cached_data:  # the data specdec distill wrote, as it trains on it
        rows, examples = [], read_shards(distill_data_dir(args.target) / "train")[: args.prompts]
        if not examples:
            raise SystemExit(f"no cached training data for {args.target}: run specdec distill first")
    else:
        rows, examples = measure(args, target)
    return {
        "training_examples": len(examples),
        "rows": rows,
        "training_rows": measure_training(args, target, examples) if args.train_steps > 0 else [],
        "bfloat16_speedup": speedups,
        "auto_data_dtype": dtype_name(generation_dtype("auto", target.model, lambda _: speedups["decode"])),
        "auto_train_dtype": dtype_name(training_dtype("auto", target.model, lambda _: speedups["training"])),
    }


def markdown(document: dict[str, Any]) -> str:
    environment, config = document["environment"], document["config"]
    rows = document["rows"]
    baseline = next((row for row in rows if row["dtype"] == "float32"), None)
    against = f"× float32 batch {baseline['batch_size']}" if baseline else "×"
    lines = [
        f"# `specdec distill` by dtype: the target writing data, the head training (`{config['target']}`)",
        "",
        f"{document['date']} · {environment['cpu']} ({environment['cpus']} CPUs, load average "
        f"{environment['load_average'][0]:.2f} before) · torch {environment['versions']['torch']} · specdec "
        f"{environment['versions']['specdec_commit']}",
        "",
        f"Command: `{' '.join(document['command'])}`",
        "",
    ]
    if rows:
        lines += [
            f"{config['prompts']} training prompts (evenly spaced over the set), greedy, at most "
            f"{config['max_tokens']} tokens each, with EAGLE-3 feature rows; median of {config['repeats']} interleaved "
            "repeats.",
            "",
            f"| dtype | batch | response tokens/s | {against} | responses identical to float32's "
            "| repeats (tokens/s) |",
            "|---|---|---|---|---|---|",
        ]
    for row in rows:
        ratio = f"{row['tokens_per_s'] / baseline['tokens_per_s']:.2f}" if baseline else "–"
        same = "–" if row["identical_to_float32"] is None else f"{row['identical_to_float32']:.0%}"
        samples = " ".join(f"{value:.0f}" for value in row["tokens_per_s_samples"])
        lines.append(
            f"| {row['dtype']} | {row['batch_size']} | {row['tokens_per_s']:.0f} | {ratio} | {same} | {samples} |"
        )
    training, speedups = document["training_rows"], document["bfloat16_speedup"]
    if training:
        first = training[0]
        examples = "the cached `specdec distill` data" if config["cached_data"] else "float32's"
        lines += [
            "",
            f"A fresh EAGLE-3 head trains {config['train_steps']} steps ({config['unroll_steps']} unrolled) on "
            f"{document['training_examples']} examples ({examples}) in each dtype (bfloat16: under autocast), median "
            f"of {config['repeats']} interleaved repeats.",
            "",
            f"| training dtype | steps/s | response tokens/s | × {first['dtype']} | repeats (steps/s) |",
            "|---|---|---|---|---|",
        ]
        for row in training:
            samples = " ".join(f"{value:.2f}" for value in row["steps_per_s_samples"])
            lines.append(
                f"| {row['dtype']} | {row['steps_per_s']:.2f} | {row['tokens_per_s']:.0f} | "
                f"{row['steps_per_s'] / first['steps_per_s']:.2f} | {samples} |"
            )
    lines += [
        "",
        f"`bfloat16_speedup` here: {speedups['decode']:.2f} at {GENERATION_ROWS} rows, {speedups['training']:.2f} at "
        f"{TRAINING_ROWS}, so `auto` writes data in {document['auto_data_dtype']} and trains in "
        f"{document['auto_train_dtype']}.",
    ]
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
    parser.add_argument("--train-steps", type=int, default=20, help="head training steps per dtype (0: no training)")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="the head's draft vocabulary")
    parser.add_argument("--unroll-steps", type=int, default=3, help="training-time unrolled steps (the demo's: 1)")
    parser.add_argument(
        "--cached-data",
        action="store_true",
        help="skip the data section; train on the cached specdec distill data (at most --prompts examples)",
    )
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
    document = {**run_metadata(args.name, command, config), "note": args.note, **measure_all(args)}
    write_report(args.result_dir, args.name, document, markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
