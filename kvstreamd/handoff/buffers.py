"""A fetch's hand-off buffer, whatever memory it lies in: shared memory on the host
(`HostBuffer`) or device memory on the daemon's GPU (`cuda_ipc.CudaBuffer`). The daemon holds
one per fetch until the client releases it or its lease runs out; it reads each only through
`FetchBuffer`, so a second kind of memory is a second class, not a second branch."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Protocol, runtime_checkable

import torch

from kvstreamd.handoff.shm import DTYPES, SHM_DIR, Segment, ShmError

log = logging.getLogger(__name__)


def nbytes_of(shape, dtype: str) -> int:
    n = DTYPES[dtype].itemsize
    for s in shape:
        n *= int(s)
    return n


@runtime_checkable
class FetchBuffer(Protocol):
    name: str  # what the client names in DELETE /v1/buffers/{name}
    nbytes: int

    def tensor(self, shape, dtype: str) -> torch.Tensor:
        """The buffer as a [L, 2, T, H, D] tensor the fill stage writes into."""

    def placement(self) -> dict:
        """The start event's fields that tell the client where the KV lies and how to map it."""

    def release(self) -> None:
        """Give the memory back; a client that still maps it keeps its own mapping."""


class HostBuffer:
    """Shared memory the model process attaches to by name. Mode 0660: under systemd the model
    process is another user in the daemon's group (see systemd/README.md); the umask must not
    take the group bits away."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.name = segment.name
        self.nbytes = segment.size

    @classmethod
    def create(cls, shape, dtype: str, reserve: bool = True) -> "HostBuffer":
        """reserve=False: the pages are allocated by reserve(), which must come before any write."""
        seg = Segment.create(nbytes_of(shape, dtype), mode=0o660, reserve=reserve)
        try:
            os.chmod(f"{SHM_DIR}/{seg.name}", 0o660)
        except OSError:
            pass
        return cls(seg)

    def tensor(self, shape, dtype: str) -> torch.Tensor:
        return self.segment.tensor(shape, dtype)

    def reserve(self) -> None:
        """Blocking: allocate the pages (Segment.reserve); ShmError where /dev/shm cannot hold them."""
        self.segment.reserve()

    def placement(self) -> dict:
        return {"device": "cpu"}

    def release(self) -> None:
        """Unlink the name now, and unmap on a thread of its own: the daemon's mapping is the
        last (the client lets go first), so the unmap frees the pages, ~13 ms for a 58 MB
        buffer, which would hold up the event loop and the client's DELETE, and with it the
        model's first token. A view still alive in this process leaves the mapping to the
        garbage collector (logged); the name is gone either way."""
        self.segment.unlink()
        threading.Thread(target=self._unmap, name=f"unmap-{self.name}", daemon=True).start()

    def release_now(self) -> None:
        """release(), the pages freed before it returns (where another buffer needs them)."""
        self.segment.unlink()
        self._unmap(lowered=False)

    def _unmap(self, lowered: bool = True) -> None:
        # At the lowest priority: the client releases the buffer as its model starts on the
        # prompt, and freeing the pages took 20-60 ms of a core beside that first token (bench e2e).
        if lowered:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: this thread only
        try:
            self.segment.close()
        except ShmError as e:
            log.warning("buffer %s: %s", self.name, e)
