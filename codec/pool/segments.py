"""The shared-memory segments the codec pool's workers read and write through: chunks to
encode and decode travel in segments the pool keeps and reuses (an arena), and a decode can
write straight into a segment of the caller's (a Destination: the fetch buffer)."""
from __future__ import annotations

import _posixshmem  # CPython's shm_open/shm_unlink, as kvstreamd/handoff/shm.py uses them
import mmap
import os
import secrets
import threading
from dataclasses import dataclass

import torch

from ..errors import NoSharedMemory


# Decode output (and a chunk to encode) travels in shared-memory segments that the pool keeps
# and reuses: a fresh segment costs a page fault and a zeroed page per 4 KiB on first touch (~18 ms for a
# 1024-token SmolLM2 chunk, ~13% of its decode), a reused one nothing. decode_many returns
# each chunk as a view of its segment (no copy out); the segment goes back to the pool when the
# last view of it is gone. Names follow kvstreamd.handoff.shm's "<prefix>-<pid>-<12 hex>" with their
# own prefix, so the daemon's start-up sweep removes any a killed process left.
SEG_PREFIX = "kvcodec"
MAX_FREE_SEGMENTS = 8  # kept for reuse (each about a chunk's output); beyond, freed
# and no more bytes than this kept: a Llama-3-8B-shaped chunk is 128 MiB, and 8 of them idle
# would be a gigabyte held for nothing (docs/benchmarks.md, "bench scale")
MAX_FREE_BYTES = 256 << 20
SEG_ROUND = 1 << 20
_worker_maps: dict[str, mmap.mmap] = {}  # in a worker: its mappings of the pool's segments


def open_segment(size: int, name: str | None = None) -> tuple[str, mmap.mmap]:
    """Create (name None) or open a shared-memory segment; returns its name and a mapping."""
    create = name is None
    if create:
        name = f"{SEG_PREFIX}-{os.getpid()}-{secrets.token_hex(6)}"
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            # reserved, not only sized: a page of a sized-only segment that /dev/shm cannot back
            # faults (SIGBUS, the whole process) when it is first written
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise NoSharedMemory(f"no room in /dev/shm for a {size >> 20} MiB codec segment "
                                     f"({e.strerror or e})") from None
        return name, mmap.mmap(fd, size)
    except BaseException:
        if create:
            _posixshmem.shm_unlink("/" + name)
        raise
    finally:
        os.close(fd)


def worker_map(name: str, size: int) -> mmap.mmap:
    mm = _worker_maps.get(name)
    if mm is None or len(mm) != size:
        if mm is not None:
            mm.close()
        while len(_worker_maps) >= 2 * MAX_FREE_SEGMENTS:  # the pool has let the oldest go
            _worker_maps.pop(next(iter(_worker_maps))).close()
        _, mm = open_segment(size, name)
        _worker_maps[name] = mm
    return mm


@dataclass(frozen=True)
class Destination:
    """Where a decode writes its chunk: a [L, 2, T, H, D] view into a named shared-memory
    segment (the fetch buffer the model process maps), so the workers write the KV where it
    is read and nothing is copied after them. Each (layer, K/V) plane of the view must be
    contiguous: a token range of a [L, 2, T_all, H, D] buffer is."""

    segment: str
    size: int  # the segment's bytes
    offset: int  # bytes from the segment's start to the view's first element
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str

    @classmethod
    def of(cls, view: torch.Tensor, segment: str, base: torch.Tensor) -> "Destination":
        """`view` of `base`, the whole segment `segment` as one tensor."""
        if view.dim() != 5 or view.stride(4) != 1 or view.stride(3) != view.shape[4] or \
                view.stride(2) != view.shape[3] * view.shape[4] or view.stride(0) != 2 * view.stride(1):
            raise ValueError(f"a destination needs contiguous (layer, K/V) planes, not strides {view.stride()}")
        offset = view.data_ptr() - base.data_ptr()
        size = base.numel() * base.element_size()
        if offset < 0 or offset + view.stride(0) * (view.shape[0] - 1) * view.element_size() > size:
            raise ValueError("the view does not lie in the segment")
        return cls(segment, size, offset, tuple(view.shape), tuple(view.stride()), str(view.dtype).removeprefix("torch."))


class Arena:
    """The pool's segments: free ones by size, handed out and taken back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[tuple[str, mmap.mmap]] = []
        self._all: set[str] = set()
        self._closed = False

    def take(self, size: int) -> tuple[str, mmap.mmap]:
        """A segment of at least size bytes (sizes vary with each chunk's bitstream, so they
        are rounded up to whole MiB, and a free one up to twice the need will do)."""
        size = -(-size // SEG_ROUND) * SEG_ROUND
        with self._lock:
            for i, (name, mm) in enumerate(self._free):
                if size <= len(mm) <= 2 * size:
                    return self._free.pop(i)
        name, mm = open_segment(size)
        with self._lock:
            self._all.add(name)
        return name, mm

    def give(self, name: str, mm: mmap.mmap) -> None:
        """Back for reuse (the caller holds no view of it any more)."""
        with self._lock:
            kept = sum(len(m) for _, m in self._free)
            if not self._closed and len(self._free) < MAX_FREE_SEGMENTS and kept + len(mm) <= MAX_FREE_BYTES:
                self._free.append((name, mm))
                return
            self._all.discard(name)
        unlink(name)  # the mapping goes with its last reference (a finalizer runs before the
        # array has let go of its buffer, so closing it here would fail)

    def close(self) -> None:
        """Unlink every segment; those still viewed by results stay mapped until they go."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
            names, self._all = self._all, set()
        for name in names:
            unlink(name)
        for _, mm in free:
            try:
                mm.close()
            except BufferError:  # a staged tensor still views it: unmapped when that goes
                pass


def unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
