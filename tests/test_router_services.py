"""The router over the real drafter and verifier services (tiny random Llama models, CPU, loopback).

Greedy output through router + services must equal the co-located Engine's target-only output token for token
(DESIGN §3), for the n-gram and the model drafter, sequential and pipelined. Also: finish reasons with EOS, seeded
sampling reproducible, a drafter stopped mid-request (the request completes unchanged; another drafter of its kind
takes over when there is one), cancellation freeing state
on both services (their Status RPCs), and 16 concurrent streams over 2 drafters and 2 verifiers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from specdec_wire.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from drafter_service.config import DrafterConfig
from drafter_service.server import RunningDrafter, start_drafter
from router.config import RouterConfig
from router.server import RunningRouter, start_router
from specdec.client import Client, InvalidArgument
from specdec.engine import Engine, GenerationRequest
from specdec.models import LoadedModel
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams
from tests.tiny_models import tiny_draft, tiny_llama
from verifier_service.config import VerifierConfig
from verifier_service.server import RunningVerifier, start_verifier

VOCAB = 32
EOS = VOCAB - 1
PROMPTS = [[1, 2, 3, 1, 2], [4], [5, 5, 5, 5, 5, 5, 5, 5], [0, 6, 3, 9, 12], [2, 4, 6, 2, 4, 6, 2], [17, 30, 8]]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=21, vocab_size=VOCAB, num_layers=2)


@pytest.fixture(scope="module")
def draft(target: LoadedModel) -> LoadedModel:
    return tiny_draft(target, seed=22, noise=0.03)


class Services:
    """Two verifiers, an n-gram and a model drafter, and a router over all of them."""

    def __init__(self, target: LoadedModel, draft: LoadedModel) -> None:
        self.verifiers: list[RunningVerifier] = [start_verifier(VerifierConfig(), model=target) for _ in range(2)]
        self.ngram: RunningDrafter = start_drafter(DrafterConfig(kind="ngram"), target=target)
        self.model: RunningDrafter = start_drafter(
            DrafterConfig(kind="model", draft_model=draft.name, draft_top_k=8), target=target, draft=draft
        )
        config = RouterConfig(
            model=target.name,
            verifiers=tuple(v.address for v in self.verifiers),
            drafters=(self.ngram.address, self.model.address),
            grpc_port=0,
            http_port=0,
            eos_token_ids=(EOS,),
            health_interval_s=0.2,
            drafter_deadline_s=2.0,
            verifier_deadline_s=10.0,
            shutdown_grace_s=0.5,
        )
        self.router: RunningRouter = start_router(config)

    def client(self) -> Client:
        return Client(self.router.grpc_address, timeout_s=60)

    def open_sequences(self) -> list[tuple[str, int, int]]:
        """(address, open sequences, runner sequences) of every service, from its Status RPC."""
        counts = []
        for verifier in self.verifiers:
            with grpc.insecure_channel(verifier.address) as channel:
                status = verifier_pb2_grpc.VerifierStub(channel).Status(verifier_pb2.VerifierStatusRequest(), timeout=5)
            counts.append((verifier.address, status.open_sequences, status.runner_sequences))
        for drafter in (self.ngram, self.model):
            with grpc.insecure_channel(drafter.address) as channel:
                status = drafter_pb2_grpc.DrafterStub(channel).Status(drafter_pb2.DrafterStatusRequest(), timeout=5)
            counts.append((drafter.address, status.open_sequences, status.runner_sequences))
        return counts

    def all_closed(self) -> bool:
        return all(open_ == runner == 0 for _, open_, runner in self.open_sequences())

    def stop(self) -> None:
        self.router.stop(0.5)
        for service in (*self.verifiers, self.ngram, self.model):
            service.stop(0)


@pytest.fixture(scope="module")
def services(target: LoadedModel, draft: LoadedModel) -> Iterator[Services]:
    services = Services(target, draft)
    yield services
    services.stop()


def engine_reference(target: LoadedModel, max_tokens: int, ignore_eos: bool) -> list[tuple[list[int], str]]:
    """Co-located target-only greedy decoding of every prompt, alone: (tokens, finish reason)."""
    engine = Engine(KVRunner(target.model), target.eos_token_ids, None)
    results = []
    for prompt in PROMPTS:
        [result] = engine.generate([GenerationRequest(prompt, GREEDY, max_tokens, ignore_eos=ignore_eos)])
        results.append((result.token_ids, result.finish_reason))
    return results


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize("speculation", ["off", "sequential", "pipelined"])
@pytest.mark.parametrize(("drafter", "tree_width"), [("ngram", 0), ("model", 1), ("model", 0), ("model", 3)])
def test_greedy_output_equals_colocated_target_only(
    services: Services, target, drafter: str, tree_width: int, speculation: str
) -> None:
    """Every round adds its accepted tokens and one more, but a pipeline hit's (its bonus deferred): also for a
    pipelined tree (``tree_width`` 0: the router's default, a dynamic tree of as many nodes as levels; 3: of 3 nodes a
    level), whose other leaves, accepted whole, are no hit and defer nothing."""
    expected = engine_reference(target, 40, ignore_eos=True)
    with services.client() as client:
        for prompt, (tokens, reason) in zip(PROMPTS, expected, strict=True):
            result = client.generate(
                prompt_ids=prompt,
                max_tokens=40,
                temperature=0.0,
                ignore_eos=True,
                drafter=drafter,
                speculation=speculation,
                num_draft_tokens=3,
                tree_width=tree_width,
            )
            assert result.token_ids == tokens, f"prompt {prompt}: {drafter} {speculation}"
            assert result.finish_reason == reason == "length"
            stats = result.stats
            assert not stats.drafter_fallback
            assert sum(stats.accepted_per_position) == stats.accepted_tokens <= stats.draft_tokens
            assert len(tokens) == stats.accepted_tokens + stats.rounds - stats.pipeline_hits
            if speculation == "off":
                assert stats.draft_tokens == 0
            elif speculation == "pipelined":
                assert stats.pipeline_hits + stats.pipeline_misses > 0
    assert wait_until(services.all_closed), services.open_sequences()


def test_speculation_is_used(services: Services) -> None:
    """Over all prompts the drafters do propose and get tokens accepted (else equality proves nothing)."""
    accepted = {}
    with services.client() as client:
        for drafter in ("ngram", "model"):
            results = [
                client.generate(
                    prompt_ids=p,
                    max_tokens=40,
                    temperature=0.0,
                    ignore_eos=True,
                    drafter=drafter,
                    speculation="pipelined",
                )
                for p in PROMPTS
            ]
            accepted[drafter] = sum(result.stats.accepted_tokens for result in results)
            assert sum(result.stats.pipeline_hits for result in results) > 0
    assert min(accepted.values()) > 0, accepted


def test_the_router_prices_forwards_from_the_verifiers_calibration(services: Services) -> None:
    with services.client() as client:
        client.generate(prompt_ids=PROMPTS[0], max_tokens=4, temperature=0.0, speculation="off")
    measured = dict(services.router.frontend.controller.cost.forward.points())
    assert 64 in measured  # timed by the verifiers at start: no request here ever made a forward that large


def test_finish_reasons_with_eos(services: Services, target) -> None:
    expected = engine_reference(target, 60, ignore_eos=False)
    with services.client() as client:
        for prompt, (tokens, reason) in zip(PROMPTS, expected, strict=True):
            result = client.generate(prompt_ids=prompt, max_tokens=60, temperature=0.0, drafter="model")
            assert (result.token_ids, result.finish_reason) == (tokens, reason)


def test_over_the_context_is_invalid_argument(services: Services, target) -> None:
    """The verifier knows the context length (256 positions); its refusal reaches the client naming the field."""
    context = target.model.config.max_position_embeddings
    with services.client() as client:
        with pytest.raises(InvalidArgument) as raised:
            client.generate(prompt_ids=[1] * 10, max_tokens=context)
        assert raised.value.details.startswith("max_tokens")
        assert client.generate(prompt_ids=[1] * 10, max_tokens=context - 10, speculation="off").finish_reason


def test_seeded_sampling_is_reproducible(services: Services) -> None:
    """With a fixed draft length (under auto the lengths follow measured timings: same law, other tokens)."""

    def sample(client: Client, seed: int) -> list[int]:
        options = {"max_tokens": 30, "temperature": 1.0, "ignore_eos": True, "drafter": "model"}
        options["speculation"] = "sequential"
        return client.generate(prompt_ids=PROMPTS[0], seed=seed, **options).token_ids

    with services.client() as client:
        first, again = sample(client, 5), sample(client, 5)
        others = [sample(client, seed) for seed in (6, 7, 8)]
    assert first == again
    assert any(other != first for other in others)


def test_drafter_stopped_mid_request(target: LoadedModel) -> None:
    """The only drafter goes away after the first chunk: the request completes with the same greedy output."""
    verifier = start_verifier(VerifierConfig(), model=target)
    drafter = start_drafter(DrafterConfig(kind="ngram"), target=target)
    config = RouterConfig(
        model=target.name,
        verifiers=(verifier.address,),
        drafters=(drafter.address,),
        grpc_port=0,
        http_port=0,
        eos_token_ids=(EOS,),
        drafter_deadline_s=1.0,
        shutdown_grace_s=0.5,
    )
    router = start_router(config)
    max_tokens = 240
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    [expected] = Engine(KVRunner(target.model), target.eos_token_ids, None).generate(
        [GenerationRequest(prompt, GREEDY, max_tokens, ignore_eos=True)]
    )
    try:
        with Client(router.grpc_address, timeout_s=60) as client:
            stream = client.stream(prompt_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            chunks = [next(stream)]
            drafter.stop(0)
            chunks += list(stream)
        tokens = [token for chunk in chunks for token in chunk.token_ids]
        final = chunks[-1]
        assert tokens == expected.token_ids
        assert final.finish_reason == "length"
        assert final.stats is not None and final.stats.drafter_fallback
        assert final.stats.draft_tokens > 0
        with grpc.insecure_channel(verifier.address) as channel:
            status = verifier_pb2_grpc.VerifierStub(channel).Status(verifier_pb2.VerifierStatusRequest(), timeout=5)
        assert status.open_sequences == 0
    finally:
        router.stop(0.5)
        verifier.stop(0)


def test_a_drafter_stopped_mid_request_is_replaced_by_another_of_its_kind(target: LoadedModel) -> None:
    """Two n-gram drafters; the request's goes away after the first chunk: the other takes over on the committed
    text (no fallback to target-only), with the same greedy output."""
    verifier = start_verifier(VerifierConfig(), model=target)
    drafters = [start_drafter(DrafterConfig(kind="ngram"), target=target) for _ in range(2)]
    config = RouterConfig(
        model=target.name,
        verifiers=(verifier.address,),
        drafters=tuple(drafter.address for drafter in drafters),
        grpc_port=0,
        http_port=0,
        eos_token_ids=(EOS,),
        drafter_deadline_s=1.0,
        shutdown_grace_s=0.5,
    )
    router = start_router(config)
    prompt, max_tokens = [3, 4, 5, 3, 4, 5, 3, 4], 240
    [expected] = Engine(KVRunner(target.model), target.eos_token_ids, None).generate(
        [GenerationRequest(prompt, GREEDY, max_tokens, ignore_eos=True)]
    )
    try:
        with Client(router.grpc_address, timeout_s=60) as client:
            stream = client.stream(prompt_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            chunks = [next(stream)]
            drafters[0].stop(0)  # the least loaded, least chosen one: the request's
            chunks += list(stream)
        assert [token for chunk in chunks for token in chunk.token_ids] == expected.token_ids
        final = chunks[-1]
        assert final.stats is not None and not final.stats.drafter_fallback
        with grpc.insecure_channel(drafters[1].address) as channel:
            status = drafter_pb2_grpc.DrafterStub(channel).Status(drafter_pb2.DrafterStatusRequest(), timeout=5)
        assert status.proposals > 0 and status.open_sequences == 0
    finally:
        router.stop(0.5)
        verifier.stop(0)
        drafters[1].stop(0)


def test_cancel_frees_state_on_both_services(services: Services) -> None:
    with services.client() as client:
        stream = client.stream(prompt_ids=PROMPTS[1], max_tokens=240, temperature=0.0, ignore_eos=True, drafter="model")
        next(stream)
        assert not services.all_closed()
        stream.close()
    assert wait_until(services.all_closed, 3.0), services.open_sequences()


def test_sixteen_concurrent_streams(services: Services, target) -> None:
    """16 streams at once over 2 drafters and 2 verifiers: every one completes correctly; nothing is left open."""
    with_eos = engine_reference(target, 50, ignore_eos=False)
    without = engine_reference(target, 50, ignore_eos=True)
    modes = ["pipelined", "sequential", "off", "pipelined"]
    kinds = ["ngram", "model"]
    outcomes: dict[int, tuple[list[int], str]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)

    def run(index: int) -> None:
        try:
            with services.client() as client:
                barrier.wait(timeout=10)
                chunks = list(
                    client.stream(
                        prompt_ids=PROMPTS[index % len(PROMPTS)],
                        max_tokens=50,
                        temperature=0.0,
                        ignore_eos=index % 2 == 0,
                        speculation=modes[index % 4],
                        drafter=kinds[index // 8],
                    )
                )
            outcomes[index] = ([t for c in chunks for t in c.token_ids], chunks[-1].finish_reason or "")
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    for index in range(16):
        reference = (without if index % 2 == 0 else with_eos)[index % len(PROMPTS)]
        assert outcomes[index] == reference, index
    assert wait_until(services.all_closed), services.open_sequences()
    workers = services.router.frontend.workers()
    assert all(worker.outstanding == 0 for worker in workers)
    assert all(worker.healthy for worker in workers)
    chosen = {worker.address: worker for worker in services.router.frontend.pool.workers()}
    assert all(chosen[v.address].chosen > 0 for v in services.verifiers), "both verifiers serve requests"
