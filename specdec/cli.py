"""``specdec`` command line: ``specdec generate PROMPT`` runs the co-located engine, or with ``--router HOST:PORT``
sends the request to a router through the client SDK (:mod:`specdec.client`); both print the same ``--json``
object. The SDK, and with it gRPC, is imported only for ``--router``; torch and transformers only by a command that
runs a model (``generate`` without ``--router``, ``distill``), so that ``specdec status`` answers in a second.

The core's own subcommands are registered by :func:`register_core_commands`; the others (``bench``, ``up`` /
``status`` / ``down``) live in packages layered above the core, which must not import them (DESIGN §10), so they
plug in as entry points of the group :data:`COMMANDS_GROUP`: each names a :data:`Register` function.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from specdec.check.command import register_check
from specdec.distill.cli import register_distill
from specdec.drafter_kinds import DRAFTER_KINDS
from specdec.errors import InvalidArgumentError, SpecdecError
from specdec.precision import DRAFT_QUANTIZATIONS, MODEL_DTYPES, check_dtype
from specdec.sampling_params import SamplingParams
from specdec.stats import GenerationResult, SpecStats
from specdec.tree import DEFAULT_DEPTH, DEFAULT_WIDTH, default_budget

if TYPE_CHECKING:
    from specdec.models import LoadedModel

COMMANDS_GROUP = "specdec.commands"

Run = Callable[[argparse.Namespace], int]
"""Runs one parsed subcommand; returns the process exit status."""

Register = Callable[[argparse._SubParsersAction], Mapping[str, Run]]
"""Adds a plugin's subparsers and returns the run function of each subcommand it added, by name."""


def _generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate a continuation of PROMPT")
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument("--target", default="smollm2-135m", help="alias, GGUF file, local directory or hub id")
    parser.add_argument("--drafter", choices=DRAFTER_KINDS, help="default: ngram (with --router: the router's)")
    parser.add_argument("--draft-model", help="draft model for --drafter model (same tokenizer as the target)")
    parser.add_argument("--early-exit-layers", type=int, help="target layers the early-exit drafter uses")
    parser.add_argument("--num-draft-tokens", type=int, help="chain length γ, or tree depth (default 4 / router's)")
    parser.add_argument("--tree-width", type=int, help="children per expanded node (default 3 / router's; 1: chain)")
    parser.add_argument("--tree-budget", type=int, help="max tree nodes (default: as many as levels; 0: width × depth)")
    parser.add_argument("--tree-sampling", choices=("iid", "without_replacement"), default="without_replacement")
    parser.add_argument("--draft-top-k", type=int, default=20, help="drafter's own truncation of q")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    parser.add_argument("--chat", action="store_true", help="wrap PROMPT in the model's chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dtype", help=f"precision of the models: {', '.join(MODEL_DTYPES)} (default float32)")
    parser.add_argument("--device", help="torch device of the models, e.g. cuda (default cpu)")
    parser.add_argument(
        "--draft-quantization",
        choices=DRAFT_QUANTIZATIONS,
        help="an eagle head's draft layers over int8 weights (int8), as loaded (none), or int8 where a float32 head "
        "runs on a CPU that can (auto, the default)",
    )
    parser.add_argument(
        "--speculation",
        choices=("off", "sequential", "pipelined", "auto"),
        help="default: the router's with --router, else sequential; in this process off, sequential or auto "
        "(each round's draft length, 0 included, chosen from measured acceptance and costs)",
    )
    remote = parser.add_argument_group("through a router (--router)")
    remote.add_argument("--router", metavar="HOST:PORT", help="generate on a router instead of in this process")
    remote.add_argument("--stop", action="append", default=[], help="stop string (repeat)")
    remote.add_argument("--timeout", type=float, default=120.0, help="deadline of the request, in seconds")
    remote.add_argument("--tls", action="store_true", help="connect with TLS (system roots unless --tls-ca)")
    remote.add_argument("--tls-ca", help="PEM CA bundle the router's certificate must chain to (implies --tls)")
    remote.add_argument("--tls-cert", help="PEM client certificate, for a router that requires one (with --tls-key)")
    remote.add_argument("--tls-key", help="PEM private key of --tls-cert")


def encode_prompt(target: LoadedModel, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt``, optionally through the tokenizer's chat template."""
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise InvalidArgumentError("target", f"{target.name!r} has no tokenizer to turn the prompt text into ids")
    if chat:
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return list(tokenizer.encode(prompt, add_special_tokens=False))


def result_json(text: str, result: GenerationResult) -> dict:
    """The ``--json`` object shared by every way of generating."""
    stats = result.stats
    return {
        "text": text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        "stats": {
            "rounds": stats.rounds,
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "mean_accepted_length": stats.mean_accepted_length,
            "accepted_per_position": stats.accepted_per_position,
            "draft_s": stats.draft_s,
            "verify_s": stats.verify_s,
            "state_s": stats.state_s,
            "tokens_per_s": result.tokens_per_s,
        },
    }


def _run_generate(args: argparse.Namespace) -> int:
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    if not args.prompt:
        raise InvalidArgumentError("prompt", "must not be empty")
    if args.max_tokens <= 0:
        raise InvalidArgumentError("max_tokens", f"must be >= 1, got {args.max_tokens}")
    dtype = check_dtype(args.dtype or "float32")
    if args.router:
        worker_settings = {"dtype": args.dtype, "device": args.device, "draft_quantization": args.draft_quantization}
        if any(worker_settings.values()):
            field = next(name for name, value in worker_settings.items() if value)
            raise InvalidArgumentError(field, "is the serving workers' setting, not a request's: drop it with --router")
        return _run_on_router(args)
    if args.stop:
        raise InvalidArgumentError("stop", "is only supported with --router")
    if args.speculation == "pipelined":  # the co-located engine drafts after each verdict; pipelining is the router's
        raise InvalidArgumentError(
            "speculation", "pipelined runs through a router (--router); here: off, sequential, auto"
        )
    import torch

    from specdec.adaptive import SpeculationController
    from specdec.drafters import DraftConfig, build_drafter, check_quantizable  # the model stack: only here
    from specdec.engine import Engine, GenerationRequest
    from specdec.models import load_model, quiet_model_loading
    from specdec.runner import KVRunner

    quiet_model_loading()
    depth = DEFAULT_DEPTH if args.num_draft_tokens is None else args.num_draft_tokens
    width = DEFAULT_WIDTH if args.tree_width is None else args.tree_width
    config = DraftConfig(
        num_draft_tokens=depth,
        tree_width=width,
        tree_budget=default_budget(width, depth) if args.tree_budget is None else args.tree_budget,
        draft_top_k=args.draft_top_k,
        tree_sampling=args.tree_sampling,
    )
    check_quantizable(args.drafter or "ngram", args.draft_quantization or "auto")
    target = load_model(args.target, dtype=getattr(torch, dtype), device=args.device or "cpu")
    drafter = None
    if args.speculation != "off":
        drafter = build_drafter(
            args.drafter or "ngram",
            target,
            config,
            draft_model=args.draft_model,
            early_exit_layers=args.early_exit_layers,
            draft_quantization=args.draft_quantization or "auto",
        )
    controller = SpeculationController(config.num_draft_tokens) if args.speculation == "auto" else None
    engine = Engine(KVRunner(target.model), target.eos_token_ids, drafter, controller)
    request = GenerationRequest(
        encode_prompt(target, args.prompt, args.chat), params, args.max_tokens, args.seed, args.ignore_eos
    )
    [result] = engine.generate([request])
    text = target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    _print_result(args, text, result, result_json(text, result))
    return 0


def _print_result(args: argparse.Namespace, text: str, result: GenerationResult, as_json: dict) -> None:
    if args.json:
        print(json.dumps(as_json))
        return
    print(text)
    stats = result.stats
    print(
        f"[{result.finish_reason}] {len(result.token_ids)} tokens in {stats.rounds} rounds, "
        f"mean accepted length {stats.mean_accepted_length:.2f}, {result.tokens_per_s:.1f} tokens/s",
        file=sys.stderr,
    )


def _run_on_router(args: argparse.Namespace) -> int:
    """``--router``: the same request through the SDK; the ``--json`` object adds the pipeline counters.

    The bearer token, if the router requires one, comes from the ``SPECDEC_BEARER_TOKEN`` environment variable.
    """
    from specdec.client import Client, ClientError, GenerateOptions, InvalidArgument, TlsFiles, Unauthenticated

    options: GenerateOptions = {
        "chat": args.chat,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
        "tree_budget": args.tree_budget or 0,
    }
    optional = {
        "seed": args.seed,
        "speculation": args.speculation,
        "drafter": args.drafter,
        "num_draft_tokens": args.num_draft_tokens,
        "tree_width": args.tree_width,
    }
    options.update({key: value for key, value in optional.items() if value is not None})  # type: ignore[typeddict-item]
    token = os.environ.get("SPECDEC_BEARER_TOKEN") or None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise InvalidArgumentError("tls_cert" if args.tls_cert is None else "tls_key", "--tls-cert needs --tls-key")
    tls: bool | TlsFiles = args.tls
    if args.tls_ca or args.tls_cert:
        tls = TlsFiles(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
    try:
        with Client(args.router, timeout_s=args.timeout, tls=tls, bearer_token=token) as client:
            remote = client.generate(args.prompt, **options)
    except (InvalidArgument, Unauthenticated) as error:
        raise InvalidArgumentError("request", error.details) from None
    except ClientError as error:
        print(f"specdec: error: router {args.router}: {error}", file=sys.stderr)
        return 1
    stats = remote.stats
    result = GenerationResult(
        remote.token_ids,
        remote.finish_reason,
        SpecStats(
            rounds=stats.rounds,
            draft_tokens=stats.draft_tokens,
            accepted_tokens=stats.accepted_tokens,
            accepted_per_position=stats.accepted_per_position,
            draft_s=stats.draft_s,
            verify_s=stats.verify_s,
            state_s=stats.state_s,
        ),
        remote.elapsed_s,
    )
    as_json = result_json(remote.text, result)
    as_json["stats"].update(
        pipeline_hits=stats.pipeline_hits,
        pipeline_misses=stats.pipeline_misses,
        wire_bytes=stats.wire_bytes,
        drafter_fallback=stats.drafter_fallback,
    )
    as_json["usage"] = {
        "prompt_tokens": remote.usage.prompt_tokens,
        "completion_tokens": remote.usage.completion_tokens,
    }
    _print_result(args, remote.text, result, as_json)
    return 0


def register_core_commands(subparsers: argparse._SubParsersAction) -> dict[str, Run]:
    """The subcommands of the core library itself (a :data:`Register`)."""
    _generate_parser(subparsers)
    return {"generate": _run_generate, "distill": register_distill(subparsers), "check": register_check(subparsers)}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Run]]:
    """The ``specdec`` parser with the core's and every installed plugin's subcommands, and their run functions.

    Plugins register in entry-point name order, so ``--help`` lists them the same way on every install; a
    subcommand name taken twice fails in argparse ("conflicting subparser") rather than shadowing silently.
    """
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    commands = register_core_commands(subparsers)
    for plugin in sorted(entry_points(group=COMMANDS_GROUP), key=lambda point: point.name):
        register: Register = plugin.load()
        commands.update(register(subparsers))
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    try:
        return commands[args.command](args)
    except (SpecdecError, OSError, RuntimeError, ValueError) as error:
        message = " ".join(str(error).split()) if args.command == "generate" else str(error)
        print(f"specdec: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
