"""Property-based fuzzing of the internal wire (DESIGN §9): hypothesis generates ``Verify`` / ``OpenSequence`` /
``Batch`` messages for a real verifier and ``Propose`` / ``Commit`` / ``OpenSequence`` / ``Batch`` messages for real
drafters (n-gram and a tiny draft model), over loopback. For any message: no INTERNAL or UNKNOWN, no hang (every call
answers well within its deadline), and afterwards the worker still serves a good request exactly.

Seeded (``derandomize``), no example database, a bounded number of examples: the run is the same every time and
takes seconds. Values lean towards the edges that matter (ids just outside the vocabulary, sizes just over the
bounds, NaN and infinite probabilities, byte strings that are not whole values) without leaving out the rest.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from drafter_service.config import DrafterConfig
from drafter_service.server import start_drafter
from specdec.models import LoadedModel
from tests.tiny_models import tiny_draft, tiny_llama
from verifier_service.config import VerifierConfig
from verifier_service.server import start_verifier

VOCAB = 8
CALL_S = 10  # every call answers well within this, or it counts as a hang
MAX_NODES = 24  # the workers' bound on nodes per proposal, so sizes just over it are cheap to generate
SEQUENCE_IDS = ["s", "t", "", "x" * 300]  # "s" is opened before each example; the rest are unknown or invalid
NOT_ALLOWED = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED}
NOT_ALLOWED_NUMBERS = {code.value[0] for code in NOT_ALLOWED}
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,  # each call has its own deadline (CALL_S); a slow example is what "no hang" checks
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

int32s = st.one_of(st.integers(-2, VOCAB + 1), st.integers(-(2**31), 2**31 - 1))
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@st.composite
def mostly_valid(draw: st.DrawFn, values: list, wrong: st.SearchStrategy) -> list:
    """``values``, or (half the time) with one element replaced by a draw of ``wrong``: a message a step from valid
    reaches deeper checks than one that is wrong everywhere."""
    if values and draw(st.booleans()):
        values[draw(st.integers(0, len(values) - 1))] = draw(wrong)
    return values


@st.composite
def token_lists(draw: st.DrawFn, max_size: int = 12) -> list[int]:
    """In-vocabulary ids, perhaps one of them wrong."""
    return draw(mostly_valid(draw(st.lists(st.integers(0, VOCAB - 1), max_size=max_size)), int32s))


@st.composite
def int32_bytes(draw: st.DrawFn, ids: list[int]) -> bytes:
    """``ids`` packed as little-endian int32, or any bytes (a length that is not a whole number of values included)."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=40))
    return struct.pack(f"<{len(ids)}i", *draw(mostly_valid(ids, int32s)))


@st.composite
def float32_bytes(draw: st.DrawFn, count: int) -> bytes:
    """``count`` equal probabilities summing to 1 (perhaps one of them NaN, infinite, negative, ...), or any bytes."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=40))
    values = draw(mostly_valid([1.0 / max(count, 1)] * count, floats32))
    return struct.pack(f"<{len(values)}f", *values)


@st.composite
def sparse_rows(draw: st.DrawFn) -> common_pb2.SparseRow:
    ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=VOCAB, unique=True))
    count = draw(st.one_of(st.just(len(ids)), st.integers(0, VOCAB + 1)))
    return common_pb2.SparseRow(ids=draw(int32_bytes(ids)), probs=draw(float32_bytes(count)))


@st.composite
def proposals(draw: st.DrawFn) -> common_pb2.Proposal:
    """A tree of in-vocabulary tokens whose parents precede their children, with sibling-shared draft rows; then
    perhaps one thing wrong: a size past the bound, a parent, a token, a row, a row index, the sibling scheme."""
    count = draw(st.one_of(st.integers(0, 6), st.integers(0, MAX_NODES + 2), st.just(MAX_NODES * 4)))
    tokens = draw(mostly_valid(draw(st.lists(st.integers(0, VOCAB - 1), min_size=count, max_size=count)), int32s))
    parents = [draw(st.integers(-1, index - 1)) for index in range(count)]
    parents = draw(mostly_valid(parents, st.integers(-3, count + 1)))
    if draw(st.booleans()):
        parents = parents[: draw(st.integers(0, count))] + draw(st.lists(st.integers(-1, 0), max_size=1))
    scheme = draw(st.one_of(st.integers(0, 2), st.integers(3, 2**31 - 1)))
    proposal = common_pb2.Proposal(tree=common_pb2.TokenTree(tokens=tokens, parents=parents), sibling_sampling=scheme)
    if draw(st.booleans()):
        rows = draw(st.lists(sparse_rows(), min_size=1, max_size=max(count, 1) + 1))
        node_rows = [min(parent + 1, len(rows) - 1) for parent in parents]  # siblings share their parent's row
        node_rows = draw(mostly_valid(node_rows, st.integers(-2, len(rows) + 1)))
        proposal.draft.CopyFrom(common_pb2.DraftDistributions(rows=rows, node_rows=node_rows))
    return proposal


@st.composite
def one_wrong(draw: st.DrawFn, valid: st.SearchStrategy, wrong: dict[str, st.SearchStrategy]) -> Message:
    """A draw of ``valid`` with (half the time) one field, a dotted path, set to a draw of its ``wrong`` strategy: a
    message a step from valid reaches deeper checks than one wrong in several fields at once."""
    message = draw(valid)
    if draw(st.booleans()):
        path = draw(st.sampled_from(sorted(wrong)))
        *parents, name = path.split(".")
        holder = message
        for parent in parents:
            holder = getattr(holder, parent)
        value = draw(wrong[path])
        if isinstance(value, list):
            del getattr(holder, name)[:]
            getattr(holder, name).extend(value)
        elif isinstance(value, Message):
            getattr(holder, name).CopyFrom(value)
        else:
            setattr(holder, name, value)
    return message


sampling = st.builds(
    common_pb2.SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.125, 2, width=32)),
    top_k=st.integers(0, VOCAB + 1),
    top_p=st.floats(0.125, 1, width=32),
    min_p=st.floats(0, 0.5, width=32),
)
SAMPLING_WRONG = {
    "sampling.temperature": floats32,
    "sampling.top_k": int32s,
    "sampling.top_p": floats32,
    "sampling.min_p": floats32,
}
valid_prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
wrong_tokens = st.one_of(token_lists(max_size=12), st.lists(st.integers(0, VOCAB - 1), min_size=60, max_size=70))
sequence_ids = st.sampled_from(SEQUENCE_IDS)
wrong_ids = st.sampled_from(SEQUENCE_IDS)
wrong_ints = st.one_of(st.integers(-2, 0), st.integers(-(2**31), 2**31 - 1))

verifier_opens = one_wrong(
    st.builds(
        verifier_pb2.OpenVerifyRequest,
        sequence_id=st.just("t"),
        prompt_ids=valid_prompts,
        sampling=sampling,
        seed=st.integers(0, 2**64 - 1),
        max_tokens=st.integers(1, 20),
        ignore_eos=st.booleans(),
        logprobs=st.booleans(),
        features=st.booleans(),
        feature_dtype=st.integers(0, 3),
    ),
    {
        **SAMPLING_WRONG,
        "sequence_id": wrong_ids,
        "prompt_ids": wrong_tokens,
        "max_tokens": wrong_ints,
        "feature_dtype": st.integers(4, 2**31 - 1),
    },
)
verifies = st.builds(
    verifier_pb2.VerifyRequest,
    sequence_id=st.sampled_from(["s", "s", "t", ""]),
    proposal=proposals(),
    defer_bonus=st.booleans(),
    stop_features=st.booleans(),
)
touches = st.builds(common_pb2.TouchRequest, sequence_ids=st.lists(wrong_ids, max_size=3))
verifier_calls = st.one_of(
    st.builds(verifier_pb2.VerifierCall, open=verifier_opens),
    st.builds(verifier_pb2.VerifierCall, verify=verifies),
    st.builds(verifier_pb2.VerifierCall, close=st.builds(verifier_pb2.CloseVerifyRequest, sequence_id=sequence_ids)),
    st.builds(verifier_pb2.VerifierCall, touch=touches),
    st.just(verifier_pb2.VerifierCall()),
)

feature_rows = st.builds(
    common_pb2.FeatureRows,
    start=st.integers(-2, 2**63 - 1),
    width=st.one_of(st.integers(-1, 40), int32s),
    dtype=st.integers(0, 5),
    data=st.binary(max_size=64),
)
drafter_opens = one_wrong(
    st.builds(
        drafter_pb2.OpenDraftRequest,
        sequence_id=st.just("t"),
        prompt_ids=valid_prompts,
        sampling=sampling,
        seed=st.integers(0, 2**64 - 1),
        shape=st.builds(
            drafter_pb2.DraftShape,
            num_draft_tokens=st.integers(0, 5),
            tree_width=st.integers(0, 3),
            tree_budget=st.integers(0, 8),
            sibling_sampling=st.integers(0, 2),
        ),
    ),
    {
        **SAMPLING_WRONG,
        "sequence_id": wrong_ids,
        "prompt_ids": wrong_tokens,
        "shape.num_draft_tokens": wrong_ints,
        "shape.tree_width": wrong_ints,
        "shape.tree_budget": st.one_of(st.integers(MAX_NODES - 1, MAX_NODES + 1), wrong_ints),
        "shape.sibling_sampling": st.integers(3, 2**31 - 1),
    },
)
proposes = one_wrong(
    st.builds(
        drafter_pb2.ProposeRequest,
        sequence_id=st.sampled_from(["s", "t"]),
        max_tokens=st.integers(0, 30),
        assume_previous_accepted=st.booleans(),
    ),
    {"sequence_id": wrong_ids, "max_tokens": wrong_ints},
)
commits = one_wrong(
    st.builds(
        drafter_pb2.DraftCommitRequest,
        sequence_id=st.sampled_from(["s", "t"]),
        base_length=st.integers(0, 5),
        emitted=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
    ),
    {
        "sequence_id": wrong_ids,
        "base_length": st.one_of(st.integers(-2, 80), st.integers(-(2**63), 2**63 - 1)),
        "emitted": wrong_tokens,
        "features": feature_rows,
    },
)
drafter_calls = st.one_of(
    st.builds(drafter_pb2.DrafterCall, open=drafter_opens),
    st.builds(drafter_pb2.DrafterCall, propose=proposes),
    st.builds(drafter_pb2.DrafterCall, commit=commits),
    st.builds(drafter_pb2.DrafterCall, close=st.builds(drafter_pb2.CloseDraftRequest, sequence_id=sequence_ids)),
    st.builds(drafter_pb2.DrafterCall, touch=touches),
    st.just(drafter_pb2.DrafterCall()),
)


def answered(call, request) -> object | None:
    """``call(request)``'s reply, or None for a refusal with an allowed code (the property: never INTERNAL,
    UNKNOWN or a hang)."""
    try:
        return call(request, timeout=CALL_S)
    except grpc.RpcError as error:
        assert error.code() not in NOT_ALLOWED, (error.code(), error.details(), request)
        return None


def assert_batch_answered(reply: object | None, results_of: int) -> None:
    """Every call of a Batch got a result, and no result is an INTERNAL or UNKNOWN failure."""
    if reply is None:  # the Batch as a whole was refused (over a bound)
        return
    assert len(reply.results) == results_of
    for result in reply.results:
        assert result.WhichOneof("result") is not None
        assert result.error.code not in NOT_ALLOWED_NUMBERS, result.error


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=11, vocab_size=VOCAB, num_layers=1)


@pytest.fixture(scope="module")
def verifier(target: LoadedModel) -> Iterator[verifier_pb2_grpc.VerifierStub]:
    config = VerifierConfig(
        max_seq_len=64, max_sequences=8, max_proposal_nodes=MAX_NODES, max_batch_nodes=3 * MAX_NODES, batch_wait_ms=0
    )
    running = start_verifier(config, model=target)
    with grpc.insecure_channel(running.address) as channel:
        yield verifier_pb2_grpc.VerifierStub(channel)
    running.stop(0)


@pytest.fixture(scope="module", params=["ngram", "model"])
def drafter(request, target: LoadedModel) -> Iterator[drafter_pb2_grpc.DrafterStub]:
    config = DrafterConfig(
        kind=request.param,
        draft_model="tiny-draft" if request.param == "model" else None,
        draft_top_k=4,
        max_proposal_nodes=MAX_NODES,
        max_seq_len=64,
        max_open_sequences=8,
    )
    running = start_drafter(config, target=target, draft=tiny_draft(target, seed=12))
    with grpc.insecure_channel(running.address) as channel:
        yield drafter_pb2_grpc.DrafterStub(channel)
    running.stop(0)


GREEDY = common_pb2.SamplingParams(temperature=0.0)


def reset_verifier(stub: verifier_pb2_grpc.VerifierStub) -> None:
    """Close every id an example may have opened; open ``s`` afresh."""
    for sequence_id in SEQUENCE_IDS:
        stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id=sequence_id), timeout=CALL_S)
    request = verifier_pb2.OpenVerifyRequest(sequence_id="s", prompt_ids=[1, 2, 3], sampling=GREEDY, max_tokens=20)
    stub.OpenSequence(request, timeout=CALL_S)


def assert_verifier_serves(stub: verifier_pb2_grpc.VerifierStub) -> None:
    """A good greedy round after the fuzzing: the target's argmax continuation, and nothing left open."""
    reset_verifier(stub)
    first = stub.Verify(verifier_pb2.VerifyRequest(sequence_id="s"), timeout=CALL_S).verdict.emitted
    stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id="s"), timeout=CALL_S)
    reset_verifier(stub)
    again = stub.Verify(verifier_pb2.VerifyRequest(sequence_id="s"), timeout=CALL_S).verdict.emitted
    assert len(first) == 1 and list(first) == list(again)
    stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id="s"), timeout=CALL_S)
    assert stub.Status(verifier_pb2.VerifierStatusRequest(), timeout=CALL_S).open_sequences == 0


def test_fuzzed_verifier_calls_never_fail_internally(verifier: verifier_pb2_grpc.VerifierStub) -> None:
    @settings(FUZZ, max_examples=150)
    @given(verify=verifies, open_request=verifier_opens)
    def case(verify: verifier_pb2.VerifyRequest, open_request: verifier_pb2.OpenVerifyRequest) -> None:
        reset_verifier(verifier)
        answered(verifier.Verify, verify)
        answered(verifier.OpenSequence, open_request)
        answered(verifier.Verify, verifier_pb2.VerifyRequest(sequence_id=open_request.sequence_id))

    case()
    assert_verifier_serves(verifier)


def test_fuzzed_verifier_batches_never_fail_internally(verifier: verifier_pb2_grpc.VerifierStub) -> None:
    @settings(FUZZ, max_examples=80)
    @given(calls=st.lists(verifier_calls, max_size=6))
    def case(calls: list[verifier_pb2.VerifierCall]) -> None:
        reset_verifier(verifier)
        reply = answered(verifier.Batch, verifier_pb2.VerifierBatchRequest(calls=calls))
        assert_batch_answered(reply, len(calls))

    case()
    assert_verifier_serves(verifier)


def reset_drafter(stub: drafter_pb2_grpc.DrafterStub) -> None:
    for sequence_id in SEQUENCE_IDS:
        if sequence_id:
            stub.CloseSequence(drafter_pb2.CloseDraftRequest(sequence_id=sequence_id), timeout=CALL_S)
    request = drafter_pb2.OpenDraftRequest(sequence_id="s", prompt_ids=[1, 2, 3, 1, 2], sampling=GREEDY, seed=1)
    stub.OpenSequence(request, timeout=CALL_S)


def assert_drafter_serves(stub: drafter_pb2_grpc.DrafterStub) -> None:
    """A good round after the fuzzing (propose, commit, propose again), and nothing left open."""
    reset_drafter(stub)
    proposal = stub.Propose(drafter_pb2.ProposeRequest(sequence_id="s", max_tokens=4), timeout=CALL_S).proposal
    stub.Commit(drafter_pb2.DraftCommitRequest(sequence_id="s", base_length=5, emitted=[3]), timeout=CALL_S)
    stub.Propose(drafter_pb2.ProposeRequest(sequence_id="s", max_tokens=4), timeout=CALL_S)
    stub.CloseSequence(drafter_pb2.CloseDraftRequest(sequence_id="s"), timeout=CALL_S)
    assert all(0 <= token < VOCAB for token in proposal.tree.tokens)
    assert stub.Status(drafter_pb2.DrafterStatusRequest(), timeout=CALL_S).open_sequences == 0


def test_fuzzed_drafter_calls_never_fail_internally(drafter: drafter_pb2_grpc.DrafterStub) -> None:
    @settings(FUZZ, max_examples=80)
    @given(open_request=drafter_opens, commit=commits, propose=proposes)
    def case(
        open_request: drafter_pb2.OpenDraftRequest,
        commit: drafter_pb2.DraftCommitRequest,
        propose: drafter_pb2.ProposeRequest,
    ) -> None:
        reset_drafter(drafter)
        answered(drafter.OpenSequence, open_request)
        answered(drafter.Commit, commit)
        answered(drafter.Propose, propose)

    case()
    assert_drafter_serves(drafter)


def test_fuzzed_drafter_batches_never_fail_internally(drafter: drafter_pb2_grpc.DrafterStub) -> None:
    @settings(FUZZ, max_examples=60)
    @given(calls=st.lists(drafter_calls, max_size=6))
    def case(calls: list[drafter_pb2.DrafterCall]) -> None:
        reset_drafter(drafter)
        reply = answered(drafter.Batch, drafter_pb2.DrafterBatchRequest(calls=calls))
        assert_batch_answered(reply, len(calls))

    case()
    assert_drafter_serves(drafter)
