"""The Drafter gRPC service, thin: proto → scheduler (which owns the core drafter) → proto.

Domain errors raised below become status codes in :mod:`grpc_common.errors` (bad fields: INVALID_ARGUMENT,
unknown sequence: NOT_FOUND, too many open sequences: RESOURCE_EXHAUSTED). ``Batch`` carries many calls in one
message (:mod:`grpc_common.batch`). A Commit's target feature rows are decoded and checked here (width: the
drafter's ``feature_width``) and given to the drafter before the commit, on the scheduler thread.
"""

from __future__ import annotations

import time

import grpc
from google.protobuf.message import Message
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

from drafter_service.scheduler import Drafted, DraftScheduler, SchedulerStatus
from grpc_common.batch import Submitted, answer_batch
from grpc_common.convert import features_from_wire, proposal_to_wire, sampling_from_wire
from specdec.drafters import DraftConfig

_SIBLING_SAMPLING = {
    common_pb2.SIBLING_SAMPLING_UNSPECIFIED: None,  # the drafter's default
    common_pb2.SIBLING_SAMPLING_IID: "iid",
    common_pb2.SIBLING_SAMPLING_WITHOUT_REPLACEMENT: "without_replacement",
}


def shape_from_wire(shape: drafter_pb2.DraftShape, default: DraftConfig) -> DraftConfig:
    """A sequence's candidate shape: ``default`` where the message says 0 / unspecified (validated)."""
    return default.with_shape(
        shape.num_draft_tokens, shape.tree_width, shape.tree_budget, _SIBLING_SAMPLING.get(shape.sibling_sampling)
    )


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """``specdec.v1.Drafter`` over one :class:`DraftScheduler`."""

    def __init__(self, scheduler: DraftScheduler, kind: str, default_shape: DraftConfig) -> None:
        self.scheduler = scheduler
        self.kind = kind
        self.default_shape = default_shape
        self.feature_width = scheduler.drafter.feature_width

    def OpenSequence(
        self, request: drafter_pb2.OpenDraftRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.OpenDraftReply:
        return self._submit_open(request).answer(context)

    def Propose(self, request: drafter_pb2.ProposeRequest, context: grpc.ServicerContext) -> drafter_pb2.ProposeReply:
        return self._submit_propose(request).answer(context)

    def Commit(
        self, request: drafter_pb2.DraftCommitRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.DraftCommitReply:
        return self._submit_commit(request).answer(context)

    def CloseSequence(
        self, request: drafter_pb2.CloseDraftRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.CloseDraftReply:
        return self._submit_close(request).answer(context)

    def Batch(
        self, request: drafter_pb2.DrafterBatchRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.DrafterBatchReply:
        results = answer_batch(request.calls, self._submit, drafter_pb2.DrafterResult, context)
        return drafter_pb2.DrafterBatchReply(results=results)

    def _submit(self, kind: str, request: Message) -> Submitted:
        submit = {
            "open": self._submit_open,
            "propose": self._submit_propose,
            "commit": self._submit_commit,
            "close": self._submit_close,
        }[kind]
        return submit(request)

    def _submit_open(self, request: drafter_pb2.OpenDraftRequest) -> Submitted:
        started = time.perf_counter_ns()
        params = sampling_from_wire(request.sampling)
        shape = shape_from_wire(request.shape, self.default_shape)
        future = self.scheduler.open(request.sequence_id, list(request.prompt_ids), params, request.seed, shape)
        return Submitted(future, lambda _: drafter_pb2.OpenDraftReply(open_ns=time.perf_counter_ns() - started))

    def _submit_propose(self, request: drafter_pb2.ProposeRequest) -> Submitted:
        future = self.scheduler.propose(
            request.sequence_id, request.max_tokens, request.assume_previous_accepted, request.propose_id
        )
        return Submitted(future, _propose_reply)

    def _submit_commit(self, request: drafter_pb2.DraftCommitRequest) -> Submitted:
        features = None
        if request.HasField("features"):
            features = features_from_wire(request.features, width=self.feature_width)
        future = self.scheduler.commit(
            request.sequence_id, request.base_length, list(request.emitted), features, request.cancel_through
        )
        return Submitted(future, lambda _: drafter_pb2.DraftCommitReply())

    def _submit_close(self, request: drafter_pb2.CloseDraftRequest) -> Submitted:
        return Submitted(self.scheduler.close(request.sequence_id), lambda _: drafter_pb2.CloseDraftReply())

    def Status(
        self, request: drafter_pb2.DrafterStatusRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.DrafterStatusReply:
        def reply(status: SchedulerStatus) -> drafter_pb2.DrafterStatusReply:
            return drafter_pb2.DrafterStatusReply(
                kind=self.kind,
                open_sequences=status.open_sequences,
                runner_sequences=status.runner_sequences,
                proposals=status.proposals,
                batches=status.batches,
                max_batch=status.max_batch,
                feature_width=self.feature_width,
                cancelled_proposals=status.cancelled,
            )

        return Submitted(self.scheduler.status(), reply).answer(context)


def _propose_reply(drafted: Drafted) -> drafter_pb2.ProposeReply:
    proposal = drafted.proposal
    message = proposal_to_wire(proposal)
    outcomes = [proposal_to_wire(outcome) for outcome in drafted.outcome_proposals]
    return drafter_pb2.ProposeReply(
        proposal=message,
        draft_ns=drafted.draft_ns,
        wire_bytes=message.ByteSize() + sum(outcome.ByteSize() for outcome in outcomes),
        assumed_path=proposal.assumed_path,
        rejections=[drafter_pb2.GuessedVerdict(emitted=rejection.emitted) for rejection in proposal.rejections],
        outcome_proposals=outcomes,
    )
