"""The chunk-file format: the documented version 2 layout byte for byte, an error that names the
damaged field, and version 1 files (the codec bitstream's magic) that still load."""
from __future__ import annotations

import io
import shutil
import struct
import zlib

import msgpack
import pytest

from kvstreamd.store import chunkfile
from kvstreamd.store.chunkfile import ChunkFileError, ChunkRecord
from kvstreamd.store.keys import chunk_keys
from kvstreamd.store.store import Store
from tests import fixtures

DATA = fixtures.DATA
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOKENS = [1, 9690, 198, 2683, 359, 253, 5356, 5646]


def record(index=1) -> ChunkRecord:
    return chunkfile.normalise(ChunkRecord.of_chunk(
        chunk_keys(MODEL, TOKENS, 4), index, (4 * index, 4 * index + 4), MODEL, TOKENS, "float16", (30, 2, 4, 3, 64),
        {"balanced": bytes(range(20)), "fast": b"\x07" * 9, "text": b""}, created=1764580000.25))


@pytest.mark.parametrize("index", [0, 1])
def test_a_record_of_a_chunk_takes_its_parent_start_and_tokens_from_the_context(index):
    keys = chunk_keys(MODEL, TOKENS, 4)
    rec = ChunkRecord.of_chunk(keys, index, (4 * index, 4 * index + 4), MODEL, TOKENS, "float16",
                               (30, 2, 4, 3, 64), {"fast": b"x"})
    assert rec == ChunkRecord(keys[index], keys[index - 1] if index else None, index, 4 * index, MODEL,
                              tuple(TOKENS[4 * index:4 * index + 4]), "float16", (30, 2, 4, 3, 64), {"fast": b"x"}, 0.0)
    assert chunkfile.normalise(rec).key == keys[index]  # the key is the chunk's: parent, model and tokens


def header_of(rec: ChunkRecord) -> dict:
    """The header map, field by field as the docstring lays it out."""
    return {"key": rec.key, "parent": rec.parent, "index": rec.index, "start": rec.start,
            "model_id": rec.model_id, "tokens": struct.pack(f"<{len(rec.tokens)}I", *rec.tokens),
            "dtype": rec.dtype, "shape": list(rec.shape), "created": rec.created,
            "levels": [[n, len(p)] for n, p in rec.levels.items()]}


def build(header, payloads: list[bytes], magic=b"KVCF", version=2, hlen=None) -> bytes:
    """A file from the documented layout; version 1 has no header CRC. The CRCs are always right,
    so a test damages exactly one field."""
    raw = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    head = struct.pack("<4sHI", magic, version, len(raw) if hlen is None else hlen) + raw
    if version == 2:
        head += struct.pack("<I", zlib.crc32(head))
    body = head + b"".join(payloads)
    return body + struct.pack("<I", zlib.crc32(body))


def same(a: ChunkRecord, b: ChunkRecord) -> bool:
    return (a.key, a.parent, a.index, a.start, a.model_id, tuple(a.tokens), a.dtype, tuple(a.shape),
            dict(a.levels), a.created) == (b.key, b.parent, b.index, b.start, b.model_id, tuple(b.tokens),
                                           b.dtype, tuple(b.shape), dict(b.levels), b.created)


# -- the layout ---------------------------------------------------------------------------------

def test_written_files_follow_the_documented_version_2_layout():
    rec = record()
    data = chunkfile.encode(rec)
    magic, version, hlen = struct.unpack_from("<4sHI", data)
    assert (magic, version) == (b"KVCF", 2) == (chunkfile.MAGIC, chunkfile.VERSION)
    assert msgpack.unpackb(data[10:10 + hlen], raw=False) == header_of(rec)
    assert struct.unpack_from("<I", data, 10 + hlen)[0] == zlib.crc32(data[:10 + hlen])
    assert data[14 + hlen:-4] == b"".join(rec.levels.values())
    assert struct.unpack_from("<I", data, len(data) - 4)[0] == zlib.crc32(data[:-4])
    assert len(data) == 18 + hlen + rec.nbytes
    assert data == build(header_of(rec), list(rec.levels.values()))
    buf = io.BytesIO()
    assert chunkfile.write(buf, rec) == len(data) and buf.getvalue() == data


def test_round_trip_every_field():
    rec = record()
    assert same(chunkfile.decode(chunkfile.encode(rec), rec.key), rec)
    first = record(0)
    assert same(chunkfile.decode(chunkfile.encode(first)), first)


def test_read_header_reads_no_payload():
    rec = record()
    data = chunkfile.encode(rec)
    f = io.BytesIO(data)
    h = chunkfile.read_header(f, len(data), rec.key)
    assert (h.version, h.key, h.parent, h.index, h.start, h.model_id, h.tokens, h.dtype, h.shape, h.created) == \
        (2, rec.key, rec.parent, rec.index, rec.start, rec.model_id, rec.tokens, rec.dtype, rec.shape, rec.created)
    assert h.levels == (("balanced", 20), ("fast", 9), ("text", 0)) and h.nbytes == rec.nbytes
    assert f.tell() == h.payload_offset == len(data) - rec.nbytes - 4


# -- one error per field ------------------------------------------------------------------------

def _with(**fields):
    def make(rec):
        return build({**header_of(rec), **fields}, list(rec.levels.values()))
    return make


def _without(name):
    def make(rec):
        h = header_of(rec)
        del h[name]
        return build(h, list(rec.levels.values()))
    return make


def _flip(offset):
    def make(rec):
        data = bytearray(chunkfile.encode(rec))
        data[offset] ^= 0x01
        return bytes(data)
    return make


DAMAGE = {
    "empty": (lambda rec: b"", "size"),
    "prefix only": (lambda rec: chunkfile.encode(rec)[:12], "size"),
    "other magic": (lambda rec: b"XXXX" + chunkfile.encode(rec)[4:], "magic"),
    "legacy magic, version 2": (lambda rec: build(b"", [], magic=b"KVSC", version=2), "version"),
    "version 3": (lambda rec: build(header_of(rec), list(rec.levels.values()), version=3), "version"),
    "v2 layout as version 1": (lambda rec: build(header_of(rec), [], version=1)[:10] + chunkfile.encode(rec)[10:],
                               "version"),
    "header length past the end": (lambda rec: build(header_of(rec), [], hlen=10**6), "header length"),
    "header length over the limit": (lambda rec: build(header_of(rec), [], hlen=2**32 - 1), "header length"),
    "header byte flipped": (_flip(30), "header CRC"),
    "header length off by one": (_flip(6), "header CRC"),  # still fits the file: the CRC sees it
    "header not msgpack": (lambda rec: build(b"\xc1", list(rec.levels.values())), "header"),
    "header a list": (lambda rec: build(msgpack.packb([1, 2]), list(rec.levels.values())), "header"),
    "header missing a field": (_without("dtype"), "header"),
    "header with an unknown field": (_with(extra=1), "header"),
    "short key": (_with(key=b"k" * 31), "header.key"),
    "parent of 5 bytes": (_with(parent=b"p" * 5), "header.parent"),
    "no parent at index 1": (_with(parent=None), "header.parent"),
    "negative index": (_with(index=-1), "header.index"),
    "bool index": (_with(index=True), "header.index"),
    "str start": (_with(start="4"), "header.start"),
    "int model_id": (_with(model_id=5), "header.model_id"),
    "token bytes not whole": (_with(tokens=b"abcde"), "header.tokens"),
    "no tokens": (_with(tokens=b""), "header.tokens"),
    "dtype nil": (_with(dtype=None), "header.dtype"),
    "negative dimension": (_with(shape=[30, -2]), "header.shape"),
    "int created": (_with(created=1764580000), "header.created"),
    "level without a length": (_with(levels=[["fast"]]), "header.levels"),
    "level named twice": (_with(levels=[["fast", 9], ["fast", 20]]), "header.levels"),
    "key of other tokens": (_with(tokens=struct.pack("<4I", 1, 2, 3, 4)), "header.key"),
    "under another name": (lambda rec: chunkfile.encode(record(0)), "key"),
    "one byte short": (lambda rec: chunkfile.encode(rec)[:-1], "payload length"),
    "one byte padded": (lambda rec: build(header_of(rec), list(rec.levels.values()) + [b"\0"]), "payload length"),
    "payload byte flipped": (_flip(-10), "CRC"),
    "file CRC flipped": (_flip(-1), "CRC"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_file_names_the_wrong_field(case):
    make, field = DAMAGE[case]
    rec = record()
    data = make(rec)
    with pytest.raises(ChunkFileError) as e:
        chunkfile.decode(data, rec.key)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")
    assert isinstance(e.value, ValueError)
    if field != "CRC":  # the header-only read finds every other field too
        with pytest.raises(ChunkFileError) as e2:
            chunkfile.read_header(io.BytesIO(data), len(data), rec.key)
        assert e2.value.field == field


def test_the_store_quarantines_with_the_field_named(tmp_path):
    rec = record()
    s = Store(tmp_path, 2**20, 2**20)
    s.open()
    s.put(rec)
    s.close()
    path = tmp_path / "chunks" / rec.key.hex()[:2] / f"{rec.key.hex()}.kvc"
    path.write_bytes(DAMAGE["negative index"][0](rec))
    s2 = Store(tmp_path, 2**20, 2**20)
    report = s2.open()
    assert report.loaded == 0 and [why for _, why in report.corrupt] == [
        "header.index: not an unsigned integer: -1"]


# -- version 1 ----------------------------------------------------------------------------------

def test_a_version_1_file_from_the_documented_layout_decodes():
    rec = record()
    data = build(header_of(rec), list(rec.levels.values()), magic=b"KVSC", version=1)
    assert len(data) == 14 + len(msgpack.packb(header_of(rec), use_bin_type=True)) + rec.nbytes
    assert same(chunkfile.decode(data, rec.key), rec)
    h = chunkfile.read_header(io.BytesIO(data), len(data), rec.key)
    assert h.version == 1 and h.payload_offset == len(data) - rec.nbytes - 4
    damaged = bytearray(data)
    damaged[-10] ^= 1
    with pytest.raises(ChunkFileError, match="^CRC: "):
        chunkfile.decode(bytes(damaged), rec.key)


def test_a_store_written_before_version_2_still_loads(tmp_path):
    """tests/data/store-v1 was written by the store as it was before this format: two chunks of
    one context."""
    shutil.copytree(DATA / "store-v1", tmp_path / "store")
    old = sorted((tmp_path / "store" / "chunks").glob("*/*.kvc"))
    assert [p.read_bytes()[:6] for p in old] == [b"KVSC\x01\x00"] * 2
    keys = chunk_keys(MODEL, TOKENS + [11173, 2**32 - 1], 4)
    s = Store(tmp_path / "store", 2**20, 2**20)
    report = s.open(verify=True)
    assert report.loaded == 2 and report.corrupt == [] and report.bytes == 24
    for i in range(2):
        got = s.get(keys[i])
        assert (got.parent, got.index, got.start, got.model_id, got.tokens, got.dtype, got.shape, got.created) == \
            (keys[i - 1] if i else None, i, 4 * i, MODEL, tuple(TOKENS[4 * i:4 * i + 4]), "float16",
             (30, 2, 4, 3, 64), 1764580000.5 + i)
        assert dict(got.levels) == {"balanced": bytes(range(i, i + 12)), "text": b""}
    assert [c.tokens for c in s.contexts()] == [8]
    # new chunks are written as version 2; the old files stay as they are
    new = chunkfile.normalise(ChunkRecord(keys[2], keys[1], 2, 8, MODEL, (11173, 2**32 - 1), "float16",
                                          (30, 2, 2, 3, 64), {"balanced": b"new"}))
    assert s.put(new)
    path = tmp_path / "store" / "chunks" / keys[2].hex()[:2] / f"{keys[2].hex()}.kvc"
    assert path.read_bytes()[:6] == b"KVCF\x02\x00"
    assert [p.read_bytes()[:6] for p in old] == [b"KVSC\x01\x00"] * 2
    s.close()
    s2 = Store(tmp_path / "store", 2**20, 2**20)
    assert s2.open(verify=True).loaded == 3
    assert [c.tokens for c in s2.contexts()] == [10]
