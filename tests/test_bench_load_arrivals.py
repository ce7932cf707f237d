"""Open-loop arrival schedules (bench/load/arrivals.py): rate, gap dispersion, bounds, determinism."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from bench.load.arrivals import arrival_offsets

N = 20_000


def gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(offsets)]


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_poisson_rate_within_four_sigma(seed: int) -> None:
    # The last offset is a sum of N-1 exponential gaps of mean 1/λ: mean (N-1)/λ, standard deviation √(N-1)/λ.
    rate = 5.0
    offsets = arrival_offsets(rate, count=N, seed=seed)
    assert len(offsets) == N and offsets[0] == 0.0 and offsets == sorted(offsets)
    expected, sigma = (N - 1) / rate, math.sqrt(N - 1) / rate
    assert abs(offsets[-1] - expected) <= 4 * sigma  # |T − 3999.8| ≤ 113.1 s


@pytest.mark.parametrize(
    ("process", "burstiness", "expected_cv", "tolerance"),
    [
        ("poisson", 1.0, 1.0, 0.05),
        ("gamma", 4.0, 0.5, 0.03),  # CV = 1/√burstiness
        ("gamma", 0.25, 2.0, 0.15),  # heavy tail: the sample CV scatters more
        ("constant", 1.0, 0.0, 1e-9),
    ],
)
def test_gap_dispersion(process: str, burstiness: float, expected_cv: float, tolerance: float) -> None:
    rate = 2.0
    observed = gaps(arrival_offsets(rate, count=N, process=process, burstiness=burstiness, seed=7))
    assert abs(statistics.fmean(observed) - 1 / rate) < 0.05 / rate * max(1.0, expected_cv)
    assert abs(cv(observed) - expected_cv) <= tolerance


def test_constant_gaps_are_exact() -> None:
    assert arrival_offsets(4.0, count=5, process="constant") == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_duration_bounds_the_schedule() -> None:
    offsets = arrival_offsets(10.0, duration_s=30.0, seed=3)
    assert offsets and max(offsets) < 30.0
    assert abs(len(offsets) - 300) <= 4 * math.sqrt(300)  # Poisson count: mean λT = 300, sd √300
    assert arrival_offsets(10.0, duration_s=30.0, count=50, seed=3) == offsets[:50]  # whichever ends first
    assert arrival_offsets(1.0, duration_s=0.5, process="constant") == [0.0]


def test_seeded_and_infinite_rate() -> None:
    assert arrival_offsets(3.0, count=100, seed=9) == arrival_offsets(3.0, count=100, seed=9)
    assert arrival_offsets(3.0, count=100, seed=9) != arrival_offsets(3.0, count=100, seed=10)
    assert arrival_offsets(math.inf, count=3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_offsets(math.inf, duration_s=1.0)
    with pytest.raises(ValueError):
        arrival_offsets(1.0)
    with pytest.raises(ValueError):
        arrival_offsets(0.0, count=1)
