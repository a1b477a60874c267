"""The state the chunk store's one lock guards, and the rules that keep it whole: the index
(each held chunk's meta and its children), the memory and disk tiers, a reader's pins and the
lasting ones, deferred deletes, the counters and the callbacks' queue; eviction from a tier, the
forgetting of a chunk that left both, and the callbacks run outside the lock in order.
`StoreCore` holds it; kvstreamd.store.reads.StoreReads reads chunks and pins them on top of it,
and kvstreamd.store.store.Store (the one to use) writes, deletes and reports (see its module
docstring for the design)."""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from kvstreamd.store import chunkfile
from kvstreamd.store.files import ChunkDir
from kvstreamd.store.chunkfile import ChunkRecord
from kvstreamd.store.pins import Pins
from kvstreamd.store.tier import Tier

log = logging.getLogger(__name__)

PINS_FILE = "pins.json"  # the lasting pins, in the store's dir

Callback = Callable[[list[bytes]], None]


@dataclass(slots=True)
class _Meta:
    parent: bytes | None
    index: int
    start: int
    model_id: str
    ntokens: int
    created: float
    nbytes: int
    levels: frozenset[str]  # the levels it is held at


def _meta_of(rec: ChunkRecord | chunkfile.Header) -> _Meta:
    levels = frozenset(rec.levels if isinstance(rec, ChunkRecord) else (name for name, _ in rec.levels))
    return _Meta(rec.parent, rec.index, rec.start, rec.model_id, len(rec.tokens), rec.created, rec.nbytes, levels)


class StoreCore:
    """The chunk store's state under its one lock, and the helpers that change it (all but
    _run_callbacks need self._lock); kvstreamd.store.store.Store is the whole store."""

    def __init__(self, dir: Path | None, memory_budget: int, disk_budget: int,
                 on_add: Callback | None = None, on_remove: Callback | None = None, pin_budget: int = 0) -> None:
        if memory_budget < 0 or disk_budget < 0:
            raise ValueError("budgets must be >= 0")
        self._dir = Path(dir) if dir is not None else None
        self._files = ChunkDir(self._dir) if self._dir is not None else None
        self._on_add = on_add
        self._on_remove = on_remove
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a put finishes
        self._cb_lock = threading.RLock()  # one callback at a time (re-entrant: callbacks may put)
        self._events: collections.deque[tuple[Callback, list[bytes]]] = collections.deque()
        self._meta: dict[bytes, _Meta] = {}  # every held key
        self._children: dict[bytes, set[bytes]] = {}  # parent key -> held chunks naming it
        self._mem = Tier("memory", memory_budget)
        self._disk = Tier("disk", disk_budget if dir is not None else 0, on_evict=self._unlink)
        self._pins: collections.Counter[bytes] = collections.Counter()
        self._lasting = Pins(pin_budget)
        self._doomed: set[bytes] = set()  # deleted while pinned: removed at the last unpin
        self._inflight: set[bytes] = set()  # keys being put
        self._evictions = 0
        self._disk_errors = 0
        self._write_fault: tuple[OSError, int] | None = None  # the last write's error, the bytes it needed
        self._dropped: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # key -> why, newest last
        self._opened = False
        self._closed = False

    # -- helpers (all but _run_callbacks need self._lock) -------------------------------------

    def _queue(self, cb: Callback | None, keys: list[bytes]) -> None:
        if cb is not None and keys:
            self._events.append((cb, keys))

    def _run_callbacks(self) -> None:
        with self._cb_lock:
            while True:
                try:
                    cb, keys = self._events.popleft()
                except IndexError:
                    return
                try:
                    cb(keys)
                except Exception:
                    log.exception("store callback %r failed", cb)

    def _add_meta(self, key: bytes, meta: _Meta) -> None:
        self._meta[key] = meta
        self._dropped.pop(key, None)  # held again: a later miss is not that damage
        if meta.parent is not None:
            self._children.setdefault(meta.parent, set()).add(key)

    def _forget(self, key: bytes) -> None:
        meta = self._meta.pop(key)
        self._lasting.lost(key)
        self._doomed.discard(key)
        if meta.parent is not None:
            kids = self._children.get(meta.parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[meta.parent]

    def _unlink(self, key: bytes) -> None:
        try:
            self._files.unlink(key)
        except OSError as e:
            self._disk_errors += 1
            log.warning("chunk %s: could not remove its file: %s", key.hex(), e)

    def _delete_locked(self, key: bytes) -> list[bytes]:
        self._mem.pop(key)
        if self._disk.pop(key):
            self._unlink(key)
        self._forget(key)
        return [key]

    def _unpin_locked(self, keys: Sequence[bytes]) -> list[bytes]:
        removed = []
        for k in keys:
            if self._pins[k] <= 1:
                self._pins.pop(k, None)
                if k in self._doomed and k in self._meta:
                    removed += self._delete_locked(k)
            else:
                self._pins[k] -= 1
        return removed + self._evict_both()

    def _save_pins(self) -> None:
        if self._dir is not None and not self._lasting.save(self._dir / PINS_FILE):
            self._disk_errors += 1

    def _evict(self, tier: Tier, protect: bytes | None = None) -> list[bytes]:
        """Evict from one tier; returns the keys that left the store (were in no other tier)."""
        removed: list[bytes] = []
        for k in tier.evict(_Kept(self._pins, self._lasting, self._disk if tier is self._mem else None), protect):
            self._evictions += 1
            if k not in self._mem and k not in self._disk:
                self._forget(k)
                removed.append(k)
        return removed

    def _evict_both(self) -> list[bytes]:
        return self._evict(self._mem) + self._evict(self._disk)


class _Kept:
    """What eviction from one tier passes over (Tier.evict asks `get(key)`): chunks a reader
    pins, and chunks a lasting pin holds, except, in the memory tier, those whose file on disk
    keeps them held (`disk`: the disk tier, or None for the disk tier itself)."""
    __slots__ = ("pins", "lasting", "disk")

    def __init__(self, pins: collections.Counter[bytes], lasting: Pins, disk: Tier | None) -> None:
        self.pins, self.lasting, self.disk = pins, lasting, disk

    def get(self, key: bytes) -> bool:
        return bool(self.pins.get(key)) or (key in self.lasting and (self.disk is None or key not in self.disk))
