"""The Verifier gRPC service, thin: proto → scheduler (which owns the BatchVerifier) → proto.

Domain errors raised below become status codes in :mod:`grpc_common.errors` (bad fields: INVALID_ARGUMENT,
unknown sequence: NOT_FOUND, too many sequences or queued calls: RESOURCE_EXHAUSTED). Only the waiting is
gRPC-specific: a call that ends (deadline, cancel) before its job ran drops the job, and a stopping scheduler
answers UNAVAILABLE. ``Batch`` carries many calls in one message (:mod:`grpc_common.batch`). Every message is
bounded before anything is decoded or allocated (INVALID_ARGUMENT naming the field): at most ``max_proposal_nodes``
nodes in a proposal, ``max_batch_calls`` calls and ``max_batch_nodes`` proposal nodes in a Batch (a draft row's
ids are bounded by the vocabulary, a prompt by the context, both in the decoding). ``Touch`` renews leases. A
sequence opened with ``features`` gets the target's feature rows with every verdict, encoded here in the dtype it
asked for (:func:`~grpc_common.convert_rows.features_to_wire`), until a Verify says ``stop_features``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
from google.protobuf.message import Message
from specdec_wire.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

from grpc_common.batch import (
    BatchTypes,
    StartedBatch,
    Submitted,
    answer_batch,
    check_batch_size,
    stream_batches,
    touched,
)
from grpc_common.convert import MAX_PROPOSAL_NODES, proposal_nodes, sampling_from_wire, top_logprobs_to_wire
from grpc_common.convert_rows import feature_dtype_from_wire, features_to_wire, proposal_from_wire
from grpc_common.server import DEFAULT_MAX_MESSAGE_BYTES
from specdec.errors import InvalidArgumentError
from specdec.verification import VerifyCall, VerifyOutcome
from verifier_service.scheduler import SchedulerStatus, SchedulerStoppedError, VerifyScheduler

_UNAVAILABLE = (SchedulerStoppedError,)


VERIFIER_BATCH = BatchTypes(
    verifier_pb2.VerifierResult, verifier_pb2.VerifierBatchReply, verifier_pb2.VerifierBatchReplies
)


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """``specdec.v1.Verifier`` over one :class:`VerifyScheduler`."""

    def __init__(
        self,
        scheduler: VerifyScheduler,
        *,
        model_name: str,
        eos_token_ids: frozenset[int],
        world_size: int = 1,
        max_proposal_nodes: int = MAX_PROPOSAL_NODES,
        max_batch_calls: int = 1024,
        max_batch_nodes: int = 8192,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        forward_costs: Sequence[tuple[int, float]] = (),
    ) -> None:
        self.scheduler = scheduler
        self.forward_costs = tuple(forward_costs)  # (positions, seconds) timed at start (specdec.calibration)
        self.model_name = model_name
        self.eos_token_ids = eos_token_ids
        self.world_size = world_size
        self.max_proposal_nodes = max_proposal_nodes
        self.max_batch_calls = max_batch_calls
        self.max_batch_nodes = max_batch_nodes
        self.max_message_bytes = max_message_bytes

    def OpenSequence(
        self, request: verifier_pb2.OpenVerifyRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.OpenVerifyReply:
        return self._submit_open(request).answer(context, _UNAVAILABLE)

    def Verify(self, request: verifier_pb2.VerifyRequest, context: grpc.ServicerContext) -> verifier_pb2.VerifyReply:
        return self._submit_verify(request).answer(context, _UNAVAILABLE)

    def CloseSequence(
        self, request: verifier_pb2.CloseVerifyRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.CloseVerifyReply:
        return self._submit_close(request).answer(context, _UNAVAILABLE)

    def Touch(self, request: common_pb2.TouchRequest, context: grpc.ServicerContext) -> common_pb2.TouchReply:
        return touched(self.scheduler, request).answer(context)

    def Batch(
        self, request: verifier_pb2.VerifierBatchRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.VerifierBatchReply:
        self._check_batch(request)
        results = answer_batch(
            request.calls,
            self._submit,
            verifier_pb2.VerifierResult,
            context,
            _UNAVAILABLE,
            together=self.scheduler.together,
        )
        return verifier_pb2.VerifierBatchReply(results=results)

    def BatchStream(
        self, requests: Iterator[verifier_pb2.VerifierBatchRequest], context: grpc.ServicerContext
    ) -> Iterator[verifier_pb2.VerifierBatchReplies]:
        def start(request: verifier_pb2.VerifierBatchRequest) -> StartedBatch:
            self._check_batch(request)
            return StartedBatch.start(request.calls, self._submit, _UNAVAILABLE, self.scheduler.together)

        return stream_batches(requests, start, VERIFIER_BATCH, context, self.max_message_bytes)

    def _check_batch(self, request: verifier_pb2.VerifierBatchRequest) -> None:
        check_batch_size(request.calls, self.max_batch_calls)
        nodes = sum(proposal_nodes(call.verify.proposal) for call in request.calls if call.HasField("verify"))
        if nodes > self.max_batch_nodes:
            raise InvalidArgumentError("calls", f"{nodes} proposal nodes in one Batch; at most {self.max_batch_nodes}")

    def _submit(self, kind: str, request: Message) -> Submitted:
        if kind == "touch":
            return touched(self.scheduler, request)
        submit = {"open": self._submit_open, "verify": self._submit_verify, "close": self._submit_close}[kind]
        return submit(request)

    def _submit_open(self, request: verifier_pb2.OpenVerifyRequest) -> Submitted:
        future = self.scheduler.open(
            request.sequence_id,
            list(request.prompt_ids),
            sampling_from_wire(request.sampling),
            request.seed,
            request.max_tokens,
            self.eos_token_ids,
            request.ignore_eos,
            request.logprobs,
            feature_dtype_from_wire(request.feature_dtype) if request.features else None,
            request.top_logprobs,
            tuple(request.feature_layers) or None,
            request.feature_context,
        )
        return Submitted(future, lambda _: verifier_pb2.OpenVerifyReply())

    def _submit_verify(self, request: verifier_pb2.VerifyRequest) -> Submitted:
        self.scheduler.metrics.received_bytes.inc(request.ByteSize())  # only here is the request still on the wire
        vocab_size = self.scheduler.verifier.runner.vocab_size
        proposal = proposal_from_wire(request.proposal, vocab_size, max_nodes=self.max_proposal_nodes)
        call = VerifyCall(request.sequence_id, proposal, request.defer_bonus, tuple(request.assumed_path))
        return Submitted(self.scheduler.verify(call, stop_features=request.stop_features), self._verify_reply)

    def _verify_reply(self, outcome: VerifyOutcome) -> verifier_pb2.VerifyReply:
        features = None
        if outcome.features is not None:  # the scheduler handed them over in the sequence's wire dtype
            features = features_to_wire(outcome.features, outcome.feature_start, outcome.features.dtype)
            self.scheduler.metrics.feature_bytes.inc(features.ByteSize())
        return verifier_pb2.VerifyReply(
            verdict=verdict_to_wire(outcome),
            verify_ns=round(outcome.verify_s * 1e9),
            state_ns=round(outcome.commit_s * 1e9),
            batch_size=outcome.batch_size,
            features=features,
            forward_positions=outcome.forward_positions,
            queued_ns=round(outcome.queued_s * 1e9),
        )

    def _submit_close(self, request: verifier_pb2.CloseVerifyRequest) -> Submitted:
        return Submitted(self.scheduler.close(request.sequence_id), lambda _: verifier_pb2.CloseVerifyReply())

    def Status(
        self, request: verifier_pb2.VerifierStatusRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.VerifierStatusReply:
        def reply(status: SchedulerStatus) -> verifier_pb2.VerifierStatusReply:
            return verifier_pb2.VerifierStatusReply(
                model=self.model_name,
                open_sequences=status.open_sequences,
                runner_sequences=status.runner_sequences,
                world_size=self.world_size,
                batch_stream=True,
                forward_costs=[
                    verifier_pb2.ForwardCost(positions=positions, seconds=seconds)
                    for positions, seconds in self.forward_costs
                ],
            )

        return Submitted(self.scheduler.status(), reply).answer(context, _UNAVAILABLE)


def verdict_to_wire(outcome: VerifyOutcome) -> common_pb2.Verdict:
    """The wire verdict of ``outcome`` (logprobs and their alternatives only when the sequence asked for them)."""
    verdict = outcome.verdict
    return common_pb2.Verdict(
        accepted_path=verdict.accepted_path,
        emitted=verdict.emitted,
        finished=verdict.finished,
        bonus_deferred=outcome.bonus_deferred,
        logprobs=outcome.logprobs or [],
        top_logprobs=[top_logprobs_to_wire(top) for top in outcome.top_logprobs or ()],
    )
