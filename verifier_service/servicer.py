"""The Verifier gRPC service, thin: proto → scheduler (which owns the BatchVerifier) → proto.

Domain errors raised below become status codes in :mod:`grpc_common.errors` (bad fields: INVALID_ARGUMENT,
unknown sequence: NOT_FOUND, too many sequences or queued calls: RESOURCE_EXHAUSTED). Only the waiting is
gRPC-specific: a call that ends (deadline, cancel) before its job ran drops the job, and a stopping scheduler
answers UNAVAILABLE.
"""

from __future__ import annotations

from concurrent.futures import CancelledError, Future
from typing import Any

import grpc
from specdec_wire.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

from grpc_common.convert import proposal_from_wire, sampling_from_wire
from specdec.errors import InvalidArgumentError
from specdec.verification import VerifyCall, VerifyOutcome
from verifier_service.scheduler import SchedulerStoppedError, VerifyScheduler


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """``specdec.v1.Verifier`` over one :class:`VerifyScheduler`."""

    def __init__(
        self, scheduler: VerifyScheduler, *, model_name: str, eos_token_ids: frozenset[int], world_size: int = 1
    ) -> None:
        self.scheduler = scheduler
        self.model_name = model_name
        self.eos_token_ids = eos_token_ids
        self.world_size = world_size

    def OpenSequence(
        self, request: verifier_pb2.OpenVerifyRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.OpenVerifyReply:
        future = self.scheduler.open(
            request.sequence_id,
            list(request.prompt_ids),
            sampling_from_wire(request.sampling),
            request.seed,
            request.max_tokens,
            self.eos_token_ids,
            request.ignore_eos,
            request.logprobs,
        )
        _wait(future, context)
        return verifier_pb2.OpenVerifyReply()

    def Verify(self, request: verifier_pb2.VerifyRequest, context: grpc.ServicerContext) -> verifier_pb2.VerifyReply:
        self.scheduler.metrics.received_bytes.inc(request.ByteSize())  # only here is the request still on the wire
        try:
            proposal = proposal_from_wire(request.proposal, self.scheduler.verifier.runner.vocab_size)
        except ValueError as error:  # malformed tree or draft rows: name the field
            raise InvalidArgumentError("proposal", str(error)) from error
        outcome = _wait(self.scheduler.verify(VerifyCall(request.sequence_id, proposal, request.defer_bonus)), context)
        return verifier_pb2.VerifyReply(
            verdict=verdict_to_wire(outcome),
            verify_ns=round(outcome.verify_s * 1e9),
            state_ns=round(outcome.commit_s * 1e9),
            batch_size=outcome.batch_size,
        )

    def CloseSequence(
        self, request: verifier_pb2.CloseVerifyRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.CloseVerifyReply:
        _wait(self.scheduler.close(request.sequence_id), context)
        return verifier_pb2.CloseVerifyReply()

    def Status(
        self, request: verifier_pb2.VerifierStatusRequest, context: grpc.ServicerContext
    ) -> verifier_pb2.VerifierStatusReply:
        status = _wait(self.scheduler.status(), context)
        return verifier_pb2.VerifierStatusReply(
            model=self.model_name,
            open_sequences=status.open_sequences,
            runner_sequences=status.runner_sequences,
            world_size=self.world_size,
        )


def verdict_to_wire(outcome: VerifyOutcome) -> common_pb2.Verdict:
    """The wire verdict of ``outcome`` (logprobs only when the sequence asked for them)."""
    verdict = outcome.verdict
    return common_pb2.Verdict(
        accepted_path=verdict.accepted_path,
        emitted=verdict.emitted,
        finished=verdict.finished,
        bonus_deferred=outcome.bonus_deferred,
        logprobs=outcome.logprobs or [],
    )


def _wait(future: Future, context: grpc.ServicerContext) -> Any:
    """The scheduler's answer; a call that ends first (cancel, deadline) cancels the job if it has not started."""
    context.add_callback(future.cancel)
    try:
        return future.result()
    except CancelledError:
        context.abort(grpc.StatusCode.CANCELLED, "the call ended before the verifier ran it")
    except SchedulerStoppedError as error:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
