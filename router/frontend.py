"""What the gRPC and HTTP front doors share: validation, admission control, running a request, status.

Both doors decode their wire format into a :class:`~router.requests.GenerateInput`, call :meth:`Frontend.plan`
(any thread: it tokenizes) and then :meth:`Frontend.generate` on the router's event loop. Admission runs on that
loop: at most ``max_concurrent_requests`` run; up to ``max_waiting_requests`` more wait in a FIFO queue and are
handed a slot as one frees (the wait counts in their TTFT, as in vLLM); anything beyond is refused at once with
:class:`~router.errors.OverloadedError` (RESOURCE_EXHAUSTED / HTTP 429 with a retry hint), so queueing stays bounded.
The frontend owns the router's :class:`~router.metrics.RouterMetrics`: it times requests, counts their outcomes
and has every session report its rounds there.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import uuid
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from router.config import RouterConfig
from router.errors import OverloadedError, UnauthenticatedError, WorkerUnavailableError
from router.metrics import RouterMetrics
from router.pipeline import Emit, Final, Session
from router.requests import GenerateInput, Plan, plan_request
from router.text import TextStream
from router.workers import WorkerPool
from specdec.adaptive import SpeculationController


@dataclass(frozen=True)
class WorkerView:
    """A worker in a status report."""

    role: str
    address: str
    healthy: bool
    outstanding: int
    kind: str | None


class Frontend:
    """The router's request handling, independent of the wire format."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        pool: WorkerPool,
        controller: SpeculationController | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool
        self.metrics = RouterMetrics(config.model)
        # What every auto request plans with: one per router, so it learns from all of them.
        self.controller = controller or SpeculationController(config.max_draft_tokens)
        self.running = 0
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()  # each resolves with a slot
        self.draining = False
        self.background: set[asyncio.Task[Any]] = set()  # sessions' unawaited cleanup, kept alive here

    def authorize(self, authorization: str | None) -> None:
        """Check an ``Authorization`` header value against the configured bearer token (if any)."""
        expected = self.config.bearer_token
        if expected is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise UnauthenticatedError("a valid 'authorization: Bearer <token>' is required")

    def plan(self, request: GenerateInput, *, default_max_tokens: int | None = None) -> Plan:
        """Validate and tokenize ``request`` (raises InvalidArgumentError naming the field)."""
        try:
            return plan_request(
                request, self.config, self.tokenizer, self.pool.drafter_kinds(), default_max_tokens=default_max_tokens
            )
        except Exception as error:
            self.metrics.request_failed(error)
            raise

    async def generate(self, plan: Plan, emit: Emit) -> Final:
        """Run ``plan`` (on the router's loop), streaming chunks through ``emit``; admission first."""
        timer = self.metrics.request(len(plan.prompt_ids))
        try:
            final = await self._admit_and_run(plan, timer.timed(emit))
        except (Exception, asyncio.CancelledError) as error:
            timer.failed(error)
            raise
        timer.finished(final)
        return final

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    async def _admit(self) -> None:
        """Take a running slot: at once if one is free and nobody waits, else in arrival order; refuse when the
        queue is full too."""
        if self.running < self.config.max_concurrent_requests and not self._waiting:
            self.running += 1
            self.metrics.requests_running.set(self.running)
            return
        if len(self._waiting) >= self.config.max_waiting_requests:
            raise OverloadedError(self.running, self.config.retry_after_s)
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(slot)
        self.metrics.requests_waiting.set(len(self._waiting))
        try:
            await slot
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():  # handed a slot just as the client left: pass it on
                self._release()
            else:
                self._waiting.remove(slot)
                self.metrics.requests_waiting.set(len(self._waiting))
            raise

    def _release(self) -> None:
        """Hand the slot to the first request still waiting, else free it."""
        while self._waiting:
            slot = self._waiting.popleft()
            self.metrics.requests_waiting.set(len(self._waiting))
            if not slot.done():
                slot.set_result(None)
                return
        self.running -= 1
        self.metrics.requests_running.set(self.running)

    async def _admit_and_run(self, plan: Plan, emit: Emit) -> Final:
        if self.draining:
            raise WorkerUnavailableError("router", "UNAVAILABLE", "the router is shutting down")
        await self._admit()
        self.controller.learn_forward_costs(self.pool.take_forward_costs())
        try:
            text = TextStream(self.tokenizer, plan.prompt_ids, plan.stop) if self.tokenizer is not None else None
            session = Session(
                plan,
                self.pool,
                emit,
                sequence_id=f"r-{uuid.uuid4().hex}",
                text=text,
                background=self.background,
                observer=self.metrics,
                controller=self.controller,
            )
            return await session.run()
        finally:
            self._release()

    def ready(self) -> bool:
        """Serving: not shutting down and at least one verifier healthy."""
        return not self.draining and self.pool.any_verifier_healthy()

    def workers(self) -> list[WorkerView]:
        return [WorkerView(w.role, w.address, w.healthy, w.outstanding, w.kind) for w in self.pool.workers()]
