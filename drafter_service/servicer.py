"""The Drafter gRPC service, thin: proto → scheduler (which owns the core drafter) → proto.

Domain errors raised below become status codes in :mod:`grpc_common.errors` (bad fields: INVALID_ARGUMENT,
unknown sequence: NOT_FOUND, too many open sequences: RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError, Future
from typing import Any

import grpc
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

from drafter_service.scheduler import DraftScheduler
from grpc_common.convert import proposal_to_wire, sampling_from_wire
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

    def OpenSequence(
        self, request: drafter_pb2.OpenDraftRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.OpenDraftReply:
        started = time.perf_counter_ns()
        params = sampling_from_wire(request.sampling)
        shape = shape_from_wire(request.shape, self.default_shape)
        prompt = list(request.prompt_ids)
        _wait(self.scheduler.open(request.sequence_id, prompt, params, request.seed, shape), context)
        return drafter_pb2.OpenDraftReply(open_ns=time.perf_counter_ns() - started)

    def Propose(self, request: drafter_pb2.ProposeRequest, context: grpc.ServicerContext) -> drafter_pb2.ProposeReply:
        future = self.scheduler.propose(request.sequence_id, request.max_tokens, request.assume_previous_accepted)
        proposal, draft_ns = _wait(future, context)
        message = proposal_to_wire(proposal)
        return drafter_pb2.ProposeReply(proposal=message, draft_ns=draft_ns, wire_bytes=message.ByteSize())

    def Commit(
        self, request: drafter_pb2.DraftCommitRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.DraftCommitReply:
        _wait(self.scheduler.commit(request.sequence_id, request.base_length, list(request.emitted)), context)
        return drafter_pb2.DraftCommitReply()

    def CloseSequence(
        self, request: drafter_pb2.CloseDraftRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.CloseDraftReply:
        _wait(self.scheduler.close(request.sequence_id), context)
        return drafter_pb2.CloseDraftReply()

    def Status(
        self, request: drafter_pb2.DrafterStatusRequest, context: grpc.ServicerContext
    ) -> drafter_pb2.DrafterStatusReply:
        status = _wait(self.scheduler.status(), context)
        return drafter_pb2.DrafterStatusReply(
            kind=self.kind,
            open_sequences=status.open_sequences,
            runner_sequences=status.runner_sequences,
            proposals=status.proposals,
            batches=status.batches,
            max_batch=status.max_batch,
        )


def _wait(future: Future, context: grpc.ServicerContext) -> Any:
    """The scheduler's answer; a call that ends first (cancel, deadline) cancels the job if it has not started."""
    context.add_callback(future.cancel)
    try:
        return future.result()
    except CancelledError:
        context.abort(grpc.StatusCode.CANCELLED, "the call ended before the drafter ran it")
