"""The sender's loop for one FETCH, over a connection: probe a link never measured, then send
each chunk at the level FetchSender picks, wait for its ACK, and END. The daemon and
`kvstreamd bench stream` both serve with this one function, so the bench measures the product."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from .bandwidth import BandwidthEstimator, Probe
from .policy import TEXT, Rule
from .sender import FetchSender

if TYPE_CHECKING:
    from .aio import ServedFetch

# Chunks on the wire at once: the next one is written as soon as the last is, so the link does
# not sit idle for a round trip between chunks (stop-and-wait cost ~3.5 ms a chunk, ~10% of a
# 512-token Gemma-3 chunk's time at 100 Mbit/s, docs/benchmarks.md); the level of each is still
# chosen from every ACK before it but one.
DEPTH = 2


@dataclass(frozen=True)
class Sent:
    """What send_chunks() did for one FETCH."""

    sender: FetchSender  # its levels and choices per chunk, with the reasons, and the deadline
    coded_bytes: int  # wire bytes of the CHUNK frames (TEXT frames not counted)
    busy_s: float  # summed send-to-ACK time of every chunk: how long the link was in use
    started: float  # loop time send_chunks() began, before any probe
    deadline_missed: bool  # what END reported (False where it stopped short)
    stopped_at: int | None = None  # the chunk it could not make (payload_of gave None); not ended


async def send_chunks(served: ServedFetch, sizes: Mapping[str, Sequence[int]],
                      payload_of: Callable[[int, str], bytes | None], text_of: Callable[[int], list[int]],
                      rule: Rule, estimator: BandwidthEstimator, work_s: Mapping[str, float],
                      dppl: Mapping[str, float], *,
                      on_sent: Callable[[int, str, int], None] | None = None,
                      before_send: Callable[[int, str], None] | None = None,
                      count: int | None = None,
                      level_of: Callable[[int, str], str] | None = None) -> Sent:
    """Send every chunk of `served`'s FETCH, then END "ok" with whether its deadline (counted
    from the FETCH's arrival) was missed. With `count` short of the FETCH's chunks, send chunks
    [0, count) only and leave the request open: the caller ends it with an ERROR.

    `sizes[level][i]` is chunk i's size at each level on offer (TEXT among them if allowed),
    `payload_of(i, level)` its encoded bytes, `text_of(i)` its token ids; `work_s` and `dppl`
    are what each level costs the fetcher in seconds and in quality. A peer whose link has
    no history (`estimator.needs_probe`) is probed first with a padded PING. Chunks go in
    order, DEPTH on the wire at once: the next is chosen once the one DEPTH - 1 before it is
    acknowledged, from what the ACKs taught.
    `payload_of` returns None for a chunk it cannot make (damaged where it is kept): the loop
    stops before it and leaves the request open, as with `count`, and says so in `stopped_at`.
    `before_send(i, level)` runs just before chunk i is written; `on_sent(i, level, nbytes)`
    once it is. `level_of(i, level)`: the level chunk i goes at when `level` is chosen for it
    (a sender that holds some chunks at some levels only sends the nearest it holds; `sizes`
    are then that level's), named so on the wire."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    if estimator.needs_probe:
        probe = Probe()
        rtt = await served.peer.ping()
        sent_at, acked_at = await served.peer.probe(probe.size)
        probe.record(estimator, sent_at, acked_at, rtt=rtt)
    chunks = len(served.fetch.keys) if count is None else count
    sender = FetchSender(served.req, chunks, sizes, max(served.remaining() * 1000, 1.0), loop.time(),
                         rule, estimator, work_s, dppl)
    coded = 0
    busy = 0.0
    inflight: dict[int, tuple[float, int]] = {}  # chunk -> (when written, wire bytes)
    last_ack = started
    stopped_at = None
    while True:
        while stopped_at is None and len(inflight) < DEPTH and (nxt := sender.next_chunk(loop.time())) is not None:
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
                if payload is None:  # the chunks before it are acknowledged before the caller says so
                    stopped_at = i
                    break
                nbytes = await served.send_chunk(i, level, payload)
                coded += nbytes
            if on_sent is not None:
                on_sent(i, level, nbytes)
            inflight[i] = (sent_at, nbytes)
        if not inflight:
            break
        ack, acked_at = await served.acks.get()
        sent_at, nbytes = inflight.pop(ack.i)
        # Written while the chunk before it was still on the link, its bytes went out once
        # that one's had: its delivery counts from then, not from when it was written.
        began = min(max(sent_at, last_ack), acked_at)
        busy += acked_at - began
        sender.on_ack(ack.i, nbytes, began, acked_at)
        last_ack = max(last_ack, acked_at)
    if stopped_at is not None:
        return Sent(sender, coded, busy, started, False, stopped_at=stopped_at)
    missed = sender.deadline_missed(loop.time())
    if chunks == len(served.fetch.keys):
        await served.end(deadline_missed=missed)
    return Sent(sender, coded, busy, started, missed)
