"""``python -m bench.load.simulate_worker --role {drafter,verifier}``: a worker with no model, on the real protocol.

It serves the real ``specdec.v1.Drafter`` or ``specdec.v1.Verifier`` service (plus ``grpc.health.v1``) on a
``grpc.aio`` server, so one process holds hundreds of concurrent calls while it sleeps instead of computing:

- **Verifier.** Draft position ``i`` (0-based depth) is accepted with probability ``acceptance[i]`` (the last
  value repeats), stopping at the first rejection; in a tree some child of the node reached is accepted with
  that probability (which one: see :func:`accept_path`). The verdict emits the accepted tokens plus one
  recovered / bonus token, a random id that is never a special token (ids below ``--first-token-id``), so
  requests run to ``max_tokens``.
  The budget and ``defer_bonus`` rules are the real verifier's (:mod:`specdec.verification`): a whole path
  accepted with ``defer_bonus`` emits no bonus, reports ``bonus_deferred`` and keeps the row, the next proposal
  hangs off it (judged from depth 0 again), and an empty proposal off a kept row draws the bonus without a forward.
- **Drafter.** ``Propose`` returns random distinct tokens in the request's shape (chain, or a tree grown level
  by level under the node budget exactly as :class:`specdec.drafters.model.ModelDrafter` does) with a sparse
  uniform ``q`` over ``--draft-support`` ids per parent in the wire format of :mod:`grpc_common.convert`
  (packed ``<i4`` ids in ascending order, ``<f4`` probabilities, one row per parent shared by siblings), or
  no distribution (one-hot ``q``) for greedy requests or ``--draft-support 0``. ``assume_previous_accepted`` and
  ``Commit`` keep the text exactly as :class:`specdec.drafters.base.SequenceDrafter` does. The rows are built
  here rather than with ``proposal_to_wire`` because that takes dense ``[N, V]`` torch rows: importing torch and
  filling 49152-wide rows would cost each worker seconds and the CPU this simulation exists to leave to the
  router; a test decodes these proposals with the real ``proposal_from_wire``.

**Batching.** One simulated device per process: calls queue while a batched call runs, and the next batch takes
every call queued (up to ``--max-batch-size``, after an optional ``--batch-wait-ms``), like the real schedulers'
continuous batching. A batch of ``n`` sleeps ``latency + n × per_sequence_ms``, the latency drawn from
``--latency`` (see :class:`bench.load.simulate.LatencySpec`) with a generator seeded by ``--seed``. The verifier
reports that sleep as ``verify_ns`` and ``state_ns = 0``; the drafter as ``draft_ns``.

**Determinism.** Each sequence's decisions come from a numpy generator seeded by the Open request's seed alone,
so a request replays the same tokens and verdicts whatever else runs; ``--seed`` drives the latency draws.

Prints one JSON line ``{"address": "HOST:PORT", "role": ROLE, ...}`` once serving; stops on SIGTERM / SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from bench.load.simulate import LatencySpec, drafter_kind, parse_acceptance
from grpc_common.errors import status_for
from grpc_common.server import DEFAULT_MAX_MESSAGE_BYTES
from specdec.errors import CapacityError, InvalidArgumentError

LOG = logging.getLogger("bench.load.simulate_worker")
ROOT = -1
DEFAULT_DRAFT_TOKENS = 4  # the real drafter's default chain length (DraftConfig)
_DRAFT_SUM_TOLERANCE = 1e-3  # the real verifier's |sum(q) - 1| allowance
J = TypeVar("J")
R = TypeVar("R")


@dataclass(frozen=True)
class WorkerConfig:
    """One simulated worker process."""

    role: str
    acceptance: tuple[float, ...]
    latency: LatencySpec
    per_sequence_ms: float = 0.0
    seed: int = 0
    vocab_size: int = 49152
    first_token_id: int = 32
    model: str = "smollm2-135m"
    draft_support: int = 4
    max_batch_size: int = 1024
    batch_wait_ms: float = 0.0
    max_sequences: int = 8192
    host: str = "127.0.0.1"
    port: int = 0
    grace_s: float = 2.0

    def __post_init__(self) -> None:
        if self.role not in ("drafter", "verifier"):
            raise ValueError(f"role must be drafter or verifier, got {self.role!r}")
        if not 0 <= self.first_token_id < self.vocab_size - 1:
            raise ValueError(f"first_token_id must leave at least two ids below vocab_size {self.vocab_size}")
        if min(self.per_sequence_ms, self.batch_wait_ms, self.draft_support) < 0 or self.max_batch_size < 1:
            raise ValueError("per_sequence_ms, batch_wait_ms and draft_support must be >= 0, max_batch_size >= 1")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> WorkerConfig:
        parser = argparse.ArgumentParser(
            prog="python -m bench.load.simulate_worker",
            description="A drafter or verifier with no model, on the real gRPC protocol.",
        )
        parser.add_argument("--role", required=True, choices=("drafter", "verifier"))
        parser.add_argument("--host", default=cls.host)
        parser.add_argument("--port", type=int, default=cls.port)
        parser.add_argument("--seed", type=int, default=cls.seed, help="seed of the latency draws")
        parser.add_argument("--acceptance", default="0.8,0.7,0.6,0.5", help="per-position acceptance probabilities")
        parser.add_argument("--latency", default="const:5", help="per batched call: const:M, lognormal:M,S, ...")
        parser.add_argument("--per-sequence-ms", type=float, default=cls.per_sequence_ms, help="added per call")
        parser.add_argument("--vocab-size", type=int, default=cls.vocab_size)
        parser.add_argument("--first-token-id", type=int, default=cls.first_token_id, help="lower ids: special")
        parser.add_argument("--model", default=cls.model, help="model name the verifier reports")
        parser.add_argument("--draft-support", type=int, default=cls.draft_support, help="q support; 0: one-hot")
        parser.add_argument("--max-batch-size", type=int, default=cls.max_batch_size)
        parser.add_argument("--batch-wait-ms", type=float, default=cls.batch_wait_ms)
        parser.add_argument("--max-sequences", type=int, default=cls.max_sequences)
        args = parser.parse_args(argv)
        return cls(
            role=args.role,
            acceptance=parse_acceptance(args.acceptance),
            latency=LatencySpec.parse(args.latency),
            per_sequence_ms=args.per_sequence_ms,
            seed=args.seed,
            vocab_size=args.vocab_size,
            first_token_id=args.first_token_id,
            model=args.model,
            draft_support=args.draft_support,
            max_batch_size=args.max_batch_size,
            batch_wait_ms=args.batch_wait_ms,
            max_sequences=args.max_sequences,
            host=args.host,
            port=args.port,
        )

    @property
    def kind(self) -> str:
        return drafter_kind(self.draft_support)


# --- the simulated device -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batched(Generic[R]):
    """A job's result with the batch it ran in: the batch's sleep and size."""

    result: R
    latency_ns: int
    batch_size: int


class Batcher(Generic[J, R]):
    """Continuous batching on one simulated device: jobs queued while a batch sleeps form the next batch.

    ``decide`` answers one job when its batch starts (a job whose caller has gone by then is skipped, as the
    real schedulers skip cancelled jobs); its exception goes to that job's caller alone.
    """

    def __init__(
        self,
        decide: Callable[[J], R],
        latency: LatencySpec,
        *,
        per_sequence_ms: float,
        rng: np.random.Generator,
        max_batch_size: int,
        batch_wait_s: float,
    ) -> None:
        self.decide = decide
        self.latency = latency
        self.per_sequence_ms = per_sequence_ms
        self.rng = rng
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.calls = self.batches = self.max_batch = 0
        self._queue: asyncio.Queue[tuple[J, asyncio.Future[Batched[R]]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the device loop (on the running event loop)."""
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def submit(self, job: J) -> Batched[R]:
        future: asyncio.Future[Batched[R]] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((job, future))
        return await future

    async def _loop(self) -> None:
        while True:
            entries = [await self._queue.get()]
            if self.batch_wait_s:
                await asyncio.sleep(self.batch_wait_s)
            while len(entries) < self.max_batch_size and not self._queue.empty():
                entries.append(self._queue.get_nowait())
            live = [(job, future) for job, future in entries if not future.done()]
            if not live:
                continue
            latency_ns = round((self.latency.sample_ms(self.rng) + self.per_sequence_ms * len(live)) * 1e6)
            outcomes: list[R | Exception] = []
            for job, _ in live:
                try:
                    outcomes.append(self.decide(job))
                except Exception as error:  # this job's caller gets it; the batch goes on
                    outcomes.append(error)
            self.calls += len(live)
            self.batches += 1
            self.max_batch = max(self.max_batch, len(live))
            await asyncio.sleep(latency_ns / 1e9)
            for (_, future), outcome in zip(live, outcomes, strict=True):
                if future.done():
                    continue
                if isinstance(outcome, Exception):
                    future.set_exception(outcome)
                else:
                    future.set_result(Batched(outcome, latency_ns, len(live)))


# --- shared pieces --------------------------------------------------------------------------------------------


def acceptance_at(acceptance: Sequence[float], depth: int) -> float:
    """``acceptance[depth]``; the last value repeats beyond the list."""
    return acceptance[min(depth, len(acceptance) - 1)]


def children_of(parents: Sequence[int]) -> dict[int, list[int]]:
    """Node index → its children in order; ROOT (-1) holds the first level."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def distinct_tokens(
    rng: np.random.Generator, count: int, low: int, high: int, exclude: Sequence[int] = ()
) -> list[int]:
    """``count`` distinct ids in ``[low, high)`` not in ``exclude``, in draw order."""
    chosen: list[int] = []
    seen = set(exclude)
    while len(chosen) < count:
        token = int(rng.integers(low, high))
        if token not in seen:
            seen.add(token)
            chosen.append(token)
    return chosen


def _check_id(sequence_id: str) -> None:
    if not sequence_id:
        raise InvalidArgumentError("sequence_id", "must not be empty")


def _not_open(sequence_id: str) -> KeyError:
    return KeyError(f"sequence_id: no open sequence {sequence_id!r}")


# --- verifier -------------------------------------------------------------------------------------------------


@dataclass
class VerifySequence:
    """One sequence on the simulated verifier; ``kept_row``: a bonus was deferred and the next proposal hangs off it."""

    rng: np.random.Generator
    remaining: int
    kept_row: bool = False
    finished: bool = False


@dataclass(frozen=True)
class VerifyDecision:
    """What one round commits (the wire Verdict's fields)."""

    accepted_path: list[int]
    emitted: list[int]
    finished: bool
    bonus_deferred: bool


def accept_path(parents: Sequence[int], acceptance: Sequence[float], rng: np.random.Generator) -> list[int]:
    """Accepted nodes, root to leaf: from the node reached at depth ``d``, one of its children is accepted with
    probability ``acceptance[d]``, else the walk stops. The child is drawn uniformly among those with the deepest
    subtrees, so a tree's accepted depth follows the chain's per-depth law down to the tree's depth (a real tree
    expands its likeliest nodes, the ones a verifier accepts most). One uniform per depth tried, plus one integer
    per choice among several children."""
    children = children_of(parents)
    height = [1] * len(parents)  # nodes on the longest downward path from each node, itself included
    for node in reversed(range(len(parents))):
        if parents[node] != ROOT:
            height[parents[node]] = max(height[parents[node]], height[node] + 1)
    path: list[int] = []
    node = ROOT
    while (kids := children.get(node)) and rng.random() < acceptance_at(acceptance, len(path)):
        tallest = max(height[kid] for kid in kids)
        kids = [kid for kid in kids if height[kid] == tallest]
        node = kids[int(rng.integers(len(kids)))] if len(kids) > 1 else kids[0]
        path.append(node)
    return path


def decide_verify(
    sequence: VerifySequence,
    tokens: Sequence[int],
    parents: Sequence[int],
    *,
    defer_bonus: bool,
    acceptance: Sequence[float],
    token_range: tuple[int, int],
) -> VerifyDecision:
    """One round's verdict under the real verifier's stop and deferral rules; the sequence is not changed.

    The final token is a bonus when the path ends at a leaf, else a recovered token; at most ``remaining`` tokens
    are emitted. A bonus is deferred when asked for, the path is not empty and it would not be the last token.
    """
    path = accept_path(parents, acceptance, sequence.rng)
    bonus = not children_of(parents).get(path[-1] if path else ROOT)
    emitted = [tokens[node] for node in path] + [int(sequence.rng.integers(*token_range))]
    keep = min(len(emitted), sequence.remaining)
    path, emitted = path[:keep], emitted[:keep]
    if defer_bonus and bonus and path and sequence.remaining - len(path) > 1:
        return VerifyDecision(path, emitted[:-1], finished=False, bonus_deferred=True)
    return VerifyDecision(path, emitted, finished=keep == sequence.remaining, bonus_deferred=False)


def advance(sequence: VerifySequence, decision: VerifyDecision) -> None:
    """Commit ``decision`` to ``sequence``."""
    sequence.remaining -= len(decision.emitted)
    sequence.kept_row = decision.bonus_deferred
    sequence.finished = decision.finished


def check_proposal(proposal: common_pb2.Proposal, vocab_size: int) -> tuple[list[int], list[int]]:
    """The tree's tokens and parents; raises InvalidArgumentError as the real verifier does for a malformed tree,
    an out-of-vocabulary token, or draft rows where a node's token has ``q = 0`` or a row does not sum to 1."""
    tokens, parents = list(proposal.tree.tokens), list(proposal.tree.parents)
    if len(tokens) != len(parents) or any(not ROOT <= parent < node for node, parent in enumerate(parents)):
        raise InvalidArgumentError("proposal.tree", "needs one parent per node, each -1 or an earlier node")
    if any(not 0 <= token < vocab_size for token in tokens):
        raise InvalidArgumentError("proposal.tree.tokens", f"token ids must be in [0, {vocab_size})")
    if not proposal.HasField("draft"):
        return tokens, parents
    draft = proposal.draft
    if len(draft.node_rows) != len(tokens) or any(not 0 <= row < len(draft.rows) for row in draft.node_rows):
        raise InvalidArgumentError("proposal.draft.node_rows", "must name one existing row per tree node")
    rows = []
    for index, row in enumerate(draft.rows):
        ids, probs = np.frombuffer(row.ids, dtype="<i4"), np.frombuffer(row.probs, dtype="<f4")
        if (
            len(row.ids) % 4
            or ids.shape != probs.shape
            or abs(float(probs.sum(dtype=np.float64)) - 1) > _DRAFT_SUM_TOLERANCE
        ):
            raise InvalidArgumentError("proposal.draft.rows", f"row {index}: ids and probs must match and sum to 1")
        rows.append(dict(zip(ids.tolist(), probs.tolist(), strict=True)))
    if any(rows[row].get(token, 0.0) <= 0 for token, row in zip(tokens, draft.node_rows, strict=True)):
        raise InvalidArgumentError("proposal.draft", "every proposed token needs q(token) > 0")
    return tokens, parents


@dataclass(frozen=True)
class _VerifyJob:
    sequence_id: str
    tokens: list[int]
    parents: list[int]
    defer_bonus: bool


class SimVerifier:
    """The simulated verifier's sequences and device (no gRPC here)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.sequences: dict[str, VerifySequence] = {}
        self.token_range = (config.first_token_id, config.vocab_size)
        self.batcher: Batcher[_VerifyJob, VerifyDecision] = Batcher(
            self._decide,
            config.latency,
            per_sequence_ms=config.per_sequence_ms,
            rng=np.random.default_rng(config.seed),
            max_batch_size=config.max_batch_size,
            batch_wait_s=config.batch_wait_ms / 1000,
        )

    def open(self, sequence_id: str, prompt_ids: Sequence[int], seed: int, max_tokens: int) -> None:
        _check_id(sequence_id)
        if sequence_id in self.sequences:
            raise InvalidArgumentError("sequence_id", f"{sequence_id!r} is already open")
        if len(self.sequences) >= self.config.max_sequences:
            raise CapacityError(f"{self.config.max_sequences} sequences are open on this verifier; retry later")
        if not prompt_ids:
            raise InvalidArgumentError("prompt_ids", "must not be empty")
        if max_tokens < 1:
            raise InvalidArgumentError("max_tokens", f"must be >= 1, got {max_tokens}")
        self.sequences[sequence_id] = VerifySequence(np.random.default_rng(seed), max_tokens)

    async def verify(
        self, sequence_id: str, proposal: common_pb2.Proposal, defer_bonus: bool
    ) -> Batched[VerifyDecision]:
        sequence = self._get(sequence_id)
        tokens, parents = check_proposal(proposal, self.config.vocab_size)
        job = _VerifyJob(sequence_id, tokens, parents, defer_bonus)
        if sequence.kept_row and not tokens:  # the bonus comes from the kept row: no forward, as in the real one
            return Batched(self._decide(job), 0, 1)
        return await self.batcher.submit(job)

    def close(self, sequence_id: str) -> None:
        self.sequences.pop(sequence_id, None)

    def _get(self, sequence_id: str) -> VerifySequence:
        sequence = self.sequences.get(sequence_id)
        if sequence is None:
            raise _not_open(sequence_id)
        if sequence.finished:
            raise InvalidArgumentError("sequence_id", f"{sequence_id!r} has finished; close it")
        return sequence

    def _decide(self, job: _VerifyJob) -> VerifyDecision:
        sequence = self._get(job.sequence_id)  # closed while queued: NOT_FOUND, like the real scheduler
        decision = decide_verify(
            sequence,
            job.tokens,
            job.parents,
            defer_bonus=job.defer_bonus,
            acceptance=self.config.acceptance,
            token_range=self.token_range,
        )
        advance(sequence, decision)
        return decision


# --- drafter --------------------------------------------------------------------------------------------------


@dataclass
class DraftSequence:
    """One sequence on the simulated drafter: its text (prompt + committed + assumed) and candidate shape.

    ``assumed`` holds the tokens ``assume_previous_accepted`` would append for the outstanding proposal (None:
    no proposal outstanding).
    """

    rng: np.random.Generator
    text: list[int]
    depth: int
    width: int
    max_nodes: int
    scheme: int
    send_q: bool
    assumed: list[int] | None = field(default=None)


def grow_tree(
    rng: np.random.Generator, depth: int, width: int, budget: int, token_range: tuple[int, int]
) -> tuple[list[int], list[int]]:
    """Random distinct sibling tokens, level by level: each level gets at most its share of the remaining budget
    (``room // levels_left``, at least one), expanded first-frontier-node first, ``width`` children per node —
    the shape :class:`specdec.drafters.model.ModelDrafter` grows. ``width == 1`` gives a chain of
    ``min(depth, budget)``; ``(depth 3, width 2, budget 6)`` gives two children per level under the first node."""
    tokens: list[int] = []
    parents: list[int] = []
    frontier = [ROOT]
    for level in range(depth):
        if len(tokens) >= budget or not frontier:
            break
        room = max(1, (budget - len(tokens)) // (depth - level))
        next_frontier: list[int] = []
        for node in frontier:
            count = min(width, room, budget - len(tokens))
            if count <= 0:
                break
            room -= count
            for token in distinct_tokens(rng, count, *token_range):
                tokens.append(token)
                parents.append(node)
                next_frontier.append(len(tokens) - 1)
        frontier = next_frontier
    return tokens, parents


def first_path(parents: Sequence[int]) -> list[int]:
    """Root-to-leaf path through each node's first child (the assumed path; a chain's is all of it)."""
    children = children_of(parents)
    path: list[int] = []
    while kids := children.get(path[-1] if path else ROOT):
        path.append(kids[0])
    return path


def draft_rows(
    rng: np.random.Generator, tokens: Sequence[int], parents: Sequence[int], support: int, token_range: tuple[int, int]
) -> common_pb2.DraftDistributions:
    """Uniform ``q`` over the children of each parent plus random ids up to ``support``, one row per parent (shared
    by its siblings) in ascending id order, packed as :func:`grpc_common.convert.proposal_to_wire` packs it."""
    draft = common_pb2.DraftDistributions()
    row_of_parent: dict[int, int] = {}
    for parent in parents:
        if parent in row_of_parent:
            continue
        siblings = [token for token, p in zip(tokens, parents, strict=True) if p == parent]
        ids = sorted(siblings + distinct_tokens(rng, max(0, support - len(siblings)), *token_range, exclude=siblings))
        row_of_parent[parent] = len(draft.rows)
        draft.rows.append(
            common_pb2.SparseRow(
                ids=np.asarray(ids, dtype="<i4").tobytes(), probs=np.full(len(ids), 1 / len(ids), dtype="<f4").tobytes()
            )
        )
    draft.node_rows.extend(row_of_parent[parent] for parent in parents)
    return draft


@dataclass(frozen=True)
class _ProposeJob:
    sequence_id: str
    max_tokens: int
    assume_previous_accepted: bool


class SimDrafter:
    """The simulated drafter's sequences and device (no gRPC here)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.sequences: dict[str, DraftSequence] = {}
        self.token_range = (config.first_token_id, config.vocab_size)
        self.batcher: Batcher[_ProposeJob, common_pb2.Proposal] = Batcher(
            self._draft,
            config.latency,
            per_sequence_ms=config.per_sequence_ms,
            rng=np.random.default_rng(config.seed),
            max_batch_size=config.max_batch_size,
            batch_wait_s=config.batch_wait_ms / 1000,
        )

    def open(self, request: drafter_pb2.OpenDraftRequest) -> None:
        sequence_id, shape = request.sequence_id, request.shape
        _check_id(sequence_id)
        if sequence_id in self.sequences:
            raise InvalidArgumentError("sequence_id", f"{sequence_id!r} is already open")
        if len(self.sequences) >= self.config.max_sequences:
            raise CapacityError(f"{self.config.max_sequences} sequences are open on this drafter; retry later")
        if not request.prompt_ids:
            raise InvalidArgumentError("prompt", "must not be empty")
        for name in ("num_draft_tokens", "tree_width", "tree_budget"):
            if getattr(shape, name) < 0:
                raise InvalidArgumentError(name, f"must be >= 0, got {getattr(shape, name)}")
        depth, width = shape.num_draft_tokens or DEFAULT_DRAFT_TOKENS, shape.tree_width or 1
        greedy = request.sampling.HasField("temperature") and request.sampling.temperature == 0
        self.sequences[sequence_id] = DraftSequence(
            rng=np.random.default_rng(request.seed),
            text=list(request.prompt_ids),
            depth=depth,
            width=width,
            max_nodes=shape.tree_budget or depth * width,
            scheme=shape.sibling_sampling or common_pb2.SIBLING_SAMPLING_WITHOUT_REPLACEMENT,
            send_q=bool(self.config.draft_support) and not greedy,
        )

    async def propose(
        self, sequence_id: str, max_tokens: int, assume_previous_accepted: bool
    ) -> Batched[common_pb2.Proposal]:
        _check_id(sequence_id)
        if max_tokens < 0:
            raise InvalidArgumentError("max_tokens", f"must be >= 0, got {max_tokens}")
        return await self.batcher.submit(_ProposeJob(sequence_id, max_tokens, assume_previous_accepted))

    def commit(self, sequence_id: str, base_length: int, emitted: Sequence[int]) -> None:
        """The committed text is now ``text[:base_length] + emitted``; an unchanged text keeps the outstanding
        proposal (a confirmed assumed chain), any other clears it."""
        sequence = self._get(sequence_id)
        if not 0 <= base_length <= len(sequence.text):
            raise InvalidArgumentError("base_length", f"must be in [0, {len(sequence.text)}], got {base_length}")
        text = sequence.text[:base_length] + list(emitted)
        if not text:
            raise InvalidArgumentError("emitted", "the committed text must not become empty")
        if text != sequence.text:
            sequence.text, sequence.assumed = text, None

    def close(self, sequence_id: str) -> None:
        self.sequences.pop(sequence_id, None)

    def _get(self, sequence_id: str) -> DraftSequence:
        sequence = self.sequences.get(sequence_id)
        if sequence is None:
            raise _not_open(sequence_id)
        return sequence

    def _draft(self, job: _ProposeJob) -> common_pb2.Proposal:
        sequence = self._get(job.sequence_id)
        if job.assume_previous_accepted:
            if sequence.assumed is None:
                raise InvalidArgumentError(
                    "assume_previous_accepted", "no outstanding proposal (it was committed, assumed or rolled back)"
                )
            sequence.text += sequence.assumed
        budget = min(job.max_tokens, sequence.max_nodes)
        tokens, parents = grow_tree(sequence.rng, sequence.depth, sequence.width, budget, self.token_range)
        sequence.assumed = [tokens[node] for node in first_path(parents)]
        proposal = common_pb2.Proposal(
            tree=common_pb2.TokenTree(tokens=tokens, parents=parents), sibling_sampling=sequence.scheme
        )
        if sequence.send_q and tokens:
            proposal.draft.CopyFrom(
                draft_rows(sequence.rng, tokens, parents, self.config.draft_support, self.token_range)
            )
        return proposal


# --- gRPC -----------------------------------------------------------------------------------------------------

Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def _mapped(handler: Handler) -> Handler:
    """Domain errors → status codes with :func:`grpc_common.errors.status_for`, as the real (sync) services'
    interceptor does; that interceptor does not apply to a ``grpc.aio`` server."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except Exception as error:
            code = status_for(error)
            if code == grpc.StatusCode.INTERNAL:
                LOG.exception("internal error")
            details = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
            await context.abort(code, str(details))

    return wrapper


class SimVerifierServicer(verifier_pb2_grpc.VerifierServicer):
    """``specdec.v1.Verifier`` over a :class:`SimVerifier`."""

    def __init__(self, verifier: SimVerifier) -> None:
        self.verifier = verifier

    @_mapped
    async def OpenSequence(
        self, request: verifier_pb2.OpenVerifyRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.OpenVerifyReply:
        self.verifier.open(request.sequence_id, request.prompt_ids, request.seed, request.max_tokens)
        return verifier_pb2.OpenVerifyReply()

    @_mapped
    async def Verify(
        self, request: verifier_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.VerifyReply:
        answer = await self.verifier.verify(request.sequence_id, request.proposal, request.defer_bonus)
        decision = answer.result
        verdict = common_pb2.Verdict(
            accepted_path=decision.accepted_path,
            emitted=decision.emitted,
            finished=decision.finished,
            bonus_deferred=decision.bonus_deferred,
        )
        return verifier_pb2.VerifyReply(
            verdict=verdict, verify_ns=answer.latency_ns, state_ns=0, batch_size=answer.batch_size
        )

    @_mapped
    async def CloseSequence(
        self, request: verifier_pb2.CloseVerifyRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.CloseVerifyReply:
        self.verifier.close(request.sequence_id)
        return verifier_pb2.CloseVerifyReply()

    @_mapped
    async def Status(
        self, request: verifier_pb2.VerifierStatusRequest, context: grpc.aio.ServicerContext
    ) -> verifier_pb2.VerifierStatusReply:
        count = len(self.verifier.sequences)
        return verifier_pb2.VerifierStatusReply(
            model=self.verifier.config.model, open_sequences=count, runner_sequences=count, world_size=1
        )


class SimDrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """``specdec.v1.Drafter`` over a :class:`SimDrafter`."""

    def __init__(self, drafter: SimDrafter) -> None:
        self.drafter = drafter

    @_mapped
    async def OpenSequence(
        self, request: drafter_pb2.OpenDraftRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.OpenDraftReply:
        self.drafter.open(request)
        return drafter_pb2.OpenDraftReply(open_ns=0)

    @_mapped
    async def Propose(
        self, request: drafter_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.ProposeReply:
        answer = await self.drafter.propose(request.sequence_id, request.max_tokens, request.assume_previous_accepted)
        proposal = answer.result
        return drafter_pb2.ProposeReply(proposal=proposal, draft_ns=answer.latency_ns, wire_bytes=proposal.ByteSize())

    @_mapped
    async def Commit(
        self, request: drafter_pb2.DraftCommitRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DraftCommitReply:
        self.drafter.commit(request.sequence_id, request.base_length, request.emitted)
        return drafter_pb2.DraftCommitReply()

    @_mapped
    async def CloseSequence(
        self, request: drafter_pb2.CloseDraftRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.CloseDraftReply:
        self.drafter.close(request.sequence_id)
        return drafter_pb2.CloseDraftReply()

    @_mapped
    async def Status(
        self, request: drafter_pb2.DrafterStatusRequest, context: grpc.aio.ServicerContext
    ) -> drafter_pb2.DrafterStatusReply:
        batcher = self.drafter.batcher
        return drafter_pb2.DrafterStatusReply(
            kind=self.drafter.config.kind,
            open_sequences=len(self.drafter.sequences),
            runner_sequences=0,
            proposals=batcher.calls,
            batches=batcher.batches,
            max_batch=batcher.max_batch,
        )


async def serve(config: WorkerConfig) -> None:
    """Serve until SIGTERM / SIGINT, then drain: health NOT_SERVING, in-flight calls get ``grace_s``."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
        ]
    )
    core: SimVerifier | SimDrafter
    if config.role == "verifier":
        core = SimVerifier(config)
        verifier_pb2_grpc.add_VerifierServicer_to_server(SimVerifierServicer(core), server)
        service, extra = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name, {"model": config.model}
    else:
        core = SimDrafter(config)
        drafter_pb2_grpc.add_DrafterServicer_to_server(SimDrafterServicer(core), server)
        service, extra = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name, {"kind": config.kind}
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    core.batcher.start()
    await server.start()
    for name in ("", service):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(json.dumps({"address": f"{config.host}:{port}", "role": config.role, **extra}), flush=True)
    await stop.wait()
    await health.enter_graceful_shutdown()
    await server.stop(config.grace_s)
    await core.batcher.stop()
    batcher = core.batcher
    LOG.info("answered %d calls in %d batches (largest %d)", batcher.calls, batcher.batches, batcher.max_batch)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = WorkerConfig.from_args(argv)
    except ValueError as error:
        print(f"simulate_worker: {error}", file=sys.stderr)
        return 2
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
