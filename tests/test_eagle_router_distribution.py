"""An EAGLE drafter served on its own: router + verifier service + eagle drafter service keep the target's exact law.

Tiny random Llama target (vocabulary 5) and an EAGLE head made from it (``EagleHead.from_target``: its embeddings,
norm and LM head, its last layer as the head's decoder layer) saved like a trained one and served by
``python -m drafter_service --kind eagle --draft-model DIR``'s code path; every verdict's feature rows travel
verifier -> router -> drafter. The first round of a request drafts nothing (the drafter has no features before the
prompt is prefilled), so the window of ``LENGTH`` tokens holds eagle rounds from the second token on: chains
sequential and pipelined (γ = 1, so a pipeline hit's pre-drafted token, verified against the kept row, lies inside
the window), a tree, temperature 1 and top-k / top-p; and a prompt whose tail repeats, so that rounds are
prompt-lookup chains (drafted before any feature row arrives) mixed with the head's. Seeded requests through the SDK;
their law of the first ``LENGTH`` tokens must match the law enumerated from the target (chi-square at 1e-3,
``assert_same_law``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from specdec_wire.v1 import drafter_pb2, drafter_pb2_grpc

from drafter_service.config import DrafterConfig
from drafter_service.server import build_core_drafter, start_drafter
from specdec.client import Client, GenerateResult
from specdec.drafters import DEFAULT_LOOKUP_MIN_MATCH, EagleDrafter
from specdec.drafters.eagle_head import EagleHead, HeadInfo, save_head
from specdec.errors import InvalidArgumentError, ModelNotFoundError
from specdec.models import LoadedModel
from specdec.sampling import SamplingParams
from tests.test_end_to_end_distribution import LENGTH, PROMPT, VOCAB, _outcome, assert_same_law, exact_law
from tests.test_router_distribution import served_router
from tests.tiny_models import tiny_llama
from verifier_service.config import VerifierConfig

SAMPLES = 1000
MAX_TOKENS = LENGTH + 1

# (speculation, num_draft_tokens, tree_width, sampling)
CASES = {
    "chain-sequential": ("sequential", 2, 1, SamplingParams(temperature=1.0)),
    "chain-pipelined": ("pipelined", 1, 1, SamplingParams(temperature=1.0)),
    "tree-top-k-top-p": ("sequential", 2, 2, SamplingParams(temperature=1.0, top_k=3, top_p=0.9)),
    "chain-pipelined-top-k": ("pipelined", 1, 1, SamplingParams(temperature=0.8, top_k=3)),
    "lookup-pipelined": ("pipelined", 2, 1, SamplingParams(temperature=1.0)),  # on REPEATING only
}
LOOKUP_CASE = "lookup-pipelined"
REPEATING = [1, 2, 3, 4, 0, 2, 1, 2, 3, 4, 0]  # its tail "1 2 3 4 0" occurred before: the first round drafts "2 1"


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=11, vocab_size=VOCAB, num_layers=2)


FUSED = (0, 1)  # an EAGLE-3 head of the 2-layer target fuses both layers' outputs


def save_tiny_head(target: LoadedModel, directory: Path, feature_layers: tuple[int, ...] = ()) -> Path:
    head = EagleHead.from_target(target.model, torch.arange(VOCAB), feature_layers=feature_layers)
    save_head(head, directory, HeadInfo(verifier="tiny", num_draft_tokens=3))
    return directory


@pytest.fixture(scope="module")
def router_address(target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    head = save_tiny_head(target, tmp_path_factory.mktemp("eagle-head"))
    with served_router(target, DrafterConfig(kind="eagle", target="tiny", draft_model=str(head))) as router:
        yield router.grpc_address


@pytest.mark.parametrize("feature_layers", [(), FUSED], ids=["final-norm", "fused"])
def test_the_eagle_drafter_service_reports_its_feature_rows(
    target: LoadedModel, tmp_path: Path, feature_layers: tuple[int, ...]
) -> None:
    head = str(save_tiny_head(target, tmp_path, feature_layers))
    config = DrafterConfig.from_args(["--kind", "eagle", "--draft-model", head], environ={})
    assert (config.kind, config.draft_model) == ("eagle", head)
    with start_drafter(config, target=target) as running, grpc.insecure_channel(running.address) as channel:
        status = drafter_pb2_grpc.DrafterStub(channel).Status(drafter_pb2.DrafterStatusRequest(), timeout=10)
    width = target.model.config.hidden_size * max(1, len(feature_layers))
    assert (status.kind, status.feature_width, tuple(status.feature_layers)) == ("eagle", width, feature_layers)
    assert status.lookup_min_match == DEFAULT_LOOKUP_MIN_MATCH  # the router plans its lookup rounds (auto) by it


def test_the_drafter_service_sets_its_eagle_drafters_prompt_lookup(target: LoadedModel, tmp_path: Path) -> None:
    head = str(save_tiny_head(target, tmp_path))
    for flags, expected in [([], DEFAULT_LOOKUP_MIN_MATCH), (["--lookup-min-match", "0"], 0)]:
        config = DrafterConfig.from_args(["--kind", "eagle", "--draft-model", head, *flags], environ={})
        drafter = build_core_drafter(config, target=target)
        assert isinstance(drafter, EagleDrafter) and drafter.lookup_min_match == expected
    with pytest.raises(InvalidArgumentError, match=r"^lookup_min_match: must be >= 0"):
        DrafterConfig(kind="eagle", lookup_min_match=-1)


def test_without_a_draft_model_the_head_cached_for_the_target_is_used(
    target: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    config = DrafterConfig(kind="eagle", target=target.name)
    with pytest.raises(ModelNotFoundError, match="specdec distill"):
        build_core_drafter(config, target=target)
    save_tiny_head(target, tmp_path / "eagle" / target.name)
    assert isinstance(build_core_drafter(config, target=target), EagleDrafter)


@pytest.fixture(scope="module")
def fused_router_address(target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    head = save_tiny_head(target, tmp_path_factory.mktemp("eagle3-head"), FUSED)
    with served_router(target, DrafterConfig(kind="eagle", target="tiny", draft_model=str(head))) as router:
        yield router.grpc_address


def sample(address: str, case: str, seed: int, prompt: list[int] = PROMPT) -> list[GenerateResult]:
    """``SAMPLES`` seeded requests of ``case`` on ``prompt``, 16 at a time over one channel."""
    speculation, num_draft_tokens, tree_width, params = CASES[case]
    client = Client(address, timeout_s=60)

    def one(index: int) -> GenerateResult:
        return client.generate(
            prompt_ids=prompt,
            max_tokens=MAX_TOKENS,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=seed + index,
            ignore_eos=True,
            drafter="eagle",
            speculation=speculation,
            num_draft_tokens=num_draft_tokens,
            tree_width=tree_width,
        )

    with client, ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(one, range(SAMPLES)))


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in CASES if case != LOOKUP_CASE])
def test_eagle_over_the_wire_follows_the_target_law(router_address: str, target: LoadedModel, case: str) -> None:
    check_law(router_address, target, case, seed=90_000 + 10_000 * list(CASES).index(case))


@pytest.mark.slow
def test_a_fused_eagle3_head_over_the_wire_follows_the_target_law(
    fused_router_address: str, target: LoadedModel
) -> None:
    """The verifier sends the fused layers' rows (two layers: twice as wide) the head asked for through
    the drafter's status; pipelined chains, so pre-drafts run on the head's own predictions too."""
    check_law(fused_router_address, target, "chain-pipelined", seed=190_000)


@pytest.mark.slow
def test_prompt_lookup_rounds_over_the_wire_follow_the_target_law(router_address: str, target: LoadedModel) -> None:
    """A prompt repeating its tail: the first round is a prompt-lookup chain (one-hot q, before any feature row), and
    pipelined rounds after it pre-draft by lookup on the assumed chain or by the head; the law of the first
    ``LENGTH`` tokens is the target's."""
    check_law(router_address, target, LOOKUP_CASE, seed=290_000, prompt=REPEATING)


def check_law(address: str, target: LoadedModel, case: str, seed: int, prompt: list[int] = PROMPT) -> None:
    speculation, _, _, params = CASES[case]
    results = sample(address, case, seed=seed, prompt=prompt)
    stats = [result.stats for result in results]
    assert not any(s.drafter_fallback for s in stats)
    assert sum(s.accepted_tokens for s in stats) > 0 and all(s.feature_bytes > 0 for s in stats)
    if speculation == "pipelined":
        assert sum(s.pipeline_hits for s in stats) > 0 and sum(s.pipeline_misses for s in stats) > 0
    counts = Counter(_outcome(result.token_ids, frozenset()) for result in results)
    assert_same_law(counts, exact_law(target, params, stop_at_eos=False, prompt=prompt))


def greedy_eagle_chain(address: str, prompt: list[int], max_tokens: int) -> GenerateResult:
    """One greedy request drafting sequential chains of 2 with the eagle drafter, ignoring EOS."""
    return Client(address, timeout_s=120).generate(
        prompt_ids=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        drafter="eagle",
        speculation="sequential",
        num_draft_tokens=2,
    )


def test_a_long_prompt_sends_the_drafter_only_the_feature_rows_its_context_reads(
    target: LoadedModel, tmp_path: Path
) -> None:
    """A prompt whose feature rows outgrow one message (here a verifier limited to 16 kB; on an 8B target's three
    layers a 700-token prompt outgrows gRPC's 16 MB) is served, drafting from its first verdict on: the verifier
    sends the rows of only the latest positions an eagle drafter's context reads (8 here, and 9 with the
    deferred-bonus row). Before, the prefill verdict failed the request (RESOURCE_EXHAUSTED)."""
    head = str(save_tiny_head(target, tmp_path, FUSED))
    prompt = [(7 * index + 3) % (VOCAB - 1) for index in range(200)]  # 200 fused rows: 25.6 kB in bfloat16
    with served_router(
        target,
        DrafterConfig(kind="eagle", target="tiny", draft_model=head, eagle_context=8),
        verifier_config=VerifierConfig(max_message_bytes=16384),
    ) as router:
        result = greedy_eagle_chain(router.grpc_address, prompt, max_tokens=6)
    assert len(result.token_ids) == 6 and result.stats.draft_tokens > 0 and not result.stats.drafter_fallback
    row = 2 * target.model.config.hidden_size * 2  # two layers, bfloat16
    assert result.stats.feature_bytes <= row * (9 + result.stats.rounds * 3) + 64 * result.stats.rounds


def test_rows_too_wide_for_a_whole_context_in_one_message_are_capped_and_the_request_still_drafts(
    tmp_path: Path,
) -> None:
    """Rows of 8 kB (hidden 2048, two fused layers) and a drafter that reads 2 101 positions: a 2 100-token prompt's
    rows (17 MB) outgrow gRPC's 16 MiB, so the router asks the verifier for the rows of only the positions half a
    message holds (1 024); the drafter drafts from those. Before, the prefill verdict failed the request."""
    wide = tiny_llama(seed=5, vocab_size=VOCAB, num_layers=2, hidden_size=2048, max_positions=4096)
    head = EagleHead.from_target(wide.model, torch.arange(VOCAB), feature_layers=FUSED)
    save_head(head, tmp_path, HeadInfo(verifier=wide.name, num_draft_tokens=2))
    prompt = [(3 * index + 1) % (VOCAB - 1) for index in range(2100)]
    drafter_config = DrafterConfig(kind="eagle", target=wide.name, draft_model=str(tmp_path), eagle_context=2100)
    with served_router(wide, drafter_config) as router:
        result = greedy_eagle_chain(router.grpc_address, prompt, max_tokens=4)
    assert len(result.token_ids) == 4 and result.stats.draft_tokens > 0 and not result.stats.drafter_fallback
    assert result.stats.feature_bytes < 9 * 1024 * 1024  # 1 024 rows of the prefill, then a few per round
