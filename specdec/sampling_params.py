"""A request's sampling settings and the alternatives it may ask for, apart from the tensor code of
:mod:`specdec.sampling` so that the router, which only checks and forwards them, needs no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from specdec.errors import InvalidArgumentError

GREEDY_BELOW = 1e-5  # temperatures under this are greedy
MAX_TOP_LOGPROBS = 20  # the most alternatives per token a request may ask for (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; ``top_k = 0``, ``top_p = 1``, ``min_p = 0`` disable a filter."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgumentError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgumentError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidArgumentError("min_p", f"must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def with_top_k_cap(self, cap: int) -> SamplingParams:
        """The same settings with top-k no larger than ``cap`` (a drafter's own truncation)."""
        if cap <= 0:
            return self
        return replace(self, top_k=cap if self.top_k == 0 else min(self.top_k, cap))


@dataclass(frozen=True)
class TopLogprobs:
    """The most probable tokens of one distribution row and their log-probabilities, most probable first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
