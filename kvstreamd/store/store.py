"""The chunk store: KV-cache chunks of LLM contexts in a memory tier and a disk tier, both LRU by
bytes, with pins, shared-prefix-aware context deletion and crash-safe files.

Chunk keys are kvstreamd.keys's (equal keys mean equal prefixes), a chunk on disk is one
kvstreamd.chunkfile file, and kvstreamd.chunkdir lays the files out, writes and scans them.

Tiers
-----
Every chunk is held in the memory tier (its record), the disk tier (its file) or both: two
`Tier`s (kvstreamd.tier), each LRU by payload bytes with a budget. A put goes to memory and is
written through to disk; memory eviction only drops a chunk's memory copy when it is on disk, and
a `get` of a disk-only chunk promotes it back to memory. Budgets count `ChunkRecord.nbytes`
(payload bytes) in each tier, not file sizes. A chunk is held while it is in either tier;
`on_add` / `on_remove` report keys becoming held / no longer held. Eviction skips pinned chunks
(`pin`, `pinned`), and a delete of a pinned chunk waits for its last unpin. Lasting pins
(`pin_context`, kvstreamd.pins: preloaded contexts) keep a context's chunks held until it is
unpinned or deleted: disk eviction passes them over, and memory eviction drops only memory copies
that have a file; their bytes are bounded by the pin budget. They are kept in `<dir>/pins.json`
and restored at `open` before it evicts (a pin whose chunks are not all there is dropped).

Disk LRU order lives in memory; it starts from the files' mtimes at `open`, and reading a chunk
that is on disk touches its file's mtime (best effort) so the order roughly survives a restart.
`open` checks every file's name and header (`open(verify=True)`: every byte); every disk read in
`get` checks the whole file. Bad files are quarantined.

Threading: one lock guards the index and both tiers; file writes and reads happen outside it (a
chunk being read from disk is pinned meanwhile). Callbacks run outside the lock, one at a time, in
the order the changes happened.

The file is long (~690 lines) because `Store` is what that one lock guards: the index, both
tiers, pins (a reader's and lasting ones) and deferred deletes, where each chunk is (placement)
and the disk's fault state all change together under it; the key contract, the file format, the
files on disk, the LRU tier and the lasting pins' bookkeeping are already apart (keys.py,
chunkfile.py, chunkdir.py, tier.py, pins.py).
"""
from __future__ import annotations

import collections
import errno
import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from kvstreamd.store import chunkfile
from kvstreamd.store.files import ChunkDir
from kvstreamd.store.chunkfile import ChunkFileError, ChunkRecord
from kvstreamd.store.pins import Pin, Pins
from kvstreamd.store.tier import Tier

log = logging.getLogger("kvstreamd.store")

PINS_FILE = "pins.json"  # the lasting pins, in the store's dir
DROPPED_KEPT = 1024  # chunks whose reason for being dropped unreadable `dropped()` still knows

Callback = Callable[[list[bytes]], None]


class StoreError(Exception):
    """A chunk the store cannot take (over both budgets, or disk-only and the write failed), or a
    store that is not open. `os_error`: the failed write's error, when that is why."""

    def __init__(self, message: str, os_error: OSError | None = None) -> None:
        super().__init__(message)
        self.os_error = os_error


# A write that failed for want of room is a "disk_full" fault until the file system has this
# much room beyond the chunk again (or a write succeeds); any other failed write is a
# "disk_error" fault until a write succeeds.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
ROOM_MARGIN = 64 * 1024


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


class Store:
    """Chunks in a memory tier and (when `dir` is given) a disk tier under `dir`; see the module
    docstring. Call `open()` before use and `close()` at the end. Thread-safe."""

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

    # -- lifecycle --------------------------------------------------------------------------

    def open(self, verify: bool = False) -> OpenReport:
        """Create the directories and index the chunk files already there (no on_add calls).
        verify=True also checks every file's CRC (reads every byte); otherwise payload damage is
        found by the get that reads the file. Leftover temp files are removed, other bad files
        quarantined; both are reported. Then evicts down to the disk budget (silently: nothing
        was announced yet)."""
        with self._lock:
            if self._opened:
                raise StoreError("store already opened")
            self._opened = True
        if self._files is None:
            return OpenReport(0, [], 0)
        self._files.create()
        scan = self._files.scan(verify)
        total = 0
        with self._lock:
            for f in scan.found:
                if f.key in self._meta:  # put before open (memory-only so far): keep one entry
                    continue
                meta = _meta_of(f.header)
                self._add_meta(f.key, meta)
                self._disk.add(f.key, meta.nbytes)
                total += meta.nbytes
            self._lasting.restore(self._dir / PINS_FILE, {k: m.nbytes for k, m in self._meta.items()})
            removed = self._evict(self._disk)
        if removed:
            log.warning("open: evicted %d chunks to fit the disk budget of %d bytes", len(removed), self._disk.budget)
        log.info("open %s: %d chunks, %d bytes, %d bad files", self._dir, len(scan.found), total, len(scan.corrupt))
        return OpenReport(len(scan.found), scan.corrupt, total)

    def close(self) -> None:
        """Wait for puts in progress, fsync the directories; later puts raise StoreError."""
        with self._lock:
            self._closed = True
            self._idle.wait_for(lambda: not self._inflight, timeout=60.0)
        if self._files is not None:
            try:
                self._files.fsync()
            except OSError as e:
                log.warning("close: fsync of %s failed: %s", self._dir, e)
        self._run_callbacks()

    # -- writes -----------------------------------------------------------------------------

    def put(self, rec: ChunkRecord) -> bool:
        """put_to(), True when the chunk was stored."""
        return self.put_to(rec) is not None

    def put_to(self, rec: ChunkRecord) -> Stored | None:
        """Store a chunk (memory tier, written through to disk when it has one). False, with
        nothing rewritten, when the key is already held or being put; a put of a key whose
        delete is deferred by a pin cancels that delete. ValueError for a malformed record (the
        key must be chunk_key(parent, model_id, tokens)); StoreError when it fits neither budget,
        or fits only the disk and the write fails. A failed write of a chunk that fits memory is
        logged and counted in usage().disk_errors; the chunk stays in memory, and the Stored returned
        says so. None when already held (the put that returns False)."""
        rec = chunkfile.normalise(rec)
        key, nb = rec.key, rec.nbytes
        with self._lock:
            if not self._opened or self._closed:
                raise StoreError("store is not open")
            if key in self._meta or key in self._inflight:
                self._doomed.discard(key)
                return None
            to_mem = nb <= self._mem.budget
            to_disk = self._files is not None and 0 < self._disk.budget and nb <= self._disk.budget
            if not (to_mem or to_disk):
                where = (f"disk budget ({self._disk.budget} bytes)" if self._files is not None
                         else "no disk tier")
                raise StoreError(f"chunk {key.hex()[:16]} of {nb} bytes exceeds the memory budget "
                                 f"({self._mem.budget} bytes) and the {where}")
            self._inflight.add(key)
        try:
            written, error = False, None
            if to_disk:
                try:
                    self._files.write(rec)
                    written = True
                    with self._lock:
                        self._write_fault = None
                except OSError as e:
                    error = e
                    with self._lock:
                        self._disk_errors += 1
                        self._write_fault = (e, nb + 4 * len(rec.tokens))
                    log.warning("chunk %s: disk write failed (%s)%s", key.hex(), e,
                                "; kept in memory only" if to_mem else "")
                    if not to_mem:
                        raise StoreError(f"chunk {key.hex()[:16]} of {nb} bytes exceeds the memory budget "
                                         f"({self._mem.budget} bytes) and writing it to disk failed: {e}",
                                         e) from e
            with self._lock:
                self._add_meta(key, _meta_of(rec))
                if to_mem:
                    self._mem.add(key, nb, rec)
                if written:
                    self._disk.add(key, nb)
                removed = self._evict(self._mem, protect=key if nb <= self._mem.budget else None)
                removed += self._evict(self._disk, protect=key if nb <= self._disk.budget else None)
                if key in self._meta:  # else a concurrent set_budgets shrank both tiers under it
                    self._queue(self._on_add, [key])
                self._queue(self._on_remove, [k for k in removed if k != key])
        finally:
            with self._lock:
                self._inflight.discard(key)
                self._idle.notify_all()
        self._run_callbacks()
        return Stored(written, error)

    def persist(self, key: bytes) -> Stored | None:
        """Write a chunk held in memory only (its write failed, say on a full disk) to disk now,
        so that a put of it again, once there is room, makes it survive a restart. None when
        there is nothing to write: not held, already on disk or being put, or it does not fit
        the disk tier."""
        with self._lock:
            rec = self._mem.get(key)
            if (rec is None or key in self._disk or key in self._inflight or self._closed or self._files is None
                    or not 0 < rec.nbytes <= self._disk.budget):
                return None
            self._inflight.add(key)
        try:
            try:
                self._files.write(rec)
            except OSError as e:
                with self._lock:
                    self._disk_errors += 1
                    self._write_fault = (e, rec.nbytes + 4 * len(rec.tokens))
                log.warning("chunk %s: disk write failed again (%s); still in memory only", key.hex(), e)
                return Stored(False, e)
            with self._lock:
                self._write_fault = None
                if key in self._meta and key not in self._disk:
                    self._disk.add(key, rec.nbytes)
                    removed = self._evict(self._disk, protect=key)
                    self._queue(self._on_remove, removed)
                else:  # deleted or evicted meanwhile: the file must not outlive it
                    self._unlink(key)
        finally:
            with self._lock:
                self._inflight.discard(key)
                self._idle.notify_all()
        self._run_callbacks()
        return Stored(True, None)

    def delete(self, key: bytes) -> bool:
        """Drop a chunk from both tiers. Deferred to the last unpin when pinned (it stays held and
        readable until then). False when not held."""
        with self._lock:
            if key not in self._meta:
                return False
            if self._pins[key]:
                self._doomed.add(key)
                return True
            self._queue(self._on_remove, self._delete_locked(key))
        self._run_callbacks()
        return True

    def delete_context(self, last_key: bytes) -> int:
        """Delete the chain ending at last_key back to its root, stopping at the first chunk that
        is also the parent of another held chunk (shared prefixes survive; chunks whose only
        children are pending deletion do not count as shared) or that another context's lasting
        pin holds; the context's own lasting pin ends. Chunks a reader pins are deleted at their
        last unpin. Returns how many chunks were deleted or scheduled for deletion."""
        n = 0
        removed: list[bytes] = []
        with self._lock:
            if self._lasting.remove(last_key) is not None:
                self._save_pins()
            k: bytes | None = last_key
            while k is not None and k in self._meta:
                if any(c not in self._doomed for c in self._children.get(k, ())) or k in self._lasting:
                    break
                parent = self._meta[k].parent
                if self._pins[k]:
                    self._doomed.add(k)
                else:
                    removed += self._delete_locked(k)
                n += 1
                k = parent
            self._queue(self._on_remove, removed)
        self._run_callbacks()
        return n

    def drop_unshared(self, keys: Sequence[bytes]) -> int:
        """Delete these chunks, last first, but not one that another held chunk still extends
        (a prefix some context uses) or that a lasting pin holds: what a prefetch nobody used
        gives back. Chunks a reader pins are deleted at their last unpin. Returns how many."""
        n = 0
        removed: list[bytes] = []
        with self._lock:
            for k in reversed(keys):
                if (k not in self._meta or k in self._lasting
                        or any(c not in self._doomed for c in self._children.get(k, ()))):
                    continue
                if self._pins[k]:
                    self._doomed.add(k)
                else:
                    removed += self._delete_locked(k)
                n += 1
            self._queue(self._on_remove, removed)
        self._run_callbacks()
        return n

    def reconfigure(self, cfg) -> None:
        """SIGHUP: the [store] budgets of `cfg` (a kvstreamd Config), evicting down to them now
        (blocking: call it off the event loop)."""
        self.set_budgets(cfg.store.memory_budget, cfg.store.disk_budget)
        self.set_pin_budget(cfg.store.pin_budget)

    def set_pin_budget(self, budget: int) -> None:
        """A new pin budget (SIGHUP). Pins held already stay, even over it; new ones must fit."""
        if budget < 0:
            raise ValueError("the pin budget must be >= 0")
        with self._lock:
            self._lasting.budget = budget

    def set_budgets(self, memory_budget: int, disk_budget: int) -> None:
        """New budgets (SIGHUP); evicts down to them now. A disk budget of 0 stops disk writes and
        evicts (deletes) every unpinned chunk file. Ignored disk budget without a directory."""
        if memory_budget < 0 or disk_budget < 0:
            raise ValueError("budgets must be >= 0")
        with self._lock:
            self._mem.budget = memory_budget
            if self._files is not None:
                self._disk.budget = disk_budget
            self._queue(self._on_remove, self._evict_both())
        self._run_callbacks()

    # -- reads ------------------------------------------------------------------------------

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

    def pin_context(self, keys: Sequence[bytes]) -> int:
        """A lasting pin on the context whose chunk keys are `keys` (all held; the last names
        the pin): eviction passes its chunks over until unpin_context or delete_context ends it.
        Returns the bytes newly pinned (0 when it was pinned already); PinRefused, with nothing
        pinned, when a chunk is not held or the pin would go over the pin budget (the message
        says how many bytes are pinned and the budget)."""
        with self._lock:
            sizes = {k: self._meta[k].nbytes for k in keys if k in self._meta}
            new = self._lasting.add(keys, sizes)
            if new:
                self._save_pins()
            return new

    def unpin_context(self, last_key: bytes) -> bool:
        """End a lasting pin (the context stays, evictable again); False when it was not pinned."""
        with self._lock:
            if self._lasting.remove(last_key) is None:
                return False
            self._save_pins()
            self._queue(self._on_remove, self._evict_both())
        self._run_callbacks()
        return True

    def is_pinned(self, last_key: bytes) -> bool:
        """Whether a lasting pin names the context ending at this chunk."""
        with self._lock:
            return self._lasting.pinned(last_key)

    def pins(self) -> list[Pin]:
        """The lasting pins."""
        with self._lock:
            return self._lasting.contexts()

    def contexts(self) -> list[ContextInfo]:
        """One entry per leaf (a held chunk no held chunk names as parent), oldest first."""
        out = []
        with self._lock:
            limit = len(self._meta)
            for leaf, lm in self._meta.items():
                if self._children.get(leaf):
                    continue
                chunks, nbytes, created, k, m = 0, 0, 0.0, leaf, lm
                while m is not None and chunks <= limit:
                    chunks += 1
                    nbytes += m.nbytes
                    created = max(created, m.created)
                    k = m.parent
                    m = self._meta.get(k) if k is not None else None
                out.append(ContextInfo(leaf, lm.model_id, lm.start + lm.ntokens, chunks, k is None, created, nbytes))
        out.sort(key=lambda c: (c.created, c.key))
        return out

    def usage(self) -> Usage:
        with self._lock:
            return Usage(len(self._meta), self._mem.bytes, self._mem.budget, self._disk.bytes, self._disk.budget,
                         len(self._mem), len(self._disk), sum(1 for c in self._pins.values() if c > 0),
                         self._evictions, self._disk_errors, self._lasting.bytes, self._lasting.budget)

    def placement(self, keys: Sequence[bytes]) -> list[str | None]:
        """Where each chunk is: "disk" (its file: it survives a restart), "memory" (memory only:
        lost on a restart), or None (not held)."""
        with self._lock:
            return ["disk" if k in self._disk else "memory" if k in self._mem else None for k in keys]

    def disk_fault(self) -> DiskFault | None:
        """Why chunks cannot be written to disk now, or None: after a write failed for want of
        room, "disk_full" until the file system has room for that chunk again (checked here, so
        it clears by itself when room is made) or a write succeeds; after any other failed
        write, "disk_error" until a write succeeds."""
        with self._lock:
            fault = self._write_fault
        if fault is None:
            return None
        e, need = fault
        if e.errno in NO_ROOM:
            try:
                st = os.statvfs(self._dir)
                room = st.f_bavail * st.f_frsize
            except OSError:
                room = 0
            if room >= need + ROOM_MARGIN:
                with self._lock:
                    if self._write_fault is fault:
                        self._write_fault = None
                return None
            return DiskFault("disk_full", f"the store's disk ({self._dir}) is full: {e.strerror}; "
                                          f"new chunks are kept in memory only")
        return DiskFault("disk_error", f"writing chunks to {self._dir} fails: {e}; "
                                       f"new chunks are kept in memory only")

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
