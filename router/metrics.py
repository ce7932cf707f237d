"""The router's Prometheus series (DESIGN §7), in a registry of its own, served at ``GET /metrics``.

vLLM's names where they exist, labelled ``model_name`` like vLLM's, so dashboards and load tools built for vLLM
read ours unchanged; our own under ``specdec:``. The speculation counters move once per round with the same
counts as the request's :class:`~router.pipeline.RequestStats` (tree nodes count as drafted tokens, never as
accepted length), so over any interval they add up to the final messages' stats. Request latencies follow
vLLM's definitions, timed by the router: TTFT from the request's admission to its first chunk, one
inter-token observation per gap between consecutive chunks (a round's burst of tokens is one chunk, as a
vLLM engine step is), end to end from admission to the request's end.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Counter, Gauge

from grpc_common.errors import status_for
from grpc_common.metrics import LoopCounter, LoopHistogram, LoopMetrics, log_buckets, service_registry
from router.errors import NoWorkerError, UnauthenticatedError, WorkerUnavailableError
from router.pipeline import Chunk, Drafted, Emit, Final, RoundRecord

# vLLM's own bounds, so histograms compare bucket for bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TTFT_BUCKETS += (40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS += (80.0,)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
E2E_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)
ROUND_BUCKETS = log_buckets(1e-4, 10.0, 5)  # draft / verify / state / round: 100 µs to 10 s
DRAFT_SIZE_BUCKETS = (0.0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64)
OVERHEAD_BUCKETS = log_buckets(50e-6, 1.0, 10)  # fine: benches read p50 / p99 of the overhead from it

FINISH_REASONS = ("stop", "length")
WIRE_DIRECTIONS = ("draft", "verdict", "features")


def failure_code(error: BaseException) -> str:
    """The gRPC status name a failed request is answered with (the HTTP API maps the same errors)."""
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    if isinstance(error, UnauthenticatedError):
        return "UNAUTHENTICATED"
    if isinstance(error, WorkerUnavailableError | NoWorkerError):
        return "UNAVAILABLE"
    return status_for(error).name


class RouterMetrics:
    """Every series of one router; observes sessions as their :class:`~router.pipeline.RoundObserver`."""

    def __init__(self, model_name: str) -> None:
        self.registry = service_registry()
        loop = LoopMetrics(self.registry)  # the series updated on the router's event loop only
        model = ["model_name"]

        def counter(name: str, documentation: str) -> LoopCounter:
            return loop.counter(name, documentation, model).labels(model_name)

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, model, registry=self.registry).labels(model_name)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> LoopHistogram:
            return loop.histogram(name, documentation, buckets, model).labels(model_name)

        def own_counter(name: str, documentation: str) -> LoopCounter:  # the router's own series: no model label
            return loop.counter(name, documentation).labels()

        def own_histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> LoopHistogram:
            return loop.histogram(name, documentation, buckets).labels()

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Rounds that verified a non-empty draft.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens (tree nodes) verified.")
        self.num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted (not counting correction or bonus)."
        )
        self._accepted_per_pos = loop.counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted at each position (0: the first drafted token).",
            ["model_name", "position"],
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Admission to the first streamed chunk.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Gap between consecutive chunks of a request.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Admission to the end of a finished request.", E2E_BUCKETS
        )
        self.requests_running = gauge("vllm:num_requests_running", "Requests generating.")
        self.requests_waiting = gauge(
            "vllm:num_requests_waiting", "Requests queued for a running slot (at most max_waiting_requests)."
        )
        request_success = loop.counter(
            "vllm:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"]
        )
        self._request_success = {reason: request_success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")

        self.draft_seconds = own_histogram("specdec:draft_seconds", "Drafter time per proposal.", ROUND_BUCKETS)
        self.verify_seconds = own_histogram("specdec:verify_seconds", "Verifier time per round.", ROUND_BUCKETS)
        self.state_seconds = own_histogram(
            "specdec:state_seconds",
            "State refresh time per round: the verifier's commit, and the drafter's of a Commit the round waited for.",
            ROUND_BUCKETS,
        )
        self.round_seconds = own_histogram("specdec:round_seconds", "Wall time of a round.", ROUND_BUCKETS)
        self.router_overhead_seconds = own_histogram(
            "specdec:router_overhead_seconds",
            "Round wall time less exposed draft, verify and state time: what the router, the wire and waiting in the "
            "workers' queues add.",
            OVERHEAD_BUCKETS,
        )
        self.verifier_queue_seconds = own_histogram(
            "specdec:verifier_queue_seconds",
            "Time a round's Verify waited at the verifier for its forward to start (a part of the router overhead).",
            OVERHEAD_BUCKETS,
        )
        self.drafter_queue_seconds = own_histogram(
            "specdec:drafter_queue_seconds",
            "Time a round's fresh proposal waited at the drafter for its batch to start (a part of the router "
            "overhead; 0 for a round whose proposal was pre-drafted).",
            OVERHEAD_BUCKETS,
        )
        self.draft_size = own_histogram(
            "specdec:draft_tokens_per_round",
            "Draft tokens (tree nodes) verified per round, target-only rounds included (auto: the lengths chosen).",
            DRAFT_SIZE_BUCKETS,
        )
        self.pipeline_hits = own_counter("specdec:pipeline_hits", "Pipelined rounds whose pre-drafted chain was used.")
        self.pipeline_rejection_hits = own_counter(
            "specdec:pipeline_rejection_hits",
            "Pipeline hits whose pre-draft was prepared for a rejection verdict (multi-outcome pre-drafting).",
        )
        self.pipeline_misses = own_counter("specdec:pipeline_misses", "Pipelined rounds that discarded it.")
        wire_bytes = loop.counter(
            "specdec:wire_bytes",
            "Bytes of proposals (draft) and verdicts (verdict) received, and of the verdicts' target feature rows "
            "relayed to drafters (features).",
            ["direction"],
        )
        self._wire_bytes = {direction: wire_bytes.labels(direction) for direction in WIRE_DIRECTIONS}
        self.drafter_fallbacks = own_counter(
            "specdec:drafter_fallbacks", "Finished requests that went target-only (drafter failed or none free)."
        )
        # counted also where a request is refused while it is tokenized, off the loop: a locked series
        self._request_failure = Counter(
            "specdec:request_failure", "Failed requests by gRPC status.", ["code"], registry=self.registry
        )
        self._model_name = model_name
        self._accepted_per_pos_children: list[LoopCounter] = []  # by position: labels() costs a lookup every round

    # --- RoundObserver ------------------------------------------------------------------------------------

    def on_proposal(self, drafted: Drafted) -> None:
        self.draft_seconds.observe(drafted.draft_ns / 1e9)
        self._wire_bytes["draft"].inc(drafted.wire_bytes)

    def on_round(self, record: RoundRecord) -> None:
        verified = record.verified
        accepted = len(verified.accepted_path)
        self.draft_size.observe(record.draft_size)
        if record.draft_size:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(record.draft_size)
            self.num_accepted_tokens.inc(accepted)
            for position in range(accepted):
                self._accepted_at(position).inc()
        self.verify_seconds.observe(verified.verify_ns / 1e9)
        state_ns = verified.state_ns + record.exposed_commit_ns  # the verifier's commit and the drafter's
        self.state_seconds.observe(state_ns / 1e9)
        self.round_seconds.observe(record.wall_ns / 1e9)
        overhead_ns = record.wall_ns - record.exposed_draft_ns - verified.verify_ns - state_ns
        self.router_overhead_seconds.observe(max(0, overhead_ns) / 1e9)
        self.verifier_queue_seconds.observe(verified.queued_ns / 1e9)
        self.drafter_queue_seconds.observe(record.exposed_draft_queue_ns / 1e9)
        if record.pipeline_hit is not None:
            (self.pipeline_hits if record.pipeline_hit else self.pipeline_misses).inc()
            if record.rejection_hit:
                self.pipeline_rejection_hits.inc()
        self._wire_bytes["verdict"].inc(verified.wire_bytes)
        self._wire_bytes["features"].inc(verified.feature_bytes)

    def _accepted_at(self, position: int) -> LoopCounter:
        """The accepted-per-position series of ``position`` (its children are made in order: every accepted
        position's predecessors were accepted too)."""
        children = self._accepted_per_pos_children
        while len(children) <= position:
            children.append(self._accepted_per_pos.labels(self._model_name, str(len(children))))
        return children[position]

    # --- requests -----------------------------------------------------------------------------------------

    def request(self, prompt_tokens: int) -> RequestTimer:
        """Start timing a request that has just been admitted (or is about to be refused)."""
        return RequestTimer(self, prompt_tokens)

    def request_failed(self, error: BaseException) -> None:
        """A request failed or was refused with ``error``."""
        self._request_failure.labels(failure_code(error)).inc()

    def request_finished(self, final: Final) -> None:
        self._request_success[final.finish_reason].inc()
        if final.stats.drafter_fallback:
            self.drafter_fallbacks.inc()


class RequestTimer:
    """One request's clock: TTFT at its first chunk, one inter-token gap per later chunk, end to end at the end."""

    def __init__(self, metrics: RouterMetrics, prompt_tokens: int) -> None:
        self._metrics = metrics
        self._prompt_tokens = prompt_tokens
        self._started = time.perf_counter()
        self._last: float | None = None

    def timed(self, emit: Emit) -> Emit:
        """``emit`` that first records the chunk."""

        async def timed_emit(chunk: Chunk) -> None:
            self.chunk(chunk)
            await emit(chunk)

        return timed_emit

    def chunk(self, chunk: Chunk) -> None:
        now, metrics = time.perf_counter(), self._metrics
        if self._last is None:
            metrics.time_to_first_token.observe(now - self._started)
            metrics.prompt_tokens.inc(self._prompt_tokens)  # prefilled once the first token exists, as vLLM counts
        else:
            metrics.inter_token_latency.observe(now - self._last)
        metrics.generation_tokens.inc(len(chunk.token_ids))
        self._last = now

    def finished(self, final: Final) -> None:
        self._metrics.e2e_request_latency.observe(time.perf_counter() - self._started)
        self._metrics.request_finished(final)

    def failed(self, error: BaseException) -> None:
        self._metrics.request_failed(error)
