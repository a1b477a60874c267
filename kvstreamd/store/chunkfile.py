"""A chunk record and the file format a chunk is kept in on disk. Reading checks every field and a
damaged file raises ChunkFileError naming the field that is wrong.

Format version 2 (written), all integers little-endian:

    offset   size   field
    0        4      magic b"KVCF"
    4        2      format version, uint16 (2)
    6        4      header length H, uint32 (at most MAX_HEADER_BYTES)
    10       H      header: one msgpack map (str keys, bin for bytes), exactly these fields:
                      "key": bin(32), "parent": bin(32) or nil, "index": uint, "start": uint,
                      "model_id": str, "tokens": bin (uint32 little-endian token ids, >= 1),
                      "dtype": str, "shape": [uint, ...], "created": float,
                      "levels": [[name: str, payload length: uint], ...]
    10+H     4      header CRC: CRC-32 (zlib.crc32) of bytes 0 .. 10+H, uint32
    14+H     sum    the level payloads, concatenated in the order of "levels"
    end-4    4      CRC-32 of every preceding byte, uint32

The file size is exactly 18 + H + sum(payload lengths). "key" must be chunk_key(parent, model_id,
tokens) (kvstreamd.store.keys), chunk 0 has no parent and every other chunk has one, and level names
are distinct. The header CRC lets a reader trust a header without reading the payloads.

Version 1 (read, never written) is the same without the header CRC (size 14 + H + sum) and with
magic b"KVSC", the codec bitstream's, which it borrowed: files stored before version 2 still load.
"""
from __future__ import annotations

import io
import struct
import time
import types
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Callable, Mapping, Sequence

import msgpack

from kvstreamd.store.keys import KEY_BYTES, chunk_key, tokens_bytes

MAGIC = b"KVCF"
VERSION = 2
LEGACY_MAGIC = b"KVSC"  # version 1 files: the codec bitstream's magic
LEGACY_VERSION = 1
MAX_HEADER_BYTES = 64 * 2**20
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
_U32 = struct.Struct("<I")
HEADER_FIELDS = ("key", "parent", "index", "start", "model_id", "tokens", "dtype", "shape", "created", "levels")


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

    @classmethod
    def of_chunk(cls, keys: Sequence[bytes], i: int, span: tuple[int, int], model_id: str,
                 tokens: Sequence[int], dtype: str, shape: tuple[int, ...], levels: Mapping[str, bytes],
                 created: float = 0.0) -> ChunkRecord:
        """Chunk i of a context whose chunk keys are `keys` and token ids `tokens`: it covers
        tokens[span[0]:span[1]], and its parent is chunk i - 1 (none for chunk 0)."""
        s, e = span
        return cls(keys[i], keys[i - 1] if i else None, i, s, model_id, tuple(tokens[s:e]), dtype, shape,
                   levels, created)

    @property
    def nbytes(self) -> int:
        """Sum of the payload lengths: what store budgets count."""
        return sum(len(v) for v in self.levels.values())


class ChunkFileError(ValueError):
    """A chunk file that is damaged or not a chunk file; `field` names what is wrong: "size",
    "magic", "version", "header length", "header CRC", "header", "header.<name>", "key",
    "payload length" or "CRC"."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True)
class Header:
    """A chunk file's checked header: everything but the payloads."""
    version: int  # the file's format version (1 or 2)
    key: bytes
    parent: bytes | None
    index: int
    start: int
    model_id: str
    tokens: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    created: float
    levels: tuple[tuple[str, int], ...]  # (level name, payload length), in file order
    payload_offset: int  # where the first payload starts

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.levels)


def _is_uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def normalise(rec: ChunkRecord) -> ChunkRecord:
    """Validate a record (ValueError says what is wrong) and return an immutable copy with token
    ids and shape as int tuples, payloads as bytes and `created` stamped if it was 0."""
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


# -- writing ------------------------------------------------------------------------------------

def write(f: BinaryIO, rec: ChunkRecord) -> int:
    """Write `rec` (a normalised record) to f as a version 2 chunk file; returns the bytes written."""
    hdr = msgpack.packb({
        "key": rec.key, "parent": rec.parent, "index": rec.index, "start": rec.start,
        "model_id": rec.model_id, "tokens": tokens_bytes(rec.tokens), "dtype": rec.dtype,
        "shape": list(rec.shape), "created": float(rec.created),
        "levels": [[name, len(p)] for name, p in rec.levels.items()],
    }, use_bin_type=True)
    head = _PREFIX.pack(MAGIC, VERSION, len(hdr)) + hdr
    head += _U32.pack(zlib.crc32(head))
    f.write(head)
    crc = zlib.crc32(head)
    for payload in rec.levels.values():
        f.write(payload)
        crc = zlib.crc32(payload, crc)
    f.write(_U32.pack(crc))
    return len(head) + rec.nbytes + _U32.size


def encode(rec: ChunkRecord) -> bytes:
    """A whole version 2 chunk file in memory (see `write`)."""
    buf = io.BytesIO()
    write(buf, rec)
    return buf.getvalue()


# -- reading ------------------------------------------------------------------------------------

def read_header(f: BinaryIO, file_size: int, expect_key: bytes | None = None) -> Header:
    """Check a chunk file's prefix and header, read from f's current position (the file's start),
    and that the file is as long as the header says; the payloads are not read and so not
    CRC-checked. expect_key: the key the file is named for. Raises ChunkFileError."""
    return _parse(f.read, file_size, expect_key)


def check(data: bytes, expect_key: bytes | None = None) -> Header:
    """Check a whole chunk file (version 2 or 1), every field and the CRC; returns its header.
    Raises ChunkFileError."""
    h = _parse(io.BytesIO(data).read, len(data), expect_key)
    (crc,) = _U32.unpack_from(data, len(data) - _U32.size)
    actual = zlib.crc32(memoryview(data)[:-_U32.size])
    if actual != crc:
        raise ChunkFileError("CRC", f"the file's bytes have CRC-32 {actual:#010x}, the file says {crc:#010x}")
    return h


def decode(data: bytes, expect_key: bytes | None = None) -> ChunkRecord:
    """A whole chunk file (version 2 or 1) -> record, checked as by `check`."""
    h = check(data, expect_key)
    payloads, off = {}, h.payload_offset
    for name, n in h.levels:
        payloads[name] = data[off:off + n]
        off += n
    return ChunkRecord(h.key, h.parent, h.index, h.start, h.model_id, h.tokens, h.dtype, h.shape,
                       types.MappingProxyType(payloads), h.created)


def _parse(read: Callable[[int], bytes], file_size: int, expect_key: bytes | None) -> Header:
    if file_size < _PREFIX.size + _U32.size:
        raise ChunkFileError("size", f"{file_size} bytes is shorter than any chunk file")
    prefix = read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise ChunkFileError("size", f"the file ended after {len(prefix)} bytes")
    magic, version, hlen = _PREFIX.unpack(prefix)
    if magic == MAGIC:
        if version != VERSION:
            raise ChunkFileError("version", f"{version} is not a version of this format (this reader reads "
                                            f"{VERSION}, and {LEGACY_VERSION} under magic {LEGACY_MAGIC!r})")
    elif magic == LEGACY_MAGIC:
        if version != LEGACY_VERSION:
            raise ChunkFileError("version", f"{version} under the legacy magic {LEGACY_MAGIC!r} (only "
                                            f"{LEGACY_VERSION} was written with it)")
    else:
        raise ChunkFileError("magic", f"{magic!r} is not {MAGIC!r} (nor the legacy {LEGACY_MAGIC!r})")
    head_crc = version == VERSION
    if hlen > MAX_HEADER_BYTES:
        raise ChunkFileError("header length", f"{hlen} bytes is over the limit of {MAX_HEADER_BYTES}")
    if _PREFIX.size + hlen + (_U32.size if head_crc else 0) + _U32.size > file_size:
        raise ChunkFileError("header length", f"{hlen} bytes does not fit a file of {file_size} bytes")
    raw = read(hlen)
    if len(raw) != hlen:
        raise ChunkFileError("header length", f"{hlen} bytes, but the file ended after {len(raw)} of them")
    body = _PREFIX.size + hlen
    if head_crc:
        stored = read(_U32.size)
        if len(stored) != _U32.size:
            raise ChunkFileError("header CRC", "the file ended inside it")
        (stored,) = _U32.unpack(stored)
        actual = zlib.crc32(raw, zlib.crc32(prefix))
        if actual != stored:
            raise ChunkFileError("header CRC", f"the prefix and header have CRC-32 {actual:#010x}, "
                                               f"the file says {stored:#010x}")
        body += _U32.size
    try:
        h = msgpack.unpackb(raw, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise ChunkFileError("header", f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(h, dict):
        raise ChunkFileError("header", f"a msgpack {type(h).__name__}, not a map")
    missing = ", ".join(repr(f) for f in HEADER_FIELDS if f not in h)
    extra = ", ".join(sorted(repr(f) for f in set(h) - set(HEADER_FIELDS)))
    if missing or extra:
        raise ChunkFileError("header", "; ".join(([f"missing fields {missing}"] if missing else [])
                                                 + ([f"unknown fields {extra}"] if extra else [])))
    hdr = _check_fields(h, version, body)
    if expect_key is not None and hdr.key != expect_key:
        raise ChunkFileError("key", f"the header's key {hdr.key.hex()[:16]} is not the file's, "
                                    f"{expect_key.hex()[:16]} (a file under another chunk's name)")
    expected = body + hdr.nbytes + _U32.size
    if expected != file_size:
        raise ChunkFileError("payload length", f"the header's levels make the file {expected} bytes, it is "
                                               f"{file_size} (truncated or padded)")
    return hdr


def _field(name: str, problem: str) -> ChunkFileError:
    return ChunkFileError(f"header.{name}", problem)


def _check_fields(h: dict, version: int, body: int) -> Header:
    key, parent = h["key"], h["parent"]
    if not (isinstance(key, bytes) and len(key) == KEY_BYTES):
        raise _field("key", f"not {KEY_BYTES} bytes: {key!r:.80}")
    if not (parent is None or (isinstance(parent, bytes) and len(parent) == KEY_BYTES)):
        raise _field("parent", f"neither nil nor {KEY_BYTES} bytes: {parent!r:.80}")
    for name in ("index", "start"):
        if not _is_uint(h[name]):
            raise _field(name, f"not an unsigned integer: {h[name]!r:.80}")
    if (h["index"] == 0) != (parent is None):
        raise _field("parent", f"{'nil' if parent is None else 'set'} at index {h['index']} (chunk 0 has "
                               f"no parent and every other chunk has one)")
    for name in ("model_id", "dtype"):
        if not isinstance(h[name], str):
            raise _field(name, f"not a str: {h[name]!r:.80}")
    tokens = h["tokens"]
    if not (isinstance(tokens, bytes) and len(tokens) >= 4 and len(tokens) % 4 == 0):
        raise _field("tokens", f"not a non-empty whole number of uint32s: {tokens!r:.80}")
    shape = h["shape"]
    if not (isinstance(shape, list) and all(_is_uint(d) for d in shape)):
        raise _field("shape", f"not a list of unsigned integers: {shape!r:.80}")
    if not isinstance(h["created"], float):
        raise _field("created", f"not a float: {h['created']!r:.80}")
    levels = h["levels"]
    if not (isinstance(levels, list) and all(isinstance(lv, list) and len(lv) == 2 and isinstance(lv[0], str)
                                             and _is_uint(lv[1]) for lv in levels)):
        raise _field("levels", f"not a list of [name, payload length] pairs: {levels!r:.80}")
    names = [name for name, _ in levels]
    if len(set(names)) != len(names):
        raise _field("levels", f"a level named twice: {names!r:.80}")
    toks = struct.unpack(f"<{len(tokens) // 4}I", tokens)
    if chunk_key(parent, h["model_id"], toks) != key:
        raise _field("key", "not the chunk key of the header's parent, model_id and tokens")
    return Header(version, key, parent, h["index"], h["start"], h["model_id"], toks, h["dtype"], tuple(shape),
                  h["created"], tuple((name, n) for name, n in levels), body)
