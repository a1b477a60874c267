"""Fetch buffers their clients have released, kept allocated and named for the next fetch that
fits in one. A new buffer's pages are allocated (zeroed) before the first chunk is decoded into
it: 25-31 ms for the 94 MB of a 4096-token SmolLM2 context on this machine, on the path of the
fetch's first chunk and taking a core from the decoders; at 1000 Mbit/s a reused buffer took
~40 ms off a 0.40 s fetch (docs/benchmarks.md).

A spare goes to the smallest fetch buffer it can hold, up to `budget` bytes of spares in all
(the oldest let go first), each for at most IDLE_S. Only a buffer its client released is kept:
one whose lease ran out, or whose fetch failed, may still be mapped by a client that reads it,
and is unlinked as before. A reused buffer holds what its last fetch left where the new fetch
writes nothing (the client reads only what its chunk events name). A fetch that needs a new
buffer where /dev/shm has no room for it first lets spares go (`make_room`): kept spares must
never fail a fetch that would have had room without them."""
from __future__ import annotations

import time

from kvstreamd.handoff.buffers import HostBuffer

IDLE_S = 60.0  # a spare unused this long is let go: the host's memory back once fetches stop


class SpareBuffers:
    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._spares: list[tuple[float, HostBuffer]] = []  # (when it was let go, the buffer), oldest first

    def take(self, nbytes: int) -> HostBuffer | None:
        """The smallest spare of at least `nbytes` bytes, no longer a spare; None if none is."""
        fits = [(b.nbytes, k) for k, (_, b) in enumerate(self._spares) if b.nbytes >= nbytes]
        if not fits:
            return None
        return self._spares.pop(min(fits)[1])[1]

    def give(self, buf: HostBuffer, now: float | None = None) -> None:
        """Keep `buf` (released by its client) for a later fetch, within the budget; one larger
        than the whole budget is released at once, the spares kept as they are."""
        if buf.nbytes > self.budget:
            buf.release()
            return
        self._spares.append((time.monotonic() if now is None else now, buf))
        self._trim()

    def make_room(self, nbytes: int, free: int) -> list[HostBuffer]:
        """The spares to let go, oldest first, so that /dev/shm (`free` bytes free now) holds
        `nbytes` more: no longer spares. The caller frees their pages (HostBuffer.release_now,
        off the event loop: ~13 ms for 58 MB) before it allocates."""
        gone: list[HostBuffer] = []
        while self._spares and free + sum(b.nbytes for b in gone) < nbytes:
            gone.append(self._spares.pop(0)[1])
        return gone

    def expire(self, now: float) -> None:
        """Let go of the spares unused for IDLE_S."""
        for at, buf in [s for s in self._spares if now - s[0] > IDLE_S]:
            self._spares.remove((at, buf))
            buf.release()

    def release_all(self) -> None:
        while self._spares:
            self._spares.pop()[1].release()

    def reconfigure(self, budget: int) -> None:
        self.budget = budget
        self._trim()

    def nbytes(self) -> int:
        return sum(b.nbytes for _, b in self._spares)

    def __len__(self) -> int:
        return len(self._spares)

    def _trim(self) -> None:
        while self._spares and self.nbytes() > self.budget:
            self._spares.pop(0)[1].release()
