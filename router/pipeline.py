"""The per-request round loop over a remote drafter and verifier, sequential or pipelined (DESIGN §4).

One :class:`Session` runs one request. Workers sit behind the small :class:`DrafterClient`,
:class:`VerifierClient` and :class:`Placement` interfaces (gRPC implementations in :mod:`router.workers`),
so the loop is tested with in-memory fakes.

A round, **sequential**: ``drafter.Propose`` → ``verifier.Verify(proposal)`` → stream the emitted tokens →
``drafter.Commit(base_length, emitted)`` (sent lazily, with the drafter's next call: carried on the next Propose,
so both travel in one message).

**Target features** (an EAGLE drafter, whose ``feature_width`` is > 0): the verifier sequence is opened with
``features``, every verdict carries the target's feature rows of the positions that got KV, and the router relays
them in their encoded form, untouched, on the drafter's Commit of that verdict, which applies them first. Rows
follow each other from position 0, so the drafter has the rows of all committed text but its last token (all of it
after a deferred bonus) when it drafts; the Commit confirming an assumed chain carries its rows too. A re-placed
request re-prefills a new verifier sequence, whose rows start at 0 again, for a reopened drafter. Once a request
has no drafter (it failed, or none was free), its next Verify stops the rows.

**Pipelined** (chains and trees): right after sending ``Verify`` for proposal k with ``defer_bonus``, the drafter
is asked to ``Propose(assume_previous_accepted)`` concurrently, numbered (``propose_id``): it pre-drafts from the
leaf of proposal k's assumed path, and with multi-outcome pre-drafting also for its likely rejection verdicts.
The verdict selects one of them or none (:mod:`router.predraft`, which also gives the exactness argument):

* a **pipeline hit** (the assumed path accepted with the bonus deferred, or a guessed rejection verdict): the
  selected proposal goes to the verifier at once; while that verification runs, the drafter is told
  ``Commit(base_length, emitted)`` (which confirms its assumption, or selects the pre-drafted rejection outcome)
  and, once that is acknowledged, asked for the next pre-draft the same way.
* a **pipeline miss**: the router does not wait for the pre-draft. The Commit of the verdict goes out with the next
  proposal request at once, carrying ``cancel_through``: the drafter stops the pre-draft (queued or mid-draft),
  answers it CANCELLED and rolls its state back to the committed prefix before it drafts afresh. The abandoned
  call is kept alive in the background; nothing waits for it, and its answer is ignored. (Only the Commit sent
  before it must have been acknowledged, so that the new Commit cannot overtake it on another connection.)

Every emitted token comes from the verifier's rule, so pipelining never changes the output distribution.

**Auto**: rounds whose draft length a router-wide :class:`~specdec.adaptive.SpeculationController` chooses every
round (0: a plain target step, the drafter kept in step by a Commit that travels while the verifier works and that
no round waits for: the drafter's next proposal waits for its answer), up to the request's shape, pipelined as above
where the controller says pre-drafting pays (:meth:`~specdec.adaptive.SpeculationController.pipelining_pays`: it
defers a whole acceptance's bonus, so it pays only where the drafting it hides costs more) and sequential otherwise;
the pre-draft's length is the controller's choice for the next round, made when the pre-draft starts (0 pre-drafts
nothing and draws the bonus at once). Each session decides for itself, with the rest of its verifier's last forward
(positions, sequences: the verdict reports them) as the load it shares the forward with; every taken round teaches
the controller the request's acceptance and the costs (forward by positions, draft per level, the rest).

Monitoring hears the loop through an optional :class:`RoundObserver` (the router's metrics), so this module stays
free of any metrics library.

Failures (DESIGN §9): a drafter error or deadline drops that drafter for the rest of the request; the next round
opens another healthy drafter of the same kind on the committed text (a drafter refused for the request's arguments
or proposals is not replaced; one that drafts from target features gets them from a new verifier sequence, a
re-prefill of the committed text, since the rows of the text so far went to the failed one) and only with none left
does the request go target-only (``drafter_fallback``; still exact). A verifier that fails is reported to placement
and the request is re-placed on another verifier with a re-prefill of prompt + output (the drafter is reopened on
the same text); with no other verifier the error escapes and the client gets UNAVAILABLE. A call that times out is
reported like any failure; placement decides whether a slow worker is a dead one. Cancellation (client gone) waits
for calls in flight, then closes the sequence on both workers, all within a round.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

from router.errors import NoWorkerError, WorkerBusyError, WorkerError, WorkerRejectedError, WorkerUnavailableError
from router.predraft import PreDraft, select, selected
from router.requests import DraftShape, Plan
from router.text import TextStream
from specdec.adaptive import Candidate, SpeculationController, drafted_work
from specdec.lookup import LookupIndex
from specdec.sampling_params import SamplingParams, TopLogprobs
from specdec.stats import AcceptanceCounts
from specdec.tree import TokenTree, grown_dynamically

LOG = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class SequenceSpec:
    """What opening a sequence on a worker needs (the prompt is the committed text so far)."""

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    ignore_eos: bool
    logprobs: bool
    shape: DraftShape
    features: bool = False  # the verifier returns the target's feature rows with every verdict
    top_logprobs: int = 0  # with logprobs: alternatives per emitted token
    feature_layers: tuple[int, ...] = ()  # the target layers of those rows (empty: the final norm's output)
    feature_context: int = 0  # rows of at most this many last positions per verdict (0: all)
    feature_width: int = 0  # values per row (the drafter's feature_width)


@dataclass(frozen=True)
class Drafted:
    """One proposal from a drafter. ``payload`` is its encoded form, handed to the verifier unchanged.

    ``assumed_path`` is what a pre-draft after it assumes accepted (empty: it cannot be pipelined), ``rejections``
    the emitted tokens of the rejection verdicts that pre-draft also prepares for; ``outcomes`` (a pre-draft's
    answer) the proposals prepared for the previous proposal's ``rejections``, in their order (:mod:`router.predraft`).
    ``model_free``: drafted without running a model (prompt lookup), so ``draft_ns`` is no draft level's cost.
    ``commit_ns``: the drafter's time applying the Commit that travelled with this Propose (0: none did);
    ``queued_ns``: how long the Propose waited at the drafter for its batch to start (0: not reported).
    """

    tree: TokenTree
    payload: object
    draft_ns: int
    wire_bytes: int
    assumed_path: tuple[int, ...] = ()
    rejections: tuple[tuple[int, ...], ...] = ()
    outcomes: tuple[Drafted, ...] = ()
    model_free: bool = False
    commit_ns: int = 0
    queued_ns: int = 0


@dataclass(frozen=True)
class Verified:
    """One verdict: accepted node indices, emitted tokens (accepted + recovered/bonus, no bonus if deferred)."""

    accepted_path: tuple[int, ...]
    emitted: tuple[int, ...]
    finished: bool
    bonus_deferred: bool
    logprobs: tuple[float, ...]
    verify_ns: int
    state_ns: int
    forward_positions: int = 0  # positions in the verifier's forward this verdict came from (0: not reported)
    batch_size: int = 1  # sequences in that forward
    wire_bytes: int = 0  # size of the verdict's reply on the wire without its feature rows (0: not measured)
    features: object | None = None  # the target's feature rows, encoded: relayed to the drafter unchanged
    feature_bytes: int = 0  # their size on the wire
    top_logprobs: tuple[TopLogprobs, ...] = ()  # per emitted token, when the sequence asked for alternatives
    queued_ns: int = 0  # how long the call waited at the verifier before that forward started (0: not reported)


class Commit(NamedTuple):
    """What a drafter is told of a verdict: the committed text is now ``text[:base_length] + emitted``; ``features``
    (the verdict's, as the verifier encoded them; None: none) are applied first; ``cancel_through`` (> 0, a pipeline
    miss) cancels the sequence's unanswered pre-drafts numbered up to it first."""

    base_length: int
    emitted: Sequence[int]
    features: object | None = None
    cancel_through: int = 0


@dataclass(frozen=True)
class RoundRecord:
    """One round whose verdict was taken, for monitoring: what it verified and where its wall time went.

    ``exposed_draft_ns`` is the drafter time the verifier waited for: a fresh proposal's ``draft_ns``, 0 for a
    proposal pre-drafted during the previous round (or no proposal), and ``exposed_commit_ns`` the drafter's time
    applying the Commit that fresh proposal carried and ``exposed_draft_queue_ns`` its wait at the drafter for its
    batch; ``drafter_wait_ns`` the round's wall time until that fresh proposal was in hand (the call, its queueing
    and the drafting). ``pipeline_hit`` is None for a round that was not pipelined; ``rejection_hit``: the hit was a
    pre-drafted rejection outcome (multi-outcome pre-drafting).
    """

    draft_size: int  # nodes verified, 0 for a target-only round
    verified: Verified
    wall_ns: int
    exposed_draft_ns: int
    pipeline_hit: bool | None
    rejection_hit: bool = False
    drafter_wait_ns: int = 0
    exposed_commit_ns: int = 0
    exposed_draft_queue_ns: int = 0


class RoundObserver(Protocol):
    """Hears what sessions do (the router's metrics); called on the router's loop, so it must not block."""

    def on_proposal(self, drafted: Drafted) -> None:
        """Every proposal received from a drafter, pre-drafted chains that are later discarded included."""
        ...

    def on_round(self, record: RoundRecord) -> None:
        """Every round whose verdict was taken (not one redone after a verifier failed)."""
        ...


class DrafterClient(Protocol):
    """A drafter worker, one call per method, each with its own deadline; failures raise WorkerError.

    ``feature_width`` > 0: it drafts from the target's feature rows, which its Commits must carry.
    """

    address: str
    feature_width: int
    feature_layers: tuple[int, ...]  # the target layers of those rows (empty: the final norm's output)
    feature_context: int  # it reads the rows of only that many latest positions (0: all)
    kind: str | None  # ngram, model, early-exit or eagle (None: not known)
    lookup_min_match: int  # > 0: some rounds are prompt-lookup chains (specdec.lookup), from tails this long

    async def open(self, sequence_id: str, spec: SequenceSpec, seed: int) -> None: ...

    async def propose(
        self,
        sequence_id: str,
        max_tokens: int,
        *,
        assume_previous_accepted: bool,
        commit: Commit | None = None,
        propose_id: int = 0,
    ) -> Drafted:
        """Draft; ``commit``, if given, is applied first, exactly as :meth:`commit` would, and its failure raises
        before any proposal is used. ``propose_id`` (> 0) numbers a pre-draft so that a Commit can cancel it."""
        ...

    async def commit(
        self,
        sequence_id: str,
        base_length: int,
        emitted: Sequence[int],
        features: object | None = None,
        cancel_through: int = 0,
    ) -> None: ...

    async def close(self, sequence_id: str) -> None: ...


class VerifierClient(Protocol):
    """A verifier worker; failures raise WorkerError."""

    address: str

    async def open(self, sequence_id: str, spec: SequenceSpec, seed: int) -> None: ...

    async def verify(
        self, sequence_id: str, drafted: Drafted | None, *, defer_bonus: bool, stop_features: bool = False
    ) -> Verified:
        """Verify ``drafted`` (None: a target step); ``stop_features``: no feature rows from this verdict on."""
        ...

    async def close(self, sequence_id: str) -> None: ...


class Placement(Protocol):
    """Chooses workers (least outstanding work first) and hears about failures."""

    def acquire_verifier(self, exclude: Collection[str]) -> VerifierClient | None:
        """A healthy verifier not in ``exclude`` (addresses), counted as busy until released; None if none."""
        ...

    def acquire_drafter(self, kind: str | None, exclude: Collection[str]) -> DrafterClient | None:
        """A healthy drafter of ``kind`` (None: any), counted as busy until released; None if none."""
        ...

    def release(self, worker: DrafterClient | VerifierClient) -> None:
        """The request no longer uses ``worker``."""
        ...

    def report_failure(self, worker: DrafterClient | VerifierClient, error: WorkerError) -> None:
        """``worker`` failed a call; placement may stop choosing it until it is healthy again."""
        ...


@dataclass(frozen=True)
class Chunk:
    """Tokens committed by one round, the text they complete and (if asked) their log-probabilities and each one's
    most probable alternatives."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[TopLogprobs, ...] = ()


@dataclass
class RequestStats(AcceptanceCounts):
    """Speculation counters of one request (DESIGN §7); ``draft_ns`` and ``wire_bytes`` include discarded proposals;
    ``state_ns`` is the verifier's commits and the drafter's applying the Commits its verified proposals carried (as
    the co-located engine's holds its drafter's commits); ``feature_bytes`` counts the target feature rows of the
    verdicts taken. ``pipeline_hits`` counts every pre-draft used, ``pipeline_rejection_hits`` those of them prepared
    for a rejection verdict (multi-outcome pre-drafting)."""

    draft_ns: int = 0
    verify_ns: int = 0
    state_ns: int = 0
    pipeline_hits: int = 0
    pipeline_rejection_hits: int = 0
    pipeline_misses: int = 0
    wire_bytes: int = 0
    feature_bytes: int = 0
    drafter_fallback: bool = False

    def count_drafted(self, drafted: Drafted) -> None:
        self.draft_ns += drafted.draft_ns
        self.wire_bytes += drafted.wire_bytes

    def count_round(self, drafted: Drafted | None, verified: Verified) -> None:
        self.count_verdict(len(drafted.tree) if drafted else 0, len(verified.accepted_path))
        self.verify_ns += verified.verify_ns
        self.state_ns += verified.state_ns + (drafted.commit_ns if drafted else 0)
        self.feature_bytes += verified.feature_bytes


@dataclass(frozen=True)
class Final:
    """How a request ended: ``finish_reason`` is ``"stop"`` (EOS or a stop string) or ``"length"``."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: RequestStats


Emit = Callable[[Chunk], Awaitable[None]]


def derive_seed(seed: int, role: str, attempt: int = 0) -> int:
    """A 64-bit seed for one worker's random numbers, derived from the request seed; distinct per role.

    Deterministic: the same request seed gives the same verifier and drafter seeds.
    """
    digest = hashlib.blake2b(f"{seed}/{role}/{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Session:
    """Runs one :class:`Plan` to completion on workers chosen by ``placement``, streaming through ``emit``.

    ``text`` detokenizes and applies stop strings (None: token ids only, no text); ``observer`` (if any) hears every
    proposal and round. Closes that nobody waits for (of a failed worker's sequence, or cleanup after a second
    cancellation) are kept in ``background``, which the owner keeps alive longer than the session. Use :meth:`run`
    once.
    """

    def __init__(
        self,
        plan: Plan,
        placement: Placement,
        emit: Emit,
        *,
        sequence_id: str,
        text: TextStream | None = None,
        background: set[asyncio.Task[Any]] | None = None,
        observer: RoundObserver | None = None,
        controller: SpeculationController | None = None,
    ) -> None:
        self.plan = plan
        self.placement = placement
        self.emit = emit
        self.text = text
        self.observer = observer
        self.stats = RequestStats()
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.verifier: VerifierClient | None = None
        self.drafter: DrafterClient | None = None
        self._base_id = sequence_id
        self._attempt = 0
        self._failed_verifiers: set[str] = set()
        self._failed_drafters: set[str] = set()
        self._replace = False  # a failed drafter is to be replaced next round, by one of ``_replace_kind``
        self._replace_kind: str | None = None
        self._predrafted: Drafted | None = None  # the pre-draft a pipeline hit selected, verified next round
        self._propose_ids = itertools.count(1)  # numbers the pre-drafts (a Commit's cancel_through names them)
        self._late_failure: WorkerError | None = None  # an abandoned pre-draft's failure, acted on next round
        self._pending_commit: Commit | None = None  # the last verdict, not yet told to the drafter
        self._flushing: asyncio.Task[None] | None = None  # the last Commit sent without the round waiting for it
        self._verifier_features = False  # the verifier sequence sends feature rows
        self._inflight: set[asyncio.Task[Any]] = set()
        self._background = background if background is not None else set()
        self._controller = controller if plan.mode == "auto" else None
        self._tracker = self._controller.tracker() if self._controller is not None else None
        if self._tracker is not None and grown_dynamically(plan.shape.tree_width, plan.sampling.greedy):
            self._tracker.ranks = self._controller.rank_tracker()  # its trees are priced, and cut, node by node
        self._last_forward: tuple[int, int] = (0, 1)  # (positions, sequences) of the last verdict's forward
        self._last_size = 0  # nodes this request put into it
        self._planned_budget: int | None = None  # auto: the next round's draft budget, chosen a round early
        self._text_index = LookupIndex()  # auto with a drafter that looks up: the committed text, indexed

    @property
    def sequence_id(self) -> str:
        """The id of the sequence on both workers (a new one after each re-placement)."""
        return self._base_id if self._attempt == 0 else f"{self._base_id}.{self._attempt}"

    @property
    def remaining(self) -> int:
        return self.plan.max_tokens - len(self.generated)

    async def run(self) -> Final:
        """Generate; returns how it ended. Worker failures other than the drafter's escape as WorkerError."""
        try:
            await self._open()
            while self.finish_reason is None:
                await self._round()
        finally:
            cleanup = asyncio.ensure_future(self._shutdown())
            try:
                await asyncio.shield(cleanup)
            except asyncio.CancelledError:
                if not cleanup.done():  # cancelled again while cleaning up: let cleanup finish on its own
                    self._keep(cleanup)
                raise
        return Final(self.finish_reason or "length", len(self.plan.prompt_ids), len(self.generated), self.stats)

    # --- opening and closing ------------------------------------------------------------------------------

    def _spec(self, feature_drafter: DrafterClient | None = None) -> SequenceSpec:
        """The sequence as a worker opens it; ``feature_drafter``: the verifier sends that drafter's feature rows."""
        plan = self.plan
        prompt = plan.prompt_ids + tuple(self.generated)
        return SequenceSpec(
            prompt,
            plan.sampling,
            self.remaining,
            plan.ignore_eos,
            plan.logprobs,
            plan.shape,
            feature_drafter is not None,
            plan.top_logprobs,
            feature_drafter.feature_layers if feature_drafter is not None else (),
            feature_drafter.feature_context if feature_drafter is not None else 0,
            feature_drafter.feature_width if feature_drafter is not None else 0,
        )

    async def _open(self) -> None:
        """Open on a verifier (required) and a drafter (optional) at once; the verifier sends feature rows when the
        drafter drafts from them."""
        drafter = self._acquire_drafter()
        opening = [self._spawn(self._open_verifier(drafter))]
        if drafter is not None:
            opening.append(self._spawn(self._open_drafter(drafter)))
        await asyncio.gather(*(asyncio.shield(task) for task in opening))

    async def _open_verifier(self, drafter: DrafterClient | None) -> None:
        """Try verifiers (least loaded first) until one opens, sending ``drafter``'s feature rows when it drafts from
        them; a refusal of the arguments fails at once."""
        features = _takes_features(drafter)
        spec, last_error = self._spec(drafter if features else None), None
        while (verifier := self.placement.acquire_verifier(self._failed_verifiers)) is not None:
            try:
                await verifier.open(self.sequence_id, spec, derive_seed(self.plan.seed, "verifier", self._attempt))
            except WorkerRejectedError:
                self._close_in_background(verifier, self.sequence_id)
                raise
            except WorkerError as error:
                self._failed_verifiers.add(verifier.address)
                self.placement.report_failure(verifier, error)
                self._close_in_background(verifier, self.sequence_id)  # a late open must not leak
                last_error = error
                continue
            self.verifier, self._verifier_features = verifier, features
            return
        if last_error is not None:
            raise last_error
        raise NoWorkerError("no healthy verifier is available")

    def _acquire_drafter(self) -> DrafterClient | None:
        """A drafter for the request (None when speculation is off, or none is free: then it goes target-only)."""
        if self.plan.mode == "off":
            return None
        drafter = self.placement.acquire_drafter(self.plan.drafter_kind, self._failed_drafters)
        if drafter is None:
            self.stats.drafter_fallback = True
        return drafter

    async def _open_drafter(self, drafter: DrafterClient) -> None:
        """Open ``drafter`` on the committed text; a failure notes it (to be replaced next round, if it may be)."""
        try:
            await drafter.open(self.sequence_id, self._spec(), derive_seed(self.plan.seed, "drafter", self._attempt))
        except WorkerError as error:
            self._note_drafter_failure(drafter, error)
            self._close_in_background(drafter, self.sequence_id)
            return
        self.drafter = drafter

    async def _replace_drafter(self) -> None:
        """Open another healthy drafter of the failed one's kind (none this request has seen fail) on the committed
        text; with none, the request goes on target-only."""
        kind, self._replace = self._replace_kind, False
        drafter = self.placement.acquire_drafter(kind, self._failed_drafters)
        if drafter is None:
            self.stats.drafter_fallback = True
            LOG.warning("no other %s drafter for request %s; it continues target-only", kind, self._base_id)
            return
        LOG.info("request %s: drafter %s replaces a failed one", self._base_id, drafter.address)
        if _takes_features(drafter) and not await self._reopen_verifier(drafter):
            self.placement.release(drafter)
            self.stats.drafter_fallback = True
            return
        await self._open_drafter(drafter)

    async def _reopen_verifier(self, drafter: DrafterClient) -> bool:
        """A new verifier sequence (a re-prefill of the committed text, under the next sequence id) that sends feature
        rows from position 0, which a replacement drafter that drafts from them needs; the old one is closed once the
        new one is open. False (the old one kept) when none opens."""
        old, old_id = self.verifier, self.sequence_id
        assert old is not None, "the verifier is opened before any round"
        self._attempt += 1
        try:
            await self._open_verifier(drafter)
        except (WorkerError, NoWorkerError) as error:
            LOG.warning("request %s: no verifier sequence for a replacement drafter: %s", self._base_id, error)
            self._attempt -= 1
            self.verifier = old
            return False
        self._close_in_background(old, old_id)
        return True

    async def _shutdown(self) -> None:
        """Let calls in flight finish (each has a deadline), then close the sequence on both workers."""
        if self._inflight:
            await asyncio.wait(list(self._inflight))
        workers = [worker for worker in (self.verifier, self.drafter) if worker is not None]
        self.verifier = self.drafter = None
        await asyncio.gather(*(self._close(worker) for worker in workers))

    async def _close(self, worker: DrafterClient | VerifierClient) -> None:
        try:
            await worker.close(self.sequence_id)
        except WorkerError as error:
            LOG.info("closing %s on %s failed: %s", self.sequence_id, worker.address, error)
        finally:
            self.placement.release(worker)

    def _spawn(self, coroutine: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """A worker call as a task that cleanup waits for, even when the request is cancelled meanwhile."""
        task = asyncio.ensure_future(coroutine)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return task

    # --- the drafter side ---------------------------------------------------------------------------------

    def _note_drafter_failure(self, drafter: DrafterClient, error: WorkerError) -> None:
        """The request leaves ``drafter``: replaced next round when it failed as a worker; one that refused this
        request's arguments or proposals is not, and the request goes on target-only."""
        self._failed_drafters.add(drafter.address)
        if isinstance(error, WorkerRejectedError):
            LOG.warning(
                "drafter %s dropped (%s); request %s continues target-only", drafter.address, error, self._base_id
            )
            self.stats.drafter_fallback = True
            return
        self.placement.report_failure(drafter, error)
        LOG.warning("drafter %s failed (%s); request %s will replace it", drafter.address, error, self._base_id)
        self._replace, self._replace_kind = True, self.plan.drafter_kind or drafter.kind

    def _drop_drafter(self, error: WorkerError) -> None:
        """Leave the drafter (closed in the background; replaced next round when it may be) and what it drafted."""
        drafter, self.drafter = self.drafter, None
        self._predrafted, self._pending_commit = None, None
        if drafter is not None:
            self._note_drafter_failure(drafter, error)
            self._close_in_background(drafter, self.sequence_id)

    async def _drafter_call(self, call: Callable[[DrafterClient], Awaitable[T]]) -> T | None:
        """``call`` on the current drafter; None (and the drafter dropped) if there is none or it fails."""
        if self.drafter is None:
            return None
        try:
            return await call(self.drafter)
        except WorkerError as error:
            self._drop_drafter(error)
            return None

    def _flush_in_background(self) -> None:
        """Tell the drafter the last verdict without the round waiting for its answer: the Commit goes out once the one
        before it is acknowledged (no Commit may overtake another), and only the drafter's next proposal waits for it
        (:meth:`_commits_acknowledged`). A drafter busy with a long job (a long prompt's first draft) then delays its
        own next proposal, not every round of every request it serves. A Commit whose drafter or sequence the
        request has left meanwhile is not sent."""
        commit, self._pending_commit = self._pending_commit, None
        previous, drafter, sequence_id = self._flushing, self.drafter, self.sequence_id

        async def flush() -> None:
            if previous is not None:
                await asyncio.shield(previous)
            if commit is not None and self.drafter is drafter and self.sequence_id == sequence_id:
                await self._drafter_call(lambda current: current.commit(sequence_id, *commit))

        self._flushing = self._spawn(flush())

    async def _commits_acknowledged(self) -> None:
        """Wait until the drafter has answered every Commit sent in the background."""
        if self._flushing is not None:
            await asyncio.shield(self._flushing)

    async def _propose(self, budget: int) -> Drafted | None:
        """A fresh proposal, carrying the last verdict's Commit if the drafter has not heard it (one message)."""
        await self._commits_acknowledged()
        commit, self._pending_commit = self._pending_commit, None
        drafted = await self._drafter_call(
            lambda drafter: drafter.propose(self.sequence_id, budget, assume_previous_accepted=False, commit=commit)
        )
        if drafted is not None:
            self._count_proposal(drafted)
        return drafted

    def _count_proposal(self, drafted: Drafted) -> None:
        self.stats.count_drafted(drafted)
        if self.observer is not None:
            self.observer.on_proposal(drafted)

    def _start_predraft(self, budget: int) -> PreDraft:
        """Pre-draft while the verifier works, after the last verdict's Commit (if the drafter has not heard it) is
        acknowledged: a later Commit, sent without waiting for this call, must never overtake that one. A failure is
        returned, not raised: only a pre-draft the verdict selects is waited for, and only then does its failure drop
        the drafter."""
        commit, self._pending_commit = self._pending_commit, None
        drafter, sequence_id, propose_id = self.drafter, self.sequence_id, next(self._propose_ids)
        committed, flushing = asyncio.Event(), self._flushing

        async def predraft() -> Drafted | WorkerError | None:
            if drafter is None:
                return None
            if flushing is not None:
                await asyncio.shield(flushing)
            if self.drafter is not drafter:  # a Commit sent in the background failed: the drafter was dropped
                return None
            try:
                if commit is not None:
                    await drafter.commit(sequence_id, *commit)
                committed.set()
                drafted = await drafter.propose(
                    sequence_id, budget, assume_previous_accepted=True, propose_id=propose_id
                )
            except WorkerError as error:
                return error
            self._count_proposal(drafted)
            return drafted

        return PreDraft(self._spawn(predraft()), propose_id, committed)

    async def _next_proposal(self) -> Drafted | None:
        """The proposal to verify this round: the pre-draft a hit selected, else a fresh one (or None)."""
        if self._predrafted is not None:
            drafted, self._predrafted = self._predrafted, None
            return drafted
        budget = self.remaining - 1  # the round's last token is always the target's
        planned, self._planned_budget = self._planned_budget, None
        if self.drafter is not None and self._controller is not None:
            budget = self._auto_budget(budget) if planned is None else min(planned, budget)
        if self.drafter is None or budget < 1:
            return None  # the round tells the drafter the last verdict while the verifier works
        return await self._propose(budget)

    def _predraft_budget(self, drafted: Drafted) -> int:
        """Nodes to pre-draft while ``drafted`` is verified: whatever the request has room for after it, or under
        ``auto`` the controller's choice for the next round (0: none, nor a deferred bonus)."""
        budget = self.remaining - len(drafted.tree) - 1
        if budget >= 1 and self._controller is not None:
            budget = self._auto_budget(budget, [drafted.tree.tokens[node] for node in drafted.assumed_path])
            if budget < 1:
                self._planned_budget = 0  # kept for the next round, which then verifies the bonus alone
        return budget

    def _auto_budget(self, budget: int, assumed: Sequence[int] = ()) -> int:
        """The controller's node budget this round: a chain of its chosen length, a greedy (dynamic) tree's best
        nodes by rank, or another tree whole or nothing; the rest of the last forward (other sequences) is the load
        this one shares. A round the drafter will propose a prompt-lookup chain in (on its text: the committed text,
        and for a pre-draft the ``assumed`` path too) is planned as one, with the request's own estimate of such
        chains and no draft level to pay."""
        assert self._controller is not None and self._tracker is not None
        shape = self.plan.shape
        nodes = min(budget, shape.max_nodes)
        lookup = len(self._lookup_chain(nodes, assumed))
        tree = not shape.is_chain
        candidate = Candidate.for_round(self._tracker, shape.num_draft_tokens, nodes, tree=tree, lookup=lookup)
        [length] = self._controller.choose([candidate], **self._shared_load())
        return candidate.node_budget(length)

    def _lookup_chain(self, limit: int, assumed: Sequence[int]) -> list[int]:
        """The prompt-lookup chain the drafter proposes this round, at most ``limit`` long (empty: its model
        drafts): its choice depends on the text alone (:mod:`specdec.lookup`)."""
        assert self._controller is not None and self._tracker is not None
        drafter = self.drafter
        if drafter is None or drafter.lookup_min_match <= 0:
            return []
        if self._tracker.lookup is None:
            self._tracker.lookup = self._controller.lookup_tracker()
            self._text_index.extend(self.plan.prompt_ids)
        index = self._text_index
        index.extend(self.generated[len(index) - len(self.plan.prompt_ids) :])
        return index.prompt_lookup(drafter.lookup_min_match, limit, assumed)

    def _shared_load(self) -> dict[str, Any]:
        """What the other sequences of this request's verifier's last forward add to it: positions and the tokens
        they are expected to commit (the controller's ``other_positions`` / ``other_tokens``)."""
        assert self._controller is not None
        positions, sequences = self._last_forward
        others = max(sequences - 1, 0)
        return {
            "other_positions": max(positions - self._last_size - 1, others),
            "other_tokens": others * self._controller.tokens_per_round.value,
        }

    async def _take_predraft(self, predraft: PreDraft, drafted: Drafted, verified: Verified) -> tuple[bool, bool]:
        """After the verdict on ``drafted``: keep the pre-draft it selects (waiting for it), or abandon it unawaited.
        Returns (hit, rejection hit); a miss leaves the cancellation to the verdict's Commit."""
        outcome, index = select(drafted, verified)
        if outcome == "miss" or self.finish_reason is not None:
            if not (predraft.committed.is_set() or predraft.task.done()):  # usually acknowledged long before
                committed = asyncio.ensure_future(predraft.committed.wait())
                await asyncio.wait([committed, predraft.task], return_when=asyncio.FIRST_COMPLETED)  # the Commit's ack
                committed.cancel()
            self._abandon(predraft.task)
            self.stats.pipeline_misses += 1
            return False, False
        answer = await asyncio.shield(predraft.task)
        if isinstance(answer, WorkerError):
            self._drop_drafter(answer)
        proposal = selected(outcome, index, answer) if isinstance(answer, Drafted) else None
        if proposal is None or self.drafter is None:
            self.stats.pipeline_misses += 1
            return False, False
        self._predrafted = proposal
        self.stats.pipeline_hits += 1
        self.stats.pipeline_rejection_hits += outcome == "rejection"
        return True, outcome == "rejection"

    def _abandon(self, task: asyncio.Task[Drafted | WorkerError | None]) -> None:
        """Stop waiting for the pre-draft ``task``: cleanup no longer waits for it, but it is kept alive until it ends.
        If it fails other than by its cancellation, the drafter is dropped at the start of the next round."""
        self._inflight.discard(task)
        self._keep(task)
        drafter = self.drafter

        def note(done: asyncio.Task[Drafted | WorkerError | None]) -> None:
            answer = None if done.cancelled() else done.result()
            if isinstance(answer, WorkerError) and answer.code != "CANCELLED" and self.drafter is drafter:
                self._late_failure = answer

        task.add_done_callback(note)

    # --- rounds -------------------------------------------------------------------------------------------

    async def _round(self) -> None:
        if self.drafter is None and self._replace:
            await self._replace_drafter()
        started = time.perf_counter_ns()
        if self._late_failure is not None:
            error, self._late_failure = self._late_failure, None
            self._drop_drafter(error)
        base_length = len(self.plan.prompt_ids) + len(self.generated)
        fresh = self._predrafted is None  # else the proposal was drafted while the previous round verified
        asked = time.perf_counter_ns()
        drafted = await self._next_proposal()
        drafter_wait_ns = time.perf_counter_ns() - asked if fresh and drafted is not None else 0
        size = len(drafted.tree) if drafted else 0
        pipelined = (
            self.plan.mode in ("pipelined", "auto")
            and self.drafter is not None
            and drafted is not None
            and size > 0
            and bool(drafted.assumed_path)
        )
        if pipelined and self._controller is not None:
            assert drafted is not None and self._tracker is not None
            depth, lookup = drafted.tree.max_depth(), self._tracker.lookup
            tracker = lookup if drafted.model_free and lookup is not None else self._tracker  # whose chain it is
            pipelined = self._controller.pipelining_pays(tracker, depth, size, **self._shared_load())
        predraft_budget = self._predraft_budget(drafted) if pipelined and drafted is not None else 0
        pipelined = predraft_budget >= 1  # room for a next proposal the controller wants; else draw the bonus now
        verifier, sequence_id = self.verifier, self.sequence_id
        assert verifier is not None, "the verifier is opened before any round"
        stop_features = self._verifier_features and self.drafter is None  # nobody left to relay them to
        verify = self._spawn(
            verifier.verify(sequence_id, drafted if size else None, defer_bonus=pipelined, stop_features=stop_features)
        )
        predraft = self._start_predraft(predraft_budget) if pipelined else None
        if predraft is None and self.drafter is not None and self._pending_commit is not None:
            self._flush_in_background()
        try:
            verified = await asyncio.shield(verify)
        except WorkerError as error:
            for task in (self._flushing, predraft.task if predraft else None):
                if task is not None:
                    await asyncio.shield(task)
            await self._recover(error, verifier, drafted)
            return
        if not verified.emitted and not verified.finished:
            raise WorkerUnavailableError(verifier.address, "INTERNAL", "the verdict emitted no token")
        if stop_features:
            self._verifier_features = False
        self.stats.count_round(drafted if size else None, verified)
        chunk = self._take(verified)
        if chunk.token_ids or chunk.text:
            await self.emit(chunk)
        hit = rejection_hit = False
        if predraft is not None:
            assert drafted is not None
            hit, rejection_hit = await self._take_predraft(predraft, drafted, verified)
        if self.drafter is not None and self.finish_reason is None:
            cancel_through = predraft.propose_id if predraft is not None and not hit else 0
            self._pending_commit = Commit(base_length, verified.emitted, verified.features, cancel_through)
        exposed = drafted if fresh and drafted is not None else None
        wall_ns = time.perf_counter_ns() - started
        record = RoundRecord(
            size,
            verified,
            wall_ns,
            exposed.draft_ns if exposed else 0,
            hit if pipelined else None,
            rejection_hit,
            drafter_wait_ns,
            exposed.commit_ns if exposed else 0,
            exposed.queued_ns if exposed else 0,
        )
        if self._controller is not None:
            depth = drafted.tree.max_depth() if size and drafted is not None else 0
            self._teach(record, depth, model_free=drafted is not None and drafted.model_free)
        if self.observer is not None:
            self.observer.on_round(record)

    def _teach(self, record: RoundRecord, depth: int, *, model_free: bool = False) -> None:
        """Tell the controller what this round accepted and cost (a forward the verifier did not size is skipped; a
        ``model_free`` proposal ran no draft level)."""
        assert self._controller is not None and self._tracker is not None
        verified = record.verified
        # read before the verdict resets them: the last round drafted too, and with a model
        drafted_before, caught_up = self._tracker.idle_rounds == 0, self._tracker.caught_up
        self._controller.observe_verdict(
            self._tracker,
            depth,
            len(verified.accepted_path),
            model_free=model_free,
            nodes=record.draft_size,
            accepted_nodes=verified.accepted_path,
        )
        if verified.forward_positions > 0:
            if self.stats.rounds > 1:  # the first verdict's forward holds this request's own prompt
                self._last_forward = (verified.forward_positions, verified.batch_size)
                self._last_size = record.draft_size
            forward_s, draft_s = verified.verify_ns / 1e9, record.exposed_draft_ns / 1e9
            waited_s = max(record.drafter_wait_ns / 1e9, draft_s)
            # Waiting at the verifier for a forward to start is left out: it comes from the load, not from this round's
            # shape, and under load it is most of a round, next to which every extra position looked cheap; a draft's
            # cost to the batch is its positions in the forward (adaptive.py's module docstring).
            other_s = record.wall_ns / 1e9 - forward_s - waited_s - verified.queued_ns / 1e9
            # A pre-draft's levels cost this round nothing. A draft after plain rounds is not a level's cost either: it
            # includes the drafter catching up on every token committed meanwhile (an EAGLE head runs over them), and
            # priced as levels that kept auto from drafting at all (adaptive.py's module docstring). Nor is a model-free
            # (prompt lookup) round, which ran none, or the draft after one, which caught up on what it committed.
            drafted = bool(record.exposed_draft_ns) and drafted_before
            shape = self.plan.shape
            dynamic_tree = (shape.num_draft_tokens, shape.max_nodes) if self._tracker.ranks is not None else None
            levels, rows = drafted_work(record.draft_size, depth, dynamic_tree)
            drafted_levels = levels if drafted and caught_up and not model_free else 0
            call_s = waited_s - draft_s if drafted and depth else None
            self._controller.observe_round(
                verified.forward_positions, forward_s, drafted_levels, draft_s, other_s, rows, call_s
            )

    def _take(self, verified: Verified) -> Chunk:
        """Account the verdict's tokens (cut at the budget or a stop string); set ``finish_reason`` when done."""
        tokens = list(verified.emitted[: self.remaining])
        pieces: list[str] = []
        stopped = False
        if self.text is not None:
            text, kept = self.text.push(tokens)
            pieces.append(text)
            stopped, tokens = self.text.stopped, tokens[:kept]
        logprobs = verified.logprobs[: len(tokens)] if self.plan.logprobs else ()
        alternatives = verified.top_logprobs[: len(tokens)] if self.plan.logprobs else ()
        self.generated.extend(tokens)
        if stopped:
            self.finish_reason = "stop"
        elif verified.finished or self.remaining <= 0:
            at_eos = bool(self.generated) and self.generated[-1] in self.plan.eos_token_ids
            self.finish_reason = "stop" if at_eos or self.remaining > 0 else "length"
            if self.text is not None:
                pieces.append(self.text.flush())
        return Chunk(tuple(tokens), "".join(pieces), tuple(logprobs), tuple(alternatives))

    async def _recover(self, error: WorkerError, verifier: VerifierClient, drafted: Drafted | None) -> None:
        """After a failed Verify: blame the drafter for a refused proposal, else re-place on another verifier."""
        if isinstance(error, WorkerRejectedError):
            if drafted is not None and len(drafted.tree) and self.drafter is not None:
                self._drop_drafter(error)  # the verifier refused the proposal: redo the round target-only
                return
            raise error
        self.placement.report_failure(verifier, error)
        self._failed_verifiers.add(verifier.address)
        LOG.warning("verifier %s failed (%s); re-placing request %s", verifier.address, error, self._base_id)
        old_id, drafter = self.sequence_id, self.drafter
        self.verifier = self.drafter = None
        self._predrafted, self._pending_commit = None, None
        self._attempt += 1
        self._close_in_background(verifier, old_id)
        if drafter is not None:
            self._close_in_background(drafter, old_id)
        replacement = self._acquire_drafter() if drafter is not None else None
        try:
            await self._open_verifier(replacement)
        except BaseException as failure:
            if replacement is not None:
                self.placement.release(replacement)
            if isinstance(failure, NoWorkerError | WorkerBusyError | WorkerUnavailableError):
                raise error from None
            raise
        if replacement is not None:
            await self._open_drafter(replacement)

    def _close_in_background(self, worker: DrafterClient | VerifierClient, sequence_id: str) -> None:
        """Best-effort close of a sequence the request has left behind, without waiting for it."""

        async def close() -> None:
            with contextlib.suppress(WorkerError):
                await worker.close(sequence_id)
            self.placement.release(worker)

        self._keep(asyncio.ensure_future(close()))

    def _keep(self, task: asyncio.Task[Any]) -> None:
        """Hold a reference to ``task`` until it is done (the loop itself keeps only weak ones)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _takes_features(drafter: DrafterClient | None) -> bool:
    return drafter is not None and drafter.feature_width > 0
