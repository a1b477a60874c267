"""When a peer has stalled, from the times it made progress alone: the stall rules of a fetch
(`StallClock`) and of a connection's writes (`WriteStall`), pure (time is an argument, as in
aioquic's recovery: `next_check()` says when to look, `verdict(now)` says what happened), so
transport/calls.py and transport/aio.py only feed them times and sleep until next_check(), and
the rules are tested without a socket or a loop (tests/transport/test_stall.py)."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FINE", "STALLED", "TIMED_OUT", "Verdict", "StallClock", "WriteStall",
           "MIN_PROGRESS_BYTES_PER_S", "LOOP_LAG_S", "MIN_WAIT_S", "DEFAULT_WRITE_STALL_S"]

# What a verdict says: the fetch may go on, or how it ends (these are also the codes of the
# two endings a fetcher gives a fetch itself, sending CANCEL for both).
FINE = "fine"
STALLED = "stalled"
TIMED_OUT = "timed_out"

# Bytes on the connection are progress of a fetch awaiting its next chunk only at this rate or
# more over stall_s (as curl's --speed-limit over --speed-time): a sender probing a slow link
# before its first chunk (512 KiB at 2 Mbit/s takes 2 s) or sending a large chunk moves; a
# peer that trickles a frame a few bytes at a time or only PINGs does not.
MIN_PROGRESS_BYTES_PER_S = 16 * 1024
# A wake-up later than planned by more than this (or a quarter of stall_s) means this side's
# event loop did not run for part of the wait (a GC pass, a starved host): that wait is not
# counted as the peer's silence, as time with reading paused is not.
LOOP_LAG_S = 0.1
# The shortest sleep between two looks: a check due now or just past still yields to the loop.
MIN_WAIT_S = 0.001
# A connection whose write buffer is over the transport's high-water mark and has not shrunk
# for this long is ended (code write_stalled, never sent) and its buffer dropped: a peer that
# stopped reading (SIGSTOPped, wedged) holds no more of our memory than was queued by then.
# The daemon's [peer] write_stall_s.
DEFAULT_WRITE_STALL_S = 10.0


@dataclass(frozen=True)
class Verdict:
    """What a look at the clock found."""

    what: str  # FINE, STALLED or TIMED_OUT
    reason: str = ""  # for STALLED and TIMED_OUT: what happened, in words for the error


OK = Verdict(FINE)


class StallClock:
    """The fetcher's view of one fetch awaiting chunks: with `stall_s`, STALLED once no whole
    chunk has come for that long, counted from the FETCH or the latest chunk, nor bytes at
    MIN_PROGRESS_BYTES_PER_S (progress is chunks, or bytes at a useful rate); with `limit_s`,
    TIMED_OUT once that many seconds have passed since the FETCH. Time this side spends not
    reading (reading paused, or its event loop held up past the planned look) never counts as
    the peer's silence. A stall is named so even when the time limit is up too."""

    def __init__(self, now: float, *, stall_s: float | None = None, limit_s: float | None = None,
                 received: int = 0):
        self.stall_s = stall_s
        self.until = None if limit_s is None else now + limit_s
        self.moved = now  # the FETCH, the latest chunk, bytes at a useful rate or reading paused
        self._moved_bytes = received  # the connection's bytes then
        self._received = (received, now)  # the latest bytes seen on the connection, and when
        self._slept: tuple[float, float] | None = None  # (the latest look, the next one it planned)

    @property
    def limited(self) -> bool:
        """The fetch has a stall_s or a limit_s: without either it never ends on its own."""
        return self.stall_s is not None or self.until is not None

    def on_chunk(self, now: float) -> None:
        """A whole chunk of the fetch arrived (bytes seen last, with on_bytes, are counted in)."""
        self.moved, self._moved_bytes = now, self._received[0]

    def on_bytes(self, total: int, now: float) -> None:
        """The connection has received `total` bytes all told by `now` (any request's, or none)."""
        self._received = (total, now)

    def on_paused(self, now: float) -> None:
        """This side is not reading at `now` (its receive buffer is full): not the peer's silence."""
        self.moved = now

    def on_wake(self, now: float) -> bool:
        """This side woke at `now` from the sleep its latest look planned. True when it woke later
        than planned by more than LOOP_LAG_S (or a quarter of stall_s): its loop was held up and
        read nothing for some of that sleep, so the whole sleep is excused as the peer's silence."""
        if self._slept is None:
            return False
        looked, planned = self._slept
        self._slept = None
        if now - planned <= max(LOOP_LAG_S, (self.stall_s or 0) / 4):
            return False
        self.moved += now - looked
        return True

    def verdict(self, now: float) -> Verdict:
        """Whether the fetch may go on at `now`: bytes at a useful rate over stall_s count as
        progress first, then a stall is named before the time limit. A FINE look plans the
        next one (next_check())."""
        self._slept = None
        if self.stall_s is not None:
            total, seen = self._received
            if seen - self.moved >= self.stall_s and total - self._moved_bytes >= MIN_PROGRESS_BYTES_PER_S * (seen - self.moved):
                self.moved, self._moved_bytes = seen, total
            if now - self.moved >= self.stall_s:
                return Verdict(STALLED, f"the peer sent no whole chunk of this fetch, nor bytes at "
                                        f"{MIN_PROGRESS_BYTES_PER_S // 1024} KiB/s, for {now - self.moved:.2f} s "
                                        f"(stall_s {self.stall_s:g})")
        if self.until is not None and now >= self.until:
            return Verdict(TIMED_OUT, "no END within the fetch's time limit")
        if self.limited:
            self._slept = (now, max(self.next_check(), now + MIN_WAIT_S))
        return OK

    def next_check(self) -> float | None:
        """When to look next: the latest look's plan, or else the earlier of when the fetch
        stalls with no more progress and its time limit; None without either."""
        if self._slept is not None:
            return self._slept[1]
        due = [t for t in (None if self.stall_s is None else self.moved + self.stall_s, self.until) if t is not None]
        return min(due) if due else None


class WriteStall:
    """A connection whose writing is paused (its write buffer over the high-water mark): STALLED
    once the buffer has not shrunk for `stall_s` (the peer reads nothing). Looked at every
    quarter of stall_s, as shrinking is seen only by looking."""

    def __init__(self, stall_s: float = DEFAULT_WRITE_STALL_S):
        self.stall_s = stall_s
        self._mark = (0.0, 0)  # (when, write buffer bytes) the buffer last shrank, or writing paused
        self._looked = 0.0

    def on_paused(self, size: int, now: float) -> None:
        """Writing paused at `now` with `size` bytes in the write buffer: the stall counts from here."""
        self._mark = (now, size)
        self._looked = now

    def verdict(self, size: int, now: float) -> Verdict:
        """`size`: the write buffer's bytes at `now`."""
        self._looked = now
        since, was = self._mark
        if size < was:
            self._mark = (now, size)
        elif now - since >= self.stall_s:
            return Verdict(STALLED, f"the peer took none of the {size} bytes queued to it for {now - since:.1f} s "
                                    f"(write_stall_s {self.stall_s:g}); dropped")
        return OK

    def next_check(self) -> float:
        return self._looked + self.stall_s / 4
