"""Host memory for fetched KV, used again once the tensors over it are gone.

A model process copies each fetched chunk out of the daemon's buffer into a KV of its own
(models.prefix). Freshly allocated, that KV's pages fault in on first write: 188 MB of fp32 for a
4096-token SmolLM2 prefix took ~50 ms of faults on an idle 2-core machine and ~130 ms beside two
busy processes (a fetch's codec workers), against ~7 ms to copy into pages already mapped. At
1000 Mbit/s the int8 chunks land every 5-8 ms, and the model process fell 100-300 ms behind the
daemon by the last one. `Recycled` hands out blocks it keeps: a block comes back when the last
tensor viewing it is freed, and the next fetch writes into pages that are already there."""
from __future__ import annotations

import math
import threading
import weakref

import numpy as np
import torch

KEEP_BYTES = 2 << 30  # free blocks kept, at most, oldest dropped first
# A free block serves a request of at least this share of its size (a small prefix does not pin a
# large block, which the next long one would then allocate afresh)
FIT = 0.5


class Recycled:
    """`empty(shape, dtype)`: an uninitialised CPU tensor over a kept block where one fits,
    else over a new one; either way the block is kept (up to `keep_bytes` of free blocks) once
    every view of the tensor is gone."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[np.ndarray] = []  # oldest first
        self._lock = threading.Lock()
        self.reused = 0  # blocks handed out again (tests, diagnostics)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None = None
              ) -> torch.Tensor:
        if device is not None and torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = max(1, math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if FIT * b.nbytes <= nbytes <= b.nbytes]
            block = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
            if block is not None:
                self.reused += 1
        if block is None:
            block = np.empty(nbytes, np.uint8)
        # The view holds the block; torch holds the view. When the last tensor over it goes, the
        # view does, and the block is free again.
        view = block[:nbytes]
        weakref.finalize(view, self._give, block)
        return torch.from_numpy(view).view(dtype).view(shape)

    def _give(self, block: np.ndarray) -> None:
        with self._lock:
            self._free.append(block)
            while sum(b.nbytes for b in self._free) > self.keep_bytes:
                self._free.pop(0)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)
