"""Memory for fetched shards, reused from one version to the next.

The kernel hands a process fresh memory a page at a time, faulting on the first write to
each 4 KiB and zeroing it; for a receiver taking shards off the network that was about
half of its CPU per GB fetched (16-core host: allocating and filling 8 MiB buffers ran at
2.65 GB/s, memcpy at 9). A receiver applies versions one after another, so the buffers of
the version it applied last are free when the next one is fetched, and take it without
a fault. At most the last applied version's bytes are kept: a receiver holds two steps'
shards at its peak anyway, so the peak does not grow, and a snapshot's worth is not held
on while only small deltas follow.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ShardBuffers:
    """Buffers for a receiver's shards. Not thread safe: used from its event loop."""

    def __init__(self) -> None:
        self._spare: list[np.ndarray] = []

    @property
    def kept(self) -> int:
        """Bytes held for later versions."""
        return sum(buffer.size for buffer in self._spare)

    def take(self, size: int) -> memoryview:
        """`size` bytes to fill: the smallest kept buffer large enough, or new memory.
        Their contents are whatever was there."""
        for i, buffer in enumerate(self._spare):  # smallest first
            if buffer.size >= size:
                del self._spare[i]
                return memoryview(buffer)[:size]
        return memoryview(np.empty(size, np.uint8))

    def give(self, shards: Iterable[memoryview]) -> None:
        """The shards of a version just applied, nothing reading them any more: kept for
        the next, with what was kept before, up to their bytes (the largest first)."""
        given = [s.obj for s in shards if isinstance(s.obj, np.ndarray)]
        limit = sum(buffer.size for buffer in given)
        kept, held = [], 0
        for buffer in sorted(self._spare + given, key=lambda b: b.size, reverse=True):
            if held + buffer.size <= limit:
                kept.append(buffer)
                held += buffer.size
        self._spare = kept[::-1]
