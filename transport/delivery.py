"""When a chunk's bytes crossed the link, from its write and ACK times alone: the sender's
delivery clock, pure (time is an argument, as in aioquic's recovery), so send.py's loop only
feeds it and its rules are tested without a socket (tests/transport/test_delivery.py)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .bandwidth import CLOCK_TICK, crossing_s


@dataclass(frozen=True)
class Delivery:
    """What one ACK says about the link."""

    nbytes: int  # wire bytes of the chunk ACKed
    began: float  # when its bytes went onto the link (not when it was written)
    rate: float  # bytes/s the link carried over the run of chunks that crossed back to back


class DeliveryClock:
    """Chunks written and not yet ACKed, and how long the link was in use (`busy_s`)."""

    def __init__(self, started: float) -> None:
        self.busy_s = 0.0
        self.last_ack = started
        self._inflight: dict[int, tuple[float, int]] = {}  # chunk -> (when written, wire bytes)
        self._run: deque[tuple[float, float, int]] = deque()  # (began, ACKed, bytes), back to back

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def on_sent(self, i: int, nbytes: int, now: float) -> None:
        self._inflight[i] = (now, nbytes)

    def on_ack(self, i: int, now: float, *, rtt: float | None = None, window: int = 1) -> Delivery:
        """Chunk i's ACK arrived at `now`; `rtt` is the connection's round trip where known and
        `window` the chunks that may be in flight at once (no more can bunch). KeyError for a
        chunk not written or ACKed already."""
        sent_at, nbytes = self._inflight.pop(i)
        # Its bytes went onto the link once the chunk before it had crossed (its ACK) or, where
        # the link was idle a while, one round trip after its write (as for the probe:
        # crossing_s): the delivery counts from then, not from when it was written.
        base = min(max(sent_at, self.last_ack), now)
        rtt = rtt or 0.0
        if sent_at + rtt > base:
            began, back_to_back = now - min(now - base, crossing_s(now - sent_at, rtt)), False
        else:
            began, back_to_back = base, sent_at <= self.last_ack
        self.busy_s += now - began
        # ACKs of chunks that crossed back to back can arrive bunched (a fetcher or a relay that
        # read several at once, late): timed over the run of such chunks, up to a window of them,
        # the rate is what the link carried, however the ACKs were spread inside the run. The
        # run starts at a chunk that took time of its own to cross: one ACKed in the same
        # instant as the chunk before it crossed earlier than it seems.
        run = self._run
        if not back_to_back:
            run.clear()
        run.append((began, now, nbytes))
        while len(run) > window or (len(run) > 1 and run[0][1] - run[0][0] < CLOCK_TICK):
            run.popleft()
        rate = sum(n for _, _, n in run) / max(now - run[0][0], CLOCK_TICK)
        self.last_ack = max(self.last_ack, now)
        return Delivery(nbytes, began, rate)
