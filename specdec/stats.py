"""Per-request speculation counters shared by the co-located engine and the router (DESIGN §7), and the engine's
result of one request: plain data, importable without torch (the command line prints them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.sampling_params import TopLogprobs


@dataclass
class AcceptanceCounts:
    """Rounds, drafted and accepted tokens; tree nodes count as drafted, never as accepted length."""

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    rounds_per_draft_size: list[int] = field(default_factory=list)  # [n]: rounds that proposed n nodes

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round: 1 + accepted / rounds."""
        return 1 + self.accepted_tokens / self.rounds if self.rounds else 0.0

    def count_verdict(self, drafted: int, accepted: int) -> None:
        """One round that proposed ``drafted`` nodes and accepted the first ``accepted`` positions."""
        self.rounds += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.rounds_per_draft_size.extend([0] * (drafted + 1 - len(self.rounds_per_draft_size)))
        self.rounds_per_draft_size[drafted] += 1
        self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1


@dataclass
class SpecStats(AcceptanceCounts):
    """Speculation counters and time split of one request (DESIGN §7 vocabulary)."""

    draft_s: float = 0.0
    verify_s: float = 0.0
    state_s: float = 0.0


@dataclass(frozen=True)
class GenerationResult:
    """``logprobs`` and ``top_logprobs`` (one per token) are empty unless the request asked for them."""

    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) or "length"
    stats: SpecStats
    elapsed_s: float
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0
