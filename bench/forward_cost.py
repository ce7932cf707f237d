"""What one target forward costs by the positions each sequence brings to it (one pending token and a chain of
draft tokens), by batch size, dtype and torch threads: whether verifying a draft of γ tokens can pay here.

A round that verifies γ draft tokens costs a forward of 1 + γ positions per sequence, ``r(γ)`` times a one-token
forward, plus the drafting; it pays only when it commits more than ``r(γ)`` tokens (more still with the draft's
cost). On a GPU ``r`` stays near 1 for small γ (the forward is bound by kernel launches and weight reads); on a CPU
it grows with γ, and where a BLAS library changes its matrix-multiply kernel with the row count, it jumps.

For each dtype (a fresh load of the target) and thread count, ``--batch-sizes`` sequences are opened on a random
prefix of ``--context`` tokens; each timed forward then carries, for every sequence, one pending token and a chain
of ``positions - 1`` draft tokens (nothing is committed, so every forward sees the same prefix). Position counts
are interleaved within each repeat; a cell is the median over ``--repeats`` of the mean of ``--number`` forwards,
beside its ratio to one position at the same batch size, dtype and threads: the tokens per round a draft of that
length must commit to break even before its own cost. Writes ``NAME.json`` and ``NAME.md``.

``--kernels packed,plain`` times the runner's prepacked oneDNN matrix multiplies (the default for float32 on CPU,
:mod:`specdec.linear`) beside torch's own, interleaved.

    python -m bench.forward_cost --kernels packed,plain --threads 1,2 --result-dir bench/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.arguments import comma_ints, comma_names
from bench.load.report import run_metadata, write_report
from specdec.errors import InvalidArgumentError
from specdec.linear import can_pack
from specdec.models import load_model, quiet_model_loading, synchronize
from specdec.precision import check_dtype
from specdec.runner import ForwardItem, KVRunner
from specdec.tree import TokenTree


def time_forwards(
    runners: Mapping[str, KVRunner],
    device: torch.device,
    *,
    batch_size: int,
    positions: Sequence[int],
    context: int,
    number: int,
    repeats: int,
    seed: int,
) -> dict[tuple[str, int], list[float]]:
    """Milliseconds per forward (one mean of ``number`` forwards per repeat) by (runner, positions per sequence);
    every runner sees the same tokens, and runners and position counts are interleaved within each repeat."""
    generator = torch.Generator().manual_seed(seed)
    vocab = next(iter(runners.values())).vocab_size
    prefix = torch.randint(vocab, (batch_size, context), generator=generator).tolist()
    drafts = torch.randint(vocab, (batch_size, 1 + max(positions)), generator=generator).tolist()
    sequences = {name: [runner.open() for _ in range(batch_size)] for name, runner in runners.items()}
    try:
        items = {}
        for name, runner in runners.items():
            runner.forward([ForwardItem(seq, tokens) for seq, tokens in zip(sequences[name], prefix, strict=True)])
            for seq in sequences[name]:
                runner.commit(seq, context)
            for count in positions:
                items[name, count] = [
                    ForwardItem(seq, row[:1], TokenTree.chain(row[1:count]))
                    for seq, row in zip(sequences[name], drafts, strict=True)
                ]
        for (name, _), batch in items.items():  # warm-up: buffers, rotary tables, the BLAS library's kernel choice
            runners[name].forward(batch)
        times: dict[tuple[str, int], list[float]] = {key: [] for key in items}
        for _ in range(repeats):
            for count in positions:
                for name, runner in runners.items():
                    synchronize(device)
                    start = time.perf_counter()
                    for _ in range(number):
                        runner.forward(items[name, count])
                    synchronize(device)
                    times[name, count].append(1e3 * (time.perf_counter() - start) / number)
        return times
    finally:
        for name, runner in runners.items():
            for seq in sequences[name]:
                runner.close(seq)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (dtype, kernels, threads, batch size, positions); kernels the runner could not use are left
    out (packed: float32 on CPU only)."""
    rows = []
    for dtype_name in args.dtypes:
        target = load_model(args.target, dtype=getattr(torch, dtype_name), device=args.device)
        packable = can_pack(target.model.lm_head)
        runners = {
            kernels: KVRunner(target.model, pack_weights=kernels == "packed")
            for kernels in args.kernels
            if packable or kernels == "plain"
        }
        if not runners:
            print(f"{dtype_name}: no kernels of {args.kernels} apply, skipped", file=sys.stderr, flush=True)
            continue
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch_size in args.batch_sizes:
                times = time_forwards(
                    runners,
                    target.model.device,
                    batch_size=batch_size,
                    positions=args.positions,
                    context=args.context,
                    number=args.number,
                    repeats=args.repeats,
                    seed=args.seed,
                )
                fewest = min(args.positions)
                for (kernels, count), samples in times.items():
                    median = statistics.median(samples)
                    plain = times.get(("plain", count))
                    rows.append(
                        {
                            "dtype": dtype_name,
                            "kernels": kernels,
                            "threads": threads,
                            "batch_size": batch_size,
                            "positions": count,
                            "ms_median": median,
                            "ms_samples": samples,
                            "ratio_to_fewest": median / statistics.median(times[kernels, fewest]),
                            "ratio_to_plain": None if plain is None else median / statistics.median(plain),
                        }
                    )
                print(f"{dtype_name} threads {threads} batch {batch_size} done", file=sys.stderr, flush=True)
        del runners, target
    return rows


def markdown(document: dict[str, Any]) -> str:
    environment, config = document["environment"], document["config"]
    versions = environment["versions"]
    lines = [
        f"# One target forward by positions per sequence: `{config['target']}`",
        "",
        f"{document['date']} · {environment['cpu']} ({environment['cpus']} CPUs, load average "
        f"{environment['load_average'][0]:.2f} before) · {', '.join(environment['gpus']) or 'no GPU'} · torch "
        f"{versions['torch']} · specdec {versions['specdec_commit']}",
        "",
        f"Command: `{' '.join(document['command'])}`",
        "",
        f"Device {config['device']}; every sequence on a {config['context']}-token prefix; a forward carries one "
        "pending token and a chain of positions − 1 draft tokens per sequence; median over "
        f"{config['repeats']} interleaved repeats of the mean of {config['number']} forwards.",
        "",
        "| dtype | kernels | threads | batch | positions | ms / forward (median) | × fewest positions | × plain "
        "| repeats (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(document["rows"], key=lambda row: (row["dtype"], row["kernels"])):
        samples = " ".join(f"{value:.1f}" for value in row["ms_samples"])
        to_plain = "–" if row["ratio_to_plain"] is None else f"{row['ratio_to_plain']:.2f}"
        lines.append(
            f"| {row['dtype']} | {row['kernels']} | {row['threads']} | {row['batch_size']} | {row['positions']} | "
            f"{row['ms_median']:.1f} | {row['ratio_to_fewest']:.2f} | {to_plain} | {samples} |"
        )
    lines += [
        "",
        "× fewest positions = r(γ) for γ = positions − 1: the tokens per round a draft of γ tokens must commit to "
        "break even before its own drafting cost. Kernels: `packed`, the runner's oneDNN matrix multiplies over "
        "weights prepacked once (`specdec/linear.py`, the default for float32 on CPU); `plain`, each linear layer "
        "as torch runs it (MKL on CPU). × plain = packed ms / plain ms in the same cell.",
    ]
    if document["note"]:
        lines += ["", document["note"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.forward_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtypes", type=comma_names, default=["float32"], help="comma-separated, e.g. float32,bfloat16"
    )
    parser.add_argument(
        "--kernels",
        type=comma_names,
        default=["packed"],
        help="comma-separated: packed (oneDNN over prepacked weights; float32 on CPU), plain (torch's own)",
    )
    parser.add_argument("--threads", type=comma_ints, default=[1, 2], help="comma-separated torch thread counts")
    parser.add_argument("--batch-sizes", type=comma_ints, default=[1, 8], help="comma-separated sequences per forward")
    parser.add_argument(
        "--positions", type=comma_ints, default=[1, 2, 3, 4, 5, 6, 9], help="comma-separated positions per sequence"
    )
    parser.add_argument("--context", type=int, default=300, help="committed tokens of every sequence")
    parser.add_argument("--number", type=int, default=5, help="forwards per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="", help="a paragraph for the report")
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="forward-cost")
    args = parser.parse_args(argv)
    quiet_model_loading()
    if not args.positions or min(args.positions) < 1:
        parser.error("--positions: give counts of at least 1")
    if not args.kernels or set(args.kernels) - {"packed", "plain"}:
        parser.error("--kernels: give packed, plain or both")
    try:
        for dtype in args.dtypes:
            check_dtype(dtype)
    except InvalidArgumentError as error:
        parser.error(f"--dtypes: {error}")
    config = {key: value for key, value in vars(args).items() if key not in ("note", "result_dir", "name")}
    command = ["python", "-m", "bench.forward_cost", *(argv if argv is not None else sys.argv[1:])]
    document = {**run_metadata(args.name, command, config), "note": args.note, "rows": measure(args)}
    write_report(args.result_dir, args.name, document, markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
