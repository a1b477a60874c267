"""POSIX shared-memory segments holding KV tensors, shared zero-copy between the daemon and a local
model process (or client).

Two sides:

* :class:`Segment` creates a segment (the daemon for fetch buffers, the client for put) and hands
  out tensor views of it.
* :class:`Attached` maps a segment someone else created, as one tensor.
* :class:`Reader` copies parts of a segment someone else created, without mapping it (trap 4).

The file is long (~530 lines) because each of the four traps below is a way the daemon or the
model process dies, and the code that avoids each sits next to the explanation of why.

Four traps this module exists to avoid (all measured on CPython 3.11 / torch 2.13, see
``tests/handoff/test_shm.py``):

1. ``multiprocessing.shared_memory.SharedMemory(name)`` registers the segment with the attaching
   process's ``resource_tracker``, which *unlinks it when that process exits* (``track=False`` only
   arrives in 3.13). We never use ``SharedMemory``: segments are opened with ``shm_open`` + ``mmap``
   directly, so attaching never registers anything. Only the creating side registers (optional,
   ``track=True``), so a crashed creator's segment is removed by its tracker; :func:`sweep_stale`
   covers the case where the tracker died too (SIGKILL of the whole cgroup, OOM).

2. Unmapping memory that a tensor still points at makes the next read of the tensor segfault
   (``torch.frombuffer`` does not hold a buffer export, so ``SharedMemory.close()`` succeeds under
   it). Every tensor here is built as ``torch.from_numpy(np.frombuffer(mmap, ...))``: the numpy
   array holds a buffer export on the ``mmap`` for as long as it lives, and the tensor's storage
   keeps the array alive, so while any tensor, slice or view of it exists ``mmap.close()`` raises
   ``BufferError`` (turned into :class:`ShmError`) instead of unmapping, and dropping the last
   Python reference to the mapping cannot unmap it either: the ``mmap`` object is only freed, and
   unmapped, after the last view is gone. bfloat16 has no numpy dtype; it is mapped as int16 and
   reinterpreted with ``Tensor.view(torch.bfloat16)`` (still a view of the same storage).

3. A tmpfs segment is sparse: ``ftruncate`` succeeds whatever its size, and writing a page that
   /dev/shm has no room for kills the process with SIGBUS (Docker's default /dev/shm is 64 MiB).
   :meth:`Segment.create` reserves the pages with ``posix_fallocate`` by default (``reserve=True``),
   turning that into a clean :class:`ShmError` at creation. It costs ~0.2 ms/MiB up front but the
   first write over the pages gets correspondingly cheaper.

4. A mapping of a segment another process owns faults when that process shrinks it: reading a
   page past the new end kills the reader with SIGBUS, and no Python code can catch it. The
   daemon reads a client's put segment with :class:`Reader`, which copies from the segment's file
   descriptor (``preadv``) and never maps it: a read of a truncated file only comes up short, and
   that is a :class:`ShmError`.

Segments are Linux/POSIX only and are created mode 0600: the model process must run as the same
user as the creator.
"""
from __future__ import annotations

import errno
import gc
import math
import mmap
import os
import re
import secrets
from multiprocessing import resource_tracker

import _posixshmem  # CPython's shm_open/shm_unlink (what multiprocessing.shared_memory uses)
import numpy as np
import torch

from codec.bitstream import DTYPE_NAMES

__all__ = ["PREFIX", "DTYPES", "ShmError", "Segment", "Attached", "Reader", "sweep_stale"]

PREFIX = "kvstreamd"
DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}  # the KV dtypes, by name
# numpy dtype each torch dtype is mapped through; bfloat16 goes via int16 + Tensor.view.
_NUMPY = {torch.float16: np.float16, torch.bfloat16: np.int16, torch.float32: np.float32}
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory segments (a tmpfs), by name
_NAME_MAX = 255  # NAME_MAX of /dev/shm (tmpfs)
_TRACKER_TYPE = "shared_memory"  # resource_tracker unlinks these with _posixshmem.shm_unlink


class ShmError(Exception):
    """A shared-memory segment could not be created, opened, viewed or closed as asked."""


# ------------------------------------------------------------------------------------ helpers


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype in DTYPES:
            return DTYPES[dtype]
    elif isinstance(dtype, torch.dtype) and dtype in _NUMPY:
        return dtype
    raise ShmError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")


def _shape(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise ShmError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ShmError(f"bad shape {shape!r}: dimensions must be non-negative ints")
        out.append(int(d))
    return tuple(out)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * _itemsize(dtype)


def _view(mm: mmap.mmap, shape: tuple[int, ...], dtype: torch.dtype, offset: int) -> torch.Tensor:
    """Zero-copy tensor over mm[offset:]; keeps a buffer export on mm for as long as it (or any
    view of it) lives, so mm cannot be closed under it (trap 2)."""
    arr = np.frombuffer(mm, dtype=_NUMPY[dtype], count=math.prod(shape), offset=offset)
    t = torch.from_numpy(arr)
    if dtype is torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.view(shape)


def _close_mapping(mm: mmap.mmap, name: str) -> None:
    try:
        mm.close()
        return
    except BufferError:
        pass
    # A view may only be kept alive by a reference cycle (a traceback, a closure): collect once.
    gc.collect()
    try:
        mm.close()
    except BufferError:
        raise ShmError(
            f"tensor views of segment {name} are still alive; drop them first"
        ) from None


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix or "/" in prefix or "\0" in prefix:
        raise ShmError(f"bad segment prefix {prefix!r}")


def _check_name(name, prefix: str) -> None:
    if not isinstance(name, str):
        raise ShmError(f"segment name must be a str, got {type(name).__name__}")
    if (not name.startswith(prefix + "-") or len(name) == len(prefix) + 1 or "/" in name
            or "\0" in name or len(name.encode("utf-8", "surrogatepass")) > _NAME_MAX):
        shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
        raise ShmError(
            f"bad shared-memory segment name {shown}: expected {prefix}-<...>, "
            f"no '/', at most {_NAME_MAX} bytes"
        )


# ------------------------------------------------------------------------------------ Segment


def _cannot_allocate(size: int, name: str, e: OSError) -> ShmError:
    hint = " (is /dev/shm big enough? docker: --shm-size)" if e.errno in (errno.ENOSPC, errno.ENOMEM) else ""
    return ShmError(f"cannot allocate {size} bytes for shared-memory segment {name}: {e}{hint}")


class Segment:
    """A segment this process created. ``tensor()`` hands out zero-copy views; ``close()`` unmaps
    (refused while views are alive), ``unlink()`` removes the name (mappings stay valid).

    As a context manager: on exit the name is unlinked and the mapping closed; if tensor views
    are still alive at that point the exit does not raise, the mapping is instead unmapped when
    the last view is dropped (use ``close()`` explicitly to have live views reported).
    """

    name: str
    size: int  # bytes allocated (nbytes, or 1 when 0 was asked for)

    def __init__(self, name: str, mm: mmap.mmap, size: int, tracked: bool, fd: int | None = None):
        self.name = name
        self.size = size
        self._mm: mmap.mmap | None = mm
        self._tracked = tracked
        self._unlinked = False
        self._fd = fd  # kept until reserve() where create(reserve=False)

    @classmethod
    def create(cls, nbytes: int, *, prefix: str = PREFIX, track: bool = True,
               reserve: bool = True, mode: int = 0o600) -> "Segment":
        """Create a segment of ``nbytes`` bytes named ``f"{prefix}-{os.getpid()}-<12 hex>"``.

        ``track``: register with this process's ``multiprocessing.resource_tracker`` so the name is
        unlinked if this process dies without unlinking it (the tracker then prints a "leaked
        shared_memory objects" warning). Pass False for a segment meant to outlive its creator.
        ``reserve``: allocate the pages now (posix_fallocate), so a too-small /dev/shm fails here
        with ShmError instead of SIGBUS on a later write. False: the caller calls reserve()
        before anything writes to the segment (on a thread: allocating 94 MB took ~20 ms).
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
            raise ShmError(f"nbytes must be a non-negative int, got {nbytes!r}")
        _check_prefix(prefix)
        size = max(int(nbytes), 1)  # a POSIX shm object of size 0 cannot be mapped
        for _ in range(16):
            name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
            _check_name(name, prefix)
            try:
                fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=mode)
                break
            except FileExistsError:
                continue
            except OSError as e:
                raise ShmError(f"cannot create shared-memory segment {name}: {e}") from e
        else:  # pragma: no cover - 16 collisions of 48 random bits
            raise ShmError("cannot find a free shared-memory segment name")
        keep = False
        try:
            try:
                os.ftruncate(fd, size)
                if reserve:
                    os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size)
                keep = not reserve
            finally:
                if not keep:
                    os.close(fd)
        except BaseException as e:
            try:
                _posixshmem.shm_unlink("/" + name)
            except OSError:
                pass
            if isinstance(e, OSError):
                raise _cannot_allocate(size, name, e) from e
            raise
        if track:
            resource_tracker.register("/" + name, _TRACKER_TYPE)
        return cls(name, mm, size, track, fd if keep else None)

    def reserve(self) -> None:
        """Allocate the pages of a segment made with create(reserve=False): ShmError, as from
        create(), where /dev/shm cannot hold them. Idempotent. May run on another thread than
        close(): whichever takes the descriptor first closes it."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.posix_fallocate(fd, 0, self.size)
        except OSError as e:
            raise _cannot_allocate(self.size, self.name, e) from e
        finally:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._mm is None

    def tensor(self, shape, dtype: str | torch.dtype, *, offset: int = 0) -> torch.Tensor:
        """A zero-copy view of ``shape`` x ``dtype`` starting ``offset`` bytes into the segment.
        Each call returns a new view of the same memory; the segment cannot be closed while any
        of them (or a slice/view of them) is alive."""
        dt = _dtype(dtype)
        shp = _shape(shape)
        if self._mm is None:
            raise ShmError(f"segment {self.name} is closed")
        item = _itemsize(dt)
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0 \
                or offset % item:
            raise ShmError(f"offset must be a non-negative multiple of {item} for {dt}, got {offset!r}")
        need = _nbytes(shp, dt)
        if offset + need > self.size:
            raise ShmError(
                f"shape {shp} {dt} needs {need} bytes at offset {offset}, "
                f"segment {self.name} has {self.size}"
            )
        return _view(self._mm, shp, dt, int(offset))

    def close(self) -> None:
        """Unmap. Raises ShmError while tensor views are alive (the mapping then stays valid and
        the segment stays usable). Idempotent. Does not remove the name: see unlink()."""
        fd, self._fd = self._fd, None
        if fd is not None:  # never reserved
            os.close(fd)
        if self._mm is None:
            return
        _close_mapping(self._mm, self.name)
        self._mm = None

    def unlink(self) -> None:
        """Remove the name so nobody new can attach; existing mappings stay valid. Idempotent."""
        if self._unlinked:
            return
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass  # already removed (by an attacher, sweep_stale, ...)
        except OSError as e:
            raise ShmError(f"cannot unlink shared-memory segment {self.name}: {e}") from e
        if self._tracked:
            resource_tracker.unregister("/" + self.name, _TRACKER_TYPE)
        self._unlinked = True

    def _detach(self) -> None:
        """close(), or if views are alive, leave the unmapping to the last of them."""
        try:
            self.close()
        except ShmError:
            self._mm = None  # the views hold the mmap object; it unmaps when they are gone

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.unlink()
        finally:
            self._detach()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else "open"
        return f"<Segment {self.name} size={self.size} {state}{' unlinked' if self._unlinked else ''}>"


# ----------------------------------------------------------------------------------- Attached


def _open_sized(name: str, prefix: str, flags: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """Open someone else's segment: (its descriptor, its size now), ShmError if it cannot hold
    `shape` of `dtype`. The caller closes the descriptor."""
    need = _nbytes(shape, dtype)
    _check_name(name, prefix)
    try:
        fd = _posixshmem.shm_open("/" + name, flags, mode=0)
    except FileNotFoundError:
        raise ShmError(f"no shared-memory segment named {name!r}") from None
    except OSError as e:
        raise ShmError(f"cannot open shared-memory segment {name!r}: {e}") from e
    try:
        size = os.fstat(fd).st_size
        if size < max(need, 1):
            raise ShmError(f"shared-memory segment {name!r} has {size} bytes, shape {shape} {dtype} needs {need}")
    except BaseException:
        os.close(fd)
        raise
    return fd, size


class Attached:
    """A segment created by another process, mapped read-write as one tensor of the given shape
    and dtype (the segment may be larger). Attaching does not register the segment with this
    process's resource_tracker, so exiting does not delete it (trap 1).

    As a context manager: release() on exit; if views of ``tensor`` are still alive at that point
    the exit does not raise, the mapping is unmapped when the last view is dropped.
    """

    name: str
    size: int  # size of the segment in bytes

    def __init__(self, name: str, mm: mmap.mmap, size: int, shape: tuple[int, ...],
                 dtype: torch.dtype):
        self.name = name
        self.size = size
        self.shape = shape
        self.dtype = dtype
        self._mm: mmap.mmap | None = mm
        self._tensor: torch.Tensor | None = _view(mm, shape, dtype, 0)

    @classmethod
    def open(cls, name: str, shape, dtype, *, prefix: str = PREFIX) -> "Attached":
        shp, dt = _shape(shape), _dtype(dtype)
        fd, size = _open_sized(name, prefix, os.O_RDWR, shp, dt)
        try:
            try:
                mm = mmap.mmap(fd, size)
            except OSError as e:
                raise ShmError(f"cannot map shared-memory segment {name!r}: {e}") from e
        finally:
            os.close(fd)
        return cls(name, mm, size, shp, dt)

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ShmError(f"segment {self.name} was released")
        return self._tensor

    @property
    def released(self) -> bool:
        return self._mm is None

    def release(self) -> None:
        """Drop our tensor and unmap. Raises ShmError if the caller still holds views of the
        tensor (everything then stays as it was). Idempotent."""
        if self._mm is None:
            return
        self._tensor = None
        try:
            _close_mapping(self._mm, self.name)
        except ShmError:
            self._tensor = _view(self._mm, self.shape, self.dtype, 0)
            raise
        self._mm = None

    def __enter__(self) -> "Attached":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.release()
        except ShmError:
            self._tensor = None
            self._mm = None  # unmapped when the caller's last view is dropped

    def __repr__(self) -> str:
        state = "released" if self._mm is None else "attached"
        return f"<Attached {self.name} {tuple(self.shape)} {self.dtype} {state}>"


# ------------------------------------------------------------------------------------- Reader


class Reader:
    """A segment created by another process that may change it while we read (a client's put),
    read as a tensor of ``shape`` x ``dtype`` by copying parts of it into this process's memory
    with ``preadv`` from the segment's descriptor. It is never mapped, so the owner truncating
    it cannot fault this process (trap 4): the read comes up short and raises ShmError.

    As a context manager: close() on exit.
    """

    name: str
    size: int  # bytes the segment had when opened

    def __init__(self, name: str, fd: int, size: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.name = name
        self.size = size
        self.shape = shape
        self.dtype = dtype
        self._fd: int | None = fd

    @classmethod
    def open(cls, name: str, shape, dtype, *, prefix: str = PREFIX) -> "Reader":
        shp, dt = _shape(shape), _dtype(dtype)
        fd, size = _open_sized(name, prefix, os.O_RDONLY, shp, dt)
        return cls(name, fd, size, shp, dt)

    def read(self, start: int, stop: int, axis: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous copy of ``tensor[..., start:stop, ...]`` (the slice on ``axis``) in this
        process's memory, or in ``out`` (contiguous, of that shape and dtype) where given.
        ShmError if the segment no longer holds it (its owner shrank it)."""
        if self._fd is None:
            raise ShmError(f"segment {self.name} is closed")
        if not 0 <= axis < len(self.shape):
            raise ShmError(f"axis {axis} is not one of the {len(self.shape)} of shape {self.shape}")
        if not 0 <= start <= stop <= self.shape[axis]:
            raise ShmError(f"[{start}:{stop}] is not within 0..{self.shape[axis]} on axis {axis} of {self.shape}")
        out_shape = self.shape[:axis] + (stop - start,) + self.shape[axis + 1:]
        if out is not None:
            if tuple(out.shape) != out_shape or out.dtype != self.dtype or not out.is_contiguous():
                raise ShmError(f"cannot read {list(out_shape)} {self.dtype} into a {list(out.shape)} {out.dtype} tensor")
            arr = out.view(torch.uint8).numpy() if self.dtype is torch.bfloat16 else out.numpy()
        else:
            arr = np.empty(out_shape, dtype=_NUMPY[self.dtype])
        inner = math.prod(self.shape[axis + 1:]) * _itemsize(self.dtype)  # bytes per index on axis
        run, row = (stop - start) * inner, self.shape[axis] * inner  # bytes to copy, bytes to skip
        outer = math.prod(self.shape[:axis])
        if run == row:  # the slice is one contiguous range of the segment
            run, outer = run * outer, 1
        dst = memoryview(arr.reshape(-1).view(np.uint8))
        for o in range(outer):
            self._read_into(dst[o * run:(o + 1) * run], o * row + start * inner)
        if out is not None:
            return out
        t = torch.from_numpy(arr)
        return t.view(torch.bfloat16) if self.dtype is torch.bfloat16 else t

    def _read_into(self, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            try:
                n = os.preadv(self._fd, [buf[done:]], offset + done)
            except OSError as e:
                raise ShmError(f"cannot read shared-memory segment {self.name!r}: {e}") from e
            if n == 0:
                try:
                    now = os.fstat(self._fd).st_size
                except OSError:  # pragma: no cover
                    now = "?"
                raise ShmError(f"shared-memory segment {self.name!r} shrank to {now} bytes while being read "
                               f"(it had {self.size}; shape {list(self.shape)} {self.dtype} needs "
                               f"{_nbytes(self.shape, self.dtype)}): its owner truncated it")
            done += n

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        """Close the descriptor. Idempotent; never raises (nothing of the segment is mapped)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Reader {self.name} {tuple(self.shape)} {self.dtype} {'closed' if self._fd is None else 'open'}>"


# -------------------------------------------------------------------------------- sweep_stale


def _pid_alive(pid: int) -> bool | None:
    """True/False, or None if pid cannot be a process id at all."""
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    except (OverflowError, OSError):
        return None
    return True


def sweep_stale(prefix: str = PREFIX, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink segments named ``f"{prefix}-{pid}-<12 hex>"`` (the Segment.create format) whose
    creator pid is not a live process; return the names removed, sorted.

    Other names and live pids' segments are never touched. Caveats: a pid that was reused by an
    unrelated process keeps its dead creator's segment (conservative); pids are only meaningful in
    this pid namespace, so do not share /dev/shm with creators in another pid namespace
    (containers) and sweep it. Unlinking only removes the name; existing mappings stay valid.
    """
    _check_prefix(prefix)
    pattern = re.compile(rf"{re.escape(prefix)}-([1-9][0-9]*)-[0-9a-f]{{12}}")
    removed: list[str] = []
    try:
        entries = list(os.scandir(shm_dir))
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if not m or not entry.is_file(follow_symlinks=False):
            continue
        if _pid_alive(int(m.group(1))) is not False:
            continue
        try:
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed.append(entry.name)
    return sorted(removed)
