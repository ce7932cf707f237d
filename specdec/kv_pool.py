"""One K and one V tensor for every open sequence of a :class:`~specdec.runner.KVRunner`, so that a forward over
many sequences attends in one batched kernel call per layer instead of one per sequence.

``keys`` and ``values`` are ``[layers, slots, kv_heads, capacity, head_dim]``: a sequence owns one slot (its index
on dim 1) from open to close, and ``capacity`` is shared. The lowest free slot is handed out first, so the
sequences of a running batch sit close together and a forward reads them as one view (:meth:`KVPool.batch_view`)
rather than a gathered copy. Growing either dimension doubles it and copies the pool once; the pool never
shrinks (a server's working set returns), so its size is ``slots x capacity`` positions, set by the most
sequences open at once and the longest of them.
"""

from __future__ import annotations

import heapq

import torch


class KVPool:
    """Slots of K/V for ``layers`` decoder layers of ``kv_heads`` heads of width ``head_dim``."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, device: torch.device, dtype: torch.dtype) -> None:
        self.keys = torch.empty(layers, 0, kv_heads, 0, head_dim, device=device, dtype=dtype)
        self.values = torch.empty_like(self.keys)
        self._free: list[int] = []  # a heap of free slot indices below ``slots``

    @property
    def slots(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def acquire(self) -> int:
        """A free slot (the lowest), growing the pool when none is left."""
        if not self._free:
            old = self.slots
            self._resize(max(4, 2 * old), self.capacity)
            self._free = list(range(old, self.slots))
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def reserve(self, size: int, *, limit: int) -> None:
        """Make every slot hold at least ``size`` positions (doubling, but not past ``limit`` >= ``size``)."""
        if size > self.capacity:
            self._resize(self.slots, min(limit, max(size, 2 * self.capacity, 16)))

    def batch_view(self, slots: list[int]) -> tuple[int, torch.Tensor | None]:
        """How a forward over ``slots`` reads the pool: ``(first, None)`` when it reads the contiguous run of slots
        ``first .. max(slots)`` as a view (at most twice as many slots as it needs, the spare ones masked out),
        else ``(0, index)``: the slots to gather, in order."""
        first, last = min(slots), max(slots)
        if last - first + 1 <= 2 * len(slots):
            return first, None
        return 0, torch.tensor(sorted(slots), device=self.keys.device)

    def _resize(self, slots: int, capacity: int) -> None:
        shape = (self.keys.shape[0], slots, self.keys.shape[2], capacity, self.keys.shape[4])
        kept_slots, kept = min(slots, self.slots), min(capacity, self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(shape)  # padded attention reads unwritten positions: NaN bits there would leak
            new[:, :kept_slots, :, :kept] = old[:, :kept_slots, :, :kept]
            setattr(self, name, new)
