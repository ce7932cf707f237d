"""Prometheus metrics of the router (``GET /metrics``) and of the verifier and drafter (``--metrics-port``).

The round loop's observer hooks are checked on the in-memory fakes of ``test_router_pipeline`` (which draft time
a round exposes), the overhead arithmetic on one synthetic round. Then real services on tiny random Llama models
(CPU, loopback, greedy): the /metrics deltas around one known request must equal that request's own counters in
its final message, exactly; names are vLLM's where they exist. Failures (invalid, malformed, refused for
overload) count under their gRPC status; the fake-worker stack of ``test_router_grpc`` makes overload
deterministic.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import threading
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from drafter_service.config import DrafterConfig
from drafter_service.server import RunningDrafter, start_drafter
from grpc_common.metrics import LoopMetrics, log_buckets
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.pipeline import Drafted, RoundRecord, Session, Verified
from router.server import RunningRouter, start_router
from specdec.client import Chunk, Client, InvalidArgument, Overloaded
from specdec.models import LoadedModel
from tests.test_router_grpc import Stack
from tests.test_router_http import post, request
from tests.test_router_pipeline import PROMPT, FakeDrafter, FakePlacement, FakeVerifier, make_plan
from tests.tiny_models import tiny_draft, tiny_llama
from verifier_service.config import VerifierConfig
from verifier_service.server import RunningVerifier, start_verifier

VOCAB = 32
EOS = VOCAB - 1
GAMMA = 3
MAX_TOKENS = 23
PROMPT_IDS = [1, 2, 3, 1, 2, 7]

ROUTER_NAMES = {
    "process_cpu_seconds_total",  # the process's own CPU clock (router CPU per round)
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "specdec:draft_seconds_bucket",
    "specdec:verify_seconds_bucket",
    "specdec:state_seconds_bucket",
    "specdec:round_seconds_bucket",
    "specdec:router_overhead_seconds_bucket",
    "specdec:verifier_queue_seconds_bucket",
    "specdec:drafter_queue_seconds_bucket",
    "specdec:pipeline_hits_total",
    "specdec:pipeline_misses_total",
    "specdec:wire_bytes_total",
    "specdec:drafter_fallbacks_total",
    "specdec:request_failure_total",
}
VERIFIER_NAMES = {
    "process_cpu_seconds_total",  # the process's own CPU clock (router CPU per round)
    "specdec:verifier_batch_size_bucket",
    "specdec:verifier_forward_seconds_bucket",
    "specdec:verifier_arrival_wait_seconds_bucket",
    "specdec:verifier_verify_calls_total",
    "specdec:verifier_kv_cache_bytes",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "specdec:wire_bytes_total",
}
DRAFTER_NAMES = {
    "process_cpu_seconds_total",  # the process's own CPU clock (router CPU per round)
    "specdec:drafter_batch_size_bucket",
    "specdec:drafter_propose_seconds_bucket",
    "specdec:drafter_arrival_wait_seconds_bucket",
    "specdec:drafter_proposals_total",
    "specdec:drafter_draft_tokens_total",
    "specdec:drafter_open_sequences",
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Recorder:
    """A RoundObserver that keeps what it hears."""

    def __init__(self) -> None:
        self.proposals: list[Drafted] = []
        self.rounds: list[RoundRecord] = []

    def on_proposal(self, drafted: Drafted) -> None:
        self.proposals.append(drafted)

    def on_round(self, record: RoundRecord) -> None:
        self.rounds.append(record)


def test_the_round_loop_reports_every_round_and_which_draft_time_was_exposed() -> None:
    """Pipelined, a chain drafted during the previous round's verification (after a hit) exposes no draft time."""
    placement = FakePlacement([FakeVerifier()], [FakeDrafter(wrong_every=9)])
    recorder = Recorder()

    async def emit(_chunk: object) -> None:
        pass

    session = Session(make_plan("pipelined", max_tokens=40), placement, emit, sequence_id="seq", observer=recorder)
    stats = asyncio.run(session.run()).stats
    rounds = recorder.rounds
    assert len(rounds) == stats.rounds and stats.pipeline_hits and stats.pipeline_misses
    assert sum(r.draft_size for r in rounds) == stats.draft_tokens
    assert sum(len(r.verified.accepted_path) for r in rounds) == stats.accepted_tokens
    assert [r.pipeline_hit for r in rounds].count(True) == stats.pipeline_hits
    assert [r.pipeline_hit for r in rounds].count(False) == stats.pipeline_misses
    assert sum(p.draft_ns for p in recorder.proposals) == stats.draft_ns
    assert rounds[0].exposed_draft_ns == 500  # the fake drafts in 500 ns
    for previous, current in itertools.pairwise(rounds):
        expected = 0 if previous.pipeline_hit or not current.draft_size else 500
        assert current.exposed_draft_ns == expected
        assert current.wall_ns > 0


def test_router_overhead_is_round_wall_less_exposed_draft_verify_and_state() -> None:
    metrics = RouterMetrics("m")
    verified = Verified((0, 1), (5, 6, 7), False, False, (), verify_ns=3_000_000, state_ns=1_000_000, wire_bytes=9)
    metrics.on_round(RoundRecord(3, verified, wall_ns=10_000_000, exposed_draft_ns=2_000_000, pipeline_hit=False))
    registry = metrics.registry
    assert registry.get_sample_value("specdec:router_overhead_seconds_sum") == pytest.approx(0.004)
    assert registry.get_sample_value("specdec:router_overhead_seconds_bucket", {"le": "0.00397"}) == 0
    assert registry.get_sample_value("specdec:router_overhead_seconds_bucket", {"le": "0.005"}) == 1
    assert registry.get_sample_value("specdec:pipeline_misses_total") == 1
    assert registry.get_sample_value("specdec:wire_bytes_total", {"direction": "verdict"}) == 9
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    counts = [registry.get_sample_value(per_pos, {"model_name": "m", "position": str(p)}) for p in range(3)]
    assert counts == [1, 1, None]  # two of three drafted tokens accepted


def test_loop_metrics_expose_exactly_what_prometheus_own_counter_and_histogram_do() -> None:
    bounds = log_buckets(50e-6, 1.0, 10)
    generator = random.Random(0)
    values = [*bounds, 0.0, -1.0, 2.0, math.inf, math.nan] + [10 ** generator.uniform(-6, 1) for _ in range(500)]
    registries = [CollectorRegistry(), CollectorRegistry()]
    loop = LoopMetrics(registries[0])
    ours = loop.histogram("h", "h", bounds, ["k"]).labels("a")
    ours_counter = loop.counter("c", "c", ["k"])
    theirs = Histogram("h", "h", ["k"], buckets=bounds, registry=registries[1]).labels("a")
    theirs_counter = Counter("c", "c", ["k"], registry=registries[1])
    for index, value in enumerate(values):
        ours.observe(value)
        theirs.observe(value)
        ours_counter.labels(str(index % 3)).inc(index)
        theirs_counter.labels(str(index % 3)).inc(index)

    def samples(registry: CollectorRegistry, name: str) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
        [family] = [f for f in registry.collect() if f.name == name]
        assert family.type == ("counter" if name == "c" else "histogram")
        return [(s.name, tuple(sorted(s.labels.items())), s.value) for s in family.samples if "_created" not in s.name]

    for name in ("h", "c"):
        ours_samples, theirs_samples = samples(registries[0], name), samples(registries[1], name)
        assert [sample[:2] for sample in ours_samples] == [sample[:2] for sample in theirs_samples]
        assert all(
            a == b or (math.isnan(a) and math.isnan(b))
            for (*_, a), (*_, b) in zip(ours_samples, theirs_samples, strict=True)
        )
    with pytest.raises(ValueError, match="labelled"):
        ours_counter.labels()


def scrape(address: str) -> tuple[Samples, set[str]]:
    """Every sample of ``http://address/metrics`` by (name, labels), and every series name (a counter without
    children yet counts under its ``_total`` name)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: Samples = {}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            names.add(family.name + "_total")
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
            names.add(sample.name)
    return samples, names


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def per_position(samples: Samples, model: str) -> dict[int, float]:
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    return {
        int(dict(labels)["position"]): count
        for (sample, labels), count in samples.items()
        if sample == name and dict(labels)["model_name"] == model
    }


class Services:
    """A verifier and a model drafter, both serving metrics, and a router over them (token ids only)."""

    def __init__(self, target: LoadedModel, draft: LoadedModel) -> None:
        self.verifier: RunningVerifier = start_verifier(VerifierConfig(metrics_port=0), model=target)
        self.drafter: RunningDrafter = start_drafter(
            DrafterConfig(kind="model", draft_model=draft.name, draft_top_k=8, metrics_port=0),
            target=target,
            draft=draft,
        )
        config = RouterConfig(
            model=target.name,
            verifiers=(self.verifier.address,),
            drafters=(self.drafter.address,),
            grpc_port=0,
            http_port=0,
            eos_token_ids=(EOS,),
            health_interval_s=0.2,
            shutdown_grace_s=0.5,
        )
        self.router: RunningRouter = start_router(config)

    def stream(self, speculation: str) -> list[Chunk]:
        with Client(self.router.grpc_address, timeout_s=60) as client:
            return list(
                client.stream(
                    prompt_ids=PROMPT_IDS,
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    seed=5,
                    ignore_eos=True,
                    drafter="model",
                    speculation=speculation,
                    num_draft_tokens=GAMMA,
                )
            )

    def stop(self) -> None:
        self.router.stop(0.5)
        self.verifier.stop(0)
        self.drafter.stop(0)


@pytest.fixture(scope="module")
def services() -> Iterator[Services]:
    target = tiny_llama(seed=21, vocab_size=VOCAB, num_layers=2)
    services = Services(target, tiny_draft(target, seed=22, noise=0.03))
    yield services
    services.stop()


def sequential_draft_sizes(chunks: list[Chunk]) -> list[int]:
    """Each sequential round's draft size, from the tokens each chunk (one per round) committed: the drafter is
    asked for min(γ, remaining − 1) tokens, none when one token remains (the round's last token is the target's)."""
    sizes, remaining = [], MAX_TOKENS
    for chunk in chunks:
        sizes.append(min(GAMMA, remaining - 1))
        remaining -= len(chunk.token_ids)
    return sizes


@pytest.mark.parametrize("speculation", ["sequential", "pipelined"])
def test_router_counters_move_by_exactly_the_requests_stats(services: Services, speculation: str) -> None:
    model = services.router.config.model
    before, _ = scrape(services.router.http_address)
    chunks = services.stream(speculation)
    after, _ = scrape(services.router.http_address)
    final, token_chunks = chunks[-1], chunks[:-1]
    stats, usage = final.stats, final.usage
    assert stats is not None and usage is not None and final.finish_reason == "length"
    assert stats.rounds == len(token_chunks) and stats.draft_tokens > 0 and stats.accepted_tokens > 0

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:spec_decode_num_draft_tokens_total", model_name=model) == stats.draft_tokens
    assert delta("vllm:spec_decode_num_accepted_tokens_total", model_name=model) == stats.accepted_tokens
    positions = per_position(after, model)
    moved = {p: count - per_position(before, model).get(p, 0.0) for p, count in positions.items()}
    assert {p: c for p, c in moved.items() if c} == dict(enumerate(stats.accepted_per_position))
    drafts = delta("vllm:spec_decode_num_drafts_total", model_name=model)
    if speculation == "sequential":
        sizes = sequential_draft_sizes(token_chunks)
        assert sum(size for size in sizes if size > 0) == stats.draft_tokens  # the reconstruction holds
        assert drafts == sum(size > 0 for size in sizes)
    else:
        assert 1 <= drafts <= stats.rounds
    assert delta("specdec:pipeline_hits_total") == stats.pipeline_hits
    assert delta("specdec:pipeline_misses_total") == stats.pipeline_misses
    assert (stats.pipeline_hits + stats.pipeline_misses > 0) == (speculation == "pipelined")
    assert delta("specdec:wire_bytes_total", direction="draft") == stats.wire_bytes
    assert delta("specdec:wire_bytes_total", direction="verdict") > 0
    assert delta("specdec:drafter_fallbacks_total") == 0

    assert delta("vllm:request_success_total", model_name=model, finished_reason="length") == 1
    assert delta("vllm:request_success_total", model_name=model, finished_reason="stop") == 0
    assert delta("vllm:generation_tokens_total", model_name=model) == usage.completion_tokens == MAX_TOKENS
    assert delta("vllm:prompt_tokens_total", model_name=model) == usage.prompt_tokens == len(PROMPT_IDS)
    assert delta("vllm:time_to_first_token_seconds_count", model_name=model) == 1
    assert delta("vllm:e2e_request_latency_seconds_count", model_name=model) == 1
    assert delta("vllm:inter_token_latency_seconds_count", model_name=model) == len(token_chunks) - 1
    per_round = ("verify", "state", "round", "verifier_queue", "drafter_queue")
    for name in (f"specdec:{series}_seconds" for series in per_round):
        assert delta(f"{name}_count") == stats.rounds and delta(f"{name}_sum") >= 0
    overhead_count = delta("specdec:router_overhead_seconds_count")
    assert overhead_count == stats.rounds and delta("specdec:router_overhead_seconds_sum") >= 0
    assert delta("specdec:draft_seconds_sum") == pytest.approx(stats.draft_s, abs=1e-6)
    assert value(after, "vllm:num_requests_running", model_name=model) == 0
    assert value(after, "vllm:num_requests_waiting", model_name=model) == 0


def test_router_exposes_the_vllm_and_specdec_names(services: Services) -> None:
    services.stream("sequential")
    _, names = scrape(services.router.http_address)
    assert not ROUTER_NAMES - names, sorted(ROUTER_NAMES - names)


def test_verifier_and_drafter_serve_their_own_metrics(services: Services) -> None:
    verifier, drafter = services.verifier.metrics_address, services.drafter.metrics_address
    assert verifier is not None and drafter is not None
    verifier_before, _ = scrape(verifier)
    drafter_before, _ = scrape(drafter)
    stats = services.stream("sequential")[-1].stats
    assert stats is not None
    verifier_after, verifier_names = scrape(verifier)
    drafter_after, drafter_names = scrape(drafter)
    assert not VERIFIER_NAMES - verifier_names, sorted(VERIFIER_NAMES - verifier_names)
    assert not DRAFTER_NAMES - drafter_names, sorted(DRAFTER_NAMES - drafter_names)

    def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    calls = moved(verifier_before, verifier_after, "specdec:verifier_verify_calls_total")
    assert calls == stats.rounds  # one Verify per round, one request at a time
    assert moved(verifier_before, verifier_after, "specdec:verifier_batch_size_count") == stats.rounds
    assert moved(verifier_before, verifier_after, "specdec:verifier_batch_size_sum") == stats.rounds
    assert moved(verifier_before, verifier_after, "specdec:verifier_forward_seconds_count") == stats.rounds
    assert moved(verifier_before, verifier_after, "specdec:verifier_arrival_wait_seconds_count") == stats.rounds
    waited = moved(verifier_before, verifier_after, "specdec:verifier_arrival_wait_seconds_sum")
    assert waited < 0.005 * stats.rounds  # a lone sequence expects nobody back: its forwards start at once
    assert moved(verifier_before, verifier_after, "specdec:wire_bytes_total", direction="received") > 0
    proposals = moved(drafter_before, drafter_after, "specdec:drafter_proposals_total")
    assert proposals == moved(drafter_before, drafter_after, "specdec:drafter_batch_size_count") >= 1
    assert moved(drafter_before, drafter_after, "specdec:drafter_draft_tokens_total") == stats.draft_tokens
    assert moved(drafter_before, drafter_after, "specdec:drafter_propose_seconds_count") == proposals
    assert moved(drafter_before, drafter_after, "specdec:drafter_arrival_wait_seconds_count") == proposals
    model = services.router.config.model  # the request's sequences are closed before its final message
    assert value(verifier_after, "vllm:num_requests_running", model_name=model) == 0
    assert value(verifier_after, "vllm:num_requests_waiting", model_name=model) == 0
    assert value(verifier_after, "specdec:verifier_kv_cache_bytes") == 0  # the last close freed the pools
    assert value(drafter_after, "specdec:drafter_open_sequences") == 0


def test_failed_requests_count_under_their_status(services: Services) -> None:
    address, model = services.router.http_address, services.router.config.model
    before, _ = scrape(address)
    with Client(services.router.grpc_address, timeout_s=30) as client, pytest.raises(InvalidArgument):
        client.generate(prompt_ids=PROMPT_IDS, max_tokens=0)
    status, _, _ = request(address, "POST", "/v1/completions", b"{not json")
    assert status == 400
    after, _ = scrape(address)
    failed = value(after, "specdec:request_failure_total", code="INVALID_ARGUMENT")
    assert failed - value(before, "specdec:request_failure_total", code="INVALID_ARGUMENT") == 2
    for reason in ("stop", "length"):
        success = "vllm:request_success_total"
        assert value(after, success, model_name=model, finished_reason=reason) == value(
            before, success, model_name=model, finished_reason=reason
        )


@pytest.fixture(scope="module")
def slow_stack() -> Iterator[Stack]:
    """Fake workers, each Verify 20 ms; one request at a time; a bearer token on the public API."""
    stack = Stack(delay_s=0.02, max_concurrent_requests=1, bearer_token="sesame")
    yield stack
    stack.stop()


def test_overload_refusal_counts_as_resource_exhausted(slow_stack: Stack) -> None:
    address = slow_stack.router.http_address
    before, _ = scrape(address)  # no token needed for /metrics
    status, _, _ = post(slow_stack, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 401  # while the API itself requires it
    started = threading.Event()

    def long_request() -> None:
        with slow_stack.client(bearer_token="sesame") as client:
            stream = client.stream(prompt_ids=PROMPT, max_tokens=30, temperature=0.0, ignore_eos=True)
            next(stream)
            started.set()
            list(stream)

    thread = threading.Thread(target=long_request)
    thread.start()
    assert started.wait(timeout=10)
    with slow_stack.client(bearer_token="sesame") as client, pytest.raises(Overloaded):
        client.generate(prompt_ids=PROMPT, max_tokens=4)
    thread.join(timeout=20)
    after, _ = scrape(address)
    code = "RESOURCE_EXHAUSTED"
    assert (
        value(after, "specdec:request_failure_total", code=code)
        - value(before, "specdec:request_failure_total", code=code)
        == 1
    )
    model = slow_stack.config.model
    assert (
        value(after, "vllm:request_success_total", model_name=model, finished_reason="length")
        == value(before, "vllm:request_success_total", model_name=model, finished_reason="length") + 1
    )


def test_a_commit_the_round_waited_for_is_state_not_overhead() -> None:
    """The drafter's time applying the Commit that a fresh proposal carried is state, as the co-located engine's
    drafter commit is, not what the router and the wire add."""
    metrics = RouterMetrics("m")
    verified = Verified((0, 1), (5, 6, 7), False, False, (), verify_ns=3_000_000, state_ns=1_000_000, wire_bytes=9)
    metrics.on_round(RoundRecord(3, verified, 10_500_000, 2_000_000, False, exposed_commit_ns=500_000))
    registry = metrics.registry
    assert registry.get_sample_value("specdec:router_overhead_seconds_sum") == pytest.approx(0.004)
    assert registry.get_sample_value("specdec:state_seconds_sum") == pytest.approx(0.0015)


def test_the_workers_queues_are_reported_as_their_parts_of_the_overhead() -> None:
    """The time a Verify waited at the verifier for its forward, and a fresh proposal at the drafter for its batch,
    are series of their own and stay in the overhead (what a round spends beside the draft, the forward and the
    state: the router, the wire and the workers' queues)."""
    metrics = RouterMetrics("m")
    verified = Verified(
        (0, 1), (5, 6, 7), False, False, (), verify_ns=3_000_000, state_ns=1_000_000, wire_bytes=9, queued_ns=2_500_000
    )
    record = RoundRecord(3, verified, 10_000_000, 2_000_000, False, exposed_draft_queue_ns=1_000_000)
    metrics.on_round(record)
    registry = metrics.registry
    assert registry.get_sample_value("specdec:router_overhead_seconds_sum") == pytest.approx(0.004)
    assert registry.get_sample_value("specdec:verifier_queue_seconds_sum") == pytest.approx(0.0025)
    assert registry.get_sample_value("specdec:drafter_queue_seconds_sum") == pytest.approx(0.001)
    assert registry.get_sample_value("specdec:verifier_queue_seconds_count") == 1
