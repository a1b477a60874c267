"""The chunk store's reads: a chunk by key (from memory, else its file, checked, and promoted),
what is held and at which levels, and pins, a reader's hold on chunks while it reads them, with
or without their payloads. `StoreReads` adds them to the state kvstreamd.store.core.StoreCore
holds; kvstreamd.store.store.Store is the whole store."""
from __future__ import annotations

import collections
import logging
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from kvstreamd.store.chunkfile import ChunkFileError, ChunkRecord
from kvstreamd.store.core import StoreCore
from kvstreamd.store.reports import ChunkInfo

log = logging.getLogger(__name__)

DROPPED_KEPT = 1024  # chunks whose reason for being dropped unreadable `dropped()` still knows


class StoreReads(StoreCore):
    """Reads and a reader's pins; kvstreamd.store.store.Store is the whole store."""

    def get(self, key: bytes) -> ChunkRecord | None:
        """The chunk, or None. From memory, else read from disk with a full check (a bad file is
        quarantined and dropped: on_remove, logged) and promoted to memory when it fits. Bumps
        the chunk in both tiers' LRU order."""
        with self._lock:
            rec = self._mem.get(key)
            if rec is not None:
                self._mem.touch(key)
                on_disk = key in self._disk
                if on_disk:
                    self._disk.touch(key)
            elif key in self._disk:
                self._disk.touch(key)
                self._pins[key] += 1  # keeps the file in place while we read it
            else:
                return None
        if rec is not None:
            if on_disk:
                self._files.touch(key)
            return rec
        error, missing = None, False
        try:
            rec = self._files.read(key)
        except ChunkFileError as e:
            error = str(e)
        except FileNotFoundError:
            error, missing = "file missing", True
        except OSError as e:
            error = f"unreadable: {e}"
        with self._lock:
            removed = []
            if error is not None:
                rec = None
                self._disk_errors += 1
                self._dropped[key] = error
                if len(self._dropped) > DROPPED_KEPT:
                    self._dropped.popitem(last=False)
                if key in self._disk:
                    if missing:
                        log.warning("chunk %s: %s; dropped", key.hex(), error)
                    else:
                        self._files.quarantine(self._files.path(key), error)
                    self._disk.pop(key)
                    if key not in self._mem:
                        self._forget(key)
                        removed.append(key)
            removed += self._unpin_locked([key])
            if rec is not None and key in self._disk and key not in self._mem and rec.nbytes <= self._mem.budget:
                self._mem.add(key, rec.nbytes, rec)
                removed += self._evict(self._mem, protect=key)
            self._queue(self._on_remove, removed)
        self._run_callbacks()
        if rec is not None:
            self._files.touch(key)
        return rec

    def dropped(self, key: bytes) -> str | None:
        """Why a get lately found chunk `key`'s file unreadable and dropped it (damaged, missing),
        so that a caller can tell that from an eviction; None if it did not."""
        with self._lock:
            return self._dropped.get(key)

    def has(self, key: bytes, levels: Sequence[str] | None = None) -> bool:
        """Whether `key` is held (at one of `levels`, when given)."""
        with self._lock:
            meta = self._meta.get(key)
            return meta is not None and (levels is None or not meta.levels.isdisjoint(levels))

    __contains__ = has

    def __len__(self) -> int:
        with self._lock:
            return len(self._meta)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._meta)

    def held_levels(self, keys: Sequence[bytes] | None = None) -> dict[bytes, frozenset[str]]:
        """Each held key (of `keys`, when given) with the levels it is held at: what this node
        tells the directory. A key's levels do not change while it is held."""
        with self._lock:
            if keys is None:
                return {k: m.levels for k, m in self._meta.items()}
            return {k: m.levels for k in keys if (m := self._meta.get(k)) is not None}

    def longest_prefix(self, keys: Sequence[bytes], levels: Sequence[str] | None = None) -> int:
        """How many leading keys of `keys` are held (at one of `levels`, when given)."""
        with self._lock:
            n = 0
            for k in keys:
                meta = self._meta.get(k)
                if meta is None or (levels is not None and meta.levels.isdisjoint(levels)):
                    break
                n += 1
            return n

    def pin(self, keys: Sequence[bytes]) -> list[ChunkRecord | None]:
        """Pin the held keys and return their records (None for keys not held, or whose file
        turned out bad; those are not left pinned). Unpin with unpin([r.key for r in recs if r]).
        Reads disk-only chunks: from an event loop, call it in a thread."""
        return self._pinned(keys, self.get)

    def pin_info(self, keys: Sequence[bytes]) -> list[ChunkInfo | None]:
        """pin() without reading payloads: each held key pinned, and what its chunk is (from its
        memory copy, or a disk-only chunk's file header), for a caller that reads each chunk with
        get() only when it needs it, so that a FETCH of many chunks holds one at a time. None
        for keys not held, or whose header does not read (those are not left pinned). Unpin
        with unpin(). Reads file headers: from an event loop, call it in a thread."""
        return self._pinned(keys, self._info)

    def _pinned(self, keys: Sequence[bytes], read: Callable[[bytes], object | None]) -> list:
        """Pin the held keys and `read(key)` each (None for keys not held); a key read as None
        is not left pinned, and if a read raises, no pin is."""
        with self._lock:
            held = [k for k in keys if k in self._meta]
            for k in held:
                self._pins[k] += 1
        out: list = []
        try:
            held_set = set(held)
            for k in keys:
                out.append(read(k) if k in held_set else None)
        finally:
            got = collections.Counter(r.key for r in out if r is not None)
            extra = list((collections.Counter(held) - got).elements())  # pinned but not returned
            if len(out) < len(keys):  # a read raised: undo every pin
                extra = held
            if extra:
                self.unpin(extra)
        return out

    def _info(self, key: bytes) -> ChunkInfo | None:
        with self._lock:
            rec = self._mem.get(key)
        if rec is not None:
            levels = {name: len(p) for name, p in rec.levels.items()}
            return ChunkInfo(rec.key, rec.start, rec.model_id, rec.tokens, rec.shape, levels)
        try:
            h = self._files.read_header(key)
        except (ChunkFileError, OSError) as e:  # get() finds it so too, and quarantines it
            log.warning("chunk %s: header does not read: %s", key.hex(), e)
            return None
        return ChunkInfo(h.key, h.start, h.model_id, h.tokens, h.shape, dict(h.levels))

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Undo pin() for these keys (once per key given); runs deferred deletes and eviction."""
        with self._lock:
            self._queue(self._on_remove, self._unpin_locked(keys))
        self._run_callbacks()

    @contextmanager
    def pinned(self, keys: Sequence[bytes]) -> Iterator[list[ChunkRecord | None]]:
        """pin() for the duration of the block: eviction skips the pinned chunks and delete() of
        one waits for the last unpin. Pins nest and count. Reads disk-only chunks (see pin)."""
        recs = self.pin(keys)
        try:
            yield recs
        finally:
            self.unpin([r.key for r in recs if r is not None])
