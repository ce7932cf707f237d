"""The drafter service's one frozen config, built once from the command line over ``SPECDEC_DRAFTER_*`` env vars."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from grpc_common.arrivals import DEFAULT_FRACTION
from grpc_common.convert import MAX_PROPOSAL_NODES
from grpc_common.metrics import check_metrics_port, parse_metrics_port
from grpc_common.tls import PLAINTEXT, TlsConfig, add_tls_arguments, tls_from_args
from specdec.drafter_kinds import DRAFTER_KINDS
from specdec.drafters import DraftConfig, check_quantizable
from specdec.errors import InvalidArgumentError
from specdec.precision import DRAFT_QUANTIZATIONS, MODEL_DTYPES, check_dtype

SERVED_KINDS: tuple[str, ...] = tuple(kind for kind in DRAFTER_KINDS if kind != "none")
ENV_PREFIX = "SPECDEC_DRAFTER_"


@dataclass(frozen=True)
class DrafterConfig:
    """Everything a drafter process needs; every field is also ``--field-name`` and ``SPECDEC_DRAFTER_FIELD_NAME``.

    ``target`` is the model the proposals are for: early exit drafts with its first ``early_exit_layers``
    layers (default a quarter), eagle with the head trained on its features in the directory ``draft_model``
    (default: the head cached for ``target``), the other kinds use its vocabulary to validate token ids (and
    the model drafter checks that ``draft_model`` shares it). ``draft_top_k`` truncates ``q`` so it travels exactly
    as a sparse row (DESIGN §5). ``num_draft_tokens`` is the default γ when a sequence asks for 0.
    ``max_batch_size`` caps the Propose calls one drafter call answers. After the first, the scheduler waits for
    the sequences it expects back within ``arrival_wait`` of a draft's duration (:mod:`grpc_common.arrivals`; 0:
    takes what is queued), or, with ``batch_wait_ms`` > 0, up to that long instead. ``max_open_sequences`` bounds
    state: beyond it OpenSequence answers RESOURCE_EXHAUSTED. ``metrics_port`` (None: no metrics server; 0: a
    free port) serves Prometheus series at ``http://host:metrics_port/metrics``. ``tls`` (``--tls-cert`` /
    ``--tls-key`` / ``--tls-ca``, :mod:`grpc_common.tls`) makes the gRPC port mutual TLS. ``sequence_idle_timeout_s``
    (0: never) is the lease of an open sequence: one that no call (or Touch) has named for that long is closed, so a
    router that died leaks nothing. ``malloc_trim_idle_s`` (0: never) is how long the scheduler waits for a job after
    some work before it hands freed heap memory back to the OS, as the verifier's does (:mod:`grpc_common.memory`):
    an eagle drafter's RSS kept 26 MiB of free pages after 20 minutes at 0.2 QPS
    (``bench/results/memory-eagle-soak/``). Every message is bounded before anything is allocated: a sequence's shape
    at most ``max_proposal_nodes`` nodes, its text (prompt + committed) at most ``max_seq_len`` tokens, a Batch at most
    ``max_batch_calls`` calls. ``eagle_context`` (default 640, the span ``specdec distill`` trains a head on) is how
    many head positions an eagle drafter attends over, and so how many of a prompt's feature rows it is sent;
    ``draft_quantization`` (``auto``, ``none``, ``int8``) what its head's draft layers run on (only an eagle head's
    can be int8; ``auto``: int8 where a float32 head runs on a CPU that can); ``lookup_min_match`` (0: never; default:
    the tail ``specdec distill`` chose for the head, else 5) makes an eagle round whose text's tail of at least that
    many tokens occurred before a prompt-lookup chain.
    """

    kind: str
    target: str = "smollm2-135m"
    draft_model: str | None = None
    early_exit_layers: int | None = None
    draft_top_k: int = 20
    num_draft_tokens: int = 4
    predraft_outcomes: int = 1
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    max_batch_size: int = 64
    batch_wait_ms: float = 0.0
    arrival_wait: float = DEFAULT_FRACTION
    max_open_sequences: int = 4096
    max_workers: int = 64
    device: str = "cpu"
    dtype: str = "float32"
    torch_threads: int = 0
    grace_s: float = 5.0
    tls: TlsConfig = PLAINTEXT
    sequence_idle_timeout_s: float = 120.0
    malloc_trim_idle_s: float = 1.0
    max_proposal_nodes: int = MAX_PROPOSAL_NODES
    max_batch_calls: int = 1024
    max_seq_len: int = 32768
    eagle_context: int | None = None  # None: the head's default (HEAD_CONTEXT)
    lookup_min_match: int | None = None  # None: the head's choice (specdec distill measured it), else 5
    draft_quantization: str = "auto"

    def __post_init__(self) -> None:
        if not 0 <= self.arrival_wait <= 1:
            raise InvalidArgumentError("arrival_wait", f"must be in [0, 1], got {self.arrival_wait}")
        if self.kind not in SERVED_KINDS:
            raise InvalidArgumentError("kind", f"must be one of {', '.join(SERVED_KINDS)}, got {self.kind!r}")
        if self.kind == "model" and not self.draft_model:
            raise InvalidArgumentError("draft_model", "the model drafter needs --draft-model")
        if self.early_exit_layers is not None and self.early_exit_layers < 1:
            raise InvalidArgumentError("early_exit_layers", f"must be >= 1, got {self.early_exit_layers}")
        check_dtype(self.dtype)
        check_quantizable(self.kind, self.draft_quantization)
        if not 0 <= self.port < 65536:
            raise InvalidArgumentError("port", f"must be in [0, 65536), got {self.port}")
        check_metrics_port(self.metrics_port)
        for name in (
            "max_batch_size",
            "max_open_sequences",
            "max_workers",
            "max_proposal_nodes",
            "max_batch_calls",
            "max_seq_len",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.lookup_min_match is not None and self.lookup_min_match < 0:
            raise InvalidArgumentError("lookup_min_match", f"must be >= 0 (0: never), got {self.lookup_min_match}")
        if self.eagle_context is not None and self.eagle_context < 1:
            raise InvalidArgumentError("eagle_context", f"must be >= 1, got {self.eagle_context}")
        for name in ("batch_wait_ms", "torch_threads", "grace_s", "sequence_idle_timeout_s", "malloc_trim_idle_s"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(name, f"must be >= 0, got {getattr(self, name)}")
        self.draft_config()  # validates num_draft_tokens, draft_top_k and predraft_outcomes

    def draft_config(self) -> DraftConfig:
        """The default candidate shape (a chain of ``num_draft_tokens``); sequences may ask for their own."""
        return DraftConfig(
            num_draft_tokens=self.num_draft_tokens,
            draft_top_k=self.draft_top_k,
            predraft_outcomes=self.predraft_outcomes,
        )

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> DrafterConfig:
        """Parse ``argv`` (default ``sys.argv[1:]``); unset flags fall back to ``SPECDEC_DRAFTER_*``, then defaults."""
        environ = os.environ if environ is None else environ
        defaults = {field.name: field.default for field in fields(cls)}
        parser = argparse.ArgumentParser(prog="python -m drafter_service", description=__doc__)

        def option(name: str, cast: Callable[[str], Any], help_text: str, **extra: Any) -> None:
            env_name = ENV_PREFIX + name.upper()
            default = cast(environ[env_name]) if env_name in environ else defaults.get(name)
            required = name == "kind" and default is None
            parser.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                type=cast,
                default=default,
                required=required,
                help=f"{help_text} (env {env_name})",
                **extra,
            )

        option("kind", str, "drafter kind", choices=SERVED_KINDS)
        option("target", str, "target model: alias, GGUF file, local directory or hub id")
        option(
            "draft_model",
            str,
            "draft model for --kind model (same tokenizer as the target); for --kind eagle the head's directory "
            "(default: the head `specdec distill` cached for --target)",
        )
        option("early_exit_layers", int, "target layers the early-exit drafter runs (default: a quarter)")
        option("draft_top_k", int, "the drafter's own top-k truncation of q (0: none)")
        option("num_draft_tokens", int, "default chain length / tree depth")
        option(
            "predraft_outcomes",
            int,
            "proposals one pipelined pre-draft prepares: 1 for full acceptance, each more for a likely rejection",
        )
        option("host", str, "address to listen on")
        option("port", int, "port to listen on (0: any free port)")
        option("metrics_port", parse_metrics_port, "port of the Prometheus /metrics endpoint (0: any free port)")
        option("max_batch_size", int, "most Propose calls answered by one drafter call")
        option("batch_wait_ms", float, "how long to wait for more Propose calls after the first")
        option("arrival_wait", float, "wait for the calls expected back, as a fraction of a draft (0: never)")
        option("max_open_sequences", int, "open sequences before OpenSequence answers RESOURCE_EXHAUSTED")
        option("max_workers", int, "gRPC handler threads")
        option("device", str, "torch device of the model")
        option("dtype", str, "model precision", choices=MODEL_DTYPES)
        option("torch_threads", int, "torch intra-op threads (0: torch's default)")
        option("grace_s", float, "seconds in-flight calls get to finish on SIGTERM")
        option("sequence_idle_timeout_s", float, "seconds without a call before an open sequence is closed (0: never)")
        option("malloc_trim_idle_s", float, "idle seconds before freed memory goes back to the OS (0: never)")
        option("max_proposal_nodes", int, "most nodes of a sequence's candidate shape")
        option("max_batch_calls", int, "most calls in one Batch")
        option("max_seq_len", int, "most tokens of a sequence's text (prompt + committed)")
        option("eagle_context", int, "head positions an eagle drafter attends over (default 640, its training span)")
        option(
            "lookup_min_match",
            int,
            "an eagle round whose text's last tokens, at least this many, occurred before drafts what followed them "
            "(prompt lookup) instead of running the head (0: never; default: the head's, which specdec distill "
            "measured, else 5)",
        )
        option(
            "draft_quantization",
            str,
            "an eagle head's draft layers over int8 weights (int8), as loaded (none), or int8 where a float32 head "
            "runs on a CPU that can (auto)",
            choices=DRAFT_QUANTIZATIONS,
        )
        add_tls_arguments(parser, ENV_PREFIX, environ)
        values = vars(parser.parse_args(argv))
        tls = tls_from_args(values)
        return cls(**values, tls=tls)
