"""Drafters and verifiers over gRPC (``grpc.aio``), and the pool that places requests on them.

Each worker has one channel; the calls of every session go in one ``Batch`` per worker per loop tick
(:mod:`router.batching`), sent on the worker's batch stream (:mod:`router.calls`). Every call carries the role's
deadline; a failed call raises one of the :mod:`router.errors` types, classified from its status code, and nothing
else about gRPC leaves this module and :mod:`router.calls`. The pool chooses the healthy worker with the least
outstanding sequences (ties: the one chosen least often), learns each drafter's kind and feature width from its
``Status`` and checks ``grpc.health.v1`` every ``health_interval_s``; a worker that fails a call, answers a check
NOT_SERVING or cannot be reached is skipped until a check passes again. A slow worker is not a dead one: one whose
calls or checks time out is skipped only after ``health_timeouts_to_eject`` in a row (calls and checks count
together; any answer in time resets the count), so one late answer under overload does not take the only verifier
out of rotation.

Worker sequences are leased (DESIGN §9): a worker closes a sequence no call has named for its idle timeout. Each
client knows the sequences the router holds open on its worker, and every ``sequence_keepalive_s`` the pool sends
each worker one Touch naming them all, so a sequence kept waiting (a slow client, a slow verifier) is never
reclaimed while this router lives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from grpc_common.convert import proposal_nodes, sampling_to_wire, top_logprobs_from_wire, tree_from_wire
from grpc_common.server import DEFAULT_MAX_MESSAGE_BYTES
from grpc_common.tls import aio_channel
from router.batching import MAX_NODES_PER_BATCH, CallBatcher
from router.calls import BatchTransport, Worker, call_failure
from router.config import RouterConfig
from router.errors import WorkerError, WorkerRejectedError, WorkerUnavailableError
from router.pipeline import Commit, Drafted, DrafterClient, SequenceSpec, Verified, VerifierClient

LOG = logging.getLogger(__name__)
T = TypeVar("T")

# What verifiers are asked to send feature rows in: bfloat16, float32's range in half the bytes. Raw layer rows
# (EAGLE-3) carry massive activations (22 500 on SmolLM2's layer 14; more on larger targets) near float16's 65 504.
FEATURE_DTYPE = common_pb2.FEATURE_DTYPE_BFLOAT16
FEATURE_BYTES = 2  # per value, in FEATURE_DTYPE


# Feature rows one Batch carries (to a drafter) or brings back (from a verifier) at most: half a message, so that
# the rest fits too (a long prompt's rows are megabytes: 641 rows of SmolLM2's three layers are 2.2 MB, of an 8B
# target's 15.8 MB).
FEATURE_KILOBYTES_PER_BATCH = DEFAULT_MAX_MESSAGE_BYTES // 2 // 1024


class WorkerClient:
    """A worker's client: its :class:`Worker` record and address, and the batcher its calls go through.

    ``batch_method`` is the stub's ``Batch`` and ``batch_request`` its request type (``calls=[...]``); a call is a
    ``call_type`` (``DrafterCall`` / ``VerifierCall``) and its result the matching ``*Result``; ``limits`` are what
    a Batch holds at most besides calls, of the weights each call is given (:class:`~router.batching.CallBatcher`).
    """

    def __init__(
        self,
        worker: Worker,
        transport: BatchTransport,
        call_type: Callable[..., Any],
        limits: Sequence[int] = (),
    ) -> None:
        self.worker = worker
        self.address = worker.address
        self.transport = transport
        self._call_type = call_type
        self.batcher: CallBatcher[Any, Any] = CallBatcher(worker.address, transport.send, limits=limits)
        self.open_sequences: set[str] = set()  # opened (or being opened) here and not yet closed: leases to renew
        self.status_known = False  # what the worker's Status tells (kind, batch stream) has been learnt

    async def _call(self, kind: str, call: Any, weights: Sequence[int] = ()) -> Any:
        """``call`` (of these ``weights``) in this tick's Batch; its reply (the ``kind`` field of its result), or its
        failure raised."""
        return self._result(kind, await self.batcher.submit(call, weights))

    async def shutdown(self, grace: float | None = None) -> None:
        """End the batch stream and close the channel."""
        await self.transport.close()
        await self.worker.channel.close(grace)

    def _result(self, kind: str, result: Any) -> Any:
        if result.WhichOneof("result") == "error":
            raise call_failure(self.address, result.error)
        return getattr(result, kind)

    async def touch(self) -> None:
        """Renew the leases of every sequence this router holds open on the worker (one call, in this tick's Batch)."""
        if self.open_sequences:
            touch = common_pb2.TouchRequest(sequence_ids=sorted(self.open_sequences))
            await self._call("touch", self._call_type(touch=touch))


C = TypeVar("C", bound=WorkerClient)


class GrpcDrafter(WorkerClient):
    """:class:`~router.pipeline.DrafterClient` over the ``specdec.v1.Drafter`` service; calls go in Batch RPCs."""

    def __init__(self, worker: Worker, streams: bool = True) -> None:
        stub = drafter_pb2_grpc.DrafterStub(worker.channel)
        transport = BatchTransport(worker, stub.BatchStream, stub.Batch, drafter_pb2.DrafterBatchRequest, streams)
        super().__init__(worker, transport, drafter_pb2.DrafterCall, [FEATURE_KILOBYTES_PER_BATCH])

    @property
    def feature_width(self) -> int:
        return self.worker.feature_width

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.worker.feature_layers

    @property
    def feature_context(self) -> int:
        return self.worker.feature_context

    @property
    def kind(self) -> str | None:
        return self.worker.kind

    @property
    def lookup_min_match(self) -> int:
        return self.worker.lookup_min_match

    async def learn_status(self, deadline_s: float) -> None:
        """Learn the drafter's kind, the feature rows it drafts from and whether it answers a batch stream."""
        stub = drafter_pb2_grpc.DrafterStub(self.worker.channel)
        status = await self.worker.call(stub.Status, drafter_pb2.DrafterStatusRequest(), deadline_s)
        worker = self.worker
        worker.kind, worker.feature_width = status.kind or None, status.feature_width
        worker.feature_layers, worker.batch_stream = tuple(status.feature_layers), status.batch_stream
        worker.feature_context = status.feature_context
        worker.lookup_min_match = status.lookup_min_match
        self.status_known = True

    async def open(self, sequence_id: str, spec: SequenceSpec, seed: int) -> None:
        shape = drafter_pb2.DraftShape(
            num_draft_tokens=spec.shape.num_draft_tokens,
            tree_width=spec.shape.tree_width,
            tree_budget=spec.shape.tree_budget,
        )
        request = drafter_pb2.OpenDraftRequest(
            sequence_id=sequence_id,
            prompt_ids=spec.prompt_ids,
            sampling=sampling_to_wire(spec.sampling),
            seed=seed,
            shape=shape,
        )
        self.open_sequences.add(sequence_id)
        await self._call("open", drafter_pb2.DrafterCall(open=request))

    async def propose(
        self,
        sequence_id: str,
        max_tokens: int,
        *,
        assume_previous_accepted: bool,
        commit: Commit | None = None,
        propose_id: int = 0,
    ) -> Drafted:
        request = drafter_pb2.ProposeRequest(
            sequence_id=sequence_id,
            max_tokens=max_tokens,
            assume_previous_accepted=assume_previous_accepted,
            propose_id=propose_id,
        )
        propose = drafter_pb2.DrafterCall(propose=request)
        if commit is None:
            committed, proposed = None, self.batcher.submit(propose)
        else:  # one group, Commit first: the drafter applies it first, and no batch split can reorder the two
            call, weights = _commit_call(sequence_id, *commit)
            committed, proposed = self.batcher.submit_group([call, propose], weights)
        commit_ns = 0
        try:
            if committed is not None:
                commit_ns = self._result("commit", await committed).commit_ns
            reply = self._result("propose", await proposed)
        except BaseException:  # a proposal after a failed commit is not used; nobody is left to read its answer
            proposed.cancel()
            raise
        try:
            tree = tree_from_wire(reply.proposal.tree)
            outcomes = tuple(Drafted(tree_from_wire(p.tree), p, 0, 0) for p in reply.outcome_proposals)
        except ValueError as error:
            raise WorkerRejectedError(self.address, "INVALID_ARGUMENT", f"malformed proposal: {error}") from None
        wire_bytes = reply.wire_bytes or reply.proposal.ByteSize()
        # a drafter that names no assumed path assumes a chain in full (and cannot pipeline a tree)
        assumed = tuple(reply.assumed_path) or (tuple(range(len(tree))) if tree.is_chain else ())
        rejections = tuple(tuple(guess.emitted) for guess in reply.rejections)
        return Drafted(
            tree,
            reply.proposal,
            reply.draft_ns,
            wire_bytes,
            assumed,
            rejections,
            outcomes,
            reply.model_free,
            commit_ns,
            reply.queued_ns,
        )

    async def commit(
        self,
        sequence_id: str,
        base_length: int,
        emitted: Sequence[int],
        features: object | None = None,
        cancel_through: int = 0,
    ) -> None:
        await self._call("commit", *_commit_call(sequence_id, base_length, emitted, features, cancel_through))

    async def close(self, sequence_id: str) -> None:
        self.open_sequences.discard(sequence_id)
        request = drafter_pb2.CloseDraftRequest(sequence_id=sequence_id)
        await self._call("close", drafter_pb2.DrafterCall(close=request))


def _commit_call(
    sequence_id: str,
    base_length: int,
    emitted: Sequence[int],
    features: object | None = None,
    cancel_through: int = 0,
) -> tuple[drafter_pb2.DrafterCall, tuple[int]]:
    """A Commit, and its weight: the kilobytes of feature rows it carries (``features``: a verdict's ``FeatureRows``
    message, carried as the verifier sent it)."""
    assert features is None or isinstance(features, common_pb2.FeatureRows)
    request = drafter_pb2.DraftCommitRequest(
        sequence_id=sequence_id,
        base_length=base_length,
        emitted=emitted,
        features=features,
        cancel_through=cancel_through,
    )
    kilobytes = len(features.data) // 1024 if features is not None else 0
    return drafter_pb2.DrafterCall(commit=request), (kilobytes,)


class GrpcVerifier(WorkerClient):
    """:class:`~router.pipeline.VerifierClient` over the ``specdec.v1.Verifier`` service; calls go in Batch RPCs."""

    def __init__(self, worker: Worker, streams: bool = True) -> None:
        stub = verifier_pb2_grpc.VerifierStub(worker.channel)
        transport = BatchTransport(worker, stub.BatchStream, stub.Batch, verifier_pb2.VerifierBatchRequest, streams)
        self._rows_due_kilobytes: dict[str, int] = {}  # sequence -> feature rows its first verdict brings (a prompt's)
        super().__init__(
            worker, transport, verifier_pb2.VerifierCall, [MAX_NODES_PER_BATCH, FEATURE_KILOBYTES_PER_BATCH]
        )

    async def learn_status(self, deadline_s: float) -> None:
        """Learn whether the verifier answers a batch stream; one whose Status fails is asked again at the next
        check, and meanwhile gets unary batches (nothing else depends on it: it stays in rotation)."""
        stub = verifier_pb2_grpc.VerifierStub(self.worker.channel)
        try:
            status = await self.worker.call(stub.Status, verifier_pb2.VerifierStatusRequest(), deadline_s)
        except WorkerError as error:
            LOG.debug("status of verifier %s failed: %s", self.address, error)
            return
        self.worker.batch_stream = status.batch_stream
        self.worker.forward_costs = tuple((cost.positions, cost.seconds) for cost in status.forward_costs)
        self.status_known = True

    async def open(self, sequence_id: str, spec: SequenceSpec, seed: int) -> None:
        context = _feature_context(spec)
        request = verifier_pb2.OpenVerifyRequest(
            sequence_id=sequence_id,
            prompt_ids=spec.prompt_ids,
            sampling=sampling_to_wire(spec.sampling),
            seed=seed,
            max_tokens=spec.max_tokens,
            ignore_eos=spec.ignore_eos,
            logprobs=spec.logprobs,
            features=spec.features,
            feature_dtype=FEATURE_DTYPE,
            top_logprobs=spec.top_logprobs,
            feature_layers=spec.feature_layers,
            feature_context=context,
        )
        self.open_sequences.add(sequence_id)
        if spec.features:  # the first verdict prefills the prompt: it brings the rows of that many positions
            positions = min(len(spec.prompt_ids), context or len(spec.prompt_ids))
            self._rows_due_kilobytes[sequence_id] = positions * spec.feature_width * FEATURE_BYTES // 1024
        await self._call("open", verifier_pb2.VerifierCall(open=request))

    async def verify(
        self, sequence_id: str, drafted: Drafted | None, *, defer_bonus: bool, stop_features: bool = False
    ) -> Verified:
        proposal = drafted.payload if drafted is not None else common_pb2.Proposal()
        assert isinstance(proposal, common_pb2.Proposal)
        request = verifier_pb2.VerifyRequest(
            sequence_id=sequence_id,
            proposal=proposal,
            defer_bonus=defer_bonus,
            stop_features=stop_features,
            assumed_path=drafted.assumed_path if defer_bonus and drafted is not None else (),
        )
        # weighed by its nodes and the feature rows its answer brings, where they are many (a prompt's)
        weights = (proposal_nodes(proposal), self._rows_due_kilobytes.pop(sequence_id, 0))
        reply = await self._call("verify", verifier_pb2.VerifierCall(verify=request), weights)
        verdict = reply.verdict
        features = reply.features if reply.HasField("features") else None
        feature_bytes = features.ByteSize() if features is not None else 0
        return Verified(
            accepted_path=tuple(verdict.accepted_path),
            emitted=tuple(verdict.emitted),
            finished=verdict.finished,
            bonus_deferred=verdict.bonus_deferred,
            logprobs=tuple(verdict.logprobs),
            verify_ns=reply.verify_ns,
            state_ns=reply.state_ns,
            forward_positions=reply.forward_positions,
            batch_size=reply.batch_size,
            wire_bytes=reply.ByteSize() - feature_bytes,
            features=features,
            feature_bytes=feature_bytes,
            top_logprobs=tuple(top_logprobs_from_wire(top) for top in verdict.top_logprobs),
            queued_ns=reply.queued_ns,
        )

    async def close(self, sequence_id: str) -> None:
        self.open_sequences.discard(sequence_id)
        self._rows_due_kilobytes.pop(sequence_id, None)
        request = verifier_pb2.CloseVerifyRequest(sequence_id=sequence_id)
        await self._call("close", verifier_pb2.VerifierCall(close=request))


def _feature_context(spec: SequenceSpec) -> int:
    """The positions whose rows a verdict sends: the drafter's ``feature_context``, but never more than half a message
    holds (0: all, when they always fit). Wide rows (an EAGLE-3 head of a 70B target: 49 kB a row) would otherwise make
    a prefill's verdict too big to send at all; the drafter then drafts from fewer rows at first, still exactly."""
    row_bytes = spec.feature_width * FEATURE_BYTES
    if not spec.features or not row_bytes:
        return spec.feature_context
    fit = max(FEATURE_KILOBYTES_PER_BATCH * 1024 // row_bytes, 1)
    return min(spec.feature_context or fit, fit)


class WorkerPool:
    """The router's workers: placement (:class:`~router.pipeline.Placement`), health and status.

    Create with :meth:`start` inside the event loop that will use it; all methods run on that loop.
    """

    def __init__(self, config: RouterConfig, drafters: list[GrpcDrafter], verifiers: list[GrpcVerifier]) -> None:
        self.config = config
        self.drafters = drafters
        self.verifiers = verifiers
        self._health_task: asyncio.Task[None] | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        # called (on the loop) whenever a worker enters or leaves rotation; the router republishes its readiness
        self.on_health_change: Callable[[], None] | None = None
        self._unread_forward_costs: list[tuple[int, float]] = []  # from verifiers' Status, not yet taken

    @classmethod
    async def start(cls, config: RouterConfig) -> WorkerPool:
        """Open a channel per worker (mutual TLS with ``config.tls``: calls and health checks alike), check every
        worker once, then keep checking in the background."""
        pool = cls(config, [], [])
        streams = config.worker_streams
        pool.drafters = [GrpcDrafter(pool._worker("drafter", address), streams) for address in config.drafters]
        pool.verifiers = [GrpcVerifier(pool._worker("verifier", address), streams) for address in config.verifiers]
        await pool.check_health()
        pool._health_task = asyncio.ensure_future(pool._health_loop())
        pool._keepalive_task = asyncio.ensure_future(pool._keepalive_loop())
        return pool

    def _worker(self, role: str, address: str) -> Worker:
        options = [
            ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            # a restarted worker is dialled again within a couple of seconds, not gRPC's default two minutes
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        deadline_s = self.config.verifier_deadline_s if role == "verifier" else self.config.drafter_deadline_s
        return Worker(role, address, aio_channel(address, self.config.tls, options), deadline_s)

    async def set_workers(self, verifiers: Sequence[str], drafters: Sequence[str]) -> None:
        """Make the worker set exactly these addresses (a supervisor re-placed or scaled workers): new ones are
        checked once before they take requests; removed ones leave rotation and their channels close (requests
        still on them fail over as on any worker failure)."""
        added: list[GrpcDrafter | GrpcVerifier] = []
        removed: list[GrpcDrafter | GrpcVerifier] = []
        for role, wanted, clients, make in (
            ("verifier", verifiers, self.verifiers, GrpcVerifier),
            ("drafter", drafters, self.drafters, GrpcDrafter),
        ):
            present = {client.address for client in clients}
            removed += [client for client in clients if client.address not in wanted]
            clients[:] = [client for client in clients if client.address in wanted]
            for address in dict.fromkeys(wanted):
                if address not in present:
                    client = make(self._worker(role, address), self.config.worker_streams)
                    clients.append(client)
                    added.append(client)
        for client in removed:
            client.worker.healthy = False
        await asyncio.gather(*(self._check(client) for client in added))
        await asyncio.gather(*(client.shutdown() for client in removed))
        if added or removed:
            LOG.info("worker set: +%s -%s", [c.address for c in added], [c.address for c in removed])
            self._health_changed()

    async def stop_health_checks(self) -> None:
        """Stop the background checks and lease renewals."""
        tasks = [task for task in (self._health_task, self._keepalive_task) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop health checks and close every channel."""
        await self.stop_health_checks()
        await asyncio.gather(*(client.shutdown() for client in self._clients()))

    def _clients(self) -> list[GrpcDrafter | GrpcVerifier]:
        return [*self.drafters, *self.verifiers]

    # --- placement ----------------------------------------------------------------------------------------

    @staticmethod
    def _least_loaded(candidates: list[C]) -> C | None:
        """The candidate with the fewest outstanding sequences (then the least chosen), now counted as busier."""
        if not candidates:
            return None
        chosen = min(candidates, key=lambda client: (client.worker.outstanding, client.worker.chosen))
        chosen.worker.outstanding += 1
        chosen.worker.chosen += 1
        return chosen

    def acquire_verifier(self, exclude: Collection[str]) -> GrpcVerifier | None:
        return self._least_loaded([v for v in self.verifiers if v.worker.healthy and v.address not in exclude])

    def acquire_drafter(self, kind: str | None, exclude: Collection[str]) -> GrpcDrafter | None:
        return self._least_loaded(
            [
                d
                for d in self.drafters
                if d.worker.healthy and d.address not in exclude and (kind is None or d.worker.kind == kind)
            ]
        )

    def release(self, worker: DrafterClient | VerifierClient) -> None:
        assert isinstance(worker, WorkerClient)
        worker.worker.outstanding -= 1

    def report_failure(self, worker: DrafterClient | VerifierClient, error: WorkerError) -> None:
        """Take ``worker`` out of rotation for an unavailable answer; for a timeout only once its calls and checks
        have timed out ``health_timeouts_to_eject`` times in a row."""
        assert isinstance(worker, WorkerClient)
        record = worker.worker
        if not isinstance(error, WorkerUnavailableError) or not record.healthy:
            return
        timed_out = error.code == grpc.StatusCode.DEADLINE_EXCEEDED.name
        if timed_out and record.timeouts < self.config.health_timeouts_to_eject:
            LOG.info("%s %s is slow (%d timeouts in a row): %s", record.role, worker.address, record.timeouts, error)
            return
        LOG.warning("%s %s marked unhealthy: %s", record.role, worker.address, error)
        record.healthy = False
        self._health_changed()

    def drafter_kinds(self) -> frozenset[str]:
        """Kinds the drafters serve; empty while some drafter's kind is unknown (it has never answered)."""
        kinds = [client.worker.kind for client in self.drafters]
        return frozenset() if None in kinds else frozenset(kind for kind in kinds if kind is not None)

    def any_verifier_healthy(self) -> bool:
        return any(client.worker.healthy for client in self.verifiers)

    def workers(self) -> list[Worker]:
        """Every worker, drafters first, for status reports."""
        return [client.worker for client in self._clients()]

    def take_forward_costs(self) -> list[tuple[int, float]]:
        """The (positions, seconds) forward costs verifiers reported (timed at their start) since the last call."""
        costs, self._unread_forward_costs = self._unread_forward_costs, []
        return costs

    # --- health -------------------------------------------------------------------------------------------

    async def check_health(self) -> None:
        """One grpc.health.v1 check of every worker (and ``Status`` of drafters whose kind is unknown)."""
        await asyncio.gather(*(self._check(client) for client in self._clients()))

    async def _check(self, client: GrpcDrafter | GrpcVerifier) -> None:
        worker = client.worker
        deadline = min(worker.deadline_s, self.config.health_interval_s)
        try:
            health = health_pb2_grpc.HealthStub(worker.channel)
            reply = await worker.call(health.Check, health_pb2.HealthCheckRequest(service=""), deadline)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if serving and not client.status_known:
                await client.learn_status(deadline)
                self._unread_forward_costs.extend(worker.forward_costs)  # a verifier's; a drafter reports none
        except WorkerError as error:
            LOG.debug("health check of %s failed: %s", worker.address, error)
            serving = False
            timed_out = error.code == grpc.StatusCode.DEADLINE_EXCEEDED.name
        else:
            timed_out = False
        # A check that times out may only mean this router's event loop or the worker is busy: under load one
        # late answer must not take a healthy worker out of rotation. NOT_SERVING and refused connections
        # (a draining or dead worker) count at once. ``worker.call`` counted the timeout with the calls'.
        if timed_out and worker.timeouts < self.config.health_timeouts_to_eject:
            return
        if serving != worker.healthy:
            LOG.info("%s %s is %s", worker.role, worker.address, "healthy" if serving else "unhealthy")
            worker.healthy = serving
            self._health_changed()

    def _health_changed(self) -> None:
        if self.on_health_change is not None:
            self.on_health_change()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_health()

    async def renew_leases(self) -> None:
        """One Touch per worker naming every sequence this router holds open there; a failure waits for the next."""
        results = await asyncio.gather(*(client.touch() for client in self._clients()), return_exceptions=True)
        for client, result in zip(self._clients(), results, strict=True):
            if isinstance(result, WorkerError):
                LOG.debug("renewing leases on %s failed: %s", client.address, result)
            elif isinstance(result, BaseException):
                raise result

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sequence_keepalive_s)
            await self.renew_leases()
