"""The sender's loop for one FETCH, over a connection: probe a link never measured, then send
each chunk at the level FetchSender picks, a window of them in flight (window_chunks), and END. The daemon and
`kvstreamd bench stream` both serve with this one function, so the bench measures the product."""
from __future__ import annotations

import asyncio
import inspect
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from .bandwidth import PROBE_ENOUGH_S, PROBES, BandwidthEstimator
from .delivery import DeliveryClock
from .policy import TEXT, Rule
from .requests import DEFAULT_MAX_BUFFERED_BYTES
from .sender import FetchSender

if TYPE_CHECKING:
    from .aio import ServedFetch

# Chunks on the wire at once: a window sized from the bandwidth-delay product, so a long
# round trip costs one RTT per fetch rather than one per chunk. At least MIN_WINDOW (the
# next chunk is written as soon as the last is, so even a LAN link never sits idle for a
# round trip between chunks: stop-and-wait cost ~3.5 ms a chunk, ~10% of a 512-token Gemma-3
# chunk's time at 100 Mbit/s, docs/benchmarks.md), at most MAX_WINDOW chunks and MAX_WINDOW_BYTES
# bytes. The level of each is still chosen when it is about to be written, from every ACK so far.
MIN_WINDOW = 2
DEPTH = MIN_WINDOW  # the name the fixed window had; kept for callers
MAX_WINDOW = 64
# Half the fetcher's default receive buffer (max_buffered_bytes, 64 MiB; reading pauses above
# it and resumes at half): chunks in flight alone can never make a fetcher stop reading. Past
# 1 Gbit/s x 250 ms this is what bounds the window; raise both together (docs/protocol.md).
MAX_WINDOW_BYTES = DEFAULT_MAX_BUFFERED_BYTES // 2


def window_chunks(bandwidth: float | None, rtt: float | None, chunk_bytes: float, *,
                  max_chunks: int = MAX_WINDOW, max_bytes: int = MAX_WINDOW_BYTES) -> int:
    """How many chunks to keep in flight: enough to fill the link for a round trip, plus the
    one being written, ceil(bandwidth * rtt / chunk_bytes) + 1, capped at `max_chunks` and at
    `max_bytes` of chunks, never under MIN_WINDOW. `bandwidth` in bytes/s and `rtt` in
    seconds are what the link taught (None: not known yet: MIN_WINDOW); `chunk_bytes` is a
    typical chunk's wire size."""
    if not bandwidth or bandwidth <= 0 or rtt is None or rtt <= 0 or chunk_bytes <= 0:
        return MIN_WINDOW
    bdp = math.ceil(bandwidth * rtt / chunk_bytes) + 1
    return max(MIN_WINDOW, min(bdp, max_chunks, int(max_bytes // chunk_bytes)))


@dataclass(frozen=True)
class Sent:
    """What send_chunks() did for one FETCH."""

    sender: FetchSender  # its levels and choices per chunk, with the reasons, and the deadline
    coded_bytes: int  # wire bytes of the CHUNK frames (TEXT frames not counted)
    busy_s: float  # summed send-to-ACK time of every chunk: how long the link was in use
    started: float  # loop time send_chunks() began, before any probe
    deadline_missed: bool  # what END reported (False where it stopped short)
    stopped_at: int | None = None  # the chunk it could not make (payload_of gave None); not ended
    max_inflight: int = 0  # the most chunks that were on the wire at once (written, not yet ACKed)
    windows: tuple[int, ...] = ()  # the window in force as each chunk was written


async def _probe(peer, estimator: BandwidthEstimator) -> None:
    """Measure the link with PROBES in turn, until one takes PROBE_ENOUGH_S to cross (the last
    always counts), and feed that one to `estimator`. The first goes beside a PING, one round
    trip for both (its PONG comes back first, the probe's ack after its bytes), whose time is
    taken off every probe's."""
    probe = PROBES[0]
    rtt, (sent_at, acked_at) = await asyncio.gather(peer.ping(), peer.probe(probe.size))
    for larger in PROBES[1:]:
        if probe.crossing_s(sent_at, acked_at, rtt) >= PROBE_ENOUGH_S:
            break
        probe = larger
        sent_at, acked_at = await peer.probe(probe.size)
    probe.record(estimator, sent_at, acked_at, rtt=rtt)


async def send_chunks(served: ServedFetch, sizes: Mapping[str, Sequence[int]],
                      payload_of: Callable[[int, str], bytes | None], text_of: Callable[[int], list[int]],
                      rule: Rule, estimator: BandwidthEstimator, work_s: Mapping[str, float],
                      dppl: Mapping[str, float], *,
                      on_sent: Callable[[int, str, int], None] | None = None,
                      before_send: Callable[[int, str], None] | None = None,
                      count: int | None = None,
                      level_of: Callable[[int, str], str] | None = None,
                      window: int | None = None, text_last: bool = False,
                      text_s: Sequence[float] | None = None, beside: Iterable[str] = ()) -> Sent:
    """Send every chunk of `served`'s FETCH, then END "ok" with whether its deadline (counted
    from the FETCH's arrival) was missed. With `count` short of the FETCH's chunks, send chunks
    [0, count) only and leave the request open: the caller ends it with an ERROR.

    `sizes[level][i]` is chunk i's size at each level on offer (TEXT among them if allowed),
    `payload_of(i, level)` its encoded bytes, `text_of(i)` its token ids; `work_s` and `dppl`
    are what each level costs the fetcher in seconds and in quality. A peer whose link has
    no history (`estimator.needs_probe`), or none lately (`stale`), is probed first with
    padded PINGs (`_probe`: the smallest of PROBES that is slow enough to time, and a plain
    PING for the round trip beside the first). Chunks go in
    order, up to a window of them on the wire at once (window_chunks: the bandwidth-delay
    product from the estimate and the connection's RTT, recomputed before each chunk; `window` fixes it instead): each chunk's
    level is chosen just before it is written, from every ACK received by then.
    `payload_of` may be a coroutine function (a sender that reads each chunk only as it is about
    to be written holds the chunks in flight, not the whole FETCH); it returns None for a chunk it cannot make (damaged where it is kept): the loop
    stops before it and leaves the request open, as with `count`, and says so in `stopped_at`.
    `before_send(i, level)` runs just before chunk i is written; `on_sent(i, level, nbytes)`
    once it is. `level_of(i, level)`: the level chunk i goes at when `level` is chosen for it
    (a sender that holds some chunks at some levels only sends the nearest it holds; `sizes`
    are then that level's), named so on the wire. `text_last`: the FETCH's (FetchSender);
    `text_s`: each chunk's receiver seconds as TEXT, by position, and `beside`: the levels it
    works on beside the others (FetchSender)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    pinging: asyncio.Task | None = None
    if estimator.needs_probe or estimator.stale(started):
        await _probe(served.peer, estimator)
    elif getattr(served.peer, "rtt", None) is None:
        # a link with history on a connection never pinged: learn the round trip alongside the
        # first chunks (the window stays MIN_WINDOW until the PONG)
        pinging = asyncio.ensure_future(served.peer.ping())
    chunks = len(served.fetch.keys) if count is None else count
    sender = FetchSender(served.req, chunks, sizes, max(served.remaining() * 1000, 1.0), loop.time(),
                         rule, estimator, work_s, dppl, text_last=text_last, text_s=text_s, beside=beside)
    coded = 0
    clock = DeliveryClock(started)
    recent: deque[int] = deque(maxlen=8)  # wire bytes of the latest chunks written
    windows: list[int] = []
    most = 0
    stopped_at = None

    def current_rtt() -> float | None:
        rtt = getattr(served.peer, "rtt", None)
        if rtt is None and pinging is not None and pinging.done() and not pinging.cancelled() \
                and pinging.exception() is None:
            rtt = pinging.result()
        return rtt

    def current_window() -> int:
        if window is not None:
            return window
        if not recent:
            return MIN_WINDOW
        return window_chunks(estimator.estimate(), current_rtt(), sum(recent) / len(recent))

    def acknowledged(ack, acked_at: float) -> None:
        d = clock.on_ack(ack.i, acked_at, rtt=current_rtt(), window=current_window())
        sender.on_ack(ack.i, d.nbytes, acked_at - d.nbytes / d.rate, acked_at)

    try:
        while True:
            while not served.acks.empty():  # every ACK so far, before the next level is chosen
                acknowledged(*served.acks.get_nowait())
            if stopped_at is None and clock.in_flight < (w := current_window()) \
                    and (nxt := sender.next_chunk(loop.time())) is not None:
                i, level = nxt
                if level_of is not None and level != TEXT:
                    level = level_of(i, level)
                if before_send is not None:
                    before_send(i, level)
                sent_at = loop.time()
                if level == TEXT:
                    nbytes = await served.send_text(i, text_of(i))
                else:
                    payload = payload_of(i, level)
                    if inspect.isawaitable(payload):  # read just before it goes (the daemon's store)
                        payload = await payload
                    if payload is None:  # the chunks before it are acknowledged before the caller says so
                        stopped_at = i
                        continue
                    nbytes = await served.send_chunk(i, level, payload)
                    coded += nbytes
                if on_sent is not None:
                    on_sent(i, level, nbytes)
                clock.on_sent(i, nbytes, sent_at)
                recent.append(nbytes)
                windows.append(w)
                most = max(most, clock.in_flight)
                continue
            if not clock.in_flight:
                break
            acknowledged(*await served.acks.get())
    finally:
        if pinging is not None:
            if not pinging.done():
                pinging.cancel()
            elif not pinging.cancelled():
                pinging.exception()  # a PING lost with the connection: the loop's own error says so
    if stopped_at is not None:
        return Sent(sender, coded, clock.busy_s, started, False, stopped_at=stopped_at, max_inflight=most,
                    windows=tuple(windows))
    missed = sender.deadline_missed(loop.time())
    if chunks == len(served.fetch.keys):
        await served.end(deadline_missed=missed)
    return Sent(sender, coded, clock.busy_s, started, missed, max_inflight=most, windows=tuple(windows))
