"""Handing freed heap memory back to the OS when a service's scheduler goes idle (glibc ``malloc_trim``).

Why: a model service's forwards allocate many activation, mask and KV tensors of ever-changing sizes (chunked
prefill, KV buffers that double, prompts from 10 to 2.8k tokens). glibc raises its mmap threshold each time a large
mmapped block is freed (up to 32 MiB), so later blocks of that size come from the heap arenas, and after a burst of
long prompts the arenas keep their freed pages: the verifier's idle RSS climbed 100-160 MiB over 200 requests in
``python -m bench.verifier_memory`` while its live tensors and Python objects stayed constant (no leak). A fixed
mmap threshold (``MALLOC_MMAP_THRESHOLD_=131072``) keeps RSS flat too, but every large tensor then costs an mmap,
page faults and munmap: the same forwards took 25% longer. ``malloc_trim(0)`` returns every arena's free pages in a
few milliseconds, so it runs once the scheduler has had no job for a while (never between the rounds of a busy
sequence, whose next call arrives within milliseconds) and costs a call arriving meanwhile at most that long.

Trimming returns free pages only. Once a long prompt has raised glibc's threshold, blocks of 16-32 MiB (attention
scores of a prefill chunk over a long context) come from the heap arenas too, and the live allocations placed around
them after that keep about 30-40 MiB of pages pinned: the trimmed idle RSS stepped up at the first long prompt of
the soak and stayed there. A threshold fixed at 16 MiB keeps those blocks mmapped (returned on free) and flattened
that step in ``bench.verifier_memory``-style runs, at about 3% of forward time (a 128 KiB threshold cost 25%).
"""

from __future__ import annotations

import ctypes
import platform
import queue
from collections.abc import Callable
from typing import Any


def _glibc(name: str, argtypes: list[type]) -> Any:
    """The C library's function ``name`` where that library is glibc, else None (macOS, musl, Windows)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    function = getattr(ctypes.CDLL(None), name, None)
    if function is not None:
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def glibc_malloc_trim() -> Callable[[], object] | None:
    """``malloc_trim(0)`` of glibc as a callable; None where the C library is not glibc."""
    trim = _glibc("malloc_trim", [ctypes.c_size_t])
    return None if trim is None else lambda: trim(0)


M_MMAP_THRESHOLD = -3  # mallopt parameter number, glibc's <malloc.h>


def fix_glibc_mmap_threshold(size_bytes: int) -> bool:
    """Fix glibc's mmap threshold at ``size_bytes`` for this process (no dynamic raise); False where not glibc."""
    mallopt = _glibc("mallopt", [ctypes.c_int, ctypes.c_int])
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, size_bytes) == 1


class IdleTrim:
    """Blocking ``get`` on a scheduler's job queue that calls ``trim`` once each time the queue has stayed empty for
    ``idle_s`` seconds after some job (nothing ran since the last trim: no call). ``idle_s`` 0 or ``trim`` None: a
    plain ``get``."""

    def __init__(self, idle_s: float, trim: Callable[[], object] | None) -> None:
        self.idle_s = idle_s
        self.trim = trim if idle_s > 0 else None
        self._worked = False  # a job was taken since the last trim

    def get(self, jobs: queue.SimpleQueue) -> Any:
        """The next job of ``jobs``, waiting as long as it takes."""
        if self.trim is not None and self._worked:
            try:
                return jobs.get(timeout=self.idle_s)
            except queue.Empty:
                self.trim()
                self._worked = False
        job = jobs.get()
        self._worked = True
        return job
