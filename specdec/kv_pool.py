"""K and V of a :class:`~specdec.runner.KVRunner`'s open sequences, held so that a forward over many sequences
attends in one batched kernel call per layer instead of one per sequence.

A :class:`KVPool` is one K and one V tensor ``[layers, slots, kv_heads, capacity, head_dim]``: a sequence owns one
slot (its index on dim 1), and every slot has the pool's ``capacity``. The lowest free slot is handed out first, so
the sequences of a running batch sit close together and a forward reads them as one view
(:meth:`KVPool.batch_view`) rather than a gathered copy. Slots grow by doubling (one copy of the pool).

:class:`KVPools` keeps one pool per **capacity class** (powers of two from 16): a sequence lives in the class its
length needs and moves up, copying its committed KV, when it outgrows it, as a buffer of its own would double.
Memory then follows each sequence's own length, not the longest one's times the number of sequences (one
4 000-token request beside 64 chat turns of 300 would otherwise make 64 slots of 4 096), and a forward makes one
attention call per class among its sequences. A class whose last sequence closes is freed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

_SMALLEST_CLASS = 16


class KVPool:
    """Slots of ``capacity`` positions of K/V for ``layers`` decoder layers of ``kv_heads`` heads of ``head_dim``."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, capacity: int, *, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.capacity = capacity
        self.keys = torch.empty(layers, 0, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.values = torch.empty_like(self.keys)
        self._free: list[int] = []  # a heap of free slot indices

    @property
    def slots(self) -> int:
        return self.keys.shape[1]

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    def acquire(self) -> int:
        """A free slot (the lowest), doubling the slots when none is left."""
        if not self._free:
            old = self.slots
            shape = (self.keys.shape[0], max(4, 2 * old), *self.keys.shape[2:])
            for name in ("keys", "values"):
                grown = getattr(self, name).new_zeros(shape)  # padded attention reads unwritten positions: no NaN bits
                grown[:, :old] = getattr(self, name)
                setattr(self, name, grown)
            self._free = list(range(old, self.slots))
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def batch_view(self, slots: list[int]) -> tuple[int, torch.Tensor | None]:
        """How a forward over ``slots`` reads the pool: ``(first, None)`` when it reads the contiguous run of slots
        ``first .. max(slots)`` as a view (at most twice as many slots as it needs, the spare ones masked out),
        else ``(0, index)``: the slots to gather, in order."""
        first, last = min(slots), max(slots)
        if last - first + 1 <= 2 * len(slots):
            return first, None
        return 0, torch.tensor(sorted(slots), device=self.keys.device)


@dataclass
class KVSlot:
    """Where one sequence's K/V lives: slot ``index`` of ``pool``."""

    pool: KVPool
    index: int


class KVPools:
    """One :class:`KVPool` per capacity class, created on first use and freed when empty."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, device: torch.device, dtype: torch.dtype) -> None:
        self._shape = (layers, kv_heads, head_dim)
        self._tensors = {"device": device, "dtype": dtype}
        self._pools: dict[int, KVPool] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of K/V held, free slots included."""
        return sum(pool.keys.nbytes + pool.values.nbytes for pool in self._pools.values())

    def reserve(self, slot: KVSlot | None, size: int, *, keep: int, limit: int) -> KVSlot:
        """A slot of at least ``size`` positions (``limit`` >= ``size`` caps its class): ``slot`` itself when it is
        big enough, else a slot of the class ``size`` needs, holding ``slot``'s first ``keep`` positions."""
        if slot is not None and slot.pool.capacity >= size:
            return slot
        capacity = min(limit, max(_SMALLEST_CLASS, 1 << (size - 1).bit_length()))
        pool = self._pools.get(capacity)
        if pool is None:
            pool = self._pools[capacity] = KVPool(*self._shape, capacity, **self._tensors)
        moved = KVSlot(pool, pool.acquire())
        if slot is not None:
            for new, old in ((pool.keys, slot.pool.keys), (pool.values, slot.pool.values)):
                new[:, moved.index, :, :keep] = old[:, slot.index, :, :keep]
            self.release(slot)
        return moved

    def release(self, slot: KVSlot) -> None:
        slot.pool.release(slot.index)
        if not slot.pool.in_use:
            del self._pools[slot.pool.capacity]
