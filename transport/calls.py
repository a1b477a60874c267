"""The two sides of one request as asyncio objects: `FetchCall` (this node fetching: an async
iterator of chunks) and `ServedFetch` (this node sending: what a handler writes to), and the
errors a fetch can end with. transport/aio.py makes them and feeds them; no sockets here."""
from __future__ import annotations

import asyncio
import zlib
from typing import Any, Awaitable, Callable, Protocol

from .messages import Ack, Chunk, End, Error, Fetch, Message, Text
from .stall import FINE, STALLED, StallClock

__all__ = ["TransportError", "HandshakeError", "ConnectionClosedError", "FetchError", "FetchFailed",
           "FetchCancelled", "FetchInterrupted", "FetchStalled", "FetchTimedOut", "FetchCall", "ServedFetch",
           "grace_s", "wait_s", "GRACE_MIN_S", "GRACE_SHARE"]

# How long past its deadline either side of a request goes on with it at most: a fetcher ends
# its fetch by then whatever its peers do, and a sender stops serving a fetcher gone silent.
GRACE_MIN_S = 1.0
GRACE_SHARE = 0.10


def grace_s(deadline_ms: float) -> float:
    """max(GRACE_MIN_S, GRACE_SHARE * deadline): seconds a request may run past its deadline."""
    return max(GRACE_MIN_S, GRACE_SHARE * deadline_ms / 1000)


def wait_s(deadline_ms: float, recompute_s: float) -> float:
    """How long a fetcher waits for chunks from peers (grace aside): until its deadline, or, where
    recomputing those chunks itself would take longer (a deadline already lost on a slow link),
    until then -- chunks arriving sooner than they could be recomputed are still worth taking,
    and past that no chunk is (the senders plan TEXT themselves where the link is slower)."""
    return max(deadline_ms / 1000, recompute_s)


class Peer(Protocol):
    """What a request's two sides use of their connection (aio.PeerConnection is the one)."""

    peer_node_id: str | None
    peer_caps: dict | None
    received_bytes: int  # bytes that came from the peer on the connection, all told
    reading_paused: bool  # this side stopped reading (its receive buffer is full)

    async def cancel(self, req: int, error: "FetchError | None" = None) -> None: ...
    async def ping(self) -> float: ...
    async def probe(self, size: int) -> tuple[float, float]: ...


class TransportError(Exception):
    """Base of the errors of transport's asyncio layer; `code` is a protocol error code, `msg`
    says what happened."""

    def __init__(self, code: str, msg: str):
        super().__init__(f"{code}: {msg}")
        self.code = code
        self.msg = msg


class HandshakeError(TransportError):
    """connect() did not reach READY: refused (auth_failed, version, ...), timed out or lost."""


class ConnectionClosedError(TransportError):
    """The connection is closed; `code`/`msg` say why."""


class FetchError(TransportError):
    """A fetch did not complete; `req` is its request id. Never raised for a complete fetch."""

    def __init__(self, code: str, msg: str, req: int):
        super().__init__(code, f"req {req}: {msg}")
        self.req = req


class FetchFailed(FetchError):
    """The sender ended the request with an ERROR (e.g. not_found, internal) or an END whose
    status is not "ok"."""


class FetchCancelled(FetchError):
    """The fetch was cancelled (by cancel() on this side)."""


class FetchInterrupted(FetchError, ConnectionClosedError):
    """The connection closed before the request's END: what arrived is not the whole context."""


class FetchStalled(FetchCancelled):
    """No whole chunk of this fetch came for the fetch's `stall_s` while it was awaited, nor
    bytes at stall.MIN_PROGRESS_BYTES_PER_S: the peer stopped, is partitioned, ignores the FETCH,
    or only trickles bytes or chatters. The fetch was cancelled on the wire."""


class FetchTimedOut(FetchCancelled):
    """The fetch's `limit_s` passed before its END: this side stopped waiting and cancelled
    it on the wire. What arrived before is good; the rest never came."""


class FetchCall:
    """The fetcher side of one FETCH: an async iterator of its CHUNK and TEXT messages that
    stops after END "ok" and raises a FetchError for any other ending. Made by
    PeerConnection.fetch(), which feeds it with deliver() and finish().

    Whatever the peer does, a call with limits never waits past them: with `stall_s`, once
    no whole chunk (CHUNK or TEXT) of this fetch has come for that long, counted from the
    FETCH or the latest chunk, while the call is awaited, nor bytes at MIN_PROGRESS_BYTES_PER_S,
    it raises FetchStalled (progress is chunks, or bytes at a useful rate: a peer that trickles
    a frame or only PINGs has stalled); with `limit_s`, once that
    many seconds have passed since the FETCH, FetchTimedOut. Either sends CANCEL first, so
    the peer stops sending and frees what it holds for the request. Time this side spends
    not reading (its receive buffer full, or its event loop held up) never counts as the peer's
    silence. Those rules are `self.stall`'s (transport/stall.StallClock); this call feeds it
    the loop's times and sleeps until its next_check()."""

    def __init__(self, peer: Peer, req: int, taken: Callable[[Chunk | Text], None], *,
                 stall_s: float | None = None, limit_s: float | None = None):
        self.peer = peer
        self.req = req
        self.end: End | None = None  # the END, once it has arrived (deadline_missed is on it)
        self._clock = asyncio.get_running_loop().time
        # the stall rules (transport/stall.py), in loop time: this call only feeds it and sleeps
        self.stall = StallClock(self._clock(), stall_s=stall_s, limit_s=limit_s, received=peer.received_bytes)
        self._taken = taken  # tells the connection a chunk left its buffer
        self._items: asyncio.Queue[Chunk | Text | None] = asyncio.Queue()
        self._final: FetchError | None = None  # set once the request is over and not ok

    def __aiter__(self) -> FetchCall:
        return self

    async def __anext__(self) -> Chunk | Text:
        if self._items.empty() and (self._final is not None or self.end is not None):
            return self._stop()
        item = await self._next()
        if item is None:
            return self._stop()
        self._taken(item)
        return item

    async def _next(self) -> Chunk | Text | None:
        stall = self.stall
        if not stall.limited:
            return await self._items.get()
        while self._items.empty():
            now = self._clock()
            if self.peer.reading_paused:  # our own backlog, not the peer's silence
                stall.on_paused(now)
            stall.on_bytes(self.peer.received_bytes, now)
            verdict = stall.verdict(now)
            if verdict.what != FINE:
                error = FetchStalled if verdict.what == STALLED else FetchTimedOut
                await self._give_up(error(verdict.what, verdict.reason, self.req))
                break
            getter = asyncio.ensure_future(self._items.get())
            try:
                await asyncio.wait({getter}, timeout=stall.next_check() - now)
            finally:
                if not getter.done():
                    getter.cancel()  # a get cancelled as its item came leaves that item queued
                    await asyncio.wait({getter})
            stall.on_wake(self._clock())  # a loop held up for some of that wait: not the peer's silence
            if not getter.cancelled():
                return getter.result()
        return self._items.get_nowait()

    async def _give_up(self, error: FetchError) -> None:
        await self.peer.cancel(self.req, error)
        if self._final is None:  # the request ended first: its ending stands
            self._final = error
            self._items.put_nowait(None)

    async def cancel(self) -> None:
        """Stop the fetch: sends CANCEL; this iterator raises FetchCancelled from now on."""
        await self.peer.cancel(self.req)

    def deliver(self, msg: Chunk | Text) -> None:
        """A chunk of this fetch arrived (checked and acknowledged by the connection)."""
        now = self._clock()
        self.stall.on_bytes(self.peer.received_bytes, now)
        self.stall.on_chunk(now)
        self._items.put_nowait(msg)

    def finish(self, end: End | None, error: FetchError | None, drop: bool = False) -> None:
        """The request is over: END "ok" (error None), or `error`. The chunks that arrived
        before the ending are still yielded, then the error raised: each was checked and
        acknowledged, and a peer that ends with NOT_FOUND for chunk i has sent the chunks
        before it (the fetcher then knows i for the one lost). `drop`: the error comes at once
        instead (this side cancelled). The connection has already stopped counting them
        (taking one is then a no-op)."""
        if error is not None:
            self._final = error
            while drop and not self._items.empty():
                self._items.get_nowait()
        self.end = end
        self._items.put_nowait(None)

    def _stop(self) -> Any:
        if self._final is not None:
            raise self._final
        raise StopAsyncIteration


class ServedFetch:
    """The sender side of one FETCH, handed to the handler in a task of its own: send the
    chunks, watch the ACKs. A CANCEL cancels the task; the connection then ends the request
    (END "cancelled"), as it does when the handler returns or raises without ending it."""

    def __init__(self, peer: Peer, fetch: Fetch, now: float,
                 send: Callable[[Message], Awaitable[int]]):
        self.peer = peer
        self.fetch = fetch
        self.req = fetch.req
        self.started = now  # loop time the FETCH arrived; the deadline counts from here
        self.deadline = now + fetch.deadline_ms / 1000.0  # loop time
        # loop time after which the fetcher cannot want what is still unsent (its wait, at least
        # the deadline, plus grace_s): a handler stops there, even when the fetcher went silent
        # and sends no ACK
        self.give_up_at = now + max(fetch.deadline_ms, fetch.wait_ms or 0) / 1000.0 + grace_s(fetch.deadline_ms)
        self.acks: asyncio.Queue[tuple[Ack, float]] = asyncio.Queue()  # (ACK, loop time it arrived)
        self.cancelled = False  # the peer sent CANCEL
        self.ended = False  # END or a request ERROR was sent
        self.task: asyncio.Task | None = None
        # the key each CHUNK i carries when send_chunk is given none: the handler sets it to the
        # keys of the records it serves, so what arrives says what it is (None: no key sent)
        self.chunk_keys: list[bytes] | None = None
        self._send = send  # the connection's request-message writer (waits for the drain)
        self._clock = asyncio.get_running_loop().time

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once it has passed)."""
        return self.deadline - self._clock()

    async def send_chunk(self, i: int, level: str, payload: bytes, crc: int | None = None,
                         key: bytes | None = None) -> int:
        """Send chunk i at `level`, saying it is the chunk of `key` (default: chunk_keys[i]);
        returns the frame's wire size (what its ACK reports)."""
        # crc32 runs at several GB/s (about 1 ms for 4 MiB), so it stays on the loop; a store
        # that keeps each chunk's crc can pass it and skip even that
        if key is None and self.chunk_keys is not None and i < len(self.chunk_keys):
            key = self.chunk_keys[i]
        msg = Chunk(self.req, i, level, payload, zlib.crc32(payload) if crc is None else crc, key)
        return await self._send(msg)

    async def send_text(self, i: int, tokens: list[int]) -> int:
        """Send chunk i as token ids, for the receiver to recompute; returns the wire size."""
        return await self._send(Text(self.req, i, list(tokens)))

    async def end(self, deadline_missed: bool | None = None) -> None:
        """Send END "ok" (every chunk must have been sent). deadline_missed defaults to
        whether the deadline has passed now."""
        if deadline_missed is None:
            deadline_missed = self.remaining() < 0
        self.ended = True
        await self._send(End(self.req, "ok", deadline_missed))

    async def fail(self, code: str, msg: str) -> None:
        """End the request with a request-scoped ERROR; the connection stays open."""
        self.ended = True
        await self._send(Error(code, msg, self.req))
