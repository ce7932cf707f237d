"""A speculation controller for tests: draft lengths from a fixed cycle, so ``auto`` changes γ every round."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from specdec.adaptive import Candidate, SpeculationController


class CyclingController(SpeculationController):
    """Chooses each length from ``lengths`` in turn (0: a plain target step), capped by the candidate's own limit,
    instead of from measurements; it still learns from what it is told, like the real one."""

    def __init__(self, lengths: Sequence[int] = (0, 3, 1, 4, 2)) -> None:
        super().__init__(max(lengths))
        self._cycle = itertools.cycle(lengths)

    def choose(self, candidates: Sequence[Candidate], **load: float) -> list[int]:
        return [min(next(self._cycle), candidate.max_length) for candidate in candidates]
