"""The simulated verifier: a chosen acceptance law under the real verifier's rules, with no model.

Draft position ``i`` (0-based depth) is accepted with probability ``acceptance[i]`` (the last value repeats),
stopping at the first rejection; in a tree some child of the node reached is accepted with that probability
(which one: see :func:`accept_path`). The verdict emits the accepted tokens plus one recovered / bonus token, a
random id that is never a special token (ids below ``--first-token-id``), so requests run to ``max_tokens``.
The budget and ``defer_bonus`` rules are the real verifier's (:mod:`specdec.verification`): a whole path accepted
with ``defer_bonus`` emits no bonus, reports ``bonus_deferred`` and keeps the row, the next proposal hangs off it
(judged from depth 0 again), and an empty proposal off a kept row draws the bonus without a forward. Proposals
are checked as the real verifier checks them, so a router sending malformed trees or ``q`` rows fails here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from specdec_wire.v1 import common_pb2

from bench.load.simulated.common import ROOT, check_sequence_id, children_of, not_open
from bench.load.simulated.config import WorkerConfig
from bench.load.simulated.device import Batched, Batcher
from specdec.errors import CapacityError, InvalidArgumentError

_DRAFT_SUM_TOLERANCE = 1e-3  # the real verifier's |sum(q) - 1| allowance


def acceptance_at(acceptance: Sequence[float], depth: int) -> float:
    """``acceptance[depth]``; the last value repeats beyond the list."""
    return acceptance[min(depth, len(acceptance) - 1)]


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
    assumed_path: Sequence[int] = (),
    acceptance: Sequence[float],
    token_range: tuple[int, int],
) -> VerifyDecision:
    """One round's verdict under the real verifier's stop and deferral rules; the sequence is not changed.

    The final token is a bonus when the path ends at a leaf, else a recovered token; at most ``remaining`` tokens
    are emitted. A bonus is deferred when asked for, the path is not empty, is the ``assumed_path`` (empty: any) and
    it would not be the last token.
    """
    path = accept_path(parents, acceptance, sequence.rng)
    bonus = not children_of(parents).get(path[-1] if path else ROOT)
    emitted = [tokens[node] for node in path] + [int(sequence.rng.integers(*token_range))]
    keep = min(len(emitted), sequence.remaining)
    path, emitted = path[:keep], emitted[:keep]
    assumed = not assumed_path or list(path) == list(assumed_path)
    if defer_bonus and bonus and path and assumed and sequence.remaining - len(path) > 1:
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
    assumed_path: tuple[int, ...] = ()


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
            open_ids=self.sequences.keys,
            arrival_wait=config.arrival_wait,
        )

    def open(self, sequence_id: str, prompt_ids: Sequence[int], seed: int, max_tokens: int) -> None:
        check_sequence_id(sequence_id)
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
        self, sequence_id: str, proposal: common_pb2.Proposal, defer_bonus: bool, assumed_path: Sequence[int] = ()
    ) -> Batched[VerifyDecision]:
        sequence = self._get(sequence_id)
        tokens, parents = check_proposal(proposal, self.config.vocab_size)
        job = _VerifyJob(sequence_id, tokens, parents, defer_bonus, tuple(assumed_path))
        if sequence.kept_row and not tokens:  # the bonus comes from the kept row: no forward, as in the real one
            return Batched(self._decide(job), 0, 1)
        return await self.batcher.submit(job)

    def close(self, sequence_id: str) -> None:
        self.sequences.pop(sequence_id, None)

    def _get(self, sequence_id: str) -> VerifySequence:
        sequence = self.sequences.get(sequence_id)
        if sequence is None:
            raise not_open(sequence_id)
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
            assumed_path=job.assumed_path,
            acceptance=self.config.acceptance,
            token_range=self.token_range,
        )
        advance(sequence, decision)
        return decision
