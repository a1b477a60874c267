"""The chunk store: KV-cache chunks of LLM contexts in a memory tier and a disk tier, both LRU by
bytes, with pins, shared-prefix-aware context deletion and crash-safe files.

Chunk keys
----------
A context (model_id, token ids) is cut into chunks of `chunk_tokens` tokens (the last one may be
shorter). Chunk i's key chains the previous one (see `chunk_key`), so equal keys mean equal
prefixes and the store never needs to compare token lists.

Tiers
-----
Every chunk is held in the memory tier (an LRU of records), the disk tier (one file per chunk) or
both. A put goes to memory and is written through to disk; memory eviction only drops a chunk's
memory copy when it is on disk, and a `get` of a disk-only chunk promotes it back to memory.
Budgets count `ChunkRecord.nbytes` (payload bytes) in each tier, not file sizes. A chunk is held
while it is in either tier; `on_add` / `on_remove` report keys becoming held / no longer held.

File format (version 1)
-----------------------
`<dir>/chunks/<first 2 hex digits of key>/<64 hex digits of key>.kvc`, all integers little-endian:

    offset   size   field
    0        4      magic b"KVSC"
    4        2      format version, uint16 (1)
    6        4      header length H, uint32
    10       H      header: one msgpack map (str keys, bin for bytes), exactly these fields:
                      "key": bin(32), "parent": bin(32) or nil, "index": uint, "start": uint,
                      "model_id": str, "tokens": bin (uint32 little-endian token ids, >= 1),
                      "dtype": str, "shape": [uint, ...], "created": float,
                      "levels": [[name: str, payload length: uint], ...]
    10+H     sum    the level payloads, concatenated in the order of "levels"
    end-4    4      CRC-32 (zlib.crc32) of every preceding byte, uint32

The file size is exactly 10 + H + sum(payload lengths) + 4. Files are written to a temp file in
the same directory (`.<hex key>.<random>.tmp`), flushed, fsynced, renamed over the final name
with os.replace, then the directory is fsynced, so a crash leaves either no file or a whole one
(plus maybe a temp file, removed by the next `open`). `open` checks every file's name, magic,
version, header, size and key (the key must be the chain hash of the header's parent, model_id
and tokens); `open(verify=True)` and every disk read in `get` also check the CRC. Bad files are
moved to `<dir>/quarantine/` (never served, never counted in budgets, left for the operator) and
the reason is logged at WARNING.

Disk LRU order lives in memory; it starts from the files' mtimes at `open`, and reading a chunk
that is on disk touches its file's mtime (best effort) so the order roughly survives a restart.

Threading: one lock guards the index; file writes and reads happen outside it (a chunk being read
from disk is pinned meanwhile). Callbacks run outside the lock, one at a time, in the order the
changes happened.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import os
import re
import secrets
import struct
import threading
import time
import types
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import msgpack

log = logging.getLogger("kvstreamd.store")

KEY_BYTES = 32
MAGIC = b"KVSC"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
_CRC = struct.Struct("<I")
_U32 = struct.Struct("<I")
SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
_NAME = re.compile(r"[0-9a-f]{64}\.kvc")
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_HEADER_FIELDS = frozenset({"key", "parent", "index", "start", "model_id", "tokens", "dtype", "shape",
                            "created", "levels"})
MAX_HEADER_BYTES = 64 * 2**20

Callback = Callable[[list[bytes]], None]


# -- keys ---------------------------------------------------------------------------------------

def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None


def chunk_key(parent: bytes | None, model_id: str, tokens: Sequence[int]) -> bytes:
    """The key of one chunk given its parent's key (None for chunk 0); see `chunk_keys`."""
    m = model_id.encode("utf-8")
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(parent or b"")
    h.update(_U32.pack(len(m)))
    h.update(m)
    h.update(_tokens_bytes(tokens))
    return h.digest()


def prefix_keys(parent: bytes | None, model_id: str, tokens: Sequence[int]) -> list[bytes]:
    """chunk_key(parent, model_id, tokens[:k]) for k = 1..len(tokens), hashed incrementally: the
    keys a stored context's last, partial chunk could have when a longer prompt runs past it."""
    m = model_id.encode("utf-8")
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(parent or b"")
    h.update(_U32.pack(len(m)))
    h.update(m)
    out = []
    for b in _chunks4(_tokens_bytes(tokens)):
        h.update(b)
        out.append(h.copy().digest())
    return out


def _chunks4(data: bytes):
    return (data[i:i + 4] for i in range(0, len(data), 4))


def chunk_keys(model_id: str, tokens: Sequence[int], chunk_tokens: int) -> list[bytes]:
    """Keys of the chunks of a context: chunk i holds tokens[i*chunk_tokens:(i+1)*chunk_tokens].

    key_i = blake2b(key_{i-1} || u32le(len(m)) || m || u32le(tokens_i[0]) || u32le(tokens_i[1]) ...,
                    digest_size=32)

    where key_{-1} is empty (b""), m is model_id encoded as UTF-8, u32le is a 4-byte little-endian
    unsigned integer, and tokens_i are chunk i's token ids (each in [0, 2**32)). The hash input
    carries no chunk length: the token bytes run to its end. Other nodes must compute exactly this.
    An empty token list gives no keys.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    keys: list[bytes] = []
    parent: bytes | None = None
    for s in range(0, len(tokens), chunk_tokens):
        parent = chunk_key(parent, model_id, tokens[s:s + chunk_tokens])
        keys.append(parent)
    return keys


# -- public types -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChunkRecord:
    key: bytes  # 32 bytes, chunk_key(parent, model_id, tokens)
    parent: bytes | None  # key of the previous chunk in the context, None for chunk 0
    index: int  # chunk index within its context (0-based)
    start: int  # position of its first token in the context
    model_id: str
    tokens: tuple[int, ...]  # the chunk's token ids (at least one)
    dtype: str  # KV dtype name, e.g. "float16"
    shape: tuple[int, ...]  # KV shape of this chunk [L, 2, T, H, D]
    levels: Mapping[str, bytes]  # level name -> encoded payload
    created: float = 0.0  # time.time() at put; 0 means "stamp it at put", other values are kept

    @property
    def nbytes(self) -> int:
        """Sum of the payload lengths: what budgets count."""
        return sum(len(v) for v in self.levels.values())


class StoreError(Exception):
    """A chunk the store cannot take (over both budgets, or disk-only and the write failed), or a
    store that is not open."""


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


# -- internals ----------------------------------------------------------------------------------

class _Corrupt(Exception):
    pass


@dataclass(slots=True)
class _Meta:
    parent: bytes | None
    index: int
    start: int
    model_id: str
    ntokens: int
    created: float
    nbytes: int


def _meta_of(rec: ChunkRecord) -> _Meta:
    return _Meta(rec.parent, rec.index, rec.start, rec.model_id, len(rec.tokens), rec.created, rec.nbytes)


def _is_uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _normalise(rec: ChunkRecord) -> ChunkRecord:
    """Validate a record given to put and return the immutable copy the store keeps."""
    if not isinstance(rec, ChunkRecord):
        raise TypeError(f"expected a ChunkRecord, got {type(rec).__name__}")
    if not isinstance(rec.key, bytes) or len(rec.key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes")
    if rec.parent is not None and (not isinstance(rec.parent, bytes) or len(rec.parent) != KEY_BYTES):
        raise ValueError(f"parent must be None or {KEY_BYTES} bytes")
    if not _is_uint(rec.index) or not _is_uint(rec.start):
        raise ValueError("index and start must be integers >= 0")
    if (rec.index == 0) != (rec.parent is None):
        raise ValueError("chunk 0 has no parent and every other chunk has one")
    if not isinstance(rec.model_id, str) or not isinstance(rec.dtype, str):
        raise ValueError("model_id and dtype must be str")
    tokens = tuple(int(t) for t in rec.tokens)
    if not tokens:
        raise ValueError("a chunk has at least one token")
    shape = tuple(int(d) for d in rec.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"bad shape {shape}")
    levels = {}
    for name, payload in rec.levels.items():
        if not isinstance(name, str):
            raise ValueError(f"level names must be str, got {name!r}")
        levels[name] = payload if isinstance(payload, bytes) else bytes(payload)
    if chunk_key(rec.parent, rec.model_id, tokens) != rec.key:
        raise ValueError(f"key {rec.key.hex()[:16]} is not the chunk key of its parent, model_id and tokens")
    created = float(rec.created) or time.time()
    return ChunkRecord(rec.key, rec.parent, rec.index, rec.start, rec.model_id, tokens, rec.dtype, shape,
                       types.MappingProxyType(levels), created)


def _encode_header(rec: ChunkRecord) -> bytes:
    hdr = msgpack.packb({
        "key": rec.key, "parent": rec.parent, "index": rec.index, "start": rec.start,
        "model_id": rec.model_id, "tokens": _tokens_bytes(rec.tokens), "dtype": rec.dtype,
        "shape": list(rec.shape), "created": float(rec.created),
        "levels": [[name, len(p)] for name, p in rec.levels.items()],
    }, use_bin_type=True)
    return _PREFIX.pack(MAGIC, VERSION, len(hdr)) + hdr


def _parse_header(prefix: bytes, read_header: Callable[[int], bytes], file_size: int,
                  expect_key: bytes) -> tuple[dict, list[tuple[str, int]], int]:
    """Check the fixed prefix and the header; returns (fields, levels, payload offset)."""
    if len(prefix) < _PREFIX.size:
        raise _Corrupt(f"truncated: {file_size} bytes")
    magic, version, hlen = _PREFIX.unpack(prefix[:_PREFIX.size])
    if magic != MAGIC:
        raise _Corrupt(f"wrong magic {magic!r}")
    if version != VERSION:
        raise _Corrupt(f"unsupported format version {version}")
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen + _CRC.size > file_size:
        raise _Corrupt(f"truncated or bad header length {hlen} in a file of {file_size} bytes")
    raw = read_header(hlen)
    if len(raw) != hlen:
        raise _Corrupt("truncated header")
    try:
        h = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise _Corrupt(f"bad header: {type(e).__name__}: {e}") from None
    if not isinstance(h, dict) or set(h) != _HEADER_FIELDS:
        raise _Corrupt("bad header: wrong fields")
    ok = (isinstance(h["key"], bytes) and len(h["key"]) == KEY_BYTES
          and (h["parent"] is None or (isinstance(h["parent"], bytes) and len(h["parent"]) == KEY_BYTES))
          and _is_uint(h["index"]) and _is_uint(h["start"]) and (h["index"] == 0) == (h["parent"] is None)
          and isinstance(h["model_id"], str) and isinstance(h["dtype"], str)
          and isinstance(h["tokens"], bytes) and len(h["tokens"]) >= 4 and len(h["tokens"]) % 4 == 0
          and isinstance(h["shape"], list) and all(_is_uint(d) for d in h["shape"])
          and isinstance(h["created"], float)
          and isinstance(h["levels"], list)
          and all(isinstance(lv, list) and len(lv) == 2 and isinstance(lv[0], str) and _is_uint(lv[1])
                  for lv in h["levels"]))
    if not ok:
        raise _Corrupt("bad header: wrong field types")
    if h["key"] != expect_key:
        raise _Corrupt("header key does not match the file name")
    levels = [(name, n) for name, n in h["levels"]]
    if len({name for name, _ in levels}) != len(levels):
        raise _Corrupt("bad header: repeated level")
    h["tokens"] = struct.unpack(f"<{len(h['tokens']) // 4}I", h["tokens"])
    if chunk_key(h["parent"], h["model_id"], h["tokens"]) != h["key"]:
        raise _Corrupt("key is not the chunk key of the header's parent, model_id and tokens")
    body = _PREFIX.size + hlen
    expected = body + sum(n for _, n in levels) + _CRC.size
    if expected != file_size:
        raise _Corrupt(f"size {file_size} bytes, header says {expected} (truncated or padded)")
    return h, levels, body


def _decode(data: bytes, expect_key: bytes) -> ChunkRecord:
    """A whole chunk file -> record, checking everything (CRC included)."""
    if len(data) < _PREFIX.size + _CRC.size:
        raise _Corrupt(f"truncated: {len(data)} bytes")
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(memoryview(data)[:-_CRC.size]) != crc:
        raise _Corrupt("CRC mismatch")
    h, levels, off = _parse_header(data[:_PREFIX.size],
                                   lambda n: data[_PREFIX.size:_PREFIX.size + n], len(data), expect_key)
    payloads = {}
    for name, n in levels:
        payloads[name] = data[off:off + n]
        off += n
    return ChunkRecord(h["key"], h["parent"], h["index"], h["start"], h["model_id"], h["tokens"], h["dtype"],
                       tuple(h["shape"]), types.MappingProxyType(payloads), h["created"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the store ----------------------------------------------------------------------------------

class Store:
    """Chunks in a memory tier and (when `dir` is given) a disk tier under `dir`; see the module
    docstring. Call `open()` before use and `close()` at the end. Thread-safe."""

    def __init__(self, dir: Path | None, memory_budget: int, disk_budget: int,
                 on_add: Callback | None = None, on_remove: Callback | None = None) -> None:
        if memory_budget < 0 or disk_budget < 0:
            raise ValueError("budgets must be >= 0")
        self._dir = Path(dir) if dir is not None else None
        self._chunks = self._dir / "chunks" if self._dir is not None else None
        self._quarantine = self._dir / "quarantine" if self._dir is not None else None
        self._mem_budget = memory_budget
        self._disk_budget = disk_budget if dir is not None else 0
        self._on_add = on_add
        self._on_remove = on_remove
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a put finishes
        self._cb_lock = threading.RLock()  # one callback at a time (re-entrant: callbacks may put)
        self._events: collections.deque[tuple[Callback, list[bytes]]] = collections.deque()
        self._meta: dict[bytes, _Meta] = {}  # every held key
        self._children: dict[bytes, set[bytes]] = {}  # parent key -> held chunks naming it
        self._mem: collections.OrderedDict[bytes, ChunkRecord] = collections.OrderedDict()  # LRU first
        self._mem_bytes = 0
        self._disk: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> nbytes, LRU first
        self._disk_bytes = 0
        self._pins: collections.Counter[bytes] = collections.Counter()
        self._doomed: set[bytes] = set()  # deleted while pinned: removed at the last unpin
        self._inflight: set[bytes] = set()  # keys being put
        self._evictions = 0
        self._disk_errors = 0
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
        if self._dir is None:
            return OpenReport(0, [], 0)
        self._chunks.mkdir(parents=True, exist_ok=True)
        self._quarantine.mkdir(parents=True, exist_ok=True)
        corrupt: list[tuple[Path, str]] = []
        found: list[tuple[int, bytes, ChunkRecord | _Meta]] = []

        def bad(path: Path, reason: str) -> None:
            corrupt.append((path, reason))
            self._move_to_quarantine(path, reason)

        for top in sorted(os.scandir(self._chunks), key=lambda e: e.name):
            path = Path(top.path)
            if not (_SUBDIR.fullmatch(top.name) and top.is_dir(follow_symlinks=False)):
                bad(path, "unexpected entry in chunks/")
                continue
            for ent in sorted(os.scandir(path), key=lambda e: e.name):
                fpath = Path(ent.path)
                if ent.name.endswith(TMP_SUFFIX) and ent.is_file(follow_symlinks=False):
                    reason = "leftover temp file (removed)"
                    try:
                        os.unlink(fpath)
                    except OSError as e:
                        reason = f"leftover temp file (could not remove: {e})"
                    log.warning("%s: %s", fpath, reason)
                    corrupt.append((fpath, reason))
                    continue
                if not (_NAME.fullmatch(ent.name) and ent.name.startswith(top.name)
                        and ent.is_file(follow_symlinks=False)):
                    bad(fpath, "unexpected file name or type")
                    continue
                key = bytes.fromhex(ent.name[:-len(SUFFIX)])
                try:
                    st = ent.stat(follow_symlinks=False)
                    if verify:
                        with open(fpath, "rb") as f:
                            item = _meta_of(_decode(f.read(), key))
                    else:
                        with open(fpath, "rb") as f:
                            h, levels, _ = _parse_header(f.read(_PREFIX.size), f.read, st.st_size, key)
                        item = _Meta(h["parent"], h["index"], h["start"], h["model_id"], len(h["tokens"]),
                                     h["created"], sum(n for _, n in levels))
                except _Corrupt as e:
                    bad(fpath, str(e))
                    continue
                except OSError as e:
                    bad(fpath, f"unreadable: {e}")
                    continue
                found.append((st.st_mtime_ns, key, item))
        found.sort(key=lambda t: (t[0], t[1]))
        total = 0
        with self._lock:
            for _, key, meta in found:
                if key in self._meta:  # put before open (memory-only so far): keep one entry
                    continue
                self._add_meta(key, meta)
                self._disk[key] = meta.nbytes
                self._disk_bytes += meta.nbytes
                total += meta.nbytes
            removed = self._evict_disk()
        if removed:
            log.warning("open: evicted %d chunks to fit the disk budget of %d bytes", len(removed), self._disk_budget)
        log.info("open %s: %d chunks, %d bytes, %d bad files", self._dir, len(found), total, len(corrupt))
        return OpenReport(len(found), corrupt, total)

    def close(self) -> None:
        """Wait for puts in progress, fsync the directories; later puts raise StoreError."""
        with self._lock:
            self._closed = True
            self._idle.wait_for(lambda: not self._inflight, timeout=60.0)
        if self._chunks is not None and self._chunks.is_dir():
            try:
                _fsync_dir(self._chunks)
                _fsync_dir(self._dir)
            except OSError as e:
                log.warning("close: fsync of %s failed: %s", self._dir, e)
        self._run_callbacks()

    # -- writes -----------------------------------------------------------------------------

    def put(self, rec: ChunkRecord) -> bool:
        """Store a chunk (memory tier, written through to disk when it has one). False, with
        nothing rewritten, when the key is already held or being put; a put of a key whose
        delete is deferred by a pin cancels that delete. ValueError for a malformed record (the
        key must be chunk_key(parent, model_id, tokens)); StoreError when it fits neither budget,
        or fits only the disk and the write fails. A failed write of a chunk that fits memory is
        logged and counted in usage().disk_errors; the chunk stays in memory and put returns True."""
        rec = _normalise(rec)
        key, nb = rec.key, rec.nbytes
        with self._lock:
            if not self._opened or self._closed:
                raise StoreError("store is not open")
            if key in self._meta or key in self._inflight:
                self._doomed.discard(key)
                return False
            to_mem = nb <= self._mem_budget
            to_disk = self._dir is not None and 0 < self._disk_budget and nb <= self._disk_budget
            if not (to_mem or to_disk):
                where = (f"disk budget ({self._disk_budget} bytes)" if self._dir is not None
                         else "no disk tier")
                raise StoreError(f"chunk {key.hex()[:16]} of {nb} bytes exceeds the memory budget "
                                 f"({self._mem_budget} bytes) and the {where}")
            self._inflight.add(key)
        try:
            written = False
            if to_disk:
                try:
                    self._write_file(rec)
                    written = True
                except OSError as e:
                    with self._lock:
                        self._disk_errors += 1
                    log.warning("chunk %s: disk write failed (%s)%s", key.hex(), e,
                                "; kept in memory only" if to_mem else "")
                    if not to_mem:
                        raise StoreError(f"chunk {key.hex()[:16]} of {nb} bytes exceeds the memory budget "
                                         f"({self._mem_budget} bytes) and writing it to disk failed: {e}") from e
            with self._lock:
                self._add_meta(key, _meta_of(rec))
                if to_mem:
                    self._mem[key] = rec
                    self._mem_bytes += nb
                if written:
                    self._disk[key] = nb
                    self._disk_bytes += nb
                removed = self._evict_mem(protect=key if nb <= self._mem_budget else None)
                removed += self._evict_disk(protect=key if nb <= self._disk_budget else None)
                if key in self._meta:  # else a concurrent set_budgets shrank both tiers under it
                    self._queue(self._on_add, [key])
                self._queue(self._on_remove, [k for k in removed if k != key])
        finally:
            with self._lock:
                self._inflight.discard(key)
                self._idle.notify_all()
        self._run_callbacks()
        return True

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
        children are pending deletion do not count as shared). Pinned chunks are deleted at
        their last unpin. Returns how many chunks were deleted or scheduled for deletion."""
        n = 0
        removed: list[bytes] = []
        with self._lock:
            k: bytes | None = last_key
            while k is not None and k in self._meta:
                if any(c not in self._doomed for c in self._children.get(k, ())):
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

    def set_budgets(self, memory_budget: int, disk_budget: int) -> None:
        """New budgets (SIGHUP); evicts down to them now. A disk budget of 0 stops disk writes and
        evicts (deletes) every unpinned chunk file. Ignored disk budget without a directory."""
        if memory_budget < 0 or disk_budget < 0:
            raise ValueError("budgets must be >= 0")
        with self._lock:
            self._mem_budget = memory_budget
            if self._dir is not None:
                self._disk_budget = disk_budget
            self._queue(self._on_remove, self._evict_mem() + self._evict_disk())
        self._run_callbacks()

    # -- reads ------------------------------------------------------------------------------

    def get(self, key: bytes) -> ChunkRecord | None:
        """The chunk, or None. From memory, else read from disk with a full check (a bad file is
        quarantined and dropped: on_remove, logged) and promoted to memory when it fits. Bumps
        the chunk in both tiers' LRU order."""
        with self._lock:
            rec = self._mem.get(key)
            if rec is not None:
                self._mem.move_to_end(key)
                on_disk = key in self._disk
                if on_disk:
                    self._disk.move_to_end(key)
            elif key in self._disk:
                self._disk.move_to_end(key)
                self._pins[key] += 1  # keeps the file in place while we read it
            else:
                return None
        if rec is not None:
            if on_disk:
                self._touch(key)
            return rec
        error, missing = None, False
        try:
            with open(self._path(key), "rb") as f:
                rec = _decode(f.read(), key)
        except _Corrupt as e:
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
                if key in self._disk:
                    if missing:
                        log.warning("chunk %s: %s; dropped", key.hex(), error)
                    else:
                        self._move_to_quarantine(self._path(key), error)
                    self._disk_bytes -= self._disk.pop(key)
                    if key not in self._mem:
                        self._forget(key)
                        removed.append(key)
            removed += self._unpin_locked([key])
            if rec is not None and key in self._disk and key not in self._mem and rec.nbytes <= self._mem_budget:
                self._mem[key] = rec
                self._mem_bytes += rec.nbytes
                removed += self._evict_mem(protect=key)
            self._queue(self._on_remove, removed)
        self._run_callbacks()
        if rec is not None:
            self._touch(key)
        return rec

    def has(self, key: bytes) -> bool:
        with self._lock:
            return key in self._meta

    __contains__ = has

    def __len__(self) -> int:
        with self._lock:
            return len(self._meta)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._meta)

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of `keys` are held."""
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._meta:
                    break
                n += 1
            return n

    def pin(self, keys: Sequence[bytes]) -> list[ChunkRecord | None]:
        """Pin the held keys and return their records (None for keys not held, or whose file
        turned out bad; those are not left pinned). Unpin with unpin([r.key for r in recs if r]).
        Reads disk-only chunks: from an event loop, call it in a thread."""
        with self._lock:
            held = [k for k in keys if k in self._meta]
            for k in held:
                self._pins[k] += 1
        recs: list[ChunkRecord | None] = []
        try:
            held_set = set(held)
            for k in keys:
                recs.append(self.get(k) if k in held_set else None)
        finally:
            got = collections.Counter(r.key for r in recs if r is not None)
            extra = list((collections.Counter(held) - got).elements())  # pinned but not returned
            if len(recs) < len(keys):  # get raised: undo every pin
                extra = held
            if extra:
                self.unpin(extra)
        return recs

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
            return Usage(len(self._meta), self._mem_bytes, self._mem_budget, self._disk_bytes, self._disk_budget,
                         len(self._mem), len(self._disk), sum(1 for c in self._pins.values() if c > 0),
                         self._evictions, self._disk_errors)

    # -- helpers (the *_locked ones and _evict_* / _add_meta / _forget need self._lock) -------

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self._chunks / h[:2] / (h + SUFFIX)

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
        if meta.parent is not None:
            self._children.setdefault(meta.parent, set()).add(key)

    def _forget(self, key: bytes) -> None:
        meta = self._meta.pop(key)
        self._doomed.discard(key)
        if meta.parent is not None:
            kids = self._children.get(meta.parent)
            if kids is not None:
                kids.discard(key)
                if not kids:
                    del self._children[meta.parent]

    def _unlink(self, key: bytes) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            self._disk_errors += 1
            log.warning("chunk %s: could not remove its file: %s", key.hex(), e)

    def _delete_locked(self, key: bytes) -> list[bytes]:
        rec = self._mem.pop(key, None)
        if rec is not None:
            self._mem_bytes -= rec.nbytes
        nb = self._disk.pop(key, None)
        if nb is not None:
            self._disk_bytes -= nb
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
        return removed + self._evict_mem() + self._evict_disk()

    def _evict_mem(self, protect: bytes | None = None) -> list[bytes]:
        removed: list[bytes] = []
        if self._mem_bytes <= self._mem_budget:
            return removed
        for k in list(self._mem):
            if self._mem_bytes <= self._mem_budget:
                break
            if k == protect or self._pins[k]:
                continue
            self._mem_bytes -= self._mem.pop(k).nbytes
            self._evictions += 1
            if k not in self._disk:
                self._forget(k)
                removed.append(k)
        return removed

    def _evict_disk(self, protect: bytes | None = None) -> list[bytes]:
        removed: list[bytes] = []
        if self._disk_bytes <= self._disk_budget:
            return removed
        for k in list(self._disk):
            if self._disk_bytes <= self._disk_budget:
                break
            if k == protect or self._pins[k]:
                continue
            self._disk_bytes -= self._disk.pop(k)
            self._unlink(k)
            self._evictions += 1
            if k not in self._mem:
                self._forget(k)
                removed.append(k)
        return removed

    def _write_file(self, rec: ChunkRecord) -> None:
        """Write one chunk file atomically (temp, fsync, rename, fsync dir). Raises OSError, leaving
        neither the temp nor the final file behind."""
        final = self._path(rec.key)
        sub = final.parent
        if not sub.is_dir():
            sub.mkdir(parents=True, exist_ok=True)
            _fsync_dir(sub.parent)
        tmp = sub / f".{rec.key.hex()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        replaced = False
        try:
            with open(tmp, "xb") as f:
                head = _encode_header(rec)
                f.write(head)
                crc = zlib.crc32(head)
                for payload in rec.levels.values():
                    f.write(payload)
                    crc = zlib.crc32(payload, crc)
                f.write(_CRC.pack(crc))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            replaced = True
            _fsync_dir(sub)
        except BaseException:
            for p in ([final] if replaced else [tmp]):
                try:
                    os.unlink(p)
                except OSError:
                    pass
            raise

    def _touch(self, key: bytes) -> None:
        try:
            os.utime(self._path(key))
        except OSError:
            pass

    def _move_to_quarantine(self, path: Path, reason: str) -> None:
        dest = self._quarantine / path.name
        n = 0
        while dest.exists():
            n += 1
            dest = self._quarantine / f"{path.name}.{n}"
        try:
            self._quarantine.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)
            log.warning("%s: %s; moved to %s", path, reason, dest)
        except OSError as e:
            log.error("%s: %s; could not quarantine it (%s), leaving it in place", path, reason, e)
