"""The options of one simulated worker process, from its command line.

One frozen config drives both roles so that :mod:`bench.load.simulate` can build every worker's command line
the same way; the fields a role does not use are ignored (``acceptance`` by the drafter, for instance).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from bench.load.simulate import LatencySpec, drafter_kind, parse_acceptance
from grpc_common.arrivals import DEFAULT_FRACTION


@dataclass(frozen=True)
class WorkerConfig:
    """One simulated worker process."""

    role: str
    acceptance: tuple[float, ...]
    latency: LatencySpec
    per_sequence_ms: float = 0.0
    seed: int = 0
    vocab_size: int = 49152
    first_token_id: int = 32
    model: str = "smollm2-135m"
    draft_support: int = 4
    max_batch_size: int = 1024
    batch_wait_ms: float = 0.0
    arrival_wait: float = DEFAULT_FRACTION
    max_sequences: int = 8192
    host: str = "127.0.0.1"
    port: int = 0
    grace_s: float = 2.0

    def __post_init__(self) -> None:
        if self.role not in ("drafter", "verifier"):
            raise ValueError(f"role must be drafter or verifier, got {self.role!r}")
        if not 0 <= self.first_token_id < self.vocab_size - 1:
            raise ValueError(f"first_token_id must leave at least two ids below vocab_size {self.vocab_size}")
        if min(self.per_sequence_ms, self.batch_wait_ms, self.draft_support) < 0 or self.max_batch_size < 1:
            raise ValueError("per_sequence_ms, batch_wait_ms and draft_support must be >= 0, max_batch_size >= 1")
        if not 0 <= self.arrival_wait <= 1:
            raise ValueError(f"arrival_wait must be in [0, 1], got {self.arrival_wait}")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> WorkerConfig:
        parser = argparse.ArgumentParser(
            prog="python -m bench.load.simulated",
            description="A drafter or verifier with no model, on the real gRPC protocol.",
        )
        parser.add_argument("--role", required=True, choices=("drafter", "verifier"))
        parser.add_argument("--host", default=cls.host)
        parser.add_argument("--port", type=int, default=cls.port)
        parser.add_argument("--seed", type=int, default=cls.seed, help="seed of the latency draws")
        parser.add_argument("--acceptance", default="0.8,0.7,0.6,0.5", help="per-position acceptance probabilities")
        parser.add_argument("--latency", default="const:5", help="per batched call: const:M, lognormal:M,S, ...")
        parser.add_argument("--per-sequence-ms", type=float, default=cls.per_sequence_ms, help="added per call")
        parser.add_argument("--vocab-size", type=int, default=cls.vocab_size)
        parser.add_argument("--first-token-id", type=int, default=cls.first_token_id, help="lower ids: special")
        parser.add_argument("--model", default=cls.model, help="model name the verifier reports")
        parser.add_argument("--draft-support", type=int, default=cls.draft_support, help="q support; 0: one-hot")
        parser.add_argument("--max-batch-size", type=int, default=cls.max_batch_size)
        parser.add_argument("--batch-wait-ms", type=float, default=cls.batch_wait_ms)
        parser.add_argument(
            "--arrival-wait", type=float, default=cls.arrival_wait, help="wait for expected calls (fraction of a batch)"
        )
        parser.add_argument("--max-sequences", type=int, default=cls.max_sequences)
        args = parser.parse_args(argv)
        return cls(
            role=args.role,
            acceptance=parse_acceptance(args.acceptance),
            latency=LatencySpec.parse(args.latency),
            per_sequence_ms=args.per_sequence_ms,
            seed=args.seed,
            vocab_size=args.vocab_size,
            first_token_id=args.first_token_id,
            model=args.model,
            draft_support=args.draft_support,
            max_batch_size=args.max_batch_size,
            batch_wait_ms=args.batch_wait_ms,
            arrival_wait=args.arrival_wait,
            max_sequences=args.max_sequences,
            host=args.host,
            port=args.port,
        )

    @property
    def kind(self) -> str:
        return drafter_kind(self.draft_support)
