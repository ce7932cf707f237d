"""Sampling through the full gRPC path follows the target's exact law (chains and trees, pipelined or not).

A second stack pre-drafts for several outcomes (``predraft_outcomes=3``) with a draft slowed to several times the
verify time, so pipeline misses find their pre-draft still running and cancel it: the law holds with rejection-outcome
hits, tree hits and cancelled pre-drafts all occurring (asserted from the stats and the drafter's Status).

Tiny random Llama target (vocabulary 5) and a related draft behind a real verifier service, a model
drafter service and the router, all on loopback. Seeded requests go through the SDK; the law of
the first ``LENGTH`` tokens must match the law enumerated from the target model itself (chi-square,
significance 1e-3; fixed seeds, so the test is deterministic up to thread interleaving, which
batches differently but does not change any sequence's random numbers).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
from specdec_wire.v1 import drafter_pb2, drafter_pb2_grpc, router_pb2, router_pb2_grpc

from drafter_service.config import DrafterConfig
from drafter_service.server import start_drafter
from grpc_common.tls import PLAINTEXT, TlsConfig
from router.config import RouterConfig
from router.server import RunningRouter, start_router
from specdec.acceptance import SampledRule, verify_batched
from specdec.adaptive import SpeculationController
from specdec.client import Client, GenerateResult
from specdec.models import LoadedModel
from specdec.sampling import SamplingParams
from tests.controllers import CyclingController
from tests.test_end_to_end_distribution import LENGTH, PROMPT, VOCAB, _outcome, assert_same_law, exact_law
from tests.tiny_models import tiny_draft, tiny_llama
from verifier_service.config import VerifierConfig
from verifier_service.server import start_verifier

SAMPLES = 1500
PARAMS = SamplingParams(temperature=1.0, top_p=0.9)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=11, vocab_size=VOCAB, num_layers=2)


@contextlib.contextmanager
def served_router(
    target: LoadedModel,
    drafter_config: DrafterConfig,
    tls: TlsConfig = PLAINTEXT,
    controller: SpeculationController | None = None,
    *,
    max_model_len: int = 0,
    acceptance_rule: SampledRule = verify_batched,
    verifier_config: VerifierConfig | None = None,
    **drafter_models: object,
) -> Iterator[RunningRouter]:
    """A verifier service (deciding sampled rounds by ``acceptance_rule``), one drafter service (``drafter_models``:
    its ``start_drafter`` models) and a router on loopback, all three with ``tls``; ``controller`` chooses the
    router's auto draft lengths, ``max_model_len`` is its context limit (0 for the verifier's), ``verifier_config``
    the verifier's settings (its ``tls`` is replaced by ``tls``); yields the router and stops all three."""
    verifier = start_verifier(
        replace(verifier_config or VerifierConfig(), tls=tls), model=target, acceptance_rule=acceptance_rule
    )
    drafter = start_drafter(replace(drafter_config, tls=tls), target=target, **drafter_models)
    router = start_router(
        RouterConfig(
            model=target.name,
            verifiers=(verifier.address,),
            drafters=(drafter.address,),
            grpc_port=0,
            http_port=0,
            eos_token_ids=tuple(target.eos_token_ids),
            max_concurrent_requests=32,
            tls=tls,
            max_model_len=max_model_len,
        ),
        controller=controller,
    )
    try:
        yield router
    finally:
        router.stop(0.5)
        drafter.stop(0)
        verifier.stop(0)


@pytest.fixture(scope="module")
def router_address(target) -> Iterator[str]:
    draft = tiny_draft(target, seed=12, num_layers=1, noise=0.3)
    with served_router(target, DrafterConfig(kind="model", draft_model=draft.name), draft=draft) as router:
        yield router.grpc_address


@pytest.fixture(scope="module")
def multi_outcome_address(target) -> Iterator[str]:
    """A model drafter pre-drafting for full acceptance and two rejection verdicts, each draft forward slowed."""
    draft = tiny_draft(target, seed=13, num_layers=1, noise=0.3)
    draft.model.register_forward_pre_hook(lambda *_: time.sleep(0.002))
    config = DrafterConfig(kind="model", draft_model=draft.name, predraft_outcomes=3)
    with served_router(target, config, draft=draft) as router:
        yield router.grpc_address


def sample_law(address: str, speculation: str, tree_width: int, seed: int) -> Counter:
    # trees of 3 nodes: with 5 tokens to generate, the first round leaves room for a pre-draft (pipelined)
    results = sample(address, speculation, tree_width, seed, SAMPLES, tree_budget=3 if tree_width > 1 else 0)
    return Counter(_outcome(result.token_ids, frozenset()) for result in results)


def sample(
    address: str, speculation: str, tree_width: int, seed: int, samples: int, tree_budget: int = 0
) -> list[GenerateResult]:
    def one(index: int) -> GenerateResult:
        with Client(address, timeout_s=60) as client:
            return client.generate(
                prompt_ids=PROMPT,
                max_tokens=LENGTH + 2,
                temperature=PARAMS.temperature,
                top_p=PARAMS.top_p,
                seed=seed + index,
                ignore_eos=True,
                drafter="model",
                speculation=speculation,
                num_draft_tokens=2 if tree_width > 1 else 3,
                tree_width=tree_width,
                tree_budget=tree_budget,
            )

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(one, range(samples)))


def cancelled_proposals(router_address: str) -> int:
    """The drafter's count of pre-drafts cancelled by a Commit, found through the router's worker list."""
    with grpc.insecure_channel(router_address) as channel:
        status = router_pb2_grpc.RouterStub(channel).Status(router_pb2.RouterStatusRequest(), timeout=10)
    [drafter] = [worker.address for worker in status.workers if worker.role == "drafter"]
    with grpc.insecure_channel(drafter) as channel:
        reply = drafter_pb2_grpc.DrafterStub(channel).Status(drafter_pb2.DrafterStatusRequest(), timeout=10)
    return reply.cancelled_proposals


@pytest.mark.slow
@pytest.mark.parametrize(
    ("speculation", "tree_width"), [("sequential", 1), ("pipelined", 1), ("sequential", 2), ("pipelined", 2)]
)
def test_grpc_path_follows_the_target_law(router_address: str, target, speculation: str, tree_width: int) -> None:
    counts = sample_law(router_address, speculation, tree_width, seed=70_000 + 10_000 * tree_width)
    assert_same_law(counts, exact_law(target, PARAMS, stop_at_eos=False))


@pytest.mark.slow
def test_auto_with_draft_lengths_changing_every_round_follows_the_target_law(target) -> None:
    """``auto`` whose controller cycles γ through 0, 3, 1, 4, 2 (capped at the request's 3): target-only rounds and
    chains of every length, one after the other in each request, and still the target's law."""
    draft = tiny_draft(target, seed=12, num_layers=1, noise=0.3)
    config = DrafterConfig(kind="model", draft_model=draft.name)
    with served_router(target, config, controller=CyclingController(), draft=draft) as router:
        counts = sample_law(router.grpc_address, "auto", 1, seed=95_000)
        with Client(router.grpc_address, timeout_s=60) as client:
            stats = client.generate(prompt_ids=PROMPT, max_tokens=12, speculation="auto", seed=1, ignore_eos=True).stats
    assert stats.rounds_per_draft_size[0] > 0 and sum(count > 0 for count in stats.rounds_per_draft_size) >= 3
    assert_same_law(counts, exact_law(target, PARAMS, stop_at_eos=False))


@pytest.mark.parametrize(("tree_width", "tree_budget"), [(1, 0), (2, 3)], ids=["chain", "tree"])
def test_multi_outcome_and_cancelled_predrafts_follow_the_target_law(
    multi_outcome_address: str, target, tree_width: int, tree_budget: int
) -> None:
    """Chains of 3 and trees of 3 nodes (depth 2) leave room in the 5-token budget to pre-draft after round 1."""
    cancelled = cancelled_proposals(multi_outcome_address)
    seed = 130_000 + 10_000 * tree_width
    results = sample(multi_outcome_address, "pipelined", tree_width, seed, 1000, tree_budget)
    stats = [result.stats for result in results]
    assert not any(s.drafter_fallback for s in stats)
    assert sum(s.pipeline_hits - s.pipeline_rejection_hits for s in stats) > 0, "full-acceptance pre-drafts were used"
    if tree_width == 1:  # a tree's guessed corrections rarely come true here (3-node trees, q truncated by top-p)
        assert sum(s.pipeline_rejection_hits for s in stats) > 0, "rejection-outcome pre-drafts were used"
    assert cancelled_proposals(multi_outcome_address) > cancelled, "misses cancelled pre-drafts in flight"
    counts = Counter(_outcome(result.token_ids, frozenset()) for result in results)
    assert_same_law(counts, exact_law(target, PARAMS, stop_at_eos=False))
