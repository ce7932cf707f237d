"""The process-wide settings a service applies around its start, in one place for every way it is run.

Why: ``python -m verifier_service`` (and the drafter's and the router's) and the Ray actor of ``specdec up`` /
KubeRay (:mod:`launcher.actors`) start the same services; when these settings lived in the ``__main__`` modules, the
actor path started services without them (no frozen collector, no thread count, glibc's own mmap threshold).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from grpc_common.memory import fix_glibc_mmap_threshold
from specdec import gc_policy

ServiceT = TypeVar("ServiceT")


def prepare(*, torch_threads: int = 0, mmap_threshold_mb: int = 0) -> None:
    """Before the service builds anything: fail on a bad ``SPECDEC_GC``, fix glibc's mmap threshold (0: glibc's own)
    and torch's intra-op threads (0: torch's default)."""
    gc_policy.choice_from()
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
