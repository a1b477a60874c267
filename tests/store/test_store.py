"""The chunk store on real files: keys, round trips, both LRU tiers, pins, reopen, corrupt
files, contexts with shared prefixes, budgets, a really full disk (tmpfs) and threads."""
from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import struct
import threading
import time
from pathlib import Path

import pytest

from kvstreamd.store.chunkfile import ChunkRecord
from kvstreamd.store.keys import chunk_key, chunk_keys
from kvstreamd.store.store import ContextInfo, Store, StoreError
from tests.fixtures import KIB, Events, chunk_file, make_context, open_store



def chunk_files(dir: Path) -> list[Path]:
    return sorted((dir / "chunks").glob("*/*"))


def same_record(a: ChunkRecord, b: ChunkRecord) -> bool:
    return (a.key, a.parent, a.index, a.start, a.model_id, tuple(a.tokens), a.dtype, tuple(a.shape),
            dict(a.levels)) == (b.key, b.parent, b.index, b.start, b.model_id, tuple(b.tokens), b.dtype,
                                tuple(b.shape), dict(b.levels))


def check_consistent(s: Store, dir: Path | None, events: Events | None = None):
    u = s.usage()
    keys = s.keys()
    assert len(keys) == len(set(keys)) == len(s) == u.chunks
    assert s._mem.bytes == sum(s._mem.get(k).nbytes for k in s._mem) == sum(map(s._mem.size, s._mem)) == u.memory_bytes
    assert u.disk_bytes == sum(map(s._disk.size, s._disk)) == s._disk.bytes
    assert set(keys) == set(s._mem) | set(s._disk)
    if dir is not None:
        on_disk = {bytes.fromhex(p.name[:-4]) for p in chunk_files(dir)}
        assert on_disk == set(s._disk)
        assert not list((dir / "chunks").glob("*/*.tmp"))
    if events is not None:
        assert events.held == set(keys)


# -- keys ---------------------------------------------------------------------------------------

def test_chunk_keys_layout_and_chaining():
    toks = list(range(100, 110))
    keys = chunk_keys("m", toks, 4)
    assert len(keys) == 3 and all(len(k) == 32 for k in keys)
    assert keys == chunk_keys("m", toks, 4) == chunk_keys("m", tuple(toks), 4)
    # the documented byte layout
    k0 = hashlib.blake2b(struct.pack("<I", 1) + b"m" + struct.pack("<4I", *toks[:4]), digest_size=32).digest()
    k1 = hashlib.blake2b(k0 + struct.pack("<I", 1) + b"m" + struct.pack("<4I", *toks[4:8]), digest_size=32).digest()
    k2 = hashlib.blake2b(k1 + struct.pack("<I", 1) + b"m" + struct.pack("<2I", *toks[8:]), digest_size=32).digest()
    assert keys == [k0, k1, k2]
    assert chunk_key(None, "m", toks[:4]) == k0 and chunk_key(k0, "m", toks[4:8]) == k1
    # shared prefix -> shared keys, then they part
    other = chunk_keys("m", toks[:8] + [1, 2], 4)
    assert other[:2] == keys[:2] and other[2] != keys[2]
    changed = chunk_keys("m", toks[:5] + [7] + toks[6:], 4)
    assert changed[0] == keys[0] and changed[1] != keys[1] and changed[2] != keys[2]
    # model id, chunk boundaries
    assert not set(chunk_keys("m2", toks, 4)) & set(keys)
    assert chunk_keys("m", toks, 5)[-1] != keys[-1]
    assert chunk_keys("m", toks[:8], 4)[-1] != chunk_keys("m", toks[:8], 8)[-1]
    # model id with a length prefix: ("ab", [..]) and ("a", ...) can not collide through the prefix
    assert chunk_keys("ab", [1], 4) != chunk_keys("a", [1], 4)
    assert chunk_keys("m", [], 4) == []
    with pytest.raises(ValueError):
        chunk_keys("m", toks, 0)
    with pytest.raises(ValueError):
        chunk_keys("m", [-1], 4)
    with pytest.raises(ValueError):
        chunk_keys("m", [2**32], 4)


# -- round trips and the memory tier ------------------------------------------------------------

def test_put_get_round_trip_every_field(tmp_path):
    ev = Events()
    s, report = open_store(tmp_path, events=ev)
    assert report.loaded == 0 and report.corrupt == []
    recs = make_context(n_chunks=2, tokens=[5, 6, 7, 8, 9, 10, 11])
    before = time.time()
    for r in recs:
        assert s.put(r) is True
    assert ev.added == [r.key for r in recs]
    for r in recs:
        got = s.get(r.key)
        assert same_record(got, r) and got.nbytes == r.nbytes == KIB
        assert before <= got.created <= time.time()
        assert got.key in s and s.has(got.key)
    assert len(s) == 2 and s.longest_prefix([r.key for r in recs] + [b"x" * 32]) == 2
    assert s.longest_prefix([b"x" * 32, recs[0].key]) == 0
    assert s.get(b"x" * 32) is None
    assert recs[1].tokens == (9, 10, 11) and s.get(recs[1].key).start == 4
    # the disk copy holds every field too, created included
    created = {r.key: s.get(r.key).created for r in recs}
    s.close()
    s2, report = open_store(tmp_path)
    assert report.loaded == 2 and report.bytes == 2 * KIB
    for r in recs:
        got = s2.get(r.key)
        assert same_record(got, r) and got.created == created[r.key]
    u = s2.usage()
    assert (u.chunks, u.memory_chunks, u.disk_chunks) == (2, 2, 2)  # both promoted by get


def test_put_rejects_bad_records(tmp_path):
    s, _ = open_store(tmp_path)
    r = make_context(n_chunks=2)[1]
    with pytest.raises(ValueError, match="chunk key"):
        s.put(ChunkRecord(**{**r.__dict__, "tokens": (1, 2, 3, 4)}))
    with pytest.raises(ValueError):
        s.put(ChunkRecord(**{**r.__dict__, "parent": None}))  # index 1 without a parent
    with pytest.raises(ValueError):
        s.put(ChunkRecord(**{**r.__dict__, "key": b"short"}))
    assert len(s) == 0 and chunk_files(tmp_path) == []
    with pytest.raises(StoreError, match="not open"):
        Store(None, 10, 10).put(r)


def test_put_of_held_key_returns_false_and_does_not_rewrite(tmp_path):
    ev = Events()
    s, _ = open_store(tmp_path, events=ev)
    r = make_context(n_chunks=1)[0]
    assert s.put(r)
    path = chunk_file(tmp_path, r.key)
    st = path.stat()
    time.sleep(0.01)
    assert s.put(r) is False
    assert s.put(ChunkRecord(**{**r.__dict__, "levels": {"high": b"other"}})) is False
    st2 = path.stat()
    assert (st2.st_mtime_ns, st2.st_ino, st2.st_size) == (st.st_mtime_ns, st.st_ino, st.st_size)
    assert ev.added == [r.key] and len(s) == 1
    assert dict(s.get(r.key).levels) == dict(r.levels)


def test_memory_lru_evicts_least_recently_got():
    ev = Events()
    s = Store(None, 3 * KIB, 50 * KIB, on_add=ev.on_add, on_remove=ev.on_remove)
    s.open()
    a, b, c, d = make_context(n_chunks=4)
    for r in (a, b, c):
        s.put(r)
    assert s.usage().disk_budget == 0  # no directory: no disk tier
    s.get(a.key)  # b is now the least recently used
    s.put(d)
    assert ev.removed == [b.key]
    assert set(s.keys()) == {a.key, c.key, d.key} and s.get(b.key) is None
    s.get(c.key)
    s.put(make_context(n_chunks=5)[4])  # order is a, d, c: a goes
    assert ev.removed == [b.key, a.key]
    u = s.usage()
    assert u.memory_bytes == 3 * KIB and u.memory_chunks == 3 and u.evictions == 2
    check_consistent(s, None, ev)


def test_memory_eviction_keeps_disk_copy_and_get_promotes(tmp_path):
    ev = Events()
    s, _ = open_store(tmp_path, mem=2 * KIB, disk=10 * KIB, events=ev)
    a, b, c = make_context(n_chunks=3)
    for r in (a, b, c):
        s.put(r)
    u = s.usage()
    assert (u.memory_chunks, u.disk_chunks, u.chunks) == (2, 3, 3)
    assert a.key not in s._mem and ev.removed == []  # left memory only
    got = s.get(a.key)  # from disk, promoted, b leaves memory
    assert same_record(got, a)
    assert set(s._mem) == {c.key, a.key}
    assert s.get(a.key) is got  # now a memory hit
    check_consistent(s, tmp_path, ev)


def test_disk_budget_eviction_calls_on_remove(tmp_path):
    ev = Events()
    s, _ = open_store(tmp_path, mem=KIB, disk=3 * KIB, events=ev)
    recs = make_context(n_chunks=5)
    for r in recs[:3]:
        s.put(r)
    s.get(recs[0].key)  # bump chunk 0 on disk (and into memory)
    s.put(recs[3])  # disk over budget: chunk 1 is the least recently used on disk
    assert ev.removed == [recs[1].key]
    assert not chunk_file(tmp_path, recs[1].key).exists()
    s.put(recs[4])  # disk order 2, 0, 3, 4: chunk 2 goes (and is in no tier)
    assert recs[2].key in ev.removed
    assert s.usage().disk_bytes <= 3 * KIB
    check_consistent(s, tmp_path, ev)


def test_chunk_bigger_than_a_budget_goes_to_the_other_tier(tmp_path):
    s, _ = open_store(tmp_path, mem=2 * KIB, disk=8 * KIB)
    big = make_context(n_chunks=1, payload=4 * KIB, seed=1)[0]
    assert s.put(big)
    assert big.key not in s._mem and big.key in s._disk
    assert same_record(s.get(big.key), big)
    assert big.key not in s._mem  # too big to promote
    huge = make_context(n_chunks=1, payload=16 * KIB, seed=2)[0]
    with pytest.raises(StoreError, match="memory budget .* disk budget"):
        s.put(huge)
    mem_only = Store(None, 2 * KIB, 0)
    mem_only.open()
    with pytest.raises(StoreError, match="no disk tier"):
        mem_only.put(big)
    small_disk, _ = open_store(tmp_path / "other", mem=8 * KIB, disk=2 * KIB)
    assert small_disk.put(big) and big.key in small_disk._mem and not chunk_files(tmp_path / "other")
    assert huge.key not in s and len(s) == 1


# -- pins ---------------------------------------------------------------------------------------

def test_pinned_chunks_survive_eviction_and_deferred_delete(tmp_path):
    ev = Events()
    s, _ = open_store(tmp_path, mem=2 * KIB, disk=2 * KIB, events=ev)
    recs = make_context(n_chunks=6)
    s.put(recs[0])
    s.put(recs[1])
    with s.pinned([recs[0].key, b"y" * 32, recs[1].key]) as got:
        assert got[1] is None and same_record(got[0], recs[0]) and same_record(got[2], recs[1])
        assert s.usage().pinned == 2
        for r in recs[2:]:
            s.put(r)  # everything else comes and goes; the pinned two stay
        assert recs[0].key in s and recs[1].key in s
        assert chunk_file(tmp_path, recs[0].key).exists()
        assert s.delete(recs[0].key) is True  # deferred: still held and readable
        assert recs[0].key in s and same_record(s.get(recs[0].key), recs[0])
        assert recs[0].key not in ev.removed
    assert s.usage().pinned == 0
    assert recs[0].key not in s and not chunk_file(tmp_path, recs[0].key).exists()
    assert recs[0].key in ev.removed
    assert s.usage().memory_bytes <= 2 * KIB and s.usage().disk_bytes <= 2 * KIB  # evicted down at unpin
    check_consistent(s, tmp_path, ev)


def test_pinned_chunks_stay_in_memory_without_a_disk_tier():
    ev = Events()
    s = Store(None, 2 * KIB, 0, on_add=ev.on_add, on_remove=ev.on_remove)
    s.open()
    recs = make_context(n_chunks=5)
    s.put(recs[0])
    with s.pinned([recs[0].key]):
        for r in recs[1:]:
            s.put(r)
        assert recs[0].key in s and s.usage().memory_bytes == 2 * KIB
        assert ev.removed == [r.key for r in recs[1:4]]
    s.get(recs[4].key)
    s.put(make_context(n_chunks=6)[5])
    assert ev.removed == [r.key for r in recs[1:4]] + [recs[0].key]  # unpinned: LRU again
    check_consistent(s, None, ev)


def test_pins_are_counted_and_a_put_cancels_a_deferred_delete(tmp_path):
    s, _ = open_store(tmp_path)
    a, b = make_context(n_chunks=2)
    s.put(a)
    s.put(b)
    with s.pinned([a.key]):
        with s.pinned([a.key, a.key]):
            assert s._pins[a.key] == 3
            s.delete(a.key)
        assert a.key in s  # still pinned once
        assert s.usage().pinned == 1
    assert a.key not in s
    with s.pinned([b.key]):
        s.delete(b.key)
        assert s.put(b) is False  # held: nothing rewritten, but the delete is cancelled
    assert b.key in s
    recs = s.pin([b.key, a.key])
    assert recs[1] is None and s.usage().pinned == 1
    s.unpin([r.key for r in recs if r])
    assert s.usage().pinned == 0


# -- reopen and corrupt files -------------------------------------------------------------------

def test_reopen_rebuilds_the_index_without_on_add(tmp_path):
    ev = Events()
    s, _ = open_store(tmp_path, events=ev)
    ctx1 = make_context(n_chunks=3, seed=1)
    ctx2 = make_context(model="model-b", n_chunks=2, seed=2)
    for r in ctx1 + ctx2:
        s.put(r)
    contexts = s.contexts()
    s.close()
    with pytest.raises(StoreError):
        s.put(make_context(seed=9)[0])
    ev2 = Events()
    s2, report = open_store(tmp_path, events=ev2)
    assert report.loaded == 5 and report.corrupt == [] and report.bytes == 5 * KIB
    assert ev2.added == [] and ev2.removed == []
    assert set(s2.keys()) == {r.key for r in ctx1 + ctx2}
    assert s2.contexts() == contexts
    u = s2.usage()
    assert (u.memory_chunks, u.disk_chunks, u.disk_bytes) == (0, 5, 5 * KIB)
    with pytest.raises(StoreError, match="already"):
        s2.open()


def test_reopen_keeps_lru_order_from_mtimes_and_evicts_to_the_budget(tmp_path):
    s, _ = open_store(tmp_path)
    recs = make_context(n_chunks=4)
    for r in recs:
        s.put(r)
    s.close()
    now = time.time()
    for age, r in zip([10, 40, 20, 30], recs):  # oldest first: 1, 3, 2, 0
        os.utime(chunk_file(tmp_path, r.key), (now - age, now - age))
    s2, report = open_store(tmp_path, disk=2 * KIB)
    assert report.loaded == 4
    assert set(s2.keys()) == {recs[0].key, recs[2].key}
    assert len(chunk_files(tmp_path)) == 2


def _damage_truncate(p: Path):
    p.write_bytes(p.read_bytes()[:-100])


def _damage_wrong_magic(p: Path):
    data = p.read_bytes()
    p.write_bytes(b"XXXX" + data[4:])


def _damage_garbage(p: Path):
    p.write_bytes(os.urandom(3000))


def _damage_empty(p: Path):
    p.write_bytes(b"")


def _damage_rename(p: Path):  # a valid file under another chunk's name, in the right directory
    p.rename(p.parent / f"{p.parent.name}{'cd' * 31}.kvc")


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_wrong_magic, _damage_garbage, _damage_empty,
                                    _damage_rename])
def test_corrupt_files_are_skipped_and_quarantined_at_open(tmp_path, damage):
    s, _ = open_store(tmp_path)
    recs = make_context(n_chunks=3)
    for r in recs:
        s.put(r)
    s.close()
    victim = chunk_file(tmp_path, recs[1].key)
    damage(victim)
    s2, report = open_store(tmp_path)
    assert report.loaded == 2 and len(report.corrupt) == 1
    bad_path, reason = report.corrupt[0]
    assert bad_path.parent == victim.parent and reason
    assert not bad_path.exists() and (tmp_path / "quarantine" / bad_path.name).exists()
    assert set(s2.keys()) == {recs[0].key, recs[2].key}
    assert s2.get(recs[1].key) is None
    check_consistent(s2, tmp_path)


def test_temp_and_foreign_files_at_open(tmp_path):
    s, _ = open_store(tmp_path)
    r = make_context(n_chunks=1)[0]
    s.put(r)
    s.close()
    sub = chunk_file(tmp_path, r.key).parent
    tmp = sub / f".{r.key.hex()}.0badf00d.tmp"
    tmp.write_bytes(b"half a chunk")
    (sub / "notes.txt").write_text("hello")
    (tmp_path / "chunks" / "zz").mkdir()
    misplaced = tmp_path / "chunks" / ("01" if sub.name == "00" else "00") / chunk_file(tmp_path, r.key).name
    misplaced.parent.mkdir(exist_ok=True)
    shutil.copy(chunk_file(tmp_path, r.key), misplaced)
    s2, report = open_store(tmp_path)
    reasons = {p.name: why for p, why in report.corrupt}
    assert set(reasons) == {tmp.name, "notes.txt", "zz", misplaced.name}
    assert "temp" in reasons[tmp.name]
    assert not tmp.exists() and not (tmp_path / "quarantine" / tmp.name).exists()  # removed
    assert (tmp_path / "quarantine" / "notes.txt").exists() and (tmp_path / "quarantine" / "zz").is_dir()
    assert (tmp_path / "quarantine" / misplaced.name).exists() and not misplaced.exists()
    assert report.loaded == 1 and s2.keys() == [r.key] and same_record(s2.get(r.key), r)


def test_bit_flip_is_found_by_get_and_by_verify(tmp_path):
    s, _ = open_store(tmp_path)
    recs = make_context(n_chunks=2)
    for r in recs:
        s.put(r)
    s.close()
    path = chunk_file(tmp_path, recs[1].key)
    data = bytearray(path.read_bytes())
    data[-200] ^= 0x10  # inside the last payload
    path.write_bytes(bytes(data))
    shutil.copytree(tmp_path / "chunks", tmp_path / "copy" / "chunks")

    ev = Events()
    s2, report = open_store(tmp_path, events=ev)  # header-only check at open: not seen yet
    ev.held = set(s2.keys())
    assert report.loaded == 2 and report.corrupt == []
    assert s2.get(recs[1].key) is None
    assert ev.removed == [recs[1].key] and recs[1].key not in s2
    assert (tmp_path / "quarantine" / path.name).exists() and not path.exists()
    assert s2.usage().disk_errors == 1
    assert s2.get(recs[1].key) is None and same_record(s2.get(recs[0].key), recs[0])
    with s2.pinned([recs[1].key]) as got:
        assert got == [None]
    check_consistent(s2, tmp_path, ev)

    s3, report = open_store(tmp_path / "copy", verify=True)
    assert report.loaded == 1 and len(report.corrupt) == 1 and "CRC" in report.corrupt[0][1]
    assert s3.keys() == [recs[0].key]


def test_damage_after_open_is_found_by_get_and_pin(tmp_path):
    ev = Events()
    s, _ = open_store(tmp_path, mem=0, events=ev)  # disk only: every get reads the file
    recs = make_context(n_chunks=3)
    for r in recs:
        s.put(r)
    _damage_truncate(chunk_file(tmp_path, recs[0].key))
    chunk_file(tmp_path, recs[2].key).unlink()
    with s.pinned([r.key for r in recs]) as got:
        assert got[0] is None and got[2] is None and same_record(got[1], recs[1])
        assert s.usage().pinned == 1
    assert s.keys() == [recs[1].key] and sorted(ev.removed) == sorted([recs[0].key, recs[2].key])
    assert s.usage().pinned == 0 and s.usage().disk_errors == 2
    check_consistent(s, tmp_path, ev)


# -- contexts -----------------------------------------------------------------------------------

def test_contexts_and_delete_context_keep_shared_prefixes(tmp_path):
    ev = Events()
    s, _ = open_store(tmp_path, events=ev)
    rng = random.Random(5)
    shared = [rng.randrange(1000) for _ in range(8)]
    ctx_a = make_context(tokens=shared + [1, 2, 3, 4, 5], seed=1)  # chunks 0,1 shared + 2 more
    ctx_b = make_context(tokens=shared + [9, 9, 9, 9], seed=2)  # chunks 0,1 shared + 1 more
    assert [r.key for r in ctx_a[:2]] == [r.key for r in ctx_b[:2]]
    for r in ctx_a + ctx_b:
        s.put(r)
    assert len(s) == 5
    infos = {c.key: c for c in s.contexts()}
    assert set(infos) == {ctx_a[-1].key, ctx_b[-1].key}
    a = infos[ctx_a[-1].key]
    assert isinstance(a, ContextInfo)
    assert (a.model_id, a.tokens, a.chunks, a.complete, a.nbytes) == ("model-a", 13, 4, True, 4 * KIB)
    assert a.created == max(s.get(r.key).created for r in ctx_a)
    b = infos[ctx_b[-1].key]
    assert (b.tokens, b.chunks, b.complete) == (12, 3, True)

    assert s.delete_context(ctx_b[1].key) == 0  # not a leaf: it is a parent of held chunks
    assert s.delete_context(ctx_a[-1].key) == 2  # ctx_a's own two chunks; the shared two stay
    assert set(s.keys()) == {r.key for r in ctx_b}
    assert sorted(ev.removed) == sorted([ctx_a[2].key, ctx_a[3].key])
    assert [c.key for c in s.contexts()] == [ctx_b[-1].key]
    assert s.delete_context(ctx_b[-1].key) == 3
    assert len(s) == 0 and s.contexts() == [] and chunk_files(tmp_path) == []
    assert s.delete_context(ctx_b[-1].key) == 0
    check_consistent(s, tmp_path, ev)


def test_incomplete_contexts_and_pinned_delete_context(tmp_path):
    s, _ = open_store(tmp_path)
    ctx = make_context(n_chunks=4)
    for r in ctx:
        s.put(r)
    assert s.delete(ctx[1].key)
    infos = {c.key: c for c in s.contexts()}
    assert set(infos) == {ctx[0].key, ctx[3].key}  # chunk 0 is a leaf now
    assert (infos[ctx[3].key].chunks, infos[ctx[3].key].complete, infos[ctx[3].key].tokens) == (2, False, 16)
    assert infos[ctx[0].key].complete
    with s.pinned([ctx[3].key]):
        assert s.delete_context(ctx[3].key) == 2  # 3 deferred, 2 now (its only child is going)
        assert set(s.keys()) == {ctx[0].key, ctx[3].key}
    assert s.keys() == [ctx[0].key]


# -- budgets ------------------------------------------------------------------------------------

def test_set_budgets_shrinking_evicts(tmp_path):
    ev = Events()
    s, _ = open_store(tmp_path, mem=10 * KIB, disk=10 * KIB, events=ev)
    recs = make_context(n_chunks=6)
    for r in recs:
        s.put(r)
    s.set_budgets(2 * KIB, 10 * KIB)
    u = s.usage()
    assert (u.memory_chunks, u.disk_chunks, u.chunks, u.memory_budget) == (2, 6, 6, 2 * KIB)
    assert ev.removed == []
    s.set_budgets(2 * KIB, 3 * KIB)
    assert s.usage().disk_chunks == 3 and len(s) == 3  # chunks 0-2 left disk and were not in memory
    assert ev.removed == [r.key for r in recs[:3]]
    s.set_budgets(2 * KIB, 0)  # no disk: files go, memory keeps its two
    assert chunk_files(tmp_path) == [] and len(s) == 2 and s.usage().disk_bytes == 0
    assert ev.removed == [r.key for r in recs[:4]]
    new = make_context(n_chunks=1, seed=7)[0]
    s.put(new)
    assert chunk_files(tmp_path) == []  # no more writes
    s.set_budgets(0, 0)
    assert len(s) == 0 and s.usage().memory_bytes == 0
    check_consistent(s, tmp_path, ev)


# -- a really full disk -------------------------------------------------------------------------

def test_full_disk_keeps_chunks_in_memory_and_counts_errors(small_disk, caplog):
    ev = Events()
    s, _ = open_store(small_disk, mem=8 * 2**20, disk=8 * 2**20, events=ev)
    recs = make_context(n_chunks=20, payload=100 * KIB)
    with caplog.at_level("WARNING", logger="kvstreamd.store"):
        for r in recs:
            assert s.put(r) is True
    u = s.usage()
    assert u.disk_errors > 0 and u.chunks == 20 and u.memory_chunks == 20
    assert 0 < u.disk_chunks < 20 and u.disk_errors == 20 - u.disk_chunks
    failed = [r for r in recs if r.key not in s._disk]
    assert any(failed[0].key.hex() in m and "No space" in m for m in caplog.messages)
    for r in recs:
        assert same_record(s.get(r.key), r)
    check_consistent(s, small_disk, ev)  # no temp file, no half file
    # a chunk that only fits the disk, on a full disk: refused, nothing left behind
    s.set_budgets(50 * KIB, 8 * 2**20)
    big = make_context(n_chunks=1, payload=200 * KIB, seed=3)[0]
    with pytest.raises(StoreError, match="writing it to disk failed"):
        s.put(big)
    assert big.key not in s
    check_consistent(s, small_disk, ev)
    s.close()
    s2, report = open_store(small_disk)
    assert report.corrupt == [] and report.loaded == len(chunk_files(small_disk))


def test_put_to_says_a_chunk_whose_file_could_not_be_written_is_in_memory_only(small_disk):
    s, _ = open_store(small_disk, mem=8 * 2**20, disk=8 * 2**20)
    recs = make_context(n_chunks=20, payload=100 * KIB)
    where = [s.put_to(r) for r in recs]
    assert where[0].on_disk and where[0].disk_error is None
    full = [w for w in where if not w.on_disk]
    assert full and all(w.disk_error.errno == errno.ENOSPC for w in full)
    assert s.placement([r.key for r in recs]) == ["disk" if w.on_disk else "memory" for w in where]
    assert s.put_to(recs[0]) is None  # already held


def test_a_full_disk_is_a_fault_until_it_has_room_again(small_disk):
    s, _ = open_store(small_disk, mem=8 * 2**20, disk=8 * 2**20)
    assert s.disk_fault() is None
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        with pytest.raises(OSError):
            while True:
                f.write(bytes(64 * KIB))
    s.put(make_context(n_chunks=1, payload=100 * KIB)[0])
    fault = s.disk_fault()
    assert fault.reason == "disk_full" and str(small_disk) in fault.message and "No space left" in fault.message
    filler.unlink()
    assert s.disk_fault() is None  # room again: no write needed to see it
    assert s.put_to(make_context(n_chunks=1, payload=100 * KIB, seed=9)[0]).on_disk


def test_persist_writes_a_chunk_held_in_memory_only_once_there_is_room(small_disk):
    ev = Events()
    s, _ = open_store(small_disk, mem=8 * 2**20, disk=8 * 2**20, events=ev)
    filler = small_disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        with pytest.raises(OSError):
            while True:
                f.write(bytes(64 * KIB))
    rec = make_context(n_chunks=1, payload=100 * KIB)[0]
    assert not s.put_to(rec).on_disk
    assert s.persist(rec.key).disk_error.errno == errno.ENOSPC  # still full
    filler.unlink()
    assert s.persist(rec.key).on_disk and s.placement([rec.key]) == ["disk"]
    assert s.persist(rec.key) is None  # nothing left to write
    check_consistent(s, small_disk, ev)
    s.close()
    s2, report = open_store(small_disk)
    assert same_record(s2.get(rec.key), rec)


# -- threads ------------------------------------------------------------------------------------

def test_concurrent_put_get_pin_keep_a_consistent_index(tmp_path):
    ev = Events()
    s, _ = open_store(tmp_path, mem=64 * KIB, disk=200 * KIB, events=ev)
    contexts = [make_context(model=f"m{t}", n_chunks=50, seed=t) for t in range(8)]
    all_keys = [r.key for ctx in contexts for r in ctx]
    errors = []
    barrier = threading.Barrier(8)

    def worker(t):
        try:
            rng = random.Random(t)
            barrier.wait()
            for i, r in enumerate(contexts[t]):
                assert s.put(r)
                for k in rng.sample(all_keys, 3):
                    got = s.get(k)
                    assert got is None or got.key == k
                s.longest_prefix([x.key for x in contexts[rng.randrange(8)]])
                if i % 10 == 9:
                    keys = rng.sample(all_keys, 4)
                    with s.pinned(keys) as recs:
                        assert all(x is None or x.key == k for x, k in zip(recs, keys))
                if i == 25 and t % 4 == 0:
                    s.delete_context(contexts[t][i].key)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    u = s.usage()
    assert u.pinned == 0 and u.memory_bytes <= 64 * KIB and u.disk_bytes <= 200 * KIB
    assert u.evictions > 0 and u.disk_errors == 0
    check_consistent(s, tmp_path, ev)
    assert len(ev.added) == 400
    for k in s.keys():
        assert s.get(k).key == k
    s.close()
    s2, report = open_store(tmp_path)
    assert report.corrupt == [] and set(s2.keys()) == set(s._disk)


def test_pin_info_pins_without_reading_payloads_and_what_it_says_matches_the_chunk(tmp_path):
    """What a sender plans with: a disk-only chunk's sizes from its header, no memory copy
    made; the pin keeps it from eviction until unpinned, and get() then reads it whole."""
    s, _ = open_store(tmp_path, mem=0, disk=4 * KIB)
    recs = make_context(n_chunks=6)
    s.put(recs[0])
    s.put(recs[1])
    infos = s.pin_info([recs[0].key, b"y" * 32, recs[1].key])
    assert infos[1] is None and s.usage().pinned == 2 and s.usage().memory_bytes == 0
    for info, rec in ((infos[0], recs[0]), (infos[2], recs[1])):
        assert (info.key, info.start, info.model_id, info.tokens, info.shape) == \
               (rec.key, rec.start, rec.model_id, rec.tokens, rec.shape)
        assert info.levels == {name: len(p) for name, p in rec.levels.items()}
    for r in recs[2:]:
        s.put(r)  # the disk tier evicts; the pinned two stay
    assert same_record(s.get(recs[0].key), recs[0]) and same_record(s.get(recs[1].key), recs[1])
    s.unpin([recs[0].key, recs[1].key])
    assert s.usage().pinned == 0 and s.usage().disk_bytes <= 4 * KIB


def test_a_pinned_chunk_whose_file_went_bad_reads_as_none_never_as_other_bytes(tmp_path):
    s, _ = open_store(tmp_path, mem=0, disk=1 << 20)
    (rec,) = make_context(n_chunks=1)
    s.put(rec)
    (info,) = s.pin_info([rec.key])
    path = chunk_file(tmp_path, rec.key)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # a payload byte: the header still reads, the file's CRC does not
    path.write_bytes(bytes(data))
    assert info is not None and s.get(rec.key) is None and rec.key not in s
    s.unpin([rec.key])
    assert s.usage().pinned == 0
