"""The chunk store: KV-cache chunks of LLM contexts in a memory tier and a disk tier, both LRU by
bytes, with pins, shared-prefix-aware context deletion and crash-safe files.

Chunk keys are kvstreamd.store.keys's (equal keys mean equal prefixes), a chunk on disk is one
kvstreamd.store.chunkfile file, and kvstreamd.store.files lays the files out, writes and scans
them.

Tiers
-----
Every chunk is held in the memory tier (its record), the disk tier (its file) or both: two
`Tier`s (kvstreamd.store.tier), each LRU by payload bytes with a budget. A put goes to memory and
is written through to disk; memory eviction only drops a chunk's memory copy when it is on disk,
and a `get` of a disk-only chunk promotes it back to memory. Budgets count `ChunkRecord.nbytes`
(payload bytes) in each tier, not file sizes. A chunk is held while it is in either tier;
`on_add` / `on_remove` report keys becoming held / no longer held. Eviction skips pinned chunks
(`pin`, `pinned`), and a delete of a pinned chunk waits for its last unpin. Lasting pins
(`pin_context`, kvstreamd.store.pins: preloaded contexts) keep a context's chunks held until it is
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

`Store` is one object under that one lock, its jobs in three files: kvstreamd.store.core holds the
state the lock guards and the rules that keep it whole (the index, eviction, deferred deletes,
the callbacks' queue), kvstreamd.store.reads the reads and a reader's pins, and this file the
life cycle, writes, deletes, budgets, lasting pins and what the store reports (its values in
kvstreamd.store.reports).
"""
from __future__ import annotations

import errno
import logging
import os
from typing import Sequence

from kvstreamd.store import chunkfile
from kvstreamd.store.chunkfile import ChunkRecord
from kvstreamd.store.core import PINS_FILE, _meta_of
from kvstreamd.store.pins import Pin
from kvstreamd.store.reads import StoreReads
from kvstreamd.store.reports import ChunkInfo, ContextInfo, DiskFault, OpenReport, Stored, StoreError, Usage

__all__ = ["Store", "StoreError", "Stored", "OpenReport", "ContextInfo", "ChunkInfo", "Usage", "DiskFault",
           "NO_ROOM", "ROOM_MARGIN"]

log = logging.getLogger(__name__)

# A write that failed for want of room is a "disk_full" fault until the file system has this
# much room beyond the chunk again (or a write succeeds); any other failed write is a
# "disk_error" fault until a write succeeds.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
ROOM_MARGIN = 64 * 1024


class Store(StoreReads):
    """Chunks in a memory tier and (when `dir` is given) a disk tier under `dir`; see the module
    docstring. Call `open()` before use and `close()` at the end. Thread-safe."""

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
