"""Every worker message is bounded before anything is allocated (DESIGN §9): a proposal's nodes and draft rows, a
Batch's calls and nodes, a drafter's shape and text. Each bound answers INVALID_ARGUMENT naming the field, fast, and
the worker goes on serving. Real servers on loopback with a tiny model."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from drafter_service.config import DrafterConfig
from drafter_service.server import start_drafter
from specdec.models import LoadedModel
from tests.tiny_models import tiny_llama
from verifier_service.config import VerifierConfig
from verifier_service.server import start_verifier

VOCAB = 8
FAST_S = 10  # a bound answers at once; an allocation it failed to prevent ran past this (or died)
GREEDY = common_pb2.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=3, vocab_size=VOCAB, num_layers=1)


@pytest.fixture(scope="module")
def verifier(target: LoadedModel) -> Iterator[verifier_pb2_grpc.VerifierStub]:
    config = VerifierConfig(max_seq_len=64, max_proposal_nodes=64, max_batch_nodes=100, max_batch_calls=50)
    running = start_verifier(config, model=target)
    with grpc.insecure_channel(running.address) as channel:
        yield verifier_pb2_grpc.VerifierStub(channel)
    running.stop(0)


@pytest.fixture(scope="module")
def drafter(target: LoadedModel) -> Iterator[drafter_pb2_grpc.DrafterStub]:
    config = DrafterConfig(kind="ngram", max_proposal_nodes=64, max_batch_calls=50, max_seq_len=64)
    running = start_drafter(config, target=target)
    with grpc.insecure_channel(running.address) as channel:
        yield drafter_pb2_grpc.DrafterStub(channel)
    running.stop(0)


def refused(call, request, field: str) -> None:
    """``call(request)`` answers INVALID_ARGUMENT naming ``field``, well within FAST_S."""
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as raised:
        call(request, timeout=FAST_S)
    error = raised.value
    assert (error.code(), error.details().split(":")[0]) == (grpc.StatusCode.INVALID_ARGUMENT, field), error.details()
    assert time.monotonic() - started < FAST_S / 2


def roots(count: int, **draft) -> common_pb2.Proposal:
    """``count`` children of the last committed token (token 1), with ``draft`` distributions if given."""
    tree = common_pb2.TokenTree(tokens=[1] * count, parents=[-1] * count)
    if not draft:
        return common_pb2.Proposal(tree=tree)
    return common_pb2.Proposal(tree=tree, draft=common_pb2.DraftDistributions(**draft))


def row(ids: list[int], probs: list[float]) -> common_pb2.SparseRow:
    return common_pb2.SparseRow(ids=np.array(ids, dtype="<i4").tobytes(), probs=np.array(probs, dtype="<f4").tobytes())


def open_verifier(stub: verifier_pb2_grpc.VerifierStub, sequence_id: str) -> None:
    request = verifier_pb2.OpenVerifyRequest(sequence_id=sequence_id, prompt_ids=[1, 2], sampling=GREEDY, max_tokens=8)
    stub.OpenSequence(request, timeout=FAST_S)


def test_a_verify_with_100000_root_children_is_refused_before_any_allocation(verifier) -> None:
    """It used to build a 100 000 x 100 000 tree mask: an allocator failure (INTERNAL), or minutes of work."""
    open_verifier(verifier, "huge")
    refused(
        verifier.Verify, verifier_pb2.VerifyRequest(sequence_id="huge", proposal=roots(100_000)), "proposal.tree.tokens"
    )
    reply = verifier.Verify(verifier_pb2.VerifyRequest(sequence_id="huge", proposal=roots(2)), timeout=FAST_S)
    assert len(reply.verdict.emitted) >= 1  # the sequence and the server go on
    verifier.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id="huge"), timeout=FAST_S)


@pytest.mark.parametrize(
    ("proposal", "field"),
    [
        (roots(65), "proposal.tree.tokens"),
        (common_pb2.Proposal(tree=common_pb2.TokenTree(tokens=[1, 2], parents=[-1])), "proposal.tree.parents"),
        (
            common_pb2.Proposal(tree=common_pb2.TokenTree(tokens=[1], parents=[-1]), sibling_sampling=7),
            "proposal.sibling_sampling",
        ),
        (roots(1, rows=[row([1], [1.0])] * 3, node_rows=[0]), "proposal.draft.rows"),
        (roots(1, rows=[row([*range(VOCAB), 1], [0.1] * (VOCAB + 1))], node_rows=[0]), "proposal.draft.rows[0]"),
        (roots(1, rows=[row([1, 1], [0.5, 0.5])], node_rows=[0]), "proposal.draft.rows[0]"),
        (roots(1, rows=[row([1], [1.0])], node_rows=[0, 0]), "proposal.draft.node_rows"),
        (roots(1, rows=[row([1], [1.0])], node_rows=[-1]), "proposal.draft.node_rows"),
    ],
    ids=["nodes", "parents", "sibling-scheme", "rows", "ids-per-row", "repeated-ids", "node-rows", "negative-row"],
)
def test_a_malformed_proposal_names_its_field(verifier, proposal: common_pb2.Proposal, field: str) -> None:
    open_verifier(verifier, "bad")
    try:
        refused(verifier.Verify, verifier_pb2.VerifyRequest(sequence_id="bad", proposal=proposal), field)
    finally:
        verifier.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id="bad"), timeout=FAST_S)


def test_a_verifier_batch_is_bounded_in_calls_and_nodes(verifier) -> None:
    closes = [verifier_pb2.VerifierCall(close=verifier_pb2.CloseVerifyRequest(sequence_id="x"))] * 51
    refused(verifier.Batch, verifier_pb2.VerifierBatchRequest(calls=closes), "calls")
    verifies = [verifier_pb2.VerifierCall(verify=verifier_pb2.VerifyRequest(sequence_id="x", proposal=roots(60)))] * 2
    refused(verifier.Batch, verifier_pb2.VerifierBatchRequest(calls=verifies), "calls")
    assert len(verifier.Batch(verifier_pb2.VerifierBatchRequest(calls=closes[:50]), timeout=FAST_S).results) == 50


def test_a_prompt_longer_than_the_context_is_refused(verifier) -> None:
    request = verifier_pb2.OpenVerifyRequest(sequence_id="long", prompt_ids=[1] * 100, sampling=GREEDY, max_tokens=1)
    refused(verifier.OpenSequence, request, "prompt")


def test_the_drafter_bounds_its_shape_text_and_batches(drafter) -> None:
    def open_draft(sequence_id: str, prompt: list[int], **shape) -> drafter_pb2.OpenDraftRequest:
        return drafter_pb2.OpenDraftRequest(
            sequence_id=sequence_id, prompt_ids=prompt, sampling=GREEDY, shape=drafter_pb2.DraftShape(**shape)
        )

    refused(drafter.OpenSequence, open_draft("a", [1], tree_width=100_000, num_draft_tokens=2), "shape.tree_width")
    refused(drafter.OpenSequence, open_draft("a", [1], tree_width=16, num_draft_tokens=16), "shape")
    refused(drafter.OpenSequence, open_draft("a", [1], sibling_sampling=9), "shape.sibling_sampling")
    refused(drafter.OpenSequence, open_draft("a", [1] * 65), "prompt_ids")
    drafter.OpenSequence(open_draft("a", [1, 2]), timeout=FAST_S)
    try:
        commit = drafter_pb2.DraftCommitRequest(sequence_id="a", base_length=2, emitted=[1] * 63)
        refused(drafter.Commit, commit, "emitted")
        refused(
            drafter.Commit, drafter_pb2.DraftCommitRequest(sequence_id="a", base_length=-1, emitted=[1]), "base_length"
        )
        closes = [drafter_pb2.DrafterCall(close=drafter_pb2.CloseDraftRequest(sequence_id="x"))] * 51
        refused(drafter.Batch, drafter_pb2.DrafterBatchRequest(calls=closes), "calls")
        drafter.Commit(drafter_pb2.DraftCommitRequest(sequence_id="a", base_length=2, emitted=[3]), timeout=FAST_S)
        drafter.Propose(drafter_pb2.ProposeRequest(sequence_id="a", max_tokens=4), timeout=FAST_S)
    finally:
        drafter.CloseSequence(drafter_pb2.CloseDraftRequest(sequence_id="a"), timeout=FAST_S)
