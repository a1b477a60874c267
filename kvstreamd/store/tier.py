"""One tier of the store (memory or disk): chunks in LRU order with their payload bytes, a budget,
and eviction that skips pinned chunks.
"""
from __future__ import annotations

import collections
from typing import Callable, Iterator, Mapping

from kvstreamd.store.chunkfile import ChunkRecord


class Tier:
    """One tier's chunks, least recently used first, with their payload bytes and a budget. The
    memory tier keeps each chunk's record, the disk tier None (its file is the chunk). Not
    thread-safe: the store calls it under its lock."""

    def __init__(self, name: str, budget: int, on_evict: Callable[[bytes], None] | None = None) -> None:
        self.name = name
        self.budget = budget
        self.bytes = 0  # sum of the chunks' sizes
        self._on_evict = on_evict  # called with each key evict() drops
        self._items: collections.OrderedDict[bytes, tuple[ChunkRecord | None, int]] = collections.OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[bytes]:
        """Keys, least recently used first."""
        return iter(self._items)

    def get(self, key: bytes) -> ChunkRecord | None:
        """The record kept for key (None when absent or when the tier keeps none); no LRU bump."""
        item = self._items.get(key)
        return item[0] if item is not None else None

    def size(self, key: bytes) -> int:
        return self._items[key][1]

    def add(self, key: bytes, nbytes: int, record: ChunkRecord | None = None) -> None:
        """Add a chunk as the most recently used (the caller evicts afterwards)."""
        if key in self._items:
            raise KeyError(f"chunk {key.hex()[:16]} is already in the {self.name} tier")
        self._items[key] = (record, nbytes)
        self.bytes += nbytes

    def pop(self, key: bytes) -> bool:
        """Drop a chunk without calling on_evict; False when it was not here."""
        item = self._items.pop(key, None)
        if item is None:
            return False
        self.bytes -= item[1]
        return True

    def touch(self, key: bytes) -> None:
        """Make a chunk here the most recently used."""
        self._items.move_to_end(key)

    def evict(self, pins: Mapping[bytes, int], protect: bytes | None = None) -> list[bytes]:
        """Drop least recently used chunks, skipping pinned ones and `protect`, until the tier is
        within its budget or only those are left; on_evict runs for each. Returns the keys dropped."""
        dropped: list[bytes] = []
        if self.bytes <= self.budget:
            return dropped
        for k in list(self._items):
            if self.bytes <= self.budget:
                break
            if k == protect or pins.get(k):
                continue
            self.bytes -= self._items.pop(k)[1]
            dropped.append(k)
            if self._on_evict is not None:
                self._on_evict(k)
        return dropped
