"""A speculation controller for tests: draft lengths and pipelining from fixed cycles, so ``auto`` changes γ every
round and mixes pipelined and sequential rounds."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from specdec.adaptive import AcceptanceTracker, Candidate, SpeculationController


class CyclingController(SpeculationController):
    """Chooses each length from ``lengths`` in turn (0: a plain target step), capped by the candidate's own limit,
    and whether a drafted round pre-drafts the next from ``pipelining`` in turn, instead of from measurements; it
    still learns from what it is told, like the real one."""

    def __init__(
        self, lengths: Sequence[int] = (0, 3, 1, 4, 2), pipelining: Sequence[bool] = (True, True, False)
    ) -> None:
        super().__init__(max(lengths))
        self._cycle = itertools.cycle(lengths)
        self._pipelining = itertools.cycle(pipelining)

    def pipelining_pays(self, tracker: AcceptanceTracker, depth: int, positions: int, **load: float) -> bool:
        return next(self._pipelining)

    def choose(self, candidates: Sequence[Candidate], **load: float) -> list[int]:
        return [min(next(self._cycle), candidate.max_length) for candidate in candidates]
