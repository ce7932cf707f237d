"""The Drafter gRPC service, thin: proto → scheduler (which owns the core drafter) → proto.

Domain errors raised below become status codes in :mod:`grpc_common.errors` (bad fields: INVALID_ARGUMENT,
unknown sequence: NOT_FOUND, too many open sequences: RESOURCE_EXHAUSTED). ``Batch`` carries many calls in one
message (:mod:`grpc_common.batch`). A Commit's target feature rows are decoded and checked here (width: the
drafter's ``feature_width``) and given to the drafter before the commit, on the scheduler thread. Every message is
bounded before anything is allocated (INVALID_ARGUMENT naming the field): a Batch's calls, a shape's nodes, a
sequence's text (the prompt, and what a Commit makes of it). ``Touch`` renews leases.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc
from google.protobuf.message import Message
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

from drafter_service.scheduler import Drafted, DraftScheduler, SchedulerStatus
from grpc_common.batch import (
    BatchTypes,
    StartedBatch,
    Submitted,
    answer_batch,
    check_batch_size,
    stream_batches,
    touched,
)
from grpc_common.convert import MAX_PROPOSAL_NODES, sampling_from_wire
from grpc_common.convert_rows import features_from_wire, proposal_to_wire
from specdec.drafters import DraftConfig
from specdec.errors import InvalidArgumentError

_SIBLING_SAMPLING = {
    common_pb2.SIBLING_SAMPLING_UNSPECIFIED: None,  # the drafter's default
    common_pb2.SIBLING_SAMPLING_IID: "iid",
    common_pb2.SIBLING_SAMPLING_WITHOUT_REPLACEMENT: "without_replacement",
}


def shape_from_wire(
    shape: drafter_pb2.DraftShape, default: DraftConfig, max_nodes: int = MAX_PROPOSAL_NODES
) -> DraftConfig:
    """A sequence's candidate shape: ``default`` where the message says 0 / unspecified (validated: a known sibling
    scheme, each size at most ``max_nodes``, and so the nodes of a round)."""
    if shape.sibling_sampling not in _SIBLING_SAMPLING:
        raise InvalidArgumentError("shape.sibling_sampling", f"unknown value {shape.sibling_sampling}")
    for name in ("num_draft_tokens", "tree_width", "tree_budget"):
        if getattr(shape, name) > max_nodes:
            raise InvalidArgumentError(f"shape.{name}", f"must be <= {max_nodes}, got {getattr(shape, name)}")
    config = default.with_shape(
        shape.num_draft_tokens, shape.tree_width, shape.tree_budget, _SIBLING_SAMPLING[shape.sibling_sampling]
    )
    if config.max_nodes > max_nodes:
        raise InvalidArgumentError("shape", f"{config.max_nodes} nodes per round; at most {max_nodes}")
    return config


DRAFTER_BATCH = BatchTypes(drafter_pb2.DrafterResult, drafter_pb2.DrafterBatchReply, drafter_pb2.DrafterBatchReplies)


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """``specdec.v1.Drafter`` over one :class:`DraftScheduler`."""

    def __init__(
        self,
        scheduler: DraftScheduler,
        kind: str,
        default_shape: DraftConfig,
        *,
        max_proposal_nodes: int = MAX_PROPOSAL_NODES,
        max_batch_calls: int = 1024,
        max_seq_len: int = 32768,
    ) -> None:
        self.scheduler = scheduler
        self.kind = kind
        self.default_shape = default_shape
        self.feature_width = scheduler.drafter.feature_width
        self.feature_layers = scheduler.drafter.feature_layers
        self.feature_context = scheduler.drafter.feature_context
        self.lookup_min_match = scheduler.drafter.lookup_min_match
        self.max_proposal_nodes = max_proposal_nodes
        self.max_batch_calls = max_batch_calls
        self.max_seq_len = max_seq_len

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

    def Touch(self, request: common_pb2.TouchRequest, context: grpc.ServicerContext) -> common_pb2.TouchReply:
        return touched(self.scheduler, request).answer(context)

    def Batch(
        self, request: drafter_pb2.DrafterBatchRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.DrafterBatchReply:
        check_batch_size(request.calls, self.max_batch_calls)
        results = answer_batch(
            request.calls, self._submit, drafter_pb2.DrafterResult, context, together=self.scheduler.together
        )
        return drafter_pb2.DrafterBatchReply(results=results)

    def BatchStream(
        self, requests: Iterator[drafter_pb2.DrafterBatchRequest], context: grpc.ServicerContext
    ) -> Iterator[drafter_pb2.DrafterBatchReplies]:
        def start(request: drafter_pb2.DrafterBatchRequest) -> StartedBatch:
            check_batch_size(request.calls, self.max_batch_calls)
            return StartedBatch.start(request.calls, self._submit, together=self.scheduler.together)

        return stream_batches(requests, start, DRAFTER_BATCH, context)

    def _submit(self, kind: str, request: Message) -> Submitted:
        if kind == "touch":
            return touched(self.scheduler, request)
        submit = {
            "open": self._submit_open,
            "propose": self._submit_propose,
            "commit": self._submit_commit,
            "close": self._submit_close,
        }[kind]
        return submit(request)

    def _submit_open(self, request: drafter_pb2.OpenDraftRequest) -> Submitted:
        started = time.perf_counter_ns()
        if len(request.prompt_ids) > self.max_seq_len:
            raise InvalidArgumentError(
                "prompt_ids", f"{len(request.prompt_ids)} tokens; at most {self.max_seq_len} (--max-seq-len)"
            )
        params = sampling_from_wire(request.sampling)
        shape = shape_from_wire(request.shape, self.default_shape, self.max_proposal_nodes)
        future = self.scheduler.open(request.sequence_id, list(request.prompt_ids), params, request.seed, shape)
        return Submitted(future, lambda _: drafter_pb2.OpenDraftReply(open_ns=time.perf_counter_ns() - started))

    def _submit_propose(self, request: drafter_pb2.ProposeRequest) -> Submitted:
        future = self.scheduler.propose(
            request.sequence_id, request.max_tokens, request.assume_previous_accepted, request.propose_id
        )
        return Submitted(future, _propose_reply)

    def _submit_commit(self, request: drafter_pb2.DraftCommitRequest) -> Submitted:
        if not 0 <= request.base_length <= self.max_seq_len:
            raise InvalidArgumentError("base_length", f"must be in [0, {self.max_seq_len}], got {request.base_length}")
        if request.base_length + len(request.emitted) > self.max_seq_len:
            raise InvalidArgumentError(
                "emitted", f"{request.base_length} + {len(request.emitted)} tokens; at most {self.max_seq_len}"
            )
        features = None
        if request.HasField("features"):
            features = features_from_wire(request.features, width=self.feature_width)
        future = self.scheduler.commit(
            request.sequence_id, request.base_length, list(request.emitted), features, request.cancel_through
        )
        return Submitted(future, lambda commit_ns: drafter_pb2.DraftCommitReply(commit_ns=commit_ns))

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
                feature_layers=self.feature_layers,
                batch_stream=True,
                feature_context=self.feature_context,
                lookup_min_match=self.lookup_min_match,
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
        model_free=proposal.model_free,
        queued_ns=drafted.queued_ns,
    )
