"""``specdec check``: certify that a live router's speculation is lossless (:mod:`specdec.check.runner`).

``specdec check --router HOST:PORT`` (gRPC, through the SDK) or ``--base-url URL`` (the OpenAI-compatible HTTP
API). The bearer token, when the router requires one, comes from ``SPECDEC_BEARER_TOKEN`` (or
``--bearer-token-file``), as for ``specdec generate --router``. Writes ``OUTPUT.md`` and ``OUTPUT.json``, prints
the Markdown, and exits 0 on pass, 1 on fail, 3 when the budget was too small to detect the wrong law.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path

from specdec import eventloop
from specdec.check.backends import Backend, GrpcBackend, HttpBackend, Prompt
from specdec.check.runner import (
    DEFAULT_SETTINGS,
    CheckConfig,
    Setting,
    modes_for,
    report_json,
    report_markdown,
    run_check,
)
from specdec.errors import InvalidArgumentError

DEFAULT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Here is a list of five fruits:\n1.",
    "The derivative of x^2 with respect to x is",
    "import numpy as np\n\nx = np.",
    "Dear hiring manager,\n\nI am writing to",
    "Q: What is the boiling point of water at sea level?\nA:",
    "La capitale de l'Italie est",
    "SELECT name, age FROM users WHERE",
    "The three laws of thermodynamics are",
    "In 1969, Neil Armstrong",
    "To make a cup of tea, first",
    '{"name": "Alice", "age":',
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "<html>\n<head>\n<title>",
    "2 + 2 = 4. 3 + 5 =",
    "Breaking news: scientists have discovered",
    "Translate to German: Good morning! ->",
    "The best way to learn a new language is",
    "for (int i = 0; i <",
    "Roses are red, violets are blue,",
    "Summary of the meeting:\n-",
    "A haiku about autumn:\n",
    "The mitochondria is",
    "User: Can you recommend a good book?\nAssistant:",
    "#!/bin/bash\n# Backup script\n",
    "Chapter 1\n\nIt was a bright cold day in April, and",
    "The main causes of the First World War were",
)


def _speculation_modes() -> tuple[str, ...]:
    """The speculation modes this SDK can request (``auto`` where the SDK has it)."""
    from specdec.client import GenerateOptions

    hint = typing.get_type_hints(GenerateOptions)["speculation"]
    return tuple(typing.get_args(hint))


def read_prompts(path: Path) -> tuple[Prompt, ...]:
    """One prompt per line: a JSON list of ints is token ids, a JSON string is text, anything else is the text itself
    (blank lines and lines starting with ``#`` are skipped)."""
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            value = line
        label = f"{path.name}:{number}"
        if isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            prompts.append(Prompt(label, ids=tuple(value)))
        elif isinstance(value, str):
            prompts.append(Prompt(label, text=value))
        else:
            prompts.append(Prompt(label, text=line))
    if not prompts:
        raise InvalidArgumentError("prompts", f"{path} holds no prompt")
    return tuple(prompts)


def register_check(subparsers: argparse._SubParsersAction) -> Callable[[argparse.Namespace], int]:
    """Add ``check`` to ``subparsers``; returns its run function."""
    parser = subparsers.add_parser("check", help="certify that a live router's speculation is lossless")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--router", metavar="HOST:PORT", help="the router's gRPC address (through the SDK)")
    where.add_argument("--base-url", metavar="URL", help="the router's OpenAI-compatible HTTP API")
    parser.add_argument("--tls", action="store_true", help="gRPC with TLS (system roots); for HTTP use https://")
    parser.add_argument("--bearer-token-file", type=Path, help="default: $SPECDEC_BEARER_TOKEN")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of each request, in seconds")
    parser.add_argument("--prompts", type=Path, help="one prompt per line (JSON list of ints: token ids)")
    parser.add_argument("--chat", action="store_true", help="wrap text prompts in the model's chat template")
    parser.add_argument("--drafters", help="drafter kinds to check, comma-separated (default: the router's)")
    parser.add_argument("--modes", help="comma-separated of sequential, pipelined, tree, auto (default: all offered)")
    parser.add_argument("--num-draft-tokens", type=int, default=0, help="chain γ (0: router default)")
    parser.add_argument("--tree-width", type=int, default=2, help="children per node of the tree mode")
    parser.add_argument("--tree-depth", type=int, default=3, help="depth of the tree mode")
    parser.add_argument(
        "--sampling",
        action="append",
        type=Setting.parse,
        help="a T > 0 setting, e.g. temperature=0.8,top_p=0.9,top_k=20 (repeat; default: "
        + "; ".join(setting.label for setting in DEFAULT_SETTINGS)
        + ")",
    )
    parser.add_argument("--distribution-prompts", type=int, default=2, help="prompts of the distribution test")
    parser.add_argument("--tokens", type=int, default=3, help="tokens per generation in the distribution test")
    parser.add_argument("--greedy-tokens", type=int, default=32, help="tokens per generation in the greedy test")
    parser.add_argument("--requests", type=int, help="request budget (default 3000 unless --minutes is given)")
    parser.add_argument("--minutes", type=float, help="time budget")
    parser.add_argument("--significance", type=float, default=0.01, help="for the whole run (default 0.01)")
    parser.add_argument(
        "--control-temperature-factor",
        type=float,
        default=0.8,
        help="the wrong law the check must detect: speculation off at this × T (default 0.8)",
    )
    parser.add_argument("--min-count", type=int, default=5, help="least count of a prefix in both samples")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="base of every request's seed")
    parser.add_argument("--no-greedy", action="store_true", help="skip the greedy identity test")
    parser.add_argument("--no-distribution", action="store_true", help="skip the distribution test")
    parser.add_argument("--output", type=Path, default=Path("specdec-check"), help="writes OUTPUT.md and OUTPUT.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return run_command


def _token(args: argparse.Namespace) -> str | None:
    if args.bearer_token_file:
        return args.bearer_token_file.read_text().strip() or None
    return os.environ.get("SPECDEC_BEARER_TOKEN") or None


async def _check(args: argparse.Namespace) -> int:
    backend: Backend
    if args.router:
        backend = GrpcBackend(args.router, tls=args.tls, bearer_token=_token(args), timeout_s=args.timeout)
        target = args.router
    else:
        backend = HttpBackend(args.base_url, bearer_token=_token(args), timeout_s=args.timeout)
        target = args.base_url
    try:
        if args.drafters is not None:
            kinds = tuple(kind.strip() for kind in args.drafters.split(",") if kind.strip())
        else:
            kinds = await backend.drafter_kinds() or ("",)  # HTTP cannot tell: the router's default drafter
        offered = ("sequential", "pipelined", "tree") + (("auto",) if "auto" in _speculation_modes() else ())
        names = tuple(name.strip() for name in args.modes.split(",")) if args.modes else offered
        requests = args.requests if args.requests is not None else (None if args.minutes else 3000)
        config = CheckConfig(
            prompts=read_prompts(args.prompts)
            if args.prompts
            else tuple(Prompt(f"p{index}", text=text) for index, text in enumerate(DEFAULT_PROMPTS)),
            modes=modes_for(
                kinds,
                names,
                num_draft_tokens=args.num_draft_tokens,
                tree_width=args.tree_width,
                tree_depth=args.tree_depth,
            ),
            settings=tuple(args.sampling) if args.sampling else DEFAULT_SETTINGS,
            distribution_prompts=args.distribution_prompts,
            tokens=args.tokens,
            greedy_tokens=args.greedy_tokens,
            requests=requests,
            minutes=args.minutes,
            significance=args.significance,
            control_temperature_factor=args.control_temperature_factor,
            min_count=args.min_count,
            concurrency=args.concurrency,
            seed=args.seed,
            chat=args.chat,
            greedy=not args.no_greedy,
            distribution=not args.no_distribution,
        )
        result = await run_check(backend, config, target=target, progress=not args.no_progress)
    finally:
        await backend.close()
    markdown = report_markdown(result)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.output}.md").write_text(markdown, encoding="utf-8")
    Path(f"{args.output}.json").write_text(json.dumps(report_json(result), indent=2) + "\n", encoding="utf-8")
    print(markdown)
    print(f"specdec check: {result.verdict} (report: {args.output}.md, {args.output}.json)", file=sys.stderr)
    return result.exit_code


def run_command(args: argparse.Namespace) -> int:
    return eventloop.run(_check(args))
