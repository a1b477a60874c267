"""What the chunk store answers with (kvstreamd.store.store.Store): where a put left a chunk
(`Stored`), what `open` found (`OpenReport`), a context, a chunk without its payloads, the
store's usage, a disk fault, and `StoreError`. Plain values; the Store that makes them is in
store.py."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


class StoreError(Exception):
    """A chunk the store cannot take (over both budgets, or disk-only and the write failed), or a
    store that is not open. `os_error`: the failed write's error, when that is why."""

    def __init__(self, message: str, os_error: OSError | None = None) -> None:
        super().__init__(message)
        self.os_error = os_error


@dataclass(frozen=True)
class Stored:
    """Where a put left a new chunk."""
    on_disk: bool  # its file is written: it survives a restart
    disk_error: OSError | None  # why its file could not be written (it is in memory only), else None


@dataclass(frozen=True)
class DiskFault:
    reason: str  # "disk_full" or "disk_error"
    message: str


@dataclass(frozen=True)
class OpenReport:
    loaded: int  # chunk files indexed
    corrupt: list[tuple[Path, str]]  # (path as found, reason) for every file skipped
    bytes: int  # payload bytes indexed (what the disk budget counts)


@dataclass(frozen=True)
class ContextInfo:
    key: bytes  # the leaf chunk's key
    model_id: str
    tokens: int  # total tokens along the chain: leaf.start + len(leaf.tokens)
    chunks: int  # chunks held along the chain
    complete: bool  # the whole chain is held back to chunk 0
    created: float  # newest `created` along the chain
    nbytes: int  # payload bytes along the chain


@dataclass(frozen=True)
class Usage:
    chunks: int
    memory_bytes: int
    memory_budget: int
    disk_bytes: int
    disk_budget: int
    memory_chunks: int
    disk_chunks: int
    pinned: int  # chunks with at least one pin
    evictions: int  # chunk evictions from either tier since start (one per tier)
    disk_errors: int  # failed chunk writes + bad or unreadable chunk files found by get
    pinned_bytes: int  # payload bytes of the chunks lasting pins hold (pin_context)
    pin_budget: int  # the most pinned_bytes may be ([store] pin_budget)


@dataclass(frozen=True)
class ChunkInfo:
    """What a held chunk is, without its payloads: what a sender plans a FETCH with (pin_info)."""
    key: bytes
    start: int
    model_id: str
    tokens: tuple[int, ...]
    shape: tuple[int, ...]
    levels: Mapping[str, int]  # level name -> payload bytes
