"""The idle trim of :mod:`grpc_common.memory`: when it calls ``trim`` and what it returns, on a plain queue."""

from __future__ import annotations

import platform
import queue
import subprocess
import sys

import pytest

from grpc_common.memory import IdleTrim, glibc_malloc_trim


def test_trims_once_per_lull_after_work() -> None:
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    trims = []

    def trim() -> None:  # the next job arrives during the trim, so get() returns without a real wait
        trims.append(len(trims))
        jobs.put(f"after trim {len(trims)}")

    idle = IdleTrim(0.01, trim)
    jobs.put("first")
    jobs.put("second")
    assert [idle.get(jobs), idle.get(jobs)] == ["first", "second"]
    assert trims == [], "jobs were waiting: no trim"
    assert idle.get(jobs) == "after trim 1"  # the queue stayed empty for idle_s after work
    assert idle.get(jobs) == "after trim 2"  # the job taken in between counts as work
    assert trims == [0, 1]


def test_disabled_without_idle_time_or_trim() -> None:
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    trims = []
    for idle in (IdleTrim(0, lambda: trims.append(0)), IdleTrim(0.01, None)):
        jobs.put("a")
        jobs.put("b")
        assert [idle.get(jobs), idle.get(jobs)] == ["a", "b"]
        assert idle.trim is None
    assert trims == []


def test_glibc_malloc_trim_is_callable_on_glibc() -> None:
    trim = glibc_malloc_trim()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert trim is not None and trim() in (0, 1)  # 1: some memory was released
    else:
        assert trim is None


def test_mmap_threshold_is_set_on_glibc() -> None:
    on_glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    code = "from grpc_common.memory import fix_glibc_mmap_threshold as f; print(f(16 << 20))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)  # process-wide
    assert done.stdout.strip() == str(on_glibc)


PACKED_SHAPES = """
import torch
from grpc_common.process import prepare
from specdec.linear import PackedLinear, can_pack

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

prepare()
torch.manual_seed(0)
torch.set_num_threads(1)
linear = torch.nn.Linear(64, 64, bias=False)
if not can_pack(linear):
    print("cannot pack")
    raise SystemExit
layer = PackedLinear(linear)
with torch.inference_mode():
    layer(torch.randn(1, 64))
    start = rss_mib()
    for rows in range(2, 302):
        layer(torch.randn(rows, 64))
print(rss_mib() - start)
"""


def test_a_service_process_bounds_onednns_per_shape_caches() -> None:
    """300 row counts through one packed layer: oneDNN's caches keep ~0.6 MiB a shape (~170 MiB here by default, 1 024
    shapes each); a service process keeps 64, ~50 MiB."""
    if platform.system() != "Linux":
        pytest.skip("reads /proc/self/statm")
    done = subprocess.run([sys.executable, "-c", PACKED_SHAPES], capture_output=True, text=True, check=True)
    if done.stdout.strip() == "cannot pack":
        pytest.skip("no oneDNN packed linear in this torch")
    assert float(done.stdout) < 100
