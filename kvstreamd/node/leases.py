"""The fetch buffers a node holds for its clients, each until the client releases it or its
lease ([api] buffer_lease_s) runs out."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvstreamd.handoff.buffers import FetchBuffer
from kvstreamd.metrics import Metrics

log = logging.getLogger("kvstreamd.node")


@dataclass
class _Held:
    buffer: FetchBuffer
    expires: float  # time.monotonic()


class BufferLeases:
    def __init__(self, lease_s: float, metrics: Metrics) -> None:
        self.lease_s = lease_s
        self.metrics = metrics
        self.held: dict[str, _Held] = {}

    def reconfigure(self, cfg) -> None:
        self.lease_s = cfg.api.buffer_lease_s  # for buffers leased from now on

    def hold(self, buf: FetchBuffer) -> None:
        self.held[buf.name] = _Held(buf, time.monotonic() + self.lease_s)

    def release(self, name: str) -> bool:
        held = self.held.pop(name, None)
        if held is None:
            return False
        try:
            held.buffer.release()
        except Exception as e:  # a view still alive in this process: leave the mapping to GC
            log.warning("buffer %s: %s", name, e)
        return True

    def release_all(self) -> None:
        for name in list(self.held):
            self.release(name)

    def expire(self, now: float) -> None:
        for name, held in list(self.held.items()):
            if held.expires < now:
                log.info("buffer %s: lease expired unreleased; unlinked", name)
                self.metrics.error("buffer_lease_expired")
                self.release(name)

    def __len__(self) -> int:
        return len(self.held)

    def nbytes(self) -> int:
        return sum(h.buffer.nbytes for h in self.held.values())
