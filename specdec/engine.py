"""The co-located engine: target runner, optional drafter and the acceptance rule in one process.

Each round, for every active sequence at once: the drafter proposes a tree (a chain is a tree),
the target verifies every sequence's ``pending + tree`` in ONE forward, the rule decides what is
emitted, then the target and the drafter commit the accepted path. With no drafter every round
is a plain target step on the same runner: that is the target-only baseline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.acceptance import Verdict, verify_greedy, verify_reference
from specdec.drafters.base import Drafter, Proposal
from specdec.errors import InvalidArgumentError
from specdec.runner import ForwardItem, KVRunner
from specdec.sampling import SamplingParams, logits_to_probs, make_generator
from specdec.tree import TokenTree


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt (token ids) and how to continue it."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 64
    seed: int | None = None
    ignore_eos: bool = False


@dataclass
class SpecStats:
    """Speculation counters of one request (DESIGN §7 vocabulary)."""

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    state_s: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round: 1 + accepted/rounds (tree nodes are not counted)."""
        return 1 + self.accepted_tokens / self.rounds if self.rounds else 0.0

    def count_accepted(self, num_accepted: int) -> None:
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position.extend([0] * (num_accepted - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length"
    stats: SpecStats
    elapsed_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class _Sequence:
    request: GenerationRequest
    runner_seq: int
    generator: torch.Generator
    pending: list[int]
    draft_handle: int | None
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    released: bool = False

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - len(self.output)


class Engine:
    """Generates for a batch of requests with ``drafter`` (or target-only when ``None``)."""

    def __init__(self, runner: KVRunner, eos_token_ids: frozenset[int], drafter: Drafter | None = None) -> None:
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.drafter = drafter

    def validate(self, request: GenerationRequest) -> None:
        """Raise :class:`InvalidArgumentError` naming the first bad field of ``request``."""
        if not request.prompt_ids:
            raise InvalidArgumentError("prompt", "must not be empty")
        if any(not 0 <= token < self.runner.vocab_size for token in request.prompt_ids):
            raise InvalidArgumentError("prompt", f"token ids must be in [0, {self.runner.vocab_size})")
        if request.max_tokens <= 0:
            raise InvalidArgumentError("max_tokens", f"must be >= 1, got {request.max_tokens}")
        context = self.runner.max_seq_len
        if len(request.prompt_ids) + request.max_tokens > context:
            raise InvalidArgumentError(
                "max_tokens",
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds the "
                f"context length {context}",
            )

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run every request to completion, verifying all active sequences together each round."""
        for request in requests:
            self.validate(request)
        start = time.perf_counter()
        sequences = [self._open(request) for request in requests]
        try:
            active = list(sequences)
            while active:
                self._round(active)
                active = [sequence for sequence in active if sequence.finish_reason is None]
        finally:
            for sequence in sequences:
                self._close(sequence)
        elapsed = time.perf_counter() - start
        return [GenerationResult(s.output, s.finish_reason or "length", s.stats, elapsed) for s in sequences]

    def _open(self, request: GenerationRequest) -> _Sequence:
        generator = make_generator(request.seed)
        handle = None
        if self.drafter is not None:
            handle = self.drafter.open(list(request.prompt_ids), request.params, generator)
        return _Sequence(request, self.runner.open(), generator, list(request.prompt_ids), handle)

    def _close(self, sequence: _Sequence) -> None:
        """Free the sequence's state on the runner and the drafter (once; later calls do nothing)."""
        if sequence.released:
            return
        sequence.released = True
        self.runner.close(sequence.runner_seq)
        if self.drafter is not None and sequence.draft_handle is not None:
            self.drafter.close(sequence.draft_handle)

    def _round(self, active: list[_Sequence]) -> None:
        started = time.perf_counter()
        proposals = self._propose(active)
        drafted = time.perf_counter()
        all_logits = self.runner.forward(
            [ForwardItem(s.runner_seq, s.pending, proposal.tree) for s, proposal in zip(active, proposals, strict=True)]
        )
        verdicts = []
        for sequence, proposal, logits in zip(active, proposals, all_logits, strict=True):
            verdicts.append(self._verify(sequence, proposal, logits))
        verified = time.perf_counter()
        for sequence, proposal, verdict in zip(active, proposals, verdicts, strict=True):
            self.runner.commit(sequence.runner_seq, len(sequence.pending), verdict.accepted_path)
            if sequence.draft_handle is not None:
                self.drafter.commit(sequence.draft_handle, verdict.accepted_path, verdict.emitted)
            self._record(sequence, proposal, verdict)
        committed = time.perf_counter()
        for sequence in active:
            sequence.stats.draft_s += drafted - started
            sequence.stats.verify_s += verified - drafted
            sequence.stats.state_s += committed - verified
            if sequence.finish_reason is not None:
                self._close(sequence)

    def _propose(self, active: list[_Sequence]) -> list[Proposal]:
        empty = Proposal(TokenTree.empty(), None)
        if self.drafter is None:
            return [empty] * len(active)
        # The round's final token is always the target's, so draft at most remaining - 1.
        handles = [s.draft_handle for s in active]
        return self.drafter.propose(handles, [s.remaining - 1 for s in active])

    def _verify(self, sequence: _Sequence, proposal: Proposal, logits: torch.Tensor) -> Verdict:
        """Apply the acceptance rule to one sequence; ``logits`` [1 + N, V] from the target forward."""
        request = sequence.request
        eos_token_ids = frozenset() if request.ignore_eos else self.eos_token_ids
        if request.params.greedy:  # the one-hot limit of the rule, without forming distributions
            return verify_greedy(proposal.tree, logits, max_new_tokens=sequence.remaining, eos_token_ids=eos_token_ids)
        target_probs = logits_to_probs(logits, request.params)
        accept_uniforms = torch.rand(len(proposal.tree), generator=sequence.generator, dtype=torch.float64)
        draw_uniform = float(torch.rand((), generator=sequence.generator, dtype=torch.float64))
        return verify_reference(
            proposal.tree,
            target_probs,
            proposal.draft_probs,
            scheme=proposal.scheme,
            accept_uniforms=accept_uniforms,
            draw_uniform=draw_uniform,
            eos_token_ids=eos_token_ids,
            max_new_tokens=sequence.remaining,
        )

    def _record(self, sequence: _Sequence, proposal: Proposal, verdict: Verdict) -> None:
        stats = sequence.stats
        stats.rounds += 1
        stats.draft_tokens += len(proposal.tree)
        stats.accepted_tokens += verdict.num_accepted
        stats.count_accepted(verdict.num_accepted)
        sequence.output.extend(verdict.emitted)
        sequence.pending = verdict.emitted[-1:]
        if sequence.output and not sequence.request.ignore_eos and sequence.output[-1] in self.eos_token_ids:
            sequence.finish_reason = "stop"
        elif sequence.remaining <= 0:
            sequence.finish_reason = "length"
