"""The soak's memory sampling and verdicts (no services: this process is the one watched)."""

import os
import time

import pytest

from bench.soak import MemorySampler, MemoryVerdict, fitted_rise, floor_rise, memory_verdicts

MIB = 1024 * 1024


def test_sampler_records_this_process_until_stopped() -> None:
    sampler = MemorySampler({"self": os.getpid()}, interval_s=0.01)
    sampler.start()
    deadline = time.monotonic() + 10.0
    while len(sampler.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    samples = sampler.stop()
    assert len(samples) >= 3 and not sampler.is_alive()
    assert all(sample["rss"]["self"] > MIB for sample in samples)
    assert [s["t"] for s in samples] == sorted(s["t"] for s in samples)


def test_verdicts_take_the_baseline_after_settling() -> None:
    samples = [
        {"t": 0.0, "rss": {"router": 100 * MIB}},
        {"t": 30.0, "rss": {"router": 150 * MIB}},
        {"t": 60.0, "rss": {"router": 160 * MIB}},
        {"t": 600.0, "rss": {"router": 165 * MIB}},
    ]
    (verdict,) = memory_verdicts(samples, settle_s=60.0)
    assert verdict == MemoryVerdict(
        "router", start=100.0, baseline=160.0, end=165.0, peak=165.0, trend=5.0, floor_rise=5.0
    )
    assert verdict.growth == 5.0


def test_the_floor_ignores_swings_and_plateaus_but_not_a_steady_rise() -> None:
    swinging = [(float(t), 1000.0 + (300.0 if t % 20 == 0 else 0.0)) for t in range(60, 601, 10)]
    assert abs(fitted_rise(swinging)) < 10.0 and floor_rise(swinging) == 0.0  # a 300 MiB swing, no rise
    plateau = [(float(t), 1100.0 if 300 <= t <= 560 else 1000.0) for t in range(60, 601, 10)]  # the soak's shape
    assert fitted_rise(plateau) > 20.0  # a line through a mid-run plateau "rises"
    assert floor_rise(plateau) == 0.0  # the floor does not
    leaking = [(float(t), 1000.0 + 0.1 * t) for t in range(60, 601, 10)]  # 0.1 MiB/s
    assert fitted_rise(leaking) == pytest.approx(54.0)
    assert floor_rise(leaking) == pytest.approx(42.0)  # lowest of the last 2 min (480 s) - lowest of the first (60 s)
    assert fitted_rise([(0.0, 5.0)]) == 0.0 and floor_rise([]) == 0.0
