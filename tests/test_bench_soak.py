"""The soak's memory sampling and verdicts (no services: this process is the one watched)."""

import os
import time

from bench.soak import MemorySampler, MemoryVerdict, memory_verdicts

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
    assert verdict == MemoryVerdict("router", start=100.0, baseline=160.0, end=165.0, peak=165.0)
    assert verdict.growth == 5.0
