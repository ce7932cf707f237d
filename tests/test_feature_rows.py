"""Target feature rows (what an EAGLE drafter drafts from) across the wire: verifier -> router -> drafter.

The ``FeatureRows`` conversions round-trip exactly (float32 bit for bit; float16 / bfloat16 equal to torch's cast)
and refuse malformed blocks before allocating. The verifier service returns, with every verdict of a sequence that
asked, the rows of the positions that got KV: contiguous from 0, covering all committed text but its last token (all
of it after a deferred bonus), equal (after the dtype cast) to a teacher-forced ``KVRunner.forward_features`` over
the committed text, for chains and trees. The drafter service applies a Commit's rows with ``add_features`` before
the commit's ``sync``, also inside a Batch. The router relays each verdict's rows untouched on the drafter's next
Commit, through the real services (a recording drafter that takes features) and, for failures, through the
in-memory fakes of ``test_router_pipeline``: a drafter that fails stops the rows, a re-placed request starts them at
0 again on the new verifier and reopened drafter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import grpc
import pytest
import torch
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from drafter_service.config import DrafterConfig
from drafter_service.server import RunningDrafter, start_drafter
from grpc_common.convert import sampling_to_wire
from grpc_common.convert_rows import feature_dtype_from_wire, features_from_wire, features_to_wire
from router.config import RouterConfig
from router.pipeline import Drafted, SequenceSpec, Verified
from router.server import start_router
from router.workers import FEATURE_DTYPE
from specdec.client import Client
from specdec.drafters import DraftConfig, NgramDrafter
from specdec.errors import InvalidArgumentError
from specdec.models import LoadedModel
from specdec.runner import ForwardItem, KVRunner
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from tests.test_metrics import scrape, value
from tests.test_router_pipeline import PROMPT, FakeDrafter, FakePlacement, FakeVerifier, make_plan, reference, run
from tests.test_verifier_service import chain_along, hf_greedy, open_request, verify
from tests.tiny_models import tiny_llama
from verifier_service.config import VerifierConfig
from verifier_service.server import RunningVerifier, start_verifier

VOCAB = 8  # test_verifier_service's chain_along drafts over this vocabulary
TIMEOUT_S = 30
GREEDY = SamplingParams(temperature=0.0)
WIRE_DTYPES = {
    common_pb2.FEATURE_DTYPE_FLOAT32: torch.float32,
    common_pb2.FEATURE_DTYPE_FLOAT16: torch.float16,
    common_pb2.FEATURE_DTYPE_BFLOAT16: torch.bfloat16,
}


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=31, vocab_size=VOCAB, num_layers=2)


def teacher_forced(target: LoadedModel, text: Sequence[int]) -> torch.Tensor:
    """The target's feature rows [len(text), hidden] of one forward over ``text``."""
    runner = KVRunner(target.model)
    seq = runner.open()
    _, [rows] = runner.forward_features([ForwardItem(seq, list(text))])
    runner.close(seq)
    return rows.cpu()


def assert_rows_equal(got: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` (float32 off the wire) equals ``reference`` cast to ``dtype``, up to the last bit of float32 arithmetic
    (batched, cached forwards add in another order), which a cast can move by one unit of ``dtype``."""
    expected = reference.to(dtype).float()
    tolerance = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


# --- the wire format ------------------------------------------------------------------------------------------


def test_float32_rows_round_trip_bit_for_bit() -> None:
    rows = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 1e3
    rows[0, :4] = torch.tensor([-0.0, float("inf"), 1e-42, -3.4e38])  # signed zero, infinity, a subnormal, extreme
    message = features_to_wire(rows, 11, torch.float32)
    assert (message.start, message.width, message.dtype) == (11, 7, common_pb2.FEATURE_DTYPE_FLOAT32)
    assert len(message.data) == 5 * 7 * 4
    start, back = features_from_wire(common_pb2.FeatureRows.FromString(message.SerializeToString()))
    assert start == 11 and back.dtype == torch.float32
    assert torch.equal(back.view(torch.int32), rows.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_rows_equal_torchs_cast(dtype: torch.dtype) -> None:
    rows = torch.randn(9, 16, generator=torch.Generator().manual_seed(1)) * 10
    message = features_to_wire(rows.double(), 0, dtype)  # any float input is cast by torch's rounding
    assert len(message.data) == 9 * 16 * 2
    start, back = features_from_wire(message)
    assert start == 0 and back.shape == (9, 16) and back.dtype == torch.float32
    assert torch.equal(back, rows.double().to(dtype).float())


def test_the_routers_feature_dtype_carries_massive_activations() -> None:
    """Raw layer rows reach tens of thousands (SmolLM2's layer 14: 22 500); what the router asks verifiers for must
    carry them (float16 made 1e5 infinite), to within bfloat16's 3 significant digits."""
    rows = torch.tensor([[1e5, -3e5, 0.5, 22516.5]])
    _, back = features_from_wire(features_to_wire(rows, 0, feature_dtype_from_wire(FEATURE_DTYPE)))
    assert bool(torch.isfinite(back).all())
    torch.testing.assert_close(back, rows, rtol=4e-3, atol=0)


def test_zero_rows_and_the_default_dtype() -> None:
    start, back = features_from_wire(common_pb2.FeatureRows(start=4, width=3))
    assert start == 4 and back.shape == (0, 3)
    half = features_to_wire(torch.ones(2, 3), 0, torch.float16)
    half.dtype = common_pb2.FEATURE_DTYPE_UNSPECIFIED  # unset reads as float16
    assert torch.equal(features_from_wire(half)[1], torch.ones(2, 3))
    assert feature_dtype_from_wire(common_pb2.FEATURE_DTYPE_UNSPECIFIED) == torch.float16
    with pytest.raises(InvalidArgumentError) as error:
        feature_dtype_from_wire(99)
    assert error.value.field == "feature_dtype"


@pytest.mark.parametrize(
    ("fields", "options", "words"),
    [
        ({"width": 0}, {}, "width must be > 0"),
        ({"width": -2}, {}, "width must be > 0"),
        ({"width": 4}, {"width": 3}, "expected 3"),
        ({"width": 4, "dtype": 42}, {}, "unknown dtype"),
        ({"width": 4, "start": -1}, {}, "start must be >= 0"),
        ({"width": 4, "data": b"\0" * 12}, {}, "not whole rows"),  # float16 rows of 4 are 8 bytes
        ({"width": 1, "data": b"\0" * 6}, {"max_rows": 2}, "at most 2"),
    ],
)
def test_malformed_rows_are_refused_naming_the_field(fields: dict, options: dict, words: str) -> None:
    with pytest.raises(InvalidArgumentError, match=words) as error:
        features_from_wire(common_pb2.FeatureRows(**fields), **options)
    assert error.value.field == "features"


# --- the verifier service ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verifier(target: LoadedModel) -> Iterator[RunningVerifier]:
    running = start_verifier(VerifierConfig(max_batch_size=8, max_sequences=16, max_seq_len=64), model=target)
    yield running
    running.stop(grace_s=0)


@pytest.fixture(scope="module")
def verifier_stub(verifier: RunningVerifier) -> Iterator[verifier_pb2_grpc.VerifierStub]:
    with grpc.insecure_channel(verifier.address) as channel:
        yield verifier_pb2_grpc.VerifierStub(channel)


def tree_along(truth: list[int], done: int) -> TokenTree:
    """A wrong first child, then the truth's next two tokens under a second child, and a child of the wrong one: the
    accepted path [1, 2] skips node 0, so the rows kept are not a prefix of the forward's."""
    wrong = (truth[done] + 1) % VOCAB
    return TokenTree((wrong, truth[done], truth[done + 1], truth[done]), (-1, -1, 1, 0))


def feature_rounds(stub, sequence_id: str, truth: list[int]) -> list[verifier_pb2.VerifyReply]:
    """Greedy rounds to the end of ``truth``: in turn a chain partly accepted, a tree, a chain accepted whole (its
    bonus deferred)."""
    out: list[int] = []
    replies = []
    deferred = False
    for index in range(len(truth)):
        done = len(out)
        if index % 3 == 1 and not deferred and done + 2 < len(truth):
            proposal = verifier_pb2.VerifyRequest(
                sequence_id=sequence_id, proposal=common_pb2.Proposal(tree=_tree(tree_along(truth, done)))
            )
            reply = stub.Verify(proposal, timeout=TIMEOUT_S)
        else:
            good, bad = (3, 0) if index % 3 == 2 else (1, 1)
            reply = verify(stub, sequence_id, chain_along(truth, done, good, bad), defer_bonus=True)
        replies.append(reply)
        out += reply.verdict.emitted
        deferred = reply.verdict.bonus_deferred
        if reply.verdict.finished:
            break
    assert out == truth
    return replies


def _tree(tree: TokenTree) -> common_pb2.TokenTree:
    return common_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents)


@pytest.mark.parametrize("wire_dtype", list(WIRE_DTYPES), ids=["float32", "float16", "bfloat16"])
def test_verdicts_carry_contiguous_rows_equal_to_a_teacher_forced_forward(
    verifier: RunningVerifier, verifier_stub, target: LoadedModel, wire_dtype: int
) -> None:
    prompt = [1, 2, 3, 4, 5, 6]
    truth = hf_greedy(target, prompt, 14)
    sequence_id = f"features-{wire_dtype}"
    request = open_request(sequence_id, prompt, max_tokens=len(truth), features=True, feature_dtype=wire_dtype)
    verifier_stub.OpenSequence(request, timeout=TIMEOUT_S)
    before = _sent_feature_bytes(verifier)
    replies = feature_rounds(verifier_stub, sequence_id, truth)
    verifier_stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id=sequence_id), timeout=TIMEOUT_S)

    committed, covered, blocks = len(prompt), 0, []
    for reply in replies:
        assert reply.HasField("features")
        assert reply.features.dtype == wire_dtype and reply.features.width == target.model.config.hidden_size
        start, rows = features_from_wire(reply.features)
        assert start == covered, "each reply continues where the last one ended"
        covered += len(rows)
        committed += len(reply.verdict.emitted)
        if reply.verdict.finished:  # a budget that ends on an accepted node leaves that node's row too
            assert committed - 1 <= covered <= committed
        else:
            assert covered == committed - (0 if reply.verdict.bonus_deferred else 1)
        blocks.append(rows)
    assert any(reply.verdict.bonus_deferred for reply in replies)
    assert any(list(reply.verdict.accepted_path) == [1, 2] for reply in replies), "a tree round took a non-prefix"
    reference = teacher_forced(target, prompt + truth)
    assert_rows_equal(torch.cat(blocks), reference[:covered], WIRE_DTYPES[wire_dtype])
    assert _sent_feature_bytes(verifier) - before == sum(reply.features.ByteSize() for reply in replies)


def test_rows_only_when_asked_and_never_after_a_stop(verifier_stub, target: LoadedModel) -> None:
    prompt = [3, 1, 4]
    truth = hf_greedy(target, prompt, 8)
    verifier_stub.OpenSequence(open_request("plain", prompt, max_tokens=8), timeout=TIMEOUT_S)
    verifier_stub.OpenSequence(open_request("stopped", prompt, max_tokens=8, features=True), timeout=TIMEOUT_S)
    first = verify(verifier_stub, "stopped", chain_along(truth, 0, 1, 0))
    assert first.HasField("features") and first.features.dtype == common_pb2.FEATURE_DTYPE_FLOAT16  # the default
    stop = verifier_pb2.VerifyRequest(sequence_id="stopped", proposal=common_pb2.Proposal(), stop_features=True)
    replies = [
        verifier_stub.Verify(stop, timeout=TIMEOUT_S),
        verify(verifier_stub, "stopped", chain_along(truth, 3, 1, 0)),
        verify(verifier_stub, "plain", chain_along(truth, 0, 2, 0)),
    ]
    assert not any(reply.HasField("features") for reply in replies)
    for sequence_id in ("plain", "stopped"):
        verifier_stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id=sequence_id), timeout=TIMEOUT_S)


def test_an_unknown_feature_dtype_is_refused(verifier_stub) -> None:
    request = open_request("bad-dtype", [1, 2], features=True, feature_dtype=7)
    with pytest.raises(grpc.RpcError) as error:
        verifier_stub.OpenSequence(request, timeout=TIMEOUT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "feature_dtype" in error.value.details()


def _sent_feature_bytes(verifier: RunningVerifier) -> float:
    registry = verifier.scheduler.metrics.registry
    return registry.get_sample_value("specdec:wire_bytes_total", {"direction": "features"}) or 0.0


# --- the drafter service ------------------------------------------------------------------------------------------


class FeatureDrafter:
    """An n-gram drafter that takes target feature rows and records them: per handle the rows received (each block
    must continue the last) and, at each ``sync``, (rows received, committed length after it)."""

    def __init__(self, width: int, vocab_size: int) -> None:
        self.inner = NgramDrafter(DraftConfig(num_draft_tokens=3), vocab_size=vocab_size)
        self.feature_width = width
        self.feature_layers = ()
        self.prompts: dict[int, list[int]] = {}
        self.rows: dict[int, list[torch.Tensor]] = {}
        self.syncs: dict[int, list[tuple[int, int]]] = {}
        self.events: list[tuple[str, int]] = []

    def __getattr__(self, name: str):  # propose, assume_accepted, close, runner_sequences: the n-gram drafter's
        return getattr(self.inner, name)

    def open(self, prompt: list[int], params: SamplingParams, generator: torch.Generator, config=None) -> int:
        handle = self.inner.open(prompt, params, generator, config)
        self.prompts[handle], self.rows[handle], self.syncs[handle] = list(prompt), [], []
        return handle

    def received(self, handle: int) -> int:
        return sum(len(rows) for rows in self.rows[handle])

    def add_features(self, handle: int, start: int, rows: torch.Tensor) -> None:
        assert start == self.received(handle) and rows.shape[1] == self.feature_width and rows.dtype == torch.float32
        self.rows[handle].append(rows)
        self.events.append(("features", handle))

    def sync(self, handle: int, base_length: int, emitted: list[int]) -> None:
        self.syncs[handle].append((self.received(handle), base_length + len(emitted)))
        self.events.append(("sync", handle))
        self.inner.sync(handle, base_length, emitted)


@pytest.fixture
def feature_drafter(target: LoadedModel) -> Iterator[tuple[FeatureDrafter, RunningDrafter]]:
    drafter = FeatureDrafter(target.model.config.hidden_size, VOCAB)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("drafter_service.server.build_core_drafter", lambda config, **_: drafter)
        running = start_drafter(DrafterConfig(kind="ngram", target="tiny"), target=target)
    yield drafter, running
    running.stop(grace_s=0)


def test_the_drafter_service_applies_a_commits_rows_before_the_commit(feature_drafter, target: LoadedModel) -> None:
    drafter, running = feature_drafter
    width = drafter.feature_width
    rows = torch.randn(6, width, generator=torch.Generator().manual_seed(2))
    with grpc.insecure_channel(running.address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        assert stub.Status(drafter_pb2.DrafterStatusRequest(), timeout=TIMEOUT_S).feature_width == width
        prompt = [1, 2, 3, 1, 2]
        stub.OpenSequence(
            drafter_pb2.OpenDraftRequest(sequence_id="s", prompt_ids=prompt, sampling=sampling_to_wire(GREEDY)),
            timeout=TIMEOUT_S,
        )
        commit = drafter_pb2.DraftCommitRequest(
            sequence_id="s", base_length=5, emitted=[3], features=features_to_wire(rows[:5], 0, torch.float32)
        )
        stub.Commit(commit, timeout=TIMEOUT_S)
        carried = drafter_pb2.DraftCommitRequest(
            sequence_id="s", base_length=6, emitted=[1], features=features_to_wire(rows[5:], 5, torch.float16)
        )
        batch = drafter_pb2.DrafterBatchRequest(
            calls=[
                drafter_pb2.DrafterCall(commit=carried),
                drafter_pb2.DrafterCall(propose=drafter_pb2.ProposeRequest(sequence_id="s", max_tokens=3)),
            ]
        )
        results = stub.Batch(batch, timeout=TIMEOUT_S).results
        assert [result.WhichOneof("result") for result in results] == ["commit", "propose"]
        bad = drafter_pb2.DraftCommitRequest(
            sequence_id="s", base_length=7, emitted=[2], features=features_to_wire(rows[:1, :-1], 6, torch.float32)
        )
        with pytest.raises(grpc.RpcError) as error:
            stub.Commit(bad, timeout=TIMEOUT_S)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "features" in error.value.details()
        stub.CloseSequence(drafter_pb2.CloseDraftRequest(sequence_id="s"), timeout=TIMEOUT_S)
    [handle] = drafter.rows
    assert drafter.events == [("features", handle), ("sync", handle)] * 2  # the refused commit changed nothing
    assert drafter.syncs[handle] == [(5, 6), (6, 7)]
    assert torch.equal(drafter.rows[handle][0], rows[:5])
    assert torch.equal(drafter.rows[handle][1], rows[5:].half().float())


def test_a_drafter_without_features_refuses_them(target: LoadedModel) -> None:
    running = start_drafter(DrafterConfig(kind="ngram", target="tiny"), target=target)
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = drafter_pb2_grpc.DrafterStub(channel)
            assert stub.Status(drafter_pb2.DrafterStatusRequest(), timeout=TIMEOUT_S).feature_width == 0
            stub.OpenSequence(drafter_pb2.OpenDraftRequest(sequence_id="s", prompt_ids=[1, 2]), timeout=TIMEOUT_S)
            rows = features_to_wire(torch.ones(1, 4), 0, torch.float16)
            commit = drafter_pb2.DraftCommitRequest(sequence_id="s", base_length=2, emitted=[3], features=rows)
            with pytest.raises(grpc.RpcError) as error:
                stub.Commit(commit, timeout=TIMEOUT_S)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "features" in error.value.details()
    finally:
        running.stop(grace_s=0)


# --- the router, over the real services -------------------------------------------------------------------------


@pytest.mark.parametrize("speculation", ["sequential", "pipelined"])
def test_the_router_relays_every_verdicts_rows_to_the_drafter(
    feature_drafter, verifier: RunningVerifier, target: LoadedModel, speculation: str
) -> None:
    drafter, running = feature_drafter
    config = RouterConfig(
        model=target.name,
        verifiers=(verifier.address,),
        drafters=(running.address,),
        grpc_port=0,
        http_port=0,
        eos_token_ids=tuple(target.eos_token_ids),
        shutdown_grace_s=0.5,
    )
    router = start_router(config)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [4, 5, 4, 5, 4], [6, 0, 6, 0]]
    try:
        results = []
        with Client(router.grpc_address, timeout_s=60) as client:
            for prompt in prompts:
                results.append(
                    client.generate(
                        prompt_ids=prompt, max_tokens=12, temperature=0.0, ignore_eos=True, speculation=speculation
                    )
                )
        samples, _ = scrape(router.http_address)
    finally:
        router.stop(0.5)
    feature_bytes = sum(result.stats.feature_bytes for result in results)
    assert feature_bytes > 0
    assert value(samples, "specdec:wire_bytes_total", direction="features") == feature_bytes
    handles = {tuple(prompt): handle for handle, prompt in drafter.prompts.items()}
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == hf_greedy(target, prompt, 12)
        handle = handles[tuple(prompt)]
        syncs = drafter.syncs[handle]
        assert syncs, "the drafter was told of the verdicts"
        for received, committed in syncs:  # each sync saw the rows of all committed text but (at most) its last token
            assert committed - 1 <= received <= committed
        if speculation == "pipelined":
            assert any(received == committed for received, committed in syncs), "a confirmed assumption had all rows"
        rows = torch.cat(drafter.rows[handle])
        wire = feature_dtype_from_wire(FEATURE_DTYPE)  # the dtype the router asks for
        assert_rows_equal(rows, teacher_forced(target, prompt + result.token_ids)[: len(rows)], wire)
    events = [event for event, _ in drafter.events]
    assert all(events[index - 1] == "features" for index, event in enumerate(events) if event == "sync")


# --- the router's round loop, on in-memory fakes ------------------------------------------------------------------


class FeatureVerifier(FakeVerifier):
    """The fake verifier of ``test_router_pipeline``, whose verdicts carry feature rows when the sequence asked:
    ``(sequence id, start, end)`` stands for the rows of positions ``start .. end - 1`` (all committed text but its
    last token, all of it after a deferred bonus); ``stop_features`` ends them."""

    def __init__(self, address: str = "verifier-0", fail_on_call: int = 0) -> None:
        super().__init__(address, fail_on_call=fail_on_call)
        self.opened_with: dict[str, bool] = {}
        self.stops: list[str] = []

    async def open(self, sequence_id: str, spec: SequenceSpec, seed: int) -> None:
        await super().open(sequence_id, spec, seed)
        self.opened_with[sequence_id] = spec.features
        self.sequences[sequence_id].update(features=spec.features, sent=0)

    async def verify(
        self, sequence_id: str, drafted: Drafted | None, *, defer_bonus: bool, stop_features: bool = False
    ) -> Verified:
        verified = await super().verify(sequence_id, drafted, defer_bonus=defer_bonus)
        state = self.sequences[sequence_id]
        if stop_features:
            assert state["features"], "only a sequence sending rows is told to stop"
            self.stops.append(sequence_id)
            state["features"] = False
        if not state["features"]:
            return verified
        start, end = state["sent"], len(state["text"]) - (0 if verified.bonus_deferred else 1)
        state["sent"] = end
        return replace(verified, features=(sequence_id, start, end), feature_bytes=4 * (end - start))


class FeatureFakeDrafter(FakeDrafter):
    """The fake drafter of ``test_router_pipeline`` with ``feature_width`` > 0: each Commit must carry the verdict's
    rows, continuing its sequence's last block and covering the committed text but (at most) its last token."""

    feature_width = 4

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.received: dict[str, int] = {}
        self.commits_with_rows = 0

    async def commit(
        self,
        sequence_id: str,
        base_length: int,
        emitted: Sequence[int],
        features: object | None = None,
        cancel_through: int = 0,
    ) -> None:
        await super().commit(sequence_id, base_length, emitted, None, cancel_through)
        assert isinstance(features, tuple), "every Commit of a drafter that takes features carries them"
        owner, start, end = features
        assert owner == sequence_id and start == self.received.get(sequence_id, 0)
        assert base_length + len(emitted) - 1 <= end <= base_length + len(emitted)
        self.received[sequence_id] = end
        self.commits_with_rows += 1


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
def test_every_commit_carries_the_rows_of_its_verdict(mode: str) -> None:
    verifier, drafter = FeatureVerifier(), FeatureFakeDrafter(wrong_every=3)
    tokens, final, _ = run(make_plan(mode), FakePlacement([verifier], [drafter]))
    assert tokens == reference(PROMPT, 40)[0]
    assert verifier.opened_with == {"seq": True} and verifier.stops == []
    assert drafter.commits_with_rows > 3 and final.stats.feature_bytes == 4 * (len(PROMPT) + len(tokens) - 1)


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
@pytest.mark.parametrize("fail_on_call", [1, 4, 7])
def test_a_failed_drafter_stops_the_rows(mode: str, fail_on_call: int) -> None:
    verifier, drafter = FeatureVerifier(), FeatureFakeDrafter(wrong_every=3, fail_on_call=fail_on_call)
    tokens, final, _ = run(make_plan(mode), FakePlacement([verifier], [drafter]))
    assert tokens == reference(PROMPT, 40)[0] and final.stats.drafter_fallback
    assert verifier.opened_with == {"seq": True} and verifier.stops == ["seq"]  # once, on the next Verify


@pytest.mark.parametrize("mode", ["sequential", "pipelined"])
def test_a_re_placed_request_starts_the_rows_again_at_zero(mode: str) -> None:
    failing, spare = FeatureVerifier("verifier-0", fail_on_call=4), FeatureVerifier("verifier-1")
    drafter = FeatureFakeDrafter(wrong_every=3)
    tokens, _, _ = run(make_plan(mode), FakePlacement([failing, spare], [drafter]))
    assert tokens == reference(PROMPT, 40)[0]
    assert spare.opened_with == {"seq.1": True} and spare.stops == []
    assert set(drafter.received) == {"seq", "seq.1"}  # the reopened drafter's rows restarted at 0 (checked per id)


def test_no_rows_without_a_drafter_that_takes_them() -> None:
    plain = FeatureVerifier()
    run(make_plan("pipelined"), FakePlacement([plain], [FakeDrafter(wrong_every=3)]))
    alone = FeatureVerifier()
    run(make_plan("sequential"), FakePlacement([alone], []))
    off = FeatureVerifier()
    run(make_plan("off"), FakePlacement([off], [FeatureFakeDrafter()]))
    assert plain.opened_with == alone.opened_with == off.opened_with == {"seq": False}
