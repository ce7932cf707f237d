"""When a worker's next forward should wait for the sequences it expects back: :class:`ArrivalWait`.

A forward costs about the same for one sequence as for many (a GPU reads the weights once per forward), so a call
that arrives just after a forward has started waits for that whole forward and then runs in the next: its round
takes two forwards. Under pipelining that is the common case. The streams whose pre-draft the verdict selected send
their next Verify at once; the others first draft (1-3 ms) and arrive that much later, after the early ones have
started a forward without them. The streams then settle into two cohorts that alternate, every round two forwards
long. A fixed window (``batch_wait_s``) closes the gap but also delays every pass that has nothing to wait for.

:class:`ArrivalWait` learns instead when each sequence comes back. Per sequence, it keeps an exponential average of
the time from the end of the forward that served it to the arrival of its next batched call. It also keeps the
average duration ``F`` of a forward, and fits a forward's cost as a fixed part plus a part per call. Forwards that
also prefill carried prompts (chunked prefill) are left out of both.

When a pass has its first batched call, the worker waits for the *expected* sequences: open, served before, not yet
arrived, and due within ``fraction · F`` of now (or overdue by less than ``F``). The pass starts as soon as they have
all arrived, or when the wait stops paying. With ``a`` sequences already in the pass and ``m`` expected, waiting
``w`` delays each of the ``a`` by ``w``. It spares each of the ``m`` the forward it would have waited out, less what
its joining adds to that forward. So the wait is capped at ``(fixed − per_call · a) · m / (a + m)``: on a flat
forward (a GPU) that is ``F · m / (a + m)``, and on a forward whose cost grows with its calls it shrinks or goes. A
pass with nothing expected, such as a lone stream or a tick whose calls came together, starts at once, as before.

Nothing here is threaded or knows gRPC. The real scheduler (:mod:`grpc_common.scheduler`) and the simulated device
(:mod:`bench.load.simulated.device`) each keep one instance, used from their one loop. ``python -m
bench.verifier_window`` measures it against fixed windows.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Set

DEFAULT_FRACTION = 1.0  # of a forward: the longest a pass waits for the sequences it expects back
DECAY = 0.25  # weight of the newest sample in the averages of a forward and of each sequence's gap
COST_DECAY = 0.05  # ... and in the moments the forward's cost line is fitted from (a longer memory)


class ArrivalWait:
    """Predicts each sequence's next arrival and says how long a pass should wait for them (0 ``fraction``: never)."""

    def __init__(self, fraction: float = DEFAULT_FRACTION) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        self.fraction = fraction
        self.forward_s: float | None = None  # average duration of a forward
        self.timed_forwards = 0  # forwards the averages have seen
        self._moments: list[float] | None = None  # averages of n, d, n², n·d over forwards (n calls, d seconds)
        self._served: dict[str, float] = {}  # sequence -> when the forward that served it ended (until it is back)
        self._gap: dict[str, float] = {}  # sequence -> average time from being served to its next arrival

    @property
    def tracked(self) -> int:
        """Sequences whose habits are kept (open ones only: the others are forgotten as passes go by)."""
        return len(self._served.keys() | self._gap.keys())

    def arrived(self, sequence_id: str, at: float) -> None:
        """A batched call of ``sequence_id`` arrived at ``at`` (a monotonic time)."""
        if not self.fraction:
            return
        served = self._served.pop(sequence_id, None)
        if served is None:
            return
        gap = max(at - served, 0.0)
        previous = self._gap.get(sequence_id)
        self._gap[sequence_id] = gap if previous is None else previous + DECAY * (gap - previous)

    def served(self, sequence_ids: Iterable[str], at: float) -> None:
        """A forward that ended at ``at`` answered ``sequence_ids``."""
        if self.fraction:  # off, nothing is waited for, and so nothing is kept that would have to be forgotten
            for sequence_id in sequence_ids:
                self._served[sequence_id] = at

    def timed(self, calls: int, seconds: float) -> None:
        """A forward of ``calls`` batched calls took ``seconds`` (a sample of the cost line)."""
        self.timed_forwards += 1
        self.forward_s = seconds if self.forward_s is None else self.forward_s + DECAY * (seconds - self.forward_s)
        sample = [calls, seconds, calls * calls, calls * seconds]
        if self._moments is None:
            self._moments = sample
        else:
            self._moments = [old + COST_DECAY * (new - old) for old, new in zip(self._moments, sample, strict=True)]

    def cost_line(self) -> tuple[float, float]:
        """(fixed, per call) seconds of a forward, fitted to the recent forwards; a batch size that has not varied
        tells nothing of the slope, which is then taken as 0 (the whole cost fixed, as on a GPU)."""
        if self._moments is None:
            return 0.0, 0.0
        calls, duration, calls_squared, product = self._moments
        variance = calls_squared - calls * calls
        slope = max((product - calls * duration) / variance, 0.0) if variance > 0.25 else 0.0
        return max(duration - slope * calls, 0.0), slope

    def until(self, present: Collection[str], open_ids: Collection[str], now: float) -> float:
        """When a pass holding calls of ``present`` should start: ``now`` unless other open sequences are expected
        soon enough that waiting for them pays, else the latest such wait. Forgets sequences no longer open."""
        if not self.fraction or not self.forward_s or not present:
            return now
        if not isinstance(open_ids, Set):  # the verifier lists its sequences: test membership in a set, not a list
            open_ids = set(open_ids)
        forward = self.forward_s
        horizon = now + self.fraction * forward
        due: list[float] = []
        for sequence_id in list(self._served):
            if sequence_id not in open_ids:
                del self._served[sequence_id]
                self._gap.pop(sequence_id, None)
                continue
            gap = self._gap.get(sequence_id)
            if gap is None or sequence_id in present:
                continue
            arrival = self._served[sequence_id] + gap
            if now - forward <= arrival <= horizon:
                due.append(max(arrival, now))
        if len(self._gap) > 2 * len(open_ids) + 64:  # sequences that left without being served again
            self._gap = {sequence_id: gap for sequence_id, gap in self._gap.items() if sequence_id in open_ids}
        # wait for the k soonest if the k-th is due within the wait that k pays for; the largest such k wins
        fixed, per_call = self.cost_line()
        spared = fixed - per_call * len(present)  # what a straggler saves by joining, less what it costs the others
        until = now
        for count, arrival in enumerate(sorted(due), start=1):
            pays = now + spared * count / (len(present) + count)
            if arrival <= pays:
                until = min(pays, horizon)
        return until
