"""The router's one frozen configuration, built once from the command line with environment fallbacks.

Every option has an environment variable ``SPECDEC_ROUTER_<NAME>`` (lists comma-separated) used when the flag
is absent, so a Kubernetes manifest can configure the router without templating its arguments. The bearer token
is read from ``SPECDEC_ROUTER_BEARER_TOKEN`` (or ``--bearer-token-file``), never from a flag, so it does not
show up in process listings. TLS (``--tls-cert``, ``--tls-key``, ``--tls-ca``, ``--tls-server-name``) is defined once
for every service in :mod:`grpc_common.tls`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from grpc_common.tls import PLAINTEXT, TlsConfig, add_tls_arguments, tls_from_args
from specdec.drafter_kinds import DRAFTER_KINDS
from specdec.errors import InvalidArgumentError
from specdec.tree import DEFAULT_DEPTH, DEFAULT_WIDTH

ENV_PREFIX = "SPECDEC_ROUTER_"
MAX_TREE_WIDTH = 16  # children per tree node a request (or the server's default shape) may ask


def check_tree_budget(budget: int, width: int, depth: int) -> None:
    """A tree's node budget holds at most ``width`` nodes a level over ``depth`` levels (0: that many)."""
    if not 0 <= budget <= width * depth:
        raise InvalidArgumentError(
            "tree_budget", f"must be in [0, tree_width × num_draft_tokens = {width * depth}], got {budget}"
        )


@dataclass(frozen=True)
class RouterConfig:
    """How one router process serves.

    ``model`` is the served model's name (checked against requests, listed by ``/v1/models``); ``tokenizer``
    is where its tokenizer loads from (an alias, GGUF file, directory or hub id), ``None`` for a router that
    takes token ids only. ``drafters`` and ``verifiers`` are worker addresses (``host:port``). Deadlines bound
    every call to a worker: a drafter past ``drafter_deadline_s`` is abandoned for the request (target-only from
    then on), a verifier past ``verifier_deadline_s`` fails the request with UNAVAILABLE or re-places it.
    At most ``max_concurrent_requests`` run at once and ``max_waiting_requests`` more wait for a slot in arrival
    order; beyond both a request is refused (RESOURCE_EXHAUSTED / HTTP 429). With ``tls`` enabled the channels to
    workers are mutual TLS and the public gRPC and HTTP ports serve TLS with the same certificate; they also require
    a client certificate from the CA unless ``tls_public_client_auth`` is off (then clients need only trust the
    CA, and the bearer token is what authenticates them). Every ``sequence_keepalive_s`` the router renews the
    leases of the sequences it holds open on each worker (one Touch per worker); keep it well below the workers'
    ``--sequence-idle-timeout-s`` (default 120 s), after which a worker reclaims a sequence nobody named.
    ``worker_streams`` sends each worker's batches on one long-lived stream (:mod:`router.calls`); off, each batch
    is a unary RPC. ``num_draft_tokens``, ``tree_width`` and ``tree_budget`` are the candidate shape of a request
    that names none (as SGLang's ``--speculative-num-steps``, ``--speculative-eagle-topk`` and
    ``--speculative-num-draft-tokens`` are a server's); ``tree_budget`` 0 is ``tree_width`` nodes a level, ``None``
    as many nodes as levels. The default, the 4 most probable nodes of a tree 4 deep with 3 children under each of a
    level's 3 most probable nodes, is EAGLE-2's dynamic tree for a greedy request, and a chain of 4 for a sampled one
    (:func:`specdec.tree.sampled_tree_is_chain`) or from a drafter of chains (the n-gram drafter).
    """

    model: str
    verifiers: tuple[str, ...]
    drafters: tuple[str, ...] = ()
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    default_drafter: str = ""
    num_draft_tokens: int = DEFAULT_DEPTH
    tree_width: int = DEFAULT_WIDTH
    tree_budget: int | None = None
    max_draft_tokens: int = 32
    default_speculation: str = "auto"
    max_concurrent_requests: int = 64
    max_waiting_requests: int = 0
    retry_after_s: float = 1.0
    drafter_deadline_s: float = 5.0
    verifier_deadline_s: float = 30.0
    health_interval_s: float = 2.0
    health_timeouts_to_eject: int = 3
    sequence_keepalive_s: float = 20.0
    default_max_tokens: int = 256
    max_model_len: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bearer_token: str | None = None
    shutdown_grace_s: float = 5.0
    tls: TlsConfig = PLAINTEXT
    tls_public_client_auth: bool = True
    worker_streams: bool = True

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgumentError("model", "must name the served model")
        if not self.verifiers:
            raise InvalidArgumentError("verifiers", "at least one verifier address is required")
        if self.default_drafter not in ("", *DRAFTER_KINDS):
            raise InvalidArgumentError(
                "default_drafter", f"unknown drafter kind {self.default_drafter!r}; one of {', '.join(DRAFTER_KINDS)}"
            )
        for name in ("grpc_port", "http_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise InvalidArgumentError(name, f"must be a port in [0, 65536), got {getattr(self, name)}")
        for name in (
            "num_draft_tokens",
            "max_draft_tokens",
            "max_concurrent_requests",
            "default_max_tokens",
            "health_timeouts_to_eject",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.num_draft_tokens > self.max_draft_tokens:
            raise InvalidArgumentError("num_draft_tokens", f"must be <= max_draft_tokens ({self.max_draft_tokens})")
        if not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise InvalidArgumentError("tree_width", f"must be in [1, {MAX_TREE_WIDTH}], got {self.tree_width}")
        if self.tree_budget is not None:
            check_tree_budget(self.tree_budget, self.tree_width, self.num_draft_tokens)
        for name in (
            "retry_after_s",
            "drafter_deadline_s",
            "verifier_deadline_s",
            "health_interval_s",
            "sequence_keepalive_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgumentError(name, f"must be a positive number of seconds, got {value}")
        if self.default_speculation not in ("auto", "sequential", "pipelined"):
            raise InvalidArgumentError(
                "default_speculation", f"must be auto, sequential or pipelined, got {self.default_speculation!r}"
            )
        if self.max_waiting_requests < 0:
            raise InvalidArgumentError("max_waiting_requests", f"must be >= 0, got {self.max_waiting_requests}")
        if self.shutdown_grace_s < 0:
            raise InvalidArgumentError("shutdown_grace_s", f"must be >= 0, got {self.shutdown_grace_s}")
        if self.max_model_len < 0:
            raise InvalidArgumentError(
                "max_model_len", f"must be >= 0 (0: left to the verifier), got {self.max_model_len}"
            )
        if self.bearer_token == "":
            raise InvalidArgumentError("bearer_token", "must not be empty (unset it to serve without a token)")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> RouterConfig:
        """Parse ``argv`` (default ``sys.argv[1:]``) with ``environ`` (default ``os.environ``) as fallback."""
        environ = os.environ if environ is None else environ
        args = _parser(environ).parse_args(argv)
        listed = {
            name: getattr(args, name) or _split(environ.get(f"{ENV_PREFIX}{name.upper()}S", "")) for name in _LISTS
        }
        token = environ.get(f"{ENV_PREFIX}BEARER_TOKEN") or None
        if args.bearer_token_file:
            token = Path(args.bearer_token_file).read_text().strip() or None
        return cls(
            model=args.model,
            verifiers=tuple(listed["verifier"]),
            drafters=tuple(listed["drafter"]),
            tokenizer=None if args.no_tokenizer else (args.tokenizer or args.model),
            host=args.host,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            default_drafter=args.default_drafter,
            num_draft_tokens=args.num_draft_tokens,
            tree_width=args.tree_width,
            tree_budget=args.tree_budget,
            max_draft_tokens=args.max_draft_tokens,
            default_speculation=args.default_speculation,
            max_concurrent_requests=args.max_concurrent_requests,
            max_waiting_requests=args.max_waiting_requests,
            retry_after_s=args.retry_after_s,
            drafter_deadline_s=args.drafter_deadline_s,
            verifier_deadline_s=args.verifier_deadline_s,
            health_interval_s=args.health_interval_s,
            health_timeouts_to_eject=args.health_timeouts_to_eject,
            sequence_keepalive_s=args.sequence_keepalive_s,
            default_max_tokens=args.default_max_tokens,
            max_model_len=args.max_model_len,
            eos_token_ids=tuple(int(token) for token in listed["eos_token_id"]),
            bearer_token=token,
            shutdown_grace_s=args.shutdown_grace_s,
            tls=tls_from_args(dict(vars(args))),
            tls_public_client_auth=args.tls_public_client_auth,
            worker_streams=args.worker_streams,
        )


_LISTS = ("drafter", "verifier", "eos_token_id")  # repeatable flags; env SPECDEC_ROUTER_<NAME>S, comma-separated


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """Flags named like the fields; each default comes from ``SPECDEC_ROUTER_<FIELD>`` when set."""
    defaults = RouterConfig.__dataclass_fields__

    def env(name: str) -> object:
        return environ.get(ENV_PREFIX + name.upper(), defaults[name].default)

    parser = argparse.ArgumentParser(prog="python -m router", description="The specdec router (gRPC + HTTP).")
    parser.add_argument(
        "--model", default=environ.get(f"{ENV_PREFIX}MODEL"), required=f"{ENV_PREFIX}MODEL" not in environ
    )
    parser.add_argument(
        "--tokenizer",
        default=environ.get(f"{ENV_PREFIX}TOKENIZER"),
        help="where the tokenizer loads from (default: --model)",
    )
    parser.add_argument(
        "--no-tokenizer",
        action="store_true",
        default=_bool(environ.get(f"{ENV_PREFIX}NO_TOKENIZER", "0")),
        help="serve token ids only (no text, no chat, no stop)",
    )
    parser.add_argument("--drafter", action="append", help="drafter host:port (repeat)")
    parser.add_argument("--verifier", action="append", help="verifier host:port (repeat)")
    parser.add_argument("--host", default=env("host"))
    parser.add_argument("--grpc-port", type=int, default=env("grpc_port"))
    parser.add_argument("--http-port", type=int, default=env("http_port"))
    parser.add_argument(
        "--default-drafter", default=env("default_drafter"), help="drafter kind for requests naming none"
    )
    parser.add_argument(
        "--num-draft-tokens", type=int, default=env("num_draft_tokens"), help="default chain length γ or tree depth (4)"
    )
    parser.add_argument(
        "--tree-width", type=int, default=env("tree_width"), help="default children per tree node (3; 1: a chain)"
    )
    parser.add_argument(
        "--tree-budget",
        type=int,
        default=env("tree_budget"),
        help="default tree nodes (unset: as many as levels; 0: tree width per level)",
    )
    parser.add_argument(
        "--max-draft-tokens", type=int, default=env("max_draft_tokens"), help="largest γ a request may ask"
    )
    parser.add_argument(
        "--default-speculation",
        choices=("auto", "sequential", "pipelined"),
        default=env("default_speculation"),
        help="mode of requests that name none (auto: the draft length adapts every round)",
    )
    parser.add_argument(
        "--max-concurrent-requests", type=int, default=env("max_concurrent_requests"), help="requests run at once"
    )
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=env("max_waiting_requests"),
        help="requests queued (FIFO) for a free slot beyond those; past both: RESOURCE_EXHAUSTED (default 0)",
    )
    parser.add_argument("--retry-after-s", type=float, default=env("retry_after_s"))
    parser.add_argument("--drafter-deadline-s", type=float, default=env("drafter_deadline_s"))
    parser.add_argument("--verifier-deadline-s", type=float, default=env("verifier_deadline_s"))
    parser.add_argument("--health-interval-s", type=float, default=env("health_interval_s"))
    parser.add_argument(
        "--health-timeouts-to-eject",
        type=int,
        default=env("health_timeouts_to_eject"),
        help="consecutive timed-out calls and health checks that mark a worker unhealthy (default 3)",
    )
    parser.add_argument(
        "--sequence-keepalive-s",
        type=float,
        default=env("sequence_keepalive_s"),
        help="how often the leases of open worker sequences are renewed (default 20; keep it well below the "
        "workers' --sequence-idle-timeout-s)",
    )
    parser.add_argument("--default-max-tokens", type=int, default=env("default_max_tokens"), help="for chat requests")
    parser.add_argument(
        "--max-model-len", type=int, default=env("max_model_len"), help="context length (0: verifier's)"
    )
    parser.add_argument(
        "--eos-token-id", type=int, action="append", help="extra EOS id (finish reasons without a tokenizer)"
    )
    parser.add_argument("--bearer-token-file", help="file holding the token the public API requires")
    parser.add_argument("--shutdown-grace-s", type=float, default=env("shutdown_grace_s"))
    add_tls_arguments(parser, ENV_PREFIX, environ, dials=True)
    parser.add_argument(
        "--tls-public-client-auth",
        action=argparse.BooleanOptionalAction,
        default=_bool(env("tls_public_client_auth")),
        help="with TLS, the public gRPC and HTTP ports also require a client certificate from --tls-ca (default: on;"
        f" env {ENV_PREFIX}TLS_PUBLIC_CLIENT_AUTH)",
    )
    parser.add_argument(
        "--worker-streams",
        action=argparse.BooleanOptionalAction,
        default=_bool(env("worker_streams")),
        help="send each worker's batches on one long-lived stream; off: one unary RPC per batch (default: on;"
        f" env {ENV_PREFIX}WORKER_STREAMS)",
    )
    return parser


def _bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes", "on")
