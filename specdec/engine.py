"""The co-located engine: target runner, optional drafter and the acceptance rule in one process.

Each round, for every active sequence at once: the drafter proposes a tree (a chain is a tree),
the target verifies every sequence's ``pending + tree`` in ONE forward, the rule decides what is
emitted, then the target and the drafter commit the accepted path. With no drafter every round
is a plain target step on the same runner: that is the target-only baseline. The verification
side is :class:`~specdec.verification.BatchVerifier`, the same code the verifier service runs;
the drafter draws from the sequence's random stream too.

With a :class:`~specdec.adaptive.SpeculationController` (``speculation: auto``) each round's draft length of
every sequence is the controller's choice, from the acceptance it measured and the costs of the rounds it saw:
anything from a plain target step (0) to the drafter's configured shape.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from specdec.adaptive import AcceptanceTracker, Candidate, SpeculationController, drafted_work
from specdec.drafters.base import Drafter, Proposal
from specdec.lookup import LookupIndex
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams, TopLogprobs
from specdec.stats import GenerationResult, SpecStats
from specdec.tree import TokenTree, grown_dynamically, sampled_tree_is_chain
from specdec.verification import BatchVerifier, VerifyCall, VerifyOutcome


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (token ids) and how to continue it; ``logprobs`` / ``top_logprobs`` as in
    :meth:`~specdec.verification.BatchVerifier.open`."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 64
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class _Sequence:
    request: GenerationRequest
    sequence_id: str
    draft_handle: int | None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    released: bool = False
    tracker: AcceptanceTracker | None = None  # its acceptance by position, when the draft length adapts
    text_index: LookupIndex = field(default_factory=LookupIndex)  # prompt + output, when its lookups are planned

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.output)


class Engine:
    """Generates for a batch of requests with ``drafter`` (or target-only when ``None``); with ``controller``, the
    draft length of every sequence adapts each round (up to the drafter's configured shape)."""

    def __init__(
        self,
        runner: KVRunner,
        eos_token_ids: frozenset[int],
        drafter: Drafter | None = None,
        controller: SpeculationController | None = None,
    ) -> None:
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.drafter = drafter
        self.controller = controller if drafter is not None else None
        self._verifier = BatchVerifier(runner)
        self._ids = itertools.count()

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`~specdec.errors.InvalidArgumentError` naming the first bad field of ``request``."""
        self._verifier.validate(request.prompt_ids, request.max_tokens)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run every request to completion, verifying all active sequences together each round."""
        for request in requests:
            self.validate(request)
        start = time.perf_counter()
        sequences: list[_Sequence] = []
        try:
            for request in requests:
                sequences.append(self._open(request))
            active = list(sequences)
            while active:
                self._round(active)
                active = [sequence for sequence in active if sequence.finish_reason is None]
        finally:
            for sequence in sequences:
                self._close(sequence)
        elapsed = time.perf_counter() - start
        return [
            GenerationResult(s.output, s.finish_reason or "length", s.stats, elapsed, s.logprobs, s.top_logprobs)
            for s in sequences
        ]

    def _open(self, request: GenerationRequest) -> _Sequence:
        sequence_id = str(next(self._ids))
        takes_features = self.drafter is not None and self.drafter.feature_width > 0
        self._verifier.open(
            sequence_id,
            request.prompt_ids,
            request.params,
            request.seed,
            request.max_tokens,
            self.eos_token_ids,
            ignore_eos=request.ignore_eos,
            logprobs=request.logprobs,
            features=takes_features,
            top_logprobs=request.top_logprobs,
            feature_layers=(self.drafter.feature_layers or None) if self.drafter is not None else None,
            feature_context=self.drafter.feature_context if takes_features else 0,
        )
        tracker = self.controller.tracker() if self.controller is not None else None
        sequence = _Sequence(request, sequence_id, None, tracker=tracker)
        if tracker is not None and self.drafter is not None:
            if self.drafter.lookup_min_match > 0:
                tracker.lookup = self.controller.lookup_tracker()
                sequence.text_index.extend(request.prompt_ids)
            if grown_dynamically(self.drafter.config.tree_width, request.params.greedy):
                tracker.ranks = self.controller.rank_tracker()
        if self.drafter is not None:
            try:
                generator = self._verifier.generator(sequence_id)
                sequence.draft_handle = self.drafter.open(list(request.prompt_ids), request.params, generator)
            except BaseException:
                self._verifier.close(sequence_id)
                raise
        return sequence

    def _close(self, sequence: _Sequence) -> None:
        """Free the sequence's state on the verifier and the drafter (once; later calls do nothing)."""
        if sequence.released:
            return
        sequence.released = True
        self._verifier.close(sequence.sequence_id)
        if self.drafter is not None and sequence.draft_handle is not None:
            self.drafter.close(sequence.draft_handle)

    def _round(self, active: list[_Sequence]) -> None:
        started = time.perf_counter()
        proposals = self._propose(active)
        drafted = time.perf_counter()
        outcomes = self._verifier.verify(
            [VerifyCall(s.sequence_id, proposal) for s, proposal in zip(active, proposals, strict=True)]
        )
        for sequence, proposal, outcome in zip(active, proposals, outcomes, strict=True):
            committed = time.perf_counter()
            if sequence.draft_handle is not None:
                verdict = outcome.verdict
                if outcome.features is not None:
                    self.drafter.add_features(sequence.draft_handle, outcome.feature_start, outcome.features)
                self.drafter.commit(sequence.draft_handle, verdict.accepted_path, verdict.emitted)
            self._record(sequence, proposal, outcome, drafted - started, time.perf_counter() - committed)
            if sequence.finish_reason is not None:
                self._close(sequence)
        if self.controller is not None:
            self._observe(active, proposals, outcomes, drafted - started, time.perf_counter() - started)

    def _propose(self, active: list[_Sequence]) -> list[Proposal]:
        empty = Proposal(TokenTree.empty(), None)
        if self.drafter is None:
            return [empty] * len(active)
        # The round's final token is always the target's, so draft at most remaining - 1.
        handles = [s.draft_handle for s in active]
        budgets = [s.remaining - 1 for s in active]
        if self.controller is not None:
            budgets = self._adaptive_budgets(active, budgets)
        return self.drafter.propose(handles, budgets)

    def _adaptive_budgets(self, active: list[_Sequence], budgets: list[int]) -> list[int]:
        """The controller's node budget for each sequence: a chain of its chosen length, a greedy (dynamic) tree's
        best nodes, or another tree whole or none; a round the drafter will propose a prompt-lookup chain in is
        planned as one (its own estimate, no level)."""
        config = self.drafter.config
        candidates = []
        for sequence, budget in zip(active, budgets, strict=True):
            nodes = min(budget, config.max_nodes)
            lookup = len(self._lookup_chain(sequence, nodes))
            tree = config.tree_width > 1 and (
                sequence.request.params.greedy
                or not sampled_tree_is_chain(config.tree_width, config.tree_budget, config.num_draft_tokens)
            )
            candidates.append(
                Candidate.for_round(sequence.tracker, config.num_draft_tokens, nodes, tree=tree, lookup=lookup)
            )
        lengths = self.controller.choose(candidates)
        return [candidate.node_budget(length) for candidate, length in zip(candidates, lengths, strict=True)]

    def _lookup_chain(self, sequence: _Sequence, limit: int) -> list[int]:
        """The prompt-lookup chain the drafter proposes for ``sequence`` this round, at most ``limit`` long (empty:
        its model drafts); the drafter's choice depends on the text alone (:mod:`specdec.lookup`)."""
        if sequence.tracker is None or sequence.tracker.lookup is None:
            return []
        index = sequence.text_index
        index.extend(sequence.output[len(index) - len(sequence.request.prompt_ids) :])
        return index.prompt_lookup(self.drafter.lookup_min_match, limit)

    def _observe(
        self,
        active: list[_Sequence],
        proposals: list[Proposal],
        outcomes: list[VerifyOutcome],
        draft_s: float,
        round_s: float,
    ) -> None:
        """Tell the controller what each sequence accepted and what the round cost."""
        depths = [proposal.tree.max_depth() for proposal in proposals]
        # the drafts that ran draft levels (a model-free one, prompt lookup, ran none)
        modelled = [(s, p, d) for s, p, d in zip(active, proposals, depths, strict=True) if d and not p.model_free]
        # a draft after plain or model-free rounds caught up on the tokens committed meanwhile: not what its levels cost
        caught_up = all(s.tracker.caught_up for s, _, _ in modelled)
        for sequence, proposal, depth, outcome in zip(active, proposals, depths, outcomes, strict=True):
            self.controller.observe_verdict(
                sequence.tracker,
                depth,
                outcome.verdict.num_accepted,
                model_free=proposal.model_free,
                nodes=len(proposal.tree),
                accepted_nodes=outcome.verdict.accepted_path,
            )
        forward = outcomes[0]
        other_s = round_s - draft_s - forward.verify_s
        config = self.drafter.config
        whole = (config.num_draft_tokens, config.max_nodes)
        work = [drafted_work(len(p.tree), d, whole if s.tracker.ranks is not None else None) for s, p, d in modelled]
        rows = sum(rows for _, rows in work)
        levels = max((levels for levels, _ in work), default=0) if caught_up else 0
        self.controller.observe_round(forward.forward_positions, forward.verify_s, levels, draft_s, other_s, rows)

    def _record(
        self, sequence: _Sequence, proposal: Proposal, outcome: VerifyOutcome, draft_s: float, drafter_commit_s: float
    ) -> None:
        stats, verdict = sequence.stats, outcome.verdict
        stats.count_verdict(len(proposal.tree), verdict.num_accepted)
        stats.draft_s += draft_s
        stats.verify_s += outcome.verify_s
        stats.state_s += outcome.commit_s + drafter_commit_s
        sequence.output.extend(verdict.emitted)
        sequence.logprobs.extend(outcome.logprobs or ())
        sequence.top_logprobs.extend(outcome.top_logprobs or ())
        sequence.finish_reason = outcome.finish_reason
