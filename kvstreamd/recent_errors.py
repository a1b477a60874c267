"""The daemon's errors with the time each happened, bounded, so that "how many of each kind in
the last hour" has an answer (`kvstreamd doctor`): kvstreamd_errors{kind} counts since start,
which cannot tell an old burst from a fresh one."""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

KEEP = 4096  # events kept: past it the oldest go, and a window reaching before them says so
# A chunk a peer sent that is damaged: its crc does not match on the wire (chunk_bad_crc), it is
# not the chunk asked for by its header (chunk_refused_<check>, kvstreamd/admission.py), or
# its bitstream does not decode (decode; kvstreamd/pipeline.py names all three).
DAMAGED_CHUNK_KINDS = ("chunk_bad_crc", "decode")
DAMAGED_CHUNK_PREFIX = "chunk_refused_"


def is_damaged_chunk(kind: str) -> bool:
    return kind in DAMAGED_CHUNK_KINDS or kind.startswith(DAMAGED_CHUNK_PREFIX)


class RecentErrors:
    """(time, kind, count) of the latest KEEP errors; safe to add to from any thread."""

    def __init__(self, keep: int = KEEP, clock: Callable[[], float] = time.time) -> None:
        self._events: collections.deque[tuple[float, str, int]] = collections.deque(maxlen=keep)
        self._clock = clock
        self._lock = threading.Lock()
        self._lost_until: float | None = None  # time of the newest event pushed out

    def add(self, kind: str, n: int = 1) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self._lost_until = self._events[0][0]
            self._events.append((self._clock(), kind, n))

    def counts(self, window_s: float) -> tuple[dict[str, int], bool]:
        """Errors by kind in the last `window_s` seconds, and whether that is all of them
        (False: events of the window were pushed out, so the counts are a floor)."""
        since = self._clock() - window_s
        out: dict[str, int] = {}
        with self._lock:
            for t, kind, n in self._events:
                if t >= since:
                    out[kind] = out.get(kind, 0) + n
            complete = self._lost_until is None or self._lost_until < since
        return dict(sorted(out.items())), complete
