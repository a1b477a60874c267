"""With transport/tls.py (its TLS handshakes), the only module that touches sockets: the
asyncio adapter that feeds protocol.Connection bytes and loop time, writes what it queues, and
turns its events into a handler task per FETCH served (`ServedFetch`, the sender side) and an
async iterator per fetch (`FetchCall`, the fetcher side). Every request rule, how a request
ends and buffer accounting are the Connection's, the stall rules transport/stall.py's; this
module only moves bytes, tells times and wakes tasks. TLS is an option of serve() and
connect(). The file is long (~600 lines) because PeerConnection is the one place where the
Connection's events meet asyncio's callbacks; split, each half would need the other's state."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import ssl as _ssl
import time
from typing import Any, Awaitable, Callable

from . import frames, tls as _tls
from .calls import (ConnectionClosedError, FetchCall, FetchCancelled, FetchError, FetchFailed,
                    FetchInterrupted, FetchStalled, FetchTimedOut, HandshakeError, ServedFetch,
                    TransportError, grace_s, wait_s)
from .events import (AckReceived, CancelReceived, ChunkReceived, ConnectionClosed, EndReceived,
                     ErrorReceived, FetchReceived, HandshakeComplete, MessageReceived)
from .loops import loop_factory, run
from .messages import (CONNECTION_LOST, HANDSHAKE_TIMEOUT, NORMAL, NOT_FOUND, WRITE_STALLED, Cancel, Chunk,
                       Error, Fetch, Message, Ping, Pong, Text)
from .protocol import Connection, State
from .requests import DEFAULT_MAX_BUFFERED_BYTES, in_request
from .stall import DEFAULT_WRITE_STALL_S, STALLED, WriteStall

__all__ = ["PeerConnection", "Server", "serve", "connect", "run", "loop_factory", "Handler",
           "OnConnect", "FetchCall", "ServedFetch", "TransportError", "HandshakeError",
           "ConnectionClosedError", "FetchError", "FetchFailed", "FetchCancelled",
           "FetchInterrupted", "FetchStalled", "FetchTimedOut", "DEFAULT_HANDSHAKE_TIMEOUT",
           "DEFAULT_MAX_BUFFERED_BYTES", "DEFAULT_WRITE_STALL_S", "MAX_INBOX_BYTES", "grace_s", "wait_s"]

log = logging.getLogger(__name__)

DEFAULT_HANDSHAKE_TIMEOUT = 5.0  # seconds from TCP connect to READY
# Messages outside a request (ADVERTISE, WITHDRAW, ...) received and not yet recv()d: past
# this many bytes of their frames, reading pauses (TCP pushes back on the peer) until the
# reader has taken them down to half. At most this plus one read's frames are held.
MAX_INBOX_BYTES = 16 * 2**20
Handler = Callable[[ServedFetch, Fetch], Awaitable[None]]
OnConnect = Callable[["PeerConnection"], Awaitable[None] | None]


class PeerConnection(asyncio.Protocol):
    """One authenticated TCP connection to a peer, either role: send and receive messages,
    fetch from the peer, and serve the peer's FETCHes with the handler."""

    def __init__(self, role: str, node_id: str, secret: bytes, *, handler: Handler | None = None,
                 on_connect: OnConnect | None = None, caps: dict | None = None,
                 max_frame_bytes: int = frames.DEFAULT_MAX_FRAME_BYTES,
                 handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                 max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
                 nonce_source: Callable[[int], bytes] | None = None,
                 on_lost: Callable[[PeerConnection], None] | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 write_stall_s: float = DEFAULT_WRITE_STALL_S, max_inbox_bytes: int = MAX_INBOX_BYTES):
        kw = {"nonce_source": nonce_source} if nonce_source else {}
        # wall_clock: what this side's PONGs report and its own PINGs are stamped against
        self.conn = Connection(role, node_id, secret, max_frame_bytes=max_frame_bytes, caps=caps,
                               max_buffered_bytes=max_buffered_bytes, wall_clock=wall_clock, **kw)
        self._wall_clock = wall_clock
        self.node_id = node_id
        self.peer_node_id: str | None = None  # known once ready
        self.peer_caps: dict | None = None
        self.closed: ConnectionClosed | None = None  # why it closed, once it has
        self._handler = handler
        self._on_connect = on_connect
        self._handshake_timeout = handshake_timeout
        self._on_lost = on_lost
        self._loop = asyncio.get_running_loop()
        self.received_bytes = 0  # bytes that came from the peer, all told
        self._transport: asyncio.Transport | None = None
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen by connect() only
        self._lost = self._loop.create_future()
        self._writable = asyncio.Event()
        self._writable.set()
        self._write_stall = WriteStall(write_stall_s)  # the write-stall rule (stall.py)
        self._stall_check: asyncio.TimerHandle | None = None  # while writing is paused
        self._probing = asyncio.Lock()  # one padded PING queued at a time
        self._timer: asyncio.TimerHandle | None = None
        self._inbox: asyncio.Queue[tuple[Message, int] | None] = asyncio.Queue()  # (message, frame size)
        self._inbox_bytes = 0
        self._max_inbox_bytes = max_inbox_bytes
        self._inbox_full = False  # over max_inbox_bytes, until taken down to half
        self._calls: dict[int, FetchCall] = {}  # this side's fetches still running, by req
        self._served: dict[int, ServedFetch] = {}  # the peer's FETCHes with a handler running
        # a PING's time -> (its PONG's waiter, the wall clock as it went: unpadded PINGs only)
        self._pings: dict[float, tuple[asyncio.Future[float], float | None]] = {}
        self._last_ping = -math.inf  # the time of this connection's latest PING (_ping)
        self.clock_offset: float | None = None  # seconds the peer's wall clock is ahead of ours (latest PONG)
        self._reading_paused = False  # what the transport was last told
        self._tasks: set[asyncio.Task] = set()
        self._label = "?"  # the peer's node id once known, its address before; for logs
        self.tls: str | None = None  # the TLS version ("TLSv1.3") when the link runs over TLS

    def __repr__(self) -> str:
        return f"<PeerConnection {self.conn.role} {self.node_id}->{self._label} {self.conn.state.value}>"

    # -- public API ------------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self.conn.state

    @property
    def reading_paused(self) -> bool:
        """True while reading is paused because the connection's receive buffer went over
        max_buffered_bytes, or the inbox over max_inbox_bytes (until either falls to half), so
        TCP pushes back on the sending peer."""
        return self._reading_paused

    @property
    def write_buffer_bytes(self) -> int:
        """Bytes written to the transport that the kernel has not taken yet."""
        return 0 if self._transport_gone() else self._transport.get_write_buffer_size()

    @property
    def inbox_bytes(self) -> int:
        """Frame bytes of the messages outside a request received and not yet recv()d."""
        return self._inbox_bytes

    @property
    def rtt(self) -> float | None:
        """Seconds, from the latest ping()."""
        return self.conn.rtt

    @property
    def busy(self) -> bool:
        """A fetch of this side's or a FETCH of the peer's is running on it."""
        return bool(self._calls or self._served)

    async def wait_ready(self) -> None:
        """Return once the handshake is done; raise HandshakeError if it failed."""
        await asyncio.shield(self._ready)

    async def send(self, msg: Message) -> int:
        """Send a message that is not part of a request (ADVERTISE, WITHDRAW, PING, ...)
        and wait for the write buffer to drain; returns its wire size."""
        if in_request(msg):  # ACKs go by themselves, as each chunk arrives
            raise TypeError(f"send {msg.TYPE} through fetch()/cancel() or the handler's ServedFetch")
        return await self._send(msg)

    async def recv(self) -> Message:
        """The next message that is not part of a request; ConnectionClosedError once closed."""
        item = await self._inbox.get()
        if item is None:
            self._inbox.put_nowait(None)  # let every other reader see the end too
            raise self._closed_error()
        msg, size = item
        self._inbox_bytes -= size
        if self._inbox_full and self._inbox_bytes <= self._max_inbox_bytes // 2:
            self._inbox_full = False
            self._sync_reading()
        return msg

    def __aiter__(self) -> PeerConnection:
        return self

    async def __anext__(self) -> Message:
        try:
            return await self.recv()
        except ConnectionClosedError:
            raise StopAsyncIteration from None

    def fetch(self, ask: Fetch, *, stall_s: float | None = None, limit_s: float | None = None) -> FetchCall:
        """Send the FETCH `ask` (Fetch.ask; numbered here with this side's next request id) and
        return the iterator of its chunks (ACKs are sent as each arrives). With `stall_s` the
        iterator gives up (FetchStalled) on a peer silent that long, with `limit_s`
        (FetchTimedOut) that many seconds from now; both send CANCEL (FetchCall)."""
        self._check_open()
        req = self.conn.next_request_id()
        call = FetchCall(self, req, self._taken, stall_s=stall_s, limit_s=limit_s)
        self._calls[req] = call
        self.conn.send(dataclasses.replace(ask, req=req), self._loop.time())
        self._flush()
        return call

    async def cancel(self, req: int, error: FetchError | None = None) -> None:
        """Cancel our fetch `req` at once: its iterator raises `error` (default
        FetchCancelled), late chunks are dropped. A no-op for a request that is already over.
        Never waits for the write buffer to drain: a peer that stopped reading must not hold
        up the fetcher that gives up on it (the CANCEL is tiny and goes out when it can)."""
        call = self._calls.pop(req, None)
        if call is None:
            return
        call.finish(None, error or FetchCancelled("cancelled", "cancelled by this side", req), drop=True)
        if self.conn.state is State.READY:
            self.conn.send(Cancel(req), self._loop.time())
            self._flush()

    async def ping(self) -> float:
        """Round-trip time in seconds, measured with PING/PONG."""
        sent_at, answered_at = await self._ping(None)
        return answered_at - sent_at

    async def probe(self, size: int) -> tuple[float, float]:
        """Active bandwidth probe for a peer with no history: a PING padded with `size`
        bytes. Returns (write start, PONG arrival) in loop time, like a chunk and its ACK.
        Probes on one connection go one at a time, and each waits for the write buffer to
        drain before its padding is made and queued: probes that time out against a peer
        that stopped reading leave at most one probe's padding queued, not one each."""
        async with self._probing:
            await self._writable.wait()
            self._check_open()
            return await self._ping(bytes(size))

    async def _ping(self, pad: bytes | None) -> tuple[float, float]:
        sent = self._loop.time()
        # The PONG names its PING by time alone, so no two PINGs of a connection share one: a
        # PING sent in the same clock tick as an earlier one (uvloop's clock ticks in
        # milliseconds) goes just past it. Even one answered already: its waiter's cleanup
        # below, run after the answer, must not find a later PING under its time.
        t = self._last_ping = max(sent, math.nextafter(self._last_ping, math.inf))
        fut = self._loop.create_future()
        # a padded PING's round trip holds its transfer: no measure of the clocks
        self._pings[t] = (fut, self._wall_clock() if pad is None else None)
        try:
            await self._send(Ping(t, pad))
            return sent, await fut  # (the clock's time, not the PING's: its PONG may come in the same tick)
        finally:  # answered, or given up on (a caller's timeout): either way no longer waited for
            self._pings.pop(t, None)

    def close(self, code: str = NORMAL, msg: str = "") -> None:
        """Tell the peer why (an ERROR frame), flush, and close the socket."""
        self.conn.close(code, msg)
        self._process()

    def abort(self) -> None:
        """Drop the TCP connection without a word (as a crash would); requests on it fail
        and handlers are cancelled at once."""
        if self._transport is not None:
            self._transport.abort()
        self.conn.close(CONNECTION_LOST, "aborted by this side")  # its ERROR is never written
        self._process()

    async def wait_closed(self) -> ConnectionClosed:
        """Wait until the socket is gone; returns why the connection closed."""
        await asyncio.shield(self._lost)
        assert self.closed is not None
        return self.closed

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        address = transport.get_extra_info("peername")
        self._label = f"{address[0]}:{address[1]}" if address else "?"
        if (sslobj := transport.get_extra_info("ssl_object")) is not None:
            self.tls = sslobj.version()
        self._timer = self._loop.call_later(self._handshake_timeout, self._on_handshake_timeout)
        self._flush()  # our HELLO

    def data_received(self, data: bytes) -> None:
        self.received_bytes += len(data)
        self.conn.receive_data(data, self._loop.time())
        self._process()

    def eof_received(self) -> bool:
        return False  # a half-closed peer cannot take our replies; close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self.tls and self.conn.state is not State.CLOSED and (
                isinstance(exc, _ssl.SSLError) or self.conn.state is not State.READY):
            # what the TLS layer said (TLS 1.3: a server refuses our certificate after the
            # handshake is done on our side), not just "connection lost"; its ERROR is never written
            self.conn.close(_tls.TLS_FAILED, _tls.lost_reason(exc, self.conn.state.value))
        self.conn.receive_eof(self._loop.time())  # CONNECTION_LOST, unless closed already
        self._process()
        if not self._lost.done():
            self._lost.set_result(None)
            if self._on_lost is not None:
                self._on_lost(self)

    def pause_writing(self) -> None:
        self._writable.clear()
        self._write_stall.on_paused(self.write_buffer_bytes, self._loop.time())
        if self._stall_check is None:
            self._stall_check = self._loop.call_at(self._write_stall.next_check(), self._check_stall)

    def resume_writing(self) -> None:
        self._writable.set()
        if self._stall_check is not None:
            self._stall_check.cancel()
            self._stall_check = None

    # -- internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.conn.state is State.CLOSED:
            raise self._closed_error()
        if self.conn.state is not State.READY:
            raise ConnectionClosedError("not_ready", f"connection is in state {self.conn.state.value}")

    def _closed_error(self) -> ConnectionClosedError:
        c = self.closed
        return ConnectionClosedError(c.code if c else CONNECTION_LOST, c.msg if c else "closed")

    async def _send(self, msg: Message) -> int:
        self._check_open()
        size = self.conn.send(msg, self._loop.time())
        self._flush()
        # respect the transport's high-water mark, so a fast sender cannot pile up memory
        await self._writable.wait()
        if self.conn.state is State.CLOSED:
            raise self._closed_error()
        return size

    def _check_stall(self) -> None:
        """Writing paused: end the connection, dropping what is queued, once WriteStall says so."""
        self._stall_check = None
        if self._writable.is_set() or self._transport_gone():
            return
        verdict = self._write_stall.verdict(self.write_buffer_bytes, self._loop.time())
        if verdict.what == STALLED:
            self.conn.close(WRITE_STALLED, verdict.reason)  # first: uvloop's abort reports the loss at once
            self._transport.abort()  # close() would wait for the bytes that do not drain; the ERROR is never written
            self._process()
            return
        self._stall_check = self._loop.call_at(self._write_stall.next_check(), self._check_stall)

    def _transport_gone(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        t = self._transport
        if t is None or t.is_closing():
            return
        if data:
            t.write(data)
        if self.conn.state is State.CLOSED:
            t.close()  # after the buffered bytes (our ERROR) are written

    def _process(self) -> None:
        now = self._loop.time()
        while (event := self.conn.next_event()) is not None:
            if isinstance(event, ChunkReceived):
                call = self._calls.get(event.msg.req)
                if call is None:  # nobody to take it; never held up reading
                    self.conn.taken(event.msg)
                else:
                    call.deliver(event.msg)
            elif isinstance(event, EndReceived):
                if (call := self._calls.pop(event.msg.req, None)) is not None:
                    call.finish(event.msg, None if event.complete else FetchFailed(
                        event.msg.status, f"stream ended with status {event.msg.status!r}", event.msg.req))
            elif isinstance(event, ErrorReceived):
                if (call := self._calls.pop(event.msg.req, None)) is not None:
                    call.finish(None, FetchFailed(event.msg.code, event.msg.msg, event.msg.req))
            elif isinstance(event, FetchReceived):
                self._serve(event.msg, now)
            elif isinstance(event, AckReceived):
                if (served := self._served.get(event.msg.req)) is not None:
                    served.acks.put_nowait((event.msg, now))
            elif isinstance(event, CancelReceived):
                if (served := self._served.get(event.msg.req)) is not None and served.task is not None:
                    served.cancelled = True
                    served.task.cancel()  # at once: the handler sees CancelledError at its next await
            elif isinstance(event, MessageReceived):
                self._received(event.msg, event.size, now)
            elif isinstance(event, HandshakeComplete):
                self._handshake_done(event)
            elif isinstance(event, ConnectionClosed):
                self._connection_closed(event)
        self._flush()
        self._sync_reading()

    def _received(self, msg: Message, size: int, now: float) -> None:
        if isinstance(msg, Pong):
            fut, wall = self._pings.pop(msg.time, (None, None))
            if wall is not None and msg.wall is not None:
                # the peer read its clock about half a round trip after ours went
                self.clock_offset = msg.wall - (wall + (now - msg.time) / 2)
            if fut is not None and not fut.done():
                fut.set_result(now)
        elif not isinstance(msg, Ping):  # the connection has already queued the PONG
            self._inbox.put_nowait((msg, size))  # ADVERTISE, WITHDRAW, ERROR "unknown_type"
            self._inbox_bytes += size
            if self._inbox_bytes > self._max_inbox_bytes:
                self._inbox_full = True  # _process syncs reading after this event

    def _taken(self, item: Chunk | Text) -> None:
        self.conn.taken(item)
        self._sync_reading()

    def _sync_reading(self) -> None:
        # the connection decides when its buffer is too full, the inbox when it is; the
        # transport just follows them
        want = self.conn.reading_paused or self._inbox_full
        if want != self._reading_paused and not self._transport_gone():
            self._reading_paused = want
            if want:
                self._transport.pause_reading()
            else:
                self._transport.resume_reading()

    def _handshake_done(self, event: HandshakeComplete) -> None:
        if self._timer:
            self._timer.cancel()
        self.peer_node_id, self.peer_caps = event.peer_node_id, event.peer_caps
        log.info("peer %s: connected from %s (%s, %s)", self.peer_node_id, self._label, self.conn.role,
                 self.tls or "plaintext")
        self._label = self.peer_node_id
        self._ready.set_result(None)
        if self._on_connect is not None:
            try:
                result = self._on_connect(self)
            except Exception:
                log.exception("peer %s: on_connect failed", self._label)
                return
            if inspect.isawaitable(result):
                self._spawn(result)

    def _on_handshake_timeout(self) -> None:
        if self.conn.state not in (State.READY, State.CLOSED):
            self.conn.close(HANDSHAKE_TIMEOUT, f"no handshake within {self._handshake_timeout} s "
                                               f"(state {self.conn.state.value})")
            self._process()

    def _serve(self, fetch: Fetch, now: float) -> None:
        if self._handler is None:
            self.conn.send(Error(NOT_FOUND, "this node serves no FETCH", fetch.req), now)
            return
        served = ServedFetch(self, fetch, now, self._send)
        self._served[fetch.req] = served
        served.task = self._spawn(self._handler(served, fetch))
        served.task.add_done_callback(lambda task: self._handler_done(served, task))

    def _handler_done(self, served: ServedFetch, task: asyncio.Task) -> None:
        # a done-callback rather than code after the await: it also runs for a task cancelled
        # before its first step (FETCH and CANCEL in one read), so every request gets its END
        self._served.pop(served.req, None)
        failure = None
        if task.cancelled():
            if not served.cancelled:
                return  # the connection or the server is going away, not a CANCEL
        elif (error := task.exception()) is not None:
            log.warning("peer %s: req %d: handler failed: %r", self._label, served.req, error)
            failure = f"handler failed: {error!r}"
        # END "cancelled", ERROR internal or END "ok": the connection knows which
        if self.conn.end_request(served.req, self._loop.time(), failure) is not None:
            self._flush()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _connection_closed(self, event: ConnectionClosed) -> None:
        self.closed = event
        if self._timer:
            self._timer.cancel()
        level = logging.INFO if event.code in (NORMAL, CONNECTION_LOST) else logging.WARNING
        log.log(level, "peer %s: closed (%s, by %s): %s", self._label, event.code,
                "peer" if event.by_peer else "us", event.msg)
        if not self._ready.done():
            self._ready.set_exception(HandshakeError(event.code, event.msg))
        calls, self._calls = self._calls, {}
        for req, call in calls.items():
            call.finish(None, FetchInterrupted(event.code, f"connection closed before END: {event.msg}", req))
        for served in list(self._served.values()):
            if served.task is not None:
                served.task.cancel()
        for fut, _ in self._pings.values():
            if not fut.done():
                fut.set_exception(self._closed_error())
        self._pings.clear()
        self._inbox.put_nowait(None)
        self.resume_writing()  # wake writers so they see the close; no more write-stall checks


class Server:
    """A listening socket whose connections are PeerConnections serving FETCHes with the
    handler. One connection's garbage, timeout or disconnect closes only that connection."""

    def __init__(self, node_id: str, secret: bytes, handler: Handler | None, *,
                 ssl: _ssl.SSLContext | None = None, **options: Any):
        self.node_id = node_id
        self.connections: set[PeerConnection] = set()  # open connections, handshaken or not
        self.tls_refused = 0  # connections refused by the TLS handshake (no frame read)
        self._secret = secret
        self._handler = handler
        self._ssl = ssl
        self._options = options
        self._server: asyncio.AbstractServer | _tls.TLSListener | None = None

    @property
    def port(self) -> int:
        """The port bound (useful with port 0)."""
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def listen(self, host: str, port: int) -> None:
        """Start accepting on host:port."""
        loop = asyncio.get_running_loop()
        if self._ssl is None:
            self._server = await loop.create_server(self._new_connection, host, port)
            return
        timeout = self._options.get("handshake_timeout", DEFAULT_HANDSHAKE_TIMEOUT)
        self._server = _tls.TLSListener(self._ssl, timeout, self._new_connection, self._refused)
        await self._server.listen(host, port)

    def _refused(self, peer: PeerConnection, address: str, why: str) -> None:
        self.tls_refused += 1  # that connection never reached its PeerConnection
        self.connections.discard(peer)

    def _new_connection(self) -> PeerConnection:
        peer = PeerConnection("server", self.node_id, self._secret, handler=self._handler,
                              on_lost=self.connections.discard, **self._options)
        self.connections.add(peer)
        return peer

    def close(self) -> None:
        """Stop listening and close every connection (ERROR "normal" to each)."""
        if self._server is not None:
            self._server.close()
        for peer in list(self.connections):
            peer.close(NORMAL, "server shutting down")

    async def wait_closed(self) -> None:
        """Wait until the listener and every connection are gone."""
        if self._server is not None:
            await self._server.wait_closed()
        await asyncio.gather(*(p.wait_closed() for p in list(self.connections)))

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
        await self.wait_closed()


async def serve(host: str, port: int, node_id: str, secret: bytes, handler: Handler | None, *,
                on_connect: OnConnect | None = None, caps: dict | None = None,
                max_frame_bytes: int = frames.DEFAULT_MAX_FRAME_BYTES,
                handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
                ssl: _ssl.SSLContext | None = None, write_stall_s: float = DEFAULT_WRITE_STALL_S) -> Server:
    """Listen on host:port; each connection's FETCHes go to `handler(served, fetch)`,
    and `on_connect(peer)` runs once a connection is READY. With `ssl` (transport.tls's
    server context) every connection is TLS: the handshake, within `handshake_timeout`,
    comes before any frame is read, and a peer it refuses is logged and dropped. A connection
    whose writes do not drain for `write_stall_s` is ended (PeerConnection)."""
    server = Server(node_id, secret, handler, ssl=ssl, on_connect=on_connect, caps=caps,
                    max_frame_bytes=max_frame_bytes, handshake_timeout=handshake_timeout,
                    max_buffered_bytes=max_buffered_bytes, write_stall_s=write_stall_s)
    await server.listen(host, port)
    return server


async def connect(host: str, port: int, node_id: str, secret: bytes, *,
                  handler: Handler | None = None, caps: dict | None = None,
                  max_frame_bytes: int = frames.DEFAULT_MAX_FRAME_BYTES,
                  handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                  max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
                  ssl: _ssl.SSLContext | None = None,
                  write_stall_s: float = DEFAULT_WRITE_STALL_S) -> PeerConnection:
    """Connect and authenticate; returns a READY PeerConnection or raises HandshakeError
    (OSError if the TCP connection itself fails). With `ssl` (transport.tls's client context)
    the link is TLS, its handshake within `handshake_timeout`; the server's chain is checked
    against the CA, not its name (peers are dialled by address); a TLS failure is a
    HandshakeError "tls_failed" saying why, e.g. "certificate verify failed: ..."."""
    loop = asyncio.get_running_loop()
    # server_hostname is SNI only: the client context does not check the name (transport/tls.py)
    tls_args = {"ssl": ssl, "server_hostname": host, "ssl_handshake_timeout": handshake_timeout} if ssl else {}
    try:
        _, peer = await loop.create_connection(
            lambda: PeerConnection("client", node_id, secret, handler=handler, caps=caps,
                                   max_frame_bytes=max_frame_bytes, handshake_timeout=handshake_timeout,
                                   max_buffered_bytes=max_buffered_bytes, write_stall_s=write_stall_s),
            host, port, **tls_args)
    except (_ssl.SSLError, ConnectionAbortedError) as e:  # the latter: past ssl_handshake_timeout
        if ssl is None:
            raise
        raise HandshakeError(_tls.TLS_FAILED, f"TLS: {_tls.describe(e)}") from None
    try:
        await peer.wait_ready()
    except HandshakeError:
        await peer.wait_closed()
        raise
    except asyncio.CancelledError:  # the caller gave up on the handshake (a ghost): not left open until its timeout
        peer.abort()
        raise
    return peer
