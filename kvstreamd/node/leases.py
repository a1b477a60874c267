"""The fetch buffers a node holds for its clients, each until the client releases it or its
lease ([api] buffer_lease_s) runs out; a released one is kept for the next fetch that fits in
it, within [api] spare_buffer_bytes (handoff/spares.py)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvstreamd.handoff.buffers import FetchBuffer, HostBuffer
from kvstreamd.handoff.spares import SpareBuffers
from kvstreamd.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class _Held:
    buffer: FetchBuffer
    expires: float  # time.monotonic()


class BufferLeases:
    def __init__(self, lease_s: float, metrics: Metrics, spare_bytes: int = 0) -> None:
        self.lease_s = lease_s
        self.metrics = metrics
        self.held: dict[str, _Held] = {}
        self.spares = SpareBuffers(spare_bytes)

    def reconfigure(self, cfg) -> None:
        self.lease_s = cfg.api.buffer_lease_s  # for buffers leased from now on
        self.spares.reconfigure(cfg.api.spare_buffer_bytes)

    def hold(self, buf: FetchBuffer) -> None:
        self.held[buf.name] = _Held(buf, time.monotonic() + self.lease_s)

    def release(self, name: str, spare: bool = False) -> bool:
        """Give back the buffer `name`; with `spare` (its client let it go, so nothing reads it)
        a host buffer is kept for a later fetch (SpareBuffers) rather than unlinked."""
        held = self.held.pop(name, None)
        if held is None:
            return False
        if spare and isinstance(held.buffer, HostBuffer):
            self.spares.give(held.buffer)
            return True
        try:
            held.buffer.release()
        except Exception as e:  # a view still alive in this process: leave the mapping to GC
            log.warning("buffer %s: %s", name, e)
        return True

    def release_all(self) -> None:
        for name in list(self.held):
            self.release(name)
        self.spares.release_all()

    def expire(self, now: float) -> None:
        for name, held in list(self.held.items()):
            if held.expires < now:
                log.info("buffer %s: lease expired unreleased; unlinked", name)
                self.metrics.error("buffer_lease_expired")
                self.release(name)
        self.spares.expire(now)

    def __len__(self) -> int:
        return len(self.held)

    def nbytes(self) -> int:
        return sum(h.buffer.nbytes for h in self.held.values())
