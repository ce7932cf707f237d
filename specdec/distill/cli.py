"""The arguments of ``specdec distill``, apart from its implementation (:mod:`specdec.distill.command`) so that
building the ``specdec`` parser imports neither torch nor transformers."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from specdec.precision import DISTILL_DTYPES


def register_distill(subparsers: argparse._SubParsersAction) -> Callable[[argparse.Namespace], int]:
    """Add ``distill`` to ``subparsers``; returns its run function."""
    parser = subparsers.add_parser("distill", help="train an EAGLE draft head from the target's own outputs")
    parser.add_argument("--target", default="smollm2-135m", help="alias, GGUF file, local directory or hub id")
    parser.add_argument("--out", type=Path, help="head directory (default: the cached head for --target)")
    parser.add_argument("--data", type=Path, help="your own conversations (JSONL, last message the assistant's)")
    parser.add_argument(
        "--categories",
        default="",
        help="comma-separated categories of the built-in prompt set to answer (default: all; data cached before is "
        "trained on whatever its category)",
    )
    parser.add_argument(
        "--data-minutes", type=float, default=30.0, help="time budget of training-data generation (after the held-out)"
    )
    parser.add_argument("--max-tokens", type=int, default=160, help="longest generated response")
    parser.add_argument(  # the shipped prompts run out at ~370 k response tokens; more samples add contexts
        "--responses-per-prompt",
        type=int,
        default=1,
        help="responses the target writes to each training prompt; those past the first are sampled at T=0.7",
    )
    parser.add_argument("--batch-size", type=int, default=96, help="sequences generated together")
    parser.add_argument(  # bfloat16: 2.2x the float32 tokens/s on a CPU with AMX, heads as good (README)
        "--data-dtype",
        choices=DISTILL_DTYPES,
        default="auto",
        help="the target's dtype while it writes training data (auto: bfloat16 where it runs >= 1.5x faster)",
    )
    parser.add_argument("--steps", type=int, help="training steps (deterministic budget)")
    parser.add_argument("--minutes", type=float, help="training time budget (default 10 when --steps is not given)")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size K")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the head")
    parser.add_argument(  # fused by default: +7.5 points of held-out agreement at equal training time (README)
        "--features",
        choices=("final", "fused"),
        default="fused",
        help="what the head reads: a low, middle and high target layer (EAGLE-3) or the final-norm rows (EAGLE-1)",
    )
    parser.add_argument("--unroll-steps", type=int, default=3, help="training-time unrolled steps (1: none)")
    parser.add_argument("--feature-weight", type=float, default=0.2, help="weight of the feature regression loss")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    parser.add_argument(
        "--snapshot-minutes", default="", help="comma-separated training minutes at which to keep a copy of the head"
    )
    parser.add_argument(
        "--held-out-prompts", type=int, default=64, help="held-out prompts that rank checkpoints (categories in turn)"
    )
    parser.add_argument(  # bfloat16 autocast: 1.65x faster steps on an AMD EPYC, 1.3-1.6x slower on a Xeon without AMX
        "--train-dtype",
        choices=DISTILL_DTYPES,
        default="auto",
        help="float32, or bfloat16 autocast (auto: bfloat16 where it runs >= 1.2x faster)",
    )
    parser.add_argument(
        "--fp32", dest="train_dtype", action="store_const", const="float32", help="the same as --train-dtype float32"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the target generates and the head trains")
    return run


def run(args: argparse.Namespace) -> int:
    from specdec.distill.command import run_distill  # torch, transformers and the target: only to distill

    return run_distill(args)
