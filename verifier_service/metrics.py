"""The verifier's Prometheus series, in a registry of its own; served when ``--metrics-port`` is given.

The scheduler records batches and queue lengths (it owns them), the servicer the bytes of each Verify request and of
the feature rows in each reply.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Summary

from grpc_common.metrics import BATCH_SIZE_BUCKETS, log_buckets, service_registry


class VerifierMetrics:
    """Batching, forward time, open sequences and queued calls of one verifier serving ``model_name``."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = service_registry()
        registry = self.registry
        self.batch_size = Histogram(
            "specdec:verifier_batch_size",
            "Sequences per target forward.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.forward_seconds = Histogram(
            "specdec:verifier_forward_seconds",
            "Time of one batched verification (target forward, acceptance and state commit).",
            buckets=log_buckets(1e-4, 10.0, 5),
            registry=registry,
        )
        self.arrival_wait_seconds = Histogram(
            "specdec:verifier_arrival_wait_seconds",
            "Time a forward waited, after its first Verify call, for the calls it expected back.",
            buckets=log_buckets(1e-5, 1.0, 5),
            registry=registry,
        )
        self._forward_cost = Summary(
            "specdec:verifier_forward_cost_seconds",
            "Time of one batched verification by the positions in its forward (label: the power of two at or above "
            "the count): sum / count per label is the cost curve adaptive speculation plans with.",
            ["positions"],
            registry=registry,
        )
        self.verify_calls = Counter("specdec:verifier_verify_calls", "Verify calls answered.", registry=registry)
        self.prefill_chunks = Counter(
            "specdec:verifier_prefill_chunks",
            "Prompt chunks prefilled ahead of their sequence's first verification (chunked prefill).",
            registry=registry,
        )
        self.running = Gauge("vllm:num_requests_running", "Open sequences.", ["model_name"], registry=registry).labels(
            model_name
        )
        self.kv_cache_bytes = Gauge(
            "specdec:verifier_kv_cache_bytes",
            "Bytes of K/V the target's runner holds for the open sequences (on this rank, under tensor parallelism).",
            registry=registry,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Verify calls queued for the next batch.", ["model_name"], registry=registry
        ).labels(model_name)
        wire_bytes = Counter(
            "specdec:wire_bytes",
            "Bytes of Verify requests received (received) and of the feature rows sent with verdicts (features).",
            ["direction"],
            registry=registry,
        )
        self.received_bytes = wire_bytes.labels("received")
        self.feature_bytes = wire_bytes.labels("features")
        self.sequences_reclaimed = Counter(
            "specdec:sequences_reclaimed",
            "Open sequences closed because no call named them for the idle timeout (their router is gone).",
            registry=registry,
        )

    def observe_forward(self, positions: int, seconds: float) -> None:
        """One batched verification of ``positions`` positions that took ``seconds``."""
        self.forward_seconds.observe(seconds)
        bucket = 1 << max(positions - 1, 0).bit_length()
        self._forward_cost.labels(str(bucket)).observe(seconds)
