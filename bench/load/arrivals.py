"""Open-loop arrival schedules: when each request is sent, independent of when earlier ones finish.

Gaps between arrivals are gamma distributed with shape ``burstiness`` and scale ``1 / (rate · burstiness)``, as in
``vllm bench serve``: the mean gap is always ``1 / rate``; burstiness 1 is a Poisson process (exponential gaps,
coefficient of variation 1), below 1 burstier, above 1 smoother (CV = 1/√burstiness). ``constant`` sends at
exact ``1 / rate`` intervals. The first request goes at offset 0. An infinite rate sends everything at once.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

ArrivalProcess = Literal["poisson", "constant", "gamma"]
ARRIVAL_PROCESSES: tuple[str, ...] = ("poisson", "constant", "gamma")
_BLOCK = 4096  # gaps drawn at a time while filling a duration


def _gaps(rng: np.random.Generator, size: int, rate_qps: float, process: str, burstiness: float) -> np.ndarray:
    if process == "constant":
        return np.full(size, 1.0 / rate_qps)
    shape = 1.0 if process == "poisson" else burstiness
    return rng.gamma(shape, 1.0 / (rate_qps * shape), size)


def arrival_offsets(
    rate_qps: float,
    *,
    count: int | None = None,
    duration_s: float | None = None,
    process: ArrivalProcess = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Sorted send offsets in seconds: ``count`` of them, or all before ``duration_s``, whichever ends first."""
    if count is None and duration_s is None:
        raise ValueError("an arrival schedule needs a count or a duration")
    if not rate_qps > 0:
        raise ValueError(f"rate must be > 0, got {rate_qps}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if process not in ARRIVAL_PROCESSES:
        raise ValueError(f"arrival process must be one of {', '.join(ARRIVAL_PROCESSES)}, got {process!r}")
    if math.isinf(rate_qps):
        if count is None:
            raise ValueError("an infinite rate needs a count")
        return [0.0] * count
    rng = np.random.default_rng(seed)
    limit = math.inf if duration_s is None else duration_s
    offsets: list[float] = []
    last = 0.0
    while count is None or len(offsets) < count:
        size = _BLOCK if count is None else count - len(offsets)
        # offset i is the sum of the first i gaps: the first request goes at 0
        block = last + np.concatenate(([0.0], np.cumsum(_gaps(rng, size, rate_qps, process, burstiness))))
        last = float(block[-1])
        block = block[:-1]
        offsets.extend(float(t) for t in block[block < limit])
        if last >= limit:
            break
    return offsets[:count]
