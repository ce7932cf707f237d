"""The verifier service's one frozen config, built once from the command line over ``SPECDEC_VERIFIER_*`` env vars."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from grpc_common.arrivals import DEFAULT_FRACTION
from grpc_common.convert import MAX_PROPOSAL_NODES
from grpc_common.metrics import check_metrics_port, parse_metrics_port
from grpc_common.server import DEFAULT_MAX_MESSAGE_BYTES
from grpc_common.tls import PLAINTEXT, TlsConfig, add_tls_arguments, tls_from_args
from specdec.errors import InvalidArgumentError
from specdec.precision import MODEL_DTYPES, check_dtype

ENV_PREFIX = "SPECDEC_VERIFIER_"


@dataclass(frozen=True)
class VerifierConfig:
    """Everything a verifier process needs; every field is also ``--field-name`` and ``SPECDEC_VERIFIER_FIELD_NAME``.

    ``max_batch_size`` caps the Verify calls that share one target forward. The scheduler is a step loop
    (:mod:`grpc_common.scheduler`): a forward starts as soon as the previous one ends, with every call that has
    arrived, and a ``Batch`` RPC's calls arrive as one group. After the first call of a forward it waits for the
    sequences it expects back within ``arrival_wait`` of a forward's duration, no longer than that pays (0: never
    wait; :mod:`grpc_common.arrivals`): a stream whose pre-draft missed drafts before it sends its Verify, and without
    the wait it would miss the forward the others started. ``batch_wait_ms`` > 0 replaces that with a fixed window:
    wait up to that long while some open sequence has no call queued.
    ``max_batch_tokens`` caps the positions of one forward (prefills of new prompts + draft nodes), so a burst of
    long new prompts is spread over several forwards instead of stalling every stream's round for one huge one.
    ``max_prefill_backlog_s`` (0: no bound) bounds the prefill a new prompt may queue behind: an OpenSequence whose
    prompt would wait behind more seconds of other prompts' prefill (forwards of ``max_batch_tokens`` at the cost the
    verifier measures for such a forward) answers RESOURCE_EXHAUSTED, which the router passes on as "overloaded, retry
    later", instead of the prompt waiting past the router's deadline (30 s), which fails the request as UNAVAILABLE.
    ``max_sequences`` bounds the open sequences (beyond it OpenSequence answers RESOURCE_EXHAUSTED) and the queued
    Verify calls.
    ``max_seq_len`` (0: the model's context) caps prompt + generated tokens of a sequence. ``max_workers``
    (0: ``max_sequences + 8``) is the number of gRPC handler threads; a Verify call holds one while it waits.
    ``world_size`` > 1 shards the model over that many tensor-parallel ranks; ``rank`` 0 serves. Both default
    to the ``WORLD_SIZE`` / ``RANK`` a launcher such as ``torchrun`` sets. ``metrics_port`` (None: no metrics
    server; 0: a free port) serves Prometheus series at ``http://host:metrics_port/metrics`` (rank 0).
    ``malloc_trim_idle_s`` (0: never) is how long the scheduler waits for a job after some work before it returns
    freed heap memory to the OS with glibc's ``malloc_trim`` (:mod:`grpc_common.memory`; skipped where the C library
    is not glibc): without it glibc keeps what bursts of long prompts freed and the idle RSS creeps up (+100-160 MiB
    over 200 requests of ``python -m bench.verifier_memory``, flat with it). A trim takes a few milliseconds; 1 s is
    far longer than the gap between two rounds of a busy sequence, so trims only run in lulls.
    ``malloc_mmap_threshold_mb`` (0: glibc's own, which rises with the largest block freed) fixes the size from
    which the process's allocations are mmapped, so that large blocks never pin heap pages (same module).
    ``tls`` (``--tls-cert`` / ``--tls-key`` / ``--tls-ca``, :mod:`grpc_common.tls`) makes the gRPC port mutual TLS.
    ``sequence_idle_timeout_s`` (0: never) is the lease of an open sequence: one that no call (or Touch) has named for
    that long is closed and its KV freed, so a router that died cannot leak sequences until ``max_sequences`` refuses
    everyone; the default is four times the router's default verifier deadline, and a live router touches its idle
    sequences far more often. Every message is bounded before anything is allocated: ``max_proposal_nodes`` nodes
    per proposal, ``max_batch_calls`` calls and ``max_batch_nodes`` proposal nodes per Batch (the router sends at
    most 512 calls per Batch and trees of at most 512 nodes).
    ``calibrate_positions`` (0: none) is the largest forward the verifier times before it serves, at every power of
    two up to it (:mod:`specdec.calibration`; about a second at 64 on a 2-core CPU): its ``Status`` reports them, and a
    router's adaptive speculation prices draft lengths from them until it has measured its own forwards.
    """

    model: str = "smollm2-135m"
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_batch_size: int = 32
    max_batch_tokens: int = 2048
    max_prefill_backlog_s: float = 10.0
    batch_wait_ms: float = 0.0
    arrival_wait: float = DEFAULT_FRACTION
    max_sequences: int = 256
    max_seq_len: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_workers: int = 0
    torch_threads: int = 0
    grace_s: float = 5.0
    malloc_trim_idle_s: float = 1.0
    malloc_mmap_threshold_mb: int = 16
    sequence_idle_timeout_s: float = 120.0
    max_proposal_nodes: int = MAX_PROPOSAL_NODES
    max_batch_calls: int = 1024
    max_batch_nodes: int = 8192
    calibrate_positions: int = 64
    world_size: int = 1
    rank: int = 0
    tls: TlsConfig = PLAINTEXT

    def __post_init__(self) -> None:
        if not 0 <= self.arrival_wait <= 1:
            raise InvalidArgumentError("arrival_wait", f"must be in [0, 1], got {self.arrival_wait}")
        check_dtype(self.dtype)
        if not 0 <= self.port < 65536:
            raise InvalidArgumentError("port", f"must be in [0, 65536), got {self.port}")
        check_metrics_port(self.metrics_port)
        if not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError("rank", f"must be in [0, world_size = {self.world_size}), got {self.rank}")
        for name in (
            "max_batch_size",
            "max_batch_tokens",
            "max_sequences",
            "max_message_bytes",
            "max_proposal_nodes",
            "max_batch_calls",
            "max_batch_nodes",
            "world_size",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(name, f"must be >= 1, got {getattr(self, name)}")
        for name in (
            "batch_wait_ms",
            "max_prefill_backlog_s",
            "max_seq_len",
            "calibrate_positions",
            "max_workers",
            "torch_threads",
            "grace_s",
            "malloc_trim_idle_s",
            "malloc_mmap_threshold_mb",
            "sequence_idle_timeout_s",
        ):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(name, f"must be >= 0, got {getattr(self, name)}")

    @property
    def handler_threads(self) -> int:
        """gRPC handler threads: enough for every open sequence to wait on a Verify, plus a few for the rest."""
        return self.max_workers or self.max_sequences + 8

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> VerifierConfig:
        """Parse ``argv`` (default ``sys.argv[1:]``); unset flags fall back to ``SPECDEC_VERIFIER_*``, then defaults."""
        environ = os.environ if environ is None else environ
        defaults = {field.name: field.default for field in fields(cls)}
        parser = argparse.ArgumentParser(prog="python -m verifier_service", description="Serve a target model.")

        def option(name: str, cast: Callable[[str], Any], help_text: str, env_name: str = "") -> None:
            env_name = env_name or ENV_PREFIX + name.upper()
            default = cast(environ[env_name]) if env_name in environ else defaults[name]
            parser.add_argument(
                "--" + name.replace("_", "-"),
                dest=name,
                type=cast,
                default=default,
                help=f"{help_text} (env {env_name})",
            )

        option("model", str, "target model: alias, GGUF file, local directory or hub id")
        option("host", str, "address to listen on")
        option("port", int, "port to listen on (0: any free port)")
        option("metrics_port", parse_metrics_port, "port of the Prometheus /metrics endpoint (0: any free port)")
        option("device", str, "torch device of the model")
        option("dtype", str, f"model precision: {', '.join(MODEL_DTYPES)}")
        option("max_batch_size", int, "most Verify calls in one target forward")
        option("max_batch_tokens", int, "most positions (prompt prefills + draft nodes) in one forward")
        option("max_prefill_backlog_s", float, "seconds of prefill a new prompt may wait behind (0: no bound)")
        option("batch_wait_ms", float, "how long to wait for more Verify calls after the first (0: never)")
        option("arrival_wait", float, "wait for the calls expected back, as a fraction of a forward (0: never)")
        option("max_sequences", int, "open sequences before OpenSequence answers RESOURCE_EXHAUSTED")
        option("max_seq_len", int, "context length per sequence (0: the model's)")
        option("max_message_bytes", int, "largest gRPC message accepted or sent")
        option("max_workers", int, "gRPC handler threads (0: max_sequences + 8)")
        option("torch_threads", int, "torch intra-op threads (0: torch's default)")
        option("grace_s", float, "seconds in-flight calls get to finish on SIGTERM")
        option("malloc_trim_idle_s", float, "idle seconds before freed memory goes back to the OS (0: never)")
        option("malloc_mmap_threshold_mb", int, "allocations from this size are mmapped (0: glibc's dynamic default)")
        option("sequence_idle_timeout_s", float, "seconds without a call before an open sequence is closed (0: never)")
        option("max_proposal_nodes", int, "most nodes in one proposal")
        option("max_batch_calls", int, "most calls in one Batch")
        option("max_batch_nodes", int, "most proposal nodes in one Batch")
        option("calibrate_positions", int, "time forwards of up to this many positions at start (0: none)")
        option("world_size", int, "tensor-parallel ranks", env_name="WORLD_SIZE")
        option("rank", int, "this process's rank (0 serves gRPC)", env_name="RANK")
        add_tls_arguments(parser, ENV_PREFIX, environ)
        values = vars(parser.parse_args(argv))
        tls = tls_from_args(values)
        return cls(**values, tls=tls)
