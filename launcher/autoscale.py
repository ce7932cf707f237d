"""How many verifiers and drafters the supervisor keeps placed, from the router's and the drafters' metrics.

The supervisor decides actor counts; on a cluster an actor it adds waits for its custom resource (or its
placement group), which is exactly what KubeRay's in-tree Ray autoscaler reacts to: it adds a pod of that
worker group (within the group's ``maxReplicas``), and removes a pod left idle after the supervisor retired its
actor. Pods therefore never exist without a service on them, and one loop sees both queues.

* **Verifiers** carry requests: ``ceil((running + waiting) / requests_per_verifier)``, from the router's
  ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``.
* **Drafters** carry draft work: ``ceil(busy / drafter_utilisation)``, where ``busy`` is the drafters' summed
  busy fraction over the last interval (the rate of ``specdec:drafter_propose_seconds_sum``, seconds of batched
  drafting per second).

Both are clamped to ``[minimum, maximum]``. A larger count applies at once; a smaller one only after it has been
wanted for ``scale_down_delay_s`` without a break (a burst's tail does not retire a worker it will need again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """What the metrics said over the last interval."""

    running: float  # router: requests generating
    waiting: float  # router: requests queued for a slot
    drafter_busy: float  # drafters: summed busy fraction (1.0 = one drafter drafting all the time)


@dataclass(frozen=True)
class Bounds:
    minimum: int
    maximum: int

    def clamp(self, count: int) -> int:
        return max(self.minimum, min(self.maximum, count))


def wanted(
    load: Load, verifiers: Bounds, drafters: Bounds, *, per_verifier: float, utilisation: float
) -> tuple[int, int]:
    """Verifier and drafter counts for ``load`` before hysteresis.

    >>> wanted(Load(40, 30, 1.5), Bounds(1, 4), Bounds(2, 8), per_verifier=32, utilisation=0.7)
    (3, 3)
    """
    return (
        verifiers.clamp(math.ceil((load.running + load.waiting) / per_verifier)),
        drafters.clamp(math.ceil(load.drafter_busy / utilisation)),
    )


class Hysteresis:
    """Up at once, down only after ``delay_s`` of wanting less (per count it governs)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._lower_since: float | None = None

    def decide(self, current: int, target: int, now: float) -> int:
        if target >= current:
            self._lower_since = None
            return target
        if self._lower_since is None:
            self._lower_since = now
        return target if now - self._lower_since >= self.delay_s else current
