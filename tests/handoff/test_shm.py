"""kvstreamd.handoff.shm: real POSIX shared memory between real processes, no mocks.

Anything that could segfault if the module regressed runs in a subprocess, where a crash shows up
as a negative return code instead of killing pytest.
"""
from __future__ import annotations

import errno
import gc
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvstreamd.handoff.shm import DTYPES, PREFIX, Attached, Reader, Segment, ShmError, sweep_stale

REPO = Path(__file__).resolve().parents[2]
SHM_DIR = Path("/dev/shm")
# Prefix for segments created by child processes and for sweep tests, so sweep_stale in these tests
# can only ever see segments this test run made.
TP = f"kvstreamdtest{os.getpid()}"

# Deterministic bit patterns per dtype, shared verbatim with the child processes.
BITS_SRC = """
import torch
INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
def bits(dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:
        raw = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    else:
        raw = torch.randint(-2**15, 2**15, (n,), generator=g, dtype=torch.int32).to(torch.int16)
    return raw.view(dtype)
"""
exec(BITS_SRC)  # defines INT, bits


def _ours() -> list[Path]:
    return sorted([*SHM_DIR.glob(f"{PREFIX}-{os.getpid()}-*"), *SHM_DIR.glob(f"{TP}-*")])


@pytest.fixture(autouse=True)
def no_leaked_segments():
    yield
    gc.collect()
    left = _ours()
    for p in left:  # clean up so one failure does not cascade, then fail
        p.rmdir() if p.is_dir() else p.unlink()
    assert not left, f"test left shared-memory segments behind: {[p.name for p in left]}"


def run_py(code: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> None:
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        pytest.fail(f"child died of {sig}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.strip().endswith("OK"), proc.stdout


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(f"/dev/shm/{name}" in line for line in f)


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------- across processes


def test_child_attaches_reads_writes_and_segment_survives_its_exit():
    """Daemon creates, model process attaches: exact bits cross, the child's writes come back, and
    the child exiting does not delete the segment (trap 1: resource_tracker)."""
    n = 4 * 64
    segs = {}
    try:
        for i, dtname in enumerate(DTYPES):
            dt = DTYPES[dtname]
            seg = Segment.create(n * torch.empty((), dtype=dt).element_size())
            segs[dtname] = seg
            seg.tensor((4, 64), dtname).view(INT[dt]).view(-1).copy_(bits(dt, n, i).view(INT[dt]))
        child = BITS_SRC + """
import sys
from kvstreamd.handoff import shm
for i, arg in enumerate(sys.argv[1:]):
    dtname, name = arg.split(":")
    dt = shm.DTYPES[dtname]
    a = shm.Attached.open(name, (4, 64), dtname)
    t = a.tensor
    assert t.dtype == dt and t.shape == (4, 64), (t.dtype, t.shape)
    assert torch.equal(t.view(INT[dt]).reshape(-1), bits(dt, 4 * 64, i).view(INT[dt])), dtname
    t.view(INT[dt])[1, :8] = torch.arange(100, 108, dtype=INT[dt])
    del t
    a.release()
print("OK")
"""
        proc = run_py(child, *(f"{k}:{s.name}" for k, s in segs.items()))
        _ok(proc)
        assert "leaked" not in proc.stderr  # no resource_tracker involvement in the child
        for i, (dtname, seg) in enumerate(segs.items()):
            dt = DTYPES[dtname]
            assert (SHM_DIR / seg.name).exists(), "segment vanished when the attaching child exited"
            got = seg.tensor((4, 64), dtname).view(INT[dt])
            want = bits(dt, n, i).view(INT[dt]).view(4, 64).clone()
            want[1, :8] = torch.arange(100, 108, dtype=INT[dt])
            assert torch.equal(got, want), dtname
            del got
            with Attached.open(seg.name, (4, 64), dt) as a:  # the name is still attachable
                assert torch.equal(a.tensor.view(INT[dt]), want)
    finally:
        for seg in segs.values():
            seg.unlink()
            seg.close()


def test_premise_plain_shared_memory_attach_deletes_segment_at_child_exit():
    """Trap 1 itself: attaching with multiprocessing.shared_memory in a child on 3.11 deletes the
    segment when the child exits. (This is what Attached avoids; if it stops being true on some
    Python the test skips.)"""
    with Segment.create(4096) as seg:
        proc = run_py("""
            import sys
            from multiprocessing import shared_memory
            s = shared_memory.SharedMemory(sys.argv[1])
            s.buf[0] = 7
            s.close()
            print("OK")
            """, seg.name)
        _ok(proc)
        if (SHM_DIR / seg.name).exists():
            pytest.skip("this Python's SharedMemory no longer unlinks attached segments at exit")
        assert seg.tensor(1, "float32").view(torch.int32).item() & 0xFF == 7  # mapping still fine


@pytest.mark.parametrize("track", [False, True])
def test_child_creates_parent_attaches_child_exits(track):
    """The put direction: the client creates and exits without unlinking; the daemon's mapping
    stays valid. track=True: the client's resource_tracker removes the name at its exit;
    track=False: the name outlives it until sweep_stale sees the dead pid."""
    child = BITS_SRC + """
import sys
from kvstreamd.handoff import shm
track = sys.argv[2] == "1"
seg = shm.Segment.create(3 * 50 * 2, prefix=sys.argv[1], track=track)
seg.tensor((3, 50), "bfloat16").view(torch.int16).copy_(bits(torch.bfloat16, 150, 5).view(torch.int16).view(3, 50))
print(seg.name, flush=True)
assert sys.stdin.readline().strip() == "go"
seg.tensor((3, 50), "bfloat16").view(torch.int16)[2, -1] = 12345   # parent sees this live
print("OK", flush=True)
# exits without close/unlink
"""
    p = subprocess.Popen([sys.executable, "-c", child, TP, "1" if track else "0"], cwd=REPO,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        name = p.stdout.readline().strip()
        assert re.fullmatch(rf"{TP}-{p.pid}-[0-9a-f]{{12}}", name), (name, p.stderr.read())
        a = Attached.open(name, (3, 50), torch.bfloat16, prefix=TP)
        want = bits(torch.bfloat16, 150, 5).view(torch.int16).view(3, 50).clone()
        assert torch.equal(a.tensor.view(torch.int16), want)
        out, err = p.communicate("go\n", timeout=180)  # waits for the child's tracker too (stderr)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and out.strip() == "OK", err
    want[2, -1] = 12345
    assert torch.equal(a.tensor.view(torch.int16), want)  # creator gone, mapping intact
    if track:
        assert not (SHM_DIR / name).exists(), "creator's resource_tracker should have unlinked it"
        assert "leaked shared_memory" in err
        assert sweep_stale(TP) == []
    else:
        assert (SHM_DIR / name).exists()
        assert sweep_stale(TP) == [name]  # dead creator pid
        assert not (SHM_DIR / name).exists()
    assert torch.equal(a.tensor.view(torch.int16), want)  # unlinking never unmaps
    a.release()
    assert a.released


# ------------------------------------------------------------------- trap 2: close vs views

TRAP2_CHILD = """
import gc, sys, torch
from kvstreamd.handoff import shm

def mapped(name):
    with open("/proc/self/maps") as f:
        return any("/dev/shm/" + name in line for line in f)

def expect_refused(fn, name):
    try:
        fn()
    except shm.ShmError as e:
        assert name in str(e) and "still alive" in str(e), str(e)
    else:
        raise AssertionError("close/release succeeded under a live view")

INT = {"float16": torch.int16, "bfloat16": torch.int16, "float32": torch.int32}
SHAPE = (8, 16)
for dtname, dt in shm.DTYPES.items():
    seg = shm.Segment.create(4096)
    seg.tensor(SHAPE, dtname).fill_(1.5)
    derived = {
        "tensor": lambda t: t,
        "slice": lambda t: t[2:4],
        "strided slice": lambda t: t[:, ::3],
        "element": lambda t: t[0, 3],
        "flat view": lambda t: t.view(-1)[5:9],
        "transpose": lambda t: t.t(),
        "int view": lambda t: t.view(INT[dtname]),
        "reshape": lambda t: t.reshape(128),
        "storage": lambda t: t.untyped_storage(),
    }
    if dtname != "bfloat16":
        derived["numpy"] = lambda t: t.numpy()[1:]
    for what, make in derived.items():
        t = seg.tensor(SHAPE, dtname)
        v = make(t)
        del t
        expect_refused(seg.close, seg.name)
        assert not seg.closed and mapped(seg.name), what
        # the view is still readable and writable, and the segment still usable
        if what == "storage":
            assert v.nbytes() == 128 * seg.tensor(1, dtname).element_size(), what
            assert sum(v[i] for i in range(8)) > 0, what
        elif what == "int view":
            assert v.shape == SHAPE and int(v.sum()) != 0, what
        else:
            assert (v == 1.5).all(), what
        seg.tensor(SHAPE, dtname)[0, 0] = 1.5
        del v
    # dropping the Segment object (after unlink) cannot unmap under a live view
    t = seg.tensor(SHAPE, dtname)[3]
    seg.unlink()
    name = seg.name
    del seg
    gc.collect()
    assert mapped(name) and (t == 1.5).all() and float(t.sum()) == 16 * 1.5, dtname
    t += 1
    assert (t == 2.5).all()
    del t
    assert not mapped(name), "last view dropped, mapping should be gone"

    # explicit close after dropping the views works
    seg = shm.Segment.create(4096)
    t = seg.tensor(SHAPE, dtname)
    del t
    seg.close()
    assert seg.closed and not mapped(seg.name)
    seg.close()  # idempotent
    try:
        seg.tensor(SHAPE, dtname)
        raise AssertionError("tensor() after close")
    except shm.ShmError:
        pass

    # Attached.release: refused while the caller holds a view, everything stays usable
    seg.unlink()
    seg = shm.Segment.create(4096)
    seg.tensor(SHAPE, dtname).fill_(-2.0)
    a = shm.Attached.open(seg.name, SHAPE, dtname)
    v = a.tensor[1:3, ::2]
    expect_refused(a.release, seg.name)
    assert not a.released and (a.tensor == -2.0).all() and (v == -2.0).all()
    v[:] = 4.0
    assert (seg.tensor(SHAPE, dtname)[1:3, ::2] == 4.0).all()
    del v
    a.release()
    a.release()  # idempotent
    assert a.released
    try:
        a.tensor
        raise AssertionError("tensor after release")
    except shm.ShmError:
        pass

    # a view kept only by a reference cycle is collected by close() itself
    cyc = [seg.tensor(SHAPE, dtname)]
    cyc.append(cyc)
    del cyc
    seg.close()

    # context managers do not raise over live views: they unmap when the last one goes
    seg.unlink()
    with shm.Segment.create(4096) as seg:
        v = seg.tensor(SHAPE, dtname)[5]
        v.fill_(3.0)
        with shm.Attached.open(seg.name, SHAPE, dtname) as a:
            w = a.tensor[5]
    assert seg.closed and a.released
    assert (v == 3.0).all() and (w == 3.0).all() and mapped(seg.name)
    del v, w
    assert not mapped(seg.name)

    # an exception inside the with block propagates unchanged
    try:
        with shm.Segment.create(64) as seg:
            v = seg.tensor(4, dtname)
            raise KeyError("boom")
    except KeyError:
        pass
    assert seg.closed
    float(v.sum())  # still mapped
    del v
print("OK")
"""


def test_close_with_live_views_raises_instead_of_segfaulting():
    proc = run_py(TRAP2_CHILD)
    _ok(proc)
    assert "Exception ignored" not in proc.stderr, proc.stderr


def test_premise_torch_frombuffer_segfaults_after_close():
    """Trap 2 itself: SharedMemory.close() under a torch.frombuffer tensor succeeds and the next
    read segfaults. Shows the subprocess harness above would catch a crash."""
    proc = run_py("""
        import torch
        from multiprocessing import shared_memory
        s = shared_memory.SharedMemory(create=True, size=1 << 20)
        t = torch.frombuffer(s.buf, dtype=torch.float32)[1000:2000]
        s.close()
        s.unlink()
        print("closed", flush=True)
        print(float(t.sum()))
        print("OK")
        """)
    if proc.returncode == 0:
        pytest.skip("this torch keeps the buffer exported; the premise no longer holds")
    assert "closed" in proc.stdout
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr)


# ---------------------------------------------------------------------------- in process


def test_create_name_size_mode_and_zero_copy():
    with Segment.create(1000) as seg:
        assert re.fullmatch(rf"{PREFIX}-{os.getpid()}-[0-9a-f]{{12}}", seg.name)
        st = os.stat(SHM_DIR / seg.name)
        assert seg.size == st.st_size == 1000
        assert stat.S_IMODE(st.st_mode) == 0o600
        a = seg.tensor((10, 25), "float32")
        b = seg.tensor(250, torch.float32)
        assert a.data_ptr() == b.data_ptr()  # same memory, no copy
        a[3, 4] = 42.0
        assert b[3 * 25 + 4] == 42.0
        c = seg.tensor((4, 5), "float16", offset=200)  # byte offset
        assert c.data_ptr() == a.data_ptr() + 200
        del a, b, c


def test_close_after_dropping_views_unmaps():
    seg = Segment.create(4096)
    t = seg.tensor((16, 16), "bfloat16")
    sl = t[3:5]
    assert _mapped(seg.name)
    del t, sl
    seg.close()
    assert seg.closed and not _mapped(seg.name)
    assert (SHM_DIR / seg.name).exists()  # close does not unlink
    with pytest.raises(ShmError, match="closed"):
        seg.tensor(4, "float32")
    seg.unlink()
    assert not (SHM_DIR / seg.name).exists()


def test_create_zero_bytes_allocates_one():
    with Segment.create(0) as seg:
        assert seg.size == 1 and os.stat(SHM_DIR / seg.name).st_size == 1
        t = seg.tensor((0, 4), "float32")
        assert t.shape == (0, 4) and t.numel() == 0
        del t


def test_reserve_allocates_pages_up_front():
    n = 8 << 20
    with Segment.create(n) as seg:
        assert os.stat(SHM_DIR / seg.name).st_blocks * 512 >= n
    with Segment.create(n, reserve=False) as seg:
        assert os.stat(SHM_DIR / seg.name).st_blocks * 512 < n  # sparse until written


def test_unlink_while_attached_keeps_mapping():
    seg = Segment.create(64 * 4)
    t = seg.tensor(64, "float32")
    t.copy_(torch.arange(64.0))
    a = Attached.open(seg.name, (8, 8), "float32")
    seg.unlink()
    seg.unlink()  # idempotent
    assert not (SHM_DIR / seg.name).exists()
    assert torch.equal(a.tensor.reshape(-1), torch.arange(64.0))
    a.tensor[7, 7] = -1.0  # still the same shared memory, both ways
    assert t[63] == -1.0
    t[0] = 99.0
    assert a.tensor[0, 0] == 99.0
    with pytest.raises(ShmError, match="no shared-memory segment named"):
        Attached.open(seg.name, (8, 8), "float32")
    del t
    seg.close()
    assert torch.equal(a.tensor[1], torch.arange(8.0, 16.0))  # the other mapping is independent
    a.release()


@pytest.mark.parametrize("dtname", list(DTYPES))
def test_dtypes_round_trip_exact_bits(dtname):
    dt = DTYPES[dtname]
    it = INT[dt]
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0],
                           dtype=dt)
    tiny = torch.tensor([torch.finfo(dt).tiny / 2, torch.finfo(dt).max, torch.finfo(dt).min],
                        dtype=dt)  # subnormal, extremes
    payload = torch.tensor([-1, 0x7FC1 if it == torch.int16 else 0x7FC00123], dtype=it).view(dt)
    want = torch.cat([special, tiny, payload, bits(dt, 1000, 11)])  # NaN payloads, random bits
    n = want.numel()
    with Segment.create(n * want.element_size()) as seg:
        t = seg.tensor(n, dt)
        assert t.dtype == dt
        t.view(it).copy_(want.view(it))
        for spec in (dtname, dt):
            with Attached.open(seg.name, (n,), spec) as a:
                assert a.tensor.dtype == dt
                assert torch.equal(a.tensor.view(it), want.view(it))
        del t


@pytest.mark.parametrize("name", [
    "", "foo", PREFIX, PREFIX + "-", f"/{PREFIX}-1-abc", f"{PREFIX}-a/b", f"{PREFIX}x-1-abc",
    f"{PREFIX}-a\0b", f"{PREFIX}-" + "x" * 300, "other-1-abcdefabcdef", 42, None,
])
def test_bad_names_raise(name):
    with pytest.raises(ShmError):
        Attached.open(name, (4,), "float32")


def test_missing_segment_raises():
    with pytest.raises(ShmError, match="no shared-memory segment named"):
        Attached.open(f"{PREFIX}-{os.getpid()}-{secrets.token_hex(6)}", (4,), "float32")


def test_too_small_segment_raises():
    with Segment.create(100) as seg:
        Attached.open(seg.name, (25,), "float32").release()  # exactly fits
        Attached.open(seg.name, (10,), "float32").release()  # larger segment is fine
        with pytest.raises(ShmError, match="needs 104"):
            Attached.open(seg.name, (26,), "float32")
        with pytest.raises(ShmError, match="needs 200"):
            Attached.open(seg.name, (2, 50), "bfloat16")
        with pytest.raises(ShmError, match="needs 104"):
            seg.tensor((26,), "float32")
        with pytest.raises(ShmError):
            seg.tensor((25,), "float32", offset=4)
        with pytest.raises(ShmError, match="offset"):
            seg.tensor((2,), "float32", offset=2)  # misaligned
        with pytest.raises(ShmError, match="offset"):
            seg.tensor((2,), "float32", offset=-4)


@pytest.mark.parametrize("dtype", ["int8", "float64", torch.int32, torch.float64, None, "fp16"])
def test_bad_dtype_raises(dtype):
    with Segment.create(64) as seg:
        with pytest.raises(ShmError, match="unsupported dtype"):
            seg.tensor((4,), dtype)
        with pytest.raises(ShmError, match="unsupported dtype"):
            Attached.open(seg.name, (4,), dtype)


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (1.5,), "ab", (True,), 2.0])
def test_bad_shape_raises(shape):
    with Segment.create(64) as seg:
        with pytest.raises(ShmError, match="shape"):
            seg.tensor(shape, "float32")
        with pytest.raises(ShmError, match="shape"):
            Attached.open(seg.name, shape, "float32")


@pytest.mark.parametrize("nbytes", [-1, 1.5, "10", None, True])
def test_bad_nbytes_raises(nbytes):
    with pytest.raises(ShmError):
        Segment.create(nbytes)


def test_bad_prefix_raises():
    for prefix in ("", "a/b", None):
        with pytest.raises(ShmError):
            Segment.create(8, prefix=prefix)


# ------------------------------------------------------------------------------- sweep_stale


def test_sweep_stale_removes_dead_pids_only():
    dead = _dead_pid()
    hx = secrets.token_hex(6)
    stale = [f"{TP}-{dead}-{hx}", f"{TP}-{dead}-{secrets.token_hex(6)}"]
    foreign = [
        f"{TP}-{dead}-{hx}x", f"{TP}-{dead}-{hx[:-1]}", f"{TP}-{dead}-{hx.upper()}",
        f"{TP}-{dead}", f"{TP}-abc-{hx}", f"{TP}-0{dead}-{hx}", f"{TP}-0-{hx}",
        f"{TP}-99999999999999999999-{hx}", f"{TP}x-{dead}-{hx}", f"x{TP}-{dead}-{hx}",
        f"{TP}-{dead}-{hx}-{hx}",
    ]
    live_ppid = f"{TP}-{os.getppid()}-{hx}"  # a live pid that is not ours
    for name in stale + foreign + [live_ppid]:
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
    os.mkdir(SHM_DIR / f"{TP}-{dead}-{secrets.token_hex(6)}")  # not a segment
    live_own = Segment.create(16, prefix=TP)
    try:
        assert sweep_stale(TP) == sorted(stale)
        assert sweep_stale(TP) == []
        for name in stale:
            assert not (SHM_DIR / name).exists()
        for name in foreign + [live_ppid, live_own.name]:
            assert (SHM_DIR / name).exists(), name
    finally:
        live_own.unlink()
        live_own.close()
        for name in foreign + [live_ppid]:
            (SHM_DIR / name).unlink()
        for p in SHM_DIR.glob(f"{TP}-{dead}-*"):
            p.rmdir() if p.is_dir() else p.unlink()


def test_sweep_stale_default_prefix_and_shm_dir(tmp_path):
    dead = _dead_pid()
    hx = secrets.token_hex(6)
    names = {
        f"{PREFIX}-{dead}-{hx}": False,
        f"{PREFIX}-{os.getpid()}-{hx}": True,
        f"{PREFIX}-{os.getppid()}-{hx}": True,
        f"{PREFIX}x-{dead}-{hx}": True,
        f"other-{dead}-{hx}": True,
        "notes.txt": True,
    }
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert sweep_stale(shm_dir=str(tmp_path)) == [f"{PREFIX}-{dead}-{hx}"]
    for name, kept in names.items():
        assert (tmp_path / name).exists() == kept, name
    assert sweep_stale(shm_dir=str(tmp_path / "missing")) == []


# -- Reader: a segment its owner may shrink, read by copy (trap 4) ---------------------------------

TRUNCATE_THEN_READ = """
import os, sys
from kvstreamd.handoff import shm
with shm.Segment.create(64 * 4096, prefix=sys.argv[1], track=False) as seg:
    print(seg.name, flush=True)  # the test removes it if this process dies
    seg.tensor((64 * 1024,), "float32").fill_(1.0)
    reader = getattr(shm, sys.argv[2]).open(seg.name, (64 * 1024,), "float32", prefix=sys.argv[1])
    os.ftruncate(os.open(f"/dev/shm/{seg.name}", os.O_RDWR), 4096)  # the owner shrinks it
    try:
        if sys.argv[2] == "Attached":
            print(float(reader.tensor[-1]))  # a page past the new end
        else:
            reader.read(0, 64 * 1024)
    except shm.ShmError as e:
        print("ShmError:", e)
    print("OK")
"""


def test_premise_a_mapping_of_a_segment_its_owner_truncates_faults_the_reader():
    """Trap 4 itself: reading a mapped page past the end the owner cut kills the reader with
    SIGBUS, which no Python code can catch. (Why the daemon reads a put's segment with Reader.)"""
    proc = run_py(TRUNCATE_THEN_READ, TP, "Attached")
    (SHM_DIR / proc.stdout.split()[0]).unlink(missing_ok=True)
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stdout, proc.stderr)


def test_a_reader_of_a_segment_its_owner_truncates_raises_shm_error_instead_of_faulting():
    proc = run_py(TRUNCATE_THEN_READ, TP, "Reader")
    _ok(proc)
    assert "ShmError:" in proc.stdout and "shrank to 4096 bytes" in proc.stdout and "truncated" in proc.stdout


@pytest.mark.parametrize("dtname", sorted(DTYPES))
def test_a_reader_copies_exactly_the_slice_asked_for_on_any_axis(dtname):
    dt = DTYPES[dtname]
    shape = (3, 2, 50, 2, 8)
    with Segment.create(2 * 3 * 2 * 50 * 2 * 8 * 4) as seg:
        want = bits(dt, 3 * 2 * 50 * 2 * 8, 9).view(shape)
        view = seg.tensor(shape, dtname)
        view.view(INT[dt]).copy_(want.view(INT[dt]))
        del view
        with Reader.open(seg.name, shape, dtname) as r:
            for axis, start, stop in ((2, 0, 16), (2, 16, 50), (2, 49, 50), (0, 1, 3), (4, 0, 8), (2, 7, 7)):
                index = (slice(None),) * axis + (slice(start, stop),)
                got = r.read(start, stop, axis)
                assert got.dtype == dt and got.is_contiguous() and got.shape == want[index].shape
                assert torch.equal(got.view(INT[dt]), want[index].contiguous().view(INT[dt])), (axis, start, stop)
        assert r.closed


def test_a_reader_reads_into_a_tensor_of_the_slice_s_shape_only():
    shape = (3, 2, 50, 2, 8)
    with Segment.create(3 * 2 * 50 * 2 * 8 * 2) as seg:
        view = seg.tensor(shape, "float16")
        view.copy_(torch.arange(view.numel(), dtype=torch.float32).view(shape).half())
        with Reader.open(seg.name, shape, "float16") as r:
            out = torch.zeros((3, 2, 10, 2, 8), dtype=torch.float16)
            assert r.read(20, 30, 2, out) is out and torch.equal(out, view[:, :, 20:30])
            with pytest.raises(ShmError, match="cannot read"):
                r.read(20, 31, 2, out)
            with pytest.raises(ShmError, match="cannot read"):
                r.read(20, 30, 2, out.float())
        del view


def test_a_reader_maps_nothing_and_holds_no_view_of_the_segment():
    with Segment.create(4096) as seg:
        seg.close()  # only the Reader has it open from here
        with Reader.open(seg.name, (1024,), "float32") as r:
            kept = r.read(0, 1024)
            assert not _mapped(seg.name)
        kept.add_(1)  # daemon-owned memory: outlives the reader, and the segment


def test_a_reader_refuses_a_segment_smaller_than_its_shape_a_slice_out_of_range_and_use_after_close():
    with Segment.create(100) as seg:
        with pytest.raises(ShmError, match="needs 104"):
            Reader.open(seg.name, (26,), "float32")
        r = Reader.open(seg.name, (5, 5), "float32")
        for start, stop, axis in ((0, 6, 0), (3, 2, 0), (-1, 2, 1), (0, 1, 2)):
            with pytest.raises(ShmError):
                r.read(start, stop, axis)
        r.close()
        r.close()  # idempotent
        with pytest.raises(ShmError, match="closed"):
            r.read(0, 1)
    with pytest.raises(ShmError, match="no shared-memory segment named"):
        Reader.open(f"{PREFIX}-{os.getpid()}-{secrets.token_hex(6)}", (4,), "float32")


def test_a_bad_segment_name_a_megabyte_long_is_not_echoed_whole():
    with pytest.raises(ShmError) as err:
        Reader.open(f"{PREFIX}-" + "x" * 2**20, (4,), "float32")
    assert len(str(err.value)) < 300 and "1048586 characters" in str(err.value)


def test_a_segment_made_unreserved_is_reserved_later_and_an_unreservable_one_says_why(monkeypatch):
    """create(reserve=False) leaves the allocation to reserve() (a fetch runs it on a thread, off
    the event loop): afterwards the pages are there; where /dev/shm cannot hold them, reserve()
    raises ShmError with the hint, as create() does."""
    seg = Segment.create(1 << 20, reserve=False)
    try:
        assert os.stat(f"/dev/shm/{seg.name}").st_blocks == 0  # nothing allocated yet
        seg.reserve()
        assert os.stat(f"/dev/shm/{seg.name}").st_blocks * 512 >= 1 << 20
        seg.reserve()  # once is enough
        seg.tensor((256, 1024), "float32").fill_(1.0)
    finally:
        seg.unlink()
        seg.close()
    seg = Segment.create(4096, reserve=False)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    try:
        with pytest.raises(ShmError, match="is /dev/shm big enough"):
            seg.reserve()
    finally:
        seg.unlink()
        seg.close()
