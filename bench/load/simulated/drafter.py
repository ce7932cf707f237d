"""The simulated drafter: random proposals in the real drafter's shapes and wire format, with no model.

``Propose`` returns random distinct tokens in the request's shape (chain, or a tree grown level by level under
the node budget exactly as :class:`specdec.drafters.model.ModelDrafter` does) with a sparse uniform ``q`` over
``--draft-support`` ids per parent in the wire format of :mod:`grpc_common.convert_rows` (packed ``<i4`` ids in
ascending order, ``<f4`` probabilities, one row per parent shared by siblings), or no distribution (one-hot
``q``) for greedy requests or ``--draft-support 0``. ``assume_previous_accepted`` and ``Commit`` keep the text
exactly as :class:`specdec.drafters.base.SequenceDrafter` does. The rows are built here rather than with
``proposal_to_wire`` because that takes dense ``[N, V]`` torch rows: importing torch and filling 49152-wide rows
would cost each worker seconds and the CPU this simulation exists to leave to the router; a test decodes these
proposals with the real ``proposal_from_wire``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from specdec_wire.v1 import common_pb2, drafter_pb2

from bench.load.simulated.common import ROOT, check_sequence_id, children_of, not_open
from bench.load.simulated.config import WorkerConfig
from bench.load.simulated.device import Batched, Batcher
from specdec.errors import CancelledByCallerError, CapacityError, InvalidArgumentError

DEFAULT_DRAFT_TOKENS = 4  # the real drafter's default chain length (DraftConfig)


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
    the shape :class:`specdec.drafters.model.ModelDrafter` grows when sampling (a greedy tree's shape follows the
    draft's confidence, :class:`~specdec.drafters.model.TreeDraft`; it holds as many nodes). ``width == 1`` gives a
    chain of ``min(depth, budget)``; ``(depth 3, width 2, budget 6)`` gives two children per level under the first
    node."""
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
    by its siblings) in ascending id order, packed as :func:`grpc_common.convert_rows.proposal_to_wire` packs it."""
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
    propose_id: int = 0  # 0: never cancelled


class SimDrafter:
    """The simulated drafter's sequences and device (no gRPC here)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.sequences: dict[str, DraftSequence] = {}
        # Per sequence, the highest propose_id a Commit cancelled (as the real drafter: a pre-draft the router
        # abandoned is answered CANCELLED, never drafted on a text a later Commit already changed).
        self._cancelled_through: dict[str, int] = {}
        self.token_range = (config.first_token_id, config.vocab_size)
        self.batcher: Batcher[_ProposeJob, common_pb2.Proposal] = Batcher(
            self._draft,
            config.latency,
            per_sequence_ms=config.per_sequence_ms,
            rng=np.random.default_rng(config.seed),
            max_batch_size=config.max_batch_size,
            batch_wait_s=config.batch_wait_ms / 1000,
            open_ids=self.sequences.keys,
            arrival_wait=config.arrival_wait,
        )

    def open(self, request: drafter_pb2.OpenDraftRequest) -> None:
        sequence_id, shape = request.sequence_id, request.shape
        check_sequence_id(sequence_id)
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
        self, sequence_id: str, max_tokens: int, assume_previous_accepted: bool, propose_id: int = 0
    ) -> Batched[common_pb2.Proposal]:
        check_sequence_id(sequence_id)
        if max_tokens < 0:
            raise InvalidArgumentError("max_tokens", f"must be >= 0, got {max_tokens}")
        return await self.batcher.submit(_ProposeJob(sequence_id, max_tokens, assume_previous_accepted, propose_id))

    def commit(self, sequence_id: str, base_length: int, emitted: Sequence[int], cancel_through: int = 0) -> None:
        """The committed text is now ``text[:base_length] + emitted``; an unchanged text keeps the outstanding
        proposal (a confirmed assumed chain), any other clears it. ``cancel_through`` cancels the sequence's
        unanswered Proposes numbered up to it."""
        if cancel_through > 0:
            previous = self._cancelled_through.get(sequence_id, 0)
            self._cancelled_through[sequence_id] = max(previous, cancel_through)
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
        self._cancelled_through.pop(sequence_id, None)

    def _get(self, sequence_id: str) -> DraftSequence:
        sequence = self.sequences.get(sequence_id)
        if sequence is None:
            raise not_open(sequence_id)
        return sequence

    def _draft(self, job: _ProposeJob) -> common_pb2.Proposal:
        sequence = self._get(job.sequence_id)
        if job.propose_id and job.propose_id <= self._cancelled_through.get(job.sequence_id, 0):
            raise CancelledByCallerError(f"propose {job.propose_id} of {job.sequence_id!r} was cancelled by a Commit")
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
