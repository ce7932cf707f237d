"""The drafter's Prometheus series, in a registry of its own; served when ``--metrics-port`` is given.

The scheduler records them: it owns the batches and the open sequences.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from grpc_common.metrics import BATCH_SIZE_BUCKETS, log_buckets, service_registry


class DrafterMetrics:
    """Batching, drafting time and output of one drafter."""

    def __init__(self) -> None:
        self.registry = service_registry()
        registry = self.registry
        self.batch_size = Histogram(
            "specdec:drafter_batch_size", "Sequences per drafter call.", buckets=BATCH_SIZE_BUCKETS, registry=registry
        )
        self.propose_seconds = Histogram(
            "specdec:drafter_propose_seconds",
            "Time of one batched drafter call.",
            buckets=log_buckets(1e-4, 10.0, 5),
            registry=registry,
        )
        self.arrival_wait_seconds = Histogram(
            "specdec:drafter_arrival_wait_seconds",
            "Time a drafter call waited, after its first Propose, for the calls it expected back.",
            buckets=log_buckets(1e-5, 1.0, 5),
            registry=registry,
        )
        self.proposals = Counter("specdec:drafter_proposals", "Propose calls answered.", registry=registry)
        self.draft_tokens = Counter("specdec:drafter_draft_tokens", "Tokens (tree nodes) proposed.", registry=registry)
        self.cancelled = Counter(
            "specdec:drafter_cancelled_proposals",
            "Propose calls cancelled by a Commit (pipeline misses).",
            registry=registry,
        )
        self.open_sequences = Gauge("specdec:drafter_open_sequences", "Open sequences.", registry=registry)
        self.sequences_reclaimed = Counter(
            "specdec:sequences_reclaimed",
            "Open sequences closed because no call named them for the idle timeout (their router is gone).",
            registry=registry,
        )
