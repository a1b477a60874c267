"""When a codec pool's workers last coded, so that background work (warming tables ahead of the
chunks, codec.pool.parallel.CodecPool.warm_grid) starts only in the gaps between requests: a put's
encodes and a fetch's decodes come in bursts with shorter gaps than QUIET_S, so it slots between
requests, not into them."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

QUIET_S = 0.5


class Quiet:
    def __init__(self, quiet_s: float = QUIET_S) -> None:
        self.quiet_s = quiet_s
        self._coding = 0  # coding jobs in flight
        self._since = time.monotonic()  # when the last one ended
        self._stopped = False
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def coding(self) -> Iterator[None]:
        """Around a coding job: background work waits while it runs and QUIET_S after."""
        with self._cond:
            self._coding += 1
        try:
            yield
        finally:
            with self._cond:
                self._coding -= 1
                self._since = time.monotonic()
                self._cond.notify_all()

    def wait(self) -> bool:
        """Until no coding job is in flight and none ended in the last quiet_s; False once
        stop() was called (the pool is closing)."""
        with self._cond:
            while not self._stopped:
                left = self._since + self.quiet_s - time.monotonic()
                if not self._coding and left <= 0:
                    return True
                self._cond.wait(left if not self._coding else None)
            return False

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
