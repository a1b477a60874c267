"""The daemon's event loop, watched: every lookup, fetch event and peer frame waits while the loop
is held (a synchronous call on it, a long GIL hold by one of its threads, a starved process), so
a hold of HELD_S or more is logged once the loop runs again, with where the loop thread was when
the hold passed HELD_S (a watcher thread takes its stack then). Every tick's lateness goes into
kvstreamd_event_loop_lag_seconds; /v1/status says the holds since start under "event_loop".

    ts=... level=warning logger=kvstreamd.ops.loop_watch msg="event loop held 0.84 s; at 0.25 s it was in:
        kvstreamd/node/puts.py:171 _put <- kvstreamd/store/store.py:262 put_to <- ..."
"""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

from kvstreamd.features import Feature

log = logging.getLogger(__name__)

TICK_S = 0.05  # how often the loop is asked to run a tick
HELD_S = 0.25  # a tick this late is a hold: logged, with where the loop was (lookups of vLLM's connector wait 0.2 s)
FRAMES = 6  # the innermost frames a hold's log line names


def where(frame, frames: int = FRAMES) -> str:
    """The innermost `frames` frames of a thread's stack, innermost first, one line."""
    stack = traceback.extract_stack(frame)[-frames:]
    return " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))


def _short(path: str) -> str:
    """A file's path from the package or library folder it is in on ("kvstreamd/node/puts.py")."""
    parts = path.replace("\\", "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("kvstreamd", "codec", "transport", "site-packages", "asyncio"):
            return "/".join(parts[i + (parts[i] == "site-packages"):])
    return "/".join(parts[-2:])


class LoopWatch(Feature):
    """A tick on the loop every TICK_S, and a thread that notices a tick overdue by HELD_S and
    takes the loop thread's stack; the tick after the hold logs it and counts it."""

    name = "event_loop"

    def __init__(self, metrics, held_s: float = HELD_S, tick_s: float = TICK_S) -> None:
        self.metrics = metrics  # kvstreamd.metrics.Metrics: loop_lag
        self.held_s, self.tick_s = held_s, tick_s
        self.holds = 0
        self.longest_s = 0.0
        self.last: dict | None = None  # the latest hold: {"seconds", "at", "where"}
        self._beat = time.monotonic()
        self._caught: str | None = None  # the loop thread's stack, taken during the current hold
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._task: asyncio.Task | None = None
        self._thread: threading.Thread | None = None
        self._loop_thread = threading.get_ident()

    async def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._task = asyncio.ensure_future(self._ticks())
        self._thread = threading.Thread(target=self._watch, name="kvstreamd-loop-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 1.0)

    async def _ticks(self) -> None:
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self.tick_s)
            now = time.monotonic()
            lag = max(now - asked - self.tick_s, 0.0)
            with self._lock:
                self._beat = now
                caught, self._caught = self._caught, None
            self.metrics.loop_lag.observe(lag)
            if lag >= self.held_s:
                self._held(lag, caught)

    def _held(self, lag: float, caught: str | None) -> None:
        self.holds += 1
        self.longest_s = max(self.longest_s, lag)
        at = caught or "(not caught: the hold ended before the watcher looked)"
        self.last = {"seconds": round(lag, 3), "at": time.time(), "where": at}
        log.warning("event loop held %.2f s; at %.2f s it was in: %s", lag, self.held_s, at)

    def _watch(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                overdue = time.monotonic() - self._beat - self.tick_s
                if overdue < self.held_s or self._caught is not None:
                    continue
            frame = sys._current_frames().get(self._loop_thread)
            text = where(frame) if frame is not None else "(the loop thread is gone)"
            with self._lock:
                if self._caught is None:
                    self._caught = text

    def status(self) -> dict:
        return {"held_s": self.held_s, "holds": self.holds, "longest_s": round(self.longest_s, 3), "last": self.last}
