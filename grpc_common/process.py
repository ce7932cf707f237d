"""The process-wide settings a service applies around its start, in one place for every way it is run.

Why: ``python -m verifier_service`` (and the drafter's and the router's) and the Ray actor of ``specdec up`` /
KubeRay (:mod:`launcher.actors`) start the same services; when these settings lived in the ``__main__`` modules, the
actor path started services without them (no frozen collector, no thread count, glibc's own mmap threshold).

oneDNN's per-shape caches are bounded here too. On a CPU the verifier's layers (and a float32 draft's) are prepacked
oneDNN multiplies (:class:`specdec.linear.PackedLinear`) whose row count is a forward's positions, different from
batch to batch; oneDNN keeps a compiled primitive per shape (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and torch's ideep
layer its own object per shape (``LRU_CACHE_CAPACITY``), 1 024 each by default, together ~0.6 MiB a shape whatever
its size: an eagle stack's verifier grew 350 MiB in a 30-minute soak (``bench/results/memory-eagle-soak/``). At 64
entries each one process holds at most ~50 MiB of them. What that costs: in a trace of the verifier's multiplies under
that soak's load and a 4-stream closed loop (252 574 calls, 378 shapes, mostly 1-12 rows), an LRU of 64 entries
missed 0.38 % of the calls against 0.13 % (the first sight of each shape) at 1 024, and a miss (building the
primitive) costs 0.3-0.9 ms against a call's 0.2-10 ms: well under 1 % of forward time. An operator's own values of
those variables win.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from grpc_common.memory import fix_glibc_mmap_threshold
from specdec import gc_policy

ServiceT = TypeVar("ServiceT")

ONEDNN_SHAPE_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
ONEDNN_SHAPE_CACHE_ENTRIES = 64


def prepare(*, torch_threads: int = 0, mmap_threshold_mb: int = 0) -> None:
    """Before the service builds anything: fail on a bad ``SPECDEC_GC``, bound oneDNN's per-shape caches (read when
    its first primitive is made), fix glibc's mmap threshold (0: glibc's own) and torch's intra-op threads (0: torch's
    default)."""
    gc_policy.choice_from()
    for variable in ONEDNN_SHAPE_CACHES:
        os.environ.setdefault(variable, str(ONEDNN_SHAPE_CACHE_ENTRIES))
    if mmap_threshold_mb:  # process-wide, before the model's allocations
        fix_glibc_mmap_threshold(mmap_threshold_mb << 20)
    if torch_threads:
        import torch  # only the model services have it to set: the router does not load it for this

        torch.set_num_threads(torch_threads)


def start_serving_process(
    start: Callable[[], ServiceT],
    *,
    torch_threads: int = 0,
    mmap_threshold_mb: int = 0,
    gc_thresholds: tuple[int, int, int] | None = gc_policy.SERVER_THRESHOLDS,
) -> ServiceT:
    """:func:`prepare`, then ``start()``, then :func:`specdec.gc_policy.settle` with ``gc_thresholds`` (None:
    CPython's, as the model services keep them) over what it built; returns what ``start`` returned."""
    prepare(torch_threads=torch_threads, mmap_threshold_mb=mmap_threshold_mb)
    service = start()
    gc_policy.settle(thresholds=gc_thresholds)
    return service
