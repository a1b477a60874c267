"""The peer protocol as a sans-IO state machine: bytes and the current time in, events and
bytes to send out. No sockets, no clocks, no asyncio here (see transport/aio.py for those).
The handshake is here; the request rules are transport/requests.py, applied to both directions."""
from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import os
from typing import Callable

from . import frames, requests
from .events import (AckReceived, CancelReceived, ChunkReceived, ConnectionClosed, EndReceived,
                     ErrorReceived, Event, FetchReceived, HandshakeComplete, MessageReceived)
from .messages import (AUTH_FAILED, BAD_CRC, BAD_MESSAGE, BAD_REQUEST, BAD_FRAME,
                       CONNECTION_LOST, FRAME_TOO_LARGE, HANDSHAKE_TIMEOUT, INTERNAL, NORMAL,
                       NOT_FOUND, NONCE_BYTES, PROTO, UNEXPECTED_MESSAGE, UNKNOWN_TYPE, VERSION,
                       Ack, Auth, Cancel, Chunk, End, Error, Fetch, Hello, Message, Ping, Pong,
                       ProtocolError, Text, check_node_id, from_wire, to_wire)
from .requests import DEFAULT_MAX_BUFFERED_BYTES, DELIVER, RULES, ReceiveBuffer, Request, Requests

__all__ = [
    "Connection", "State", "Event", "HandshakeComplete", "FetchReceived", "ChunkReceived",
    "AckReceived", "EndReceived", "CancelReceived", "ErrorReceived", "MessageReceived",
    "ConnectionClosed", "Request", "LocalProtocolError", "ProtocolError", "auth_proof",
    "AUTH_LABEL", "PROTO", "HANDSHAKE_MAX_FRAME_BYTES", "DEFAULT_MAX_BUFFERED_BYTES",
    "AUTH_FAILED", "BAD_CRC", "BAD_FRAME", "BAD_MESSAGE", "BAD_REQUEST", "CONNECTION_LOST",
    "FRAME_TOO_LARGE", "HANDSHAKE_TIMEOUT", "INTERNAL", "NORMAL", "NOT_FOUND",
    "UNEXPECTED_MESSAGE", "UNKNOWN_TYPE", "VERSION",
]

AUTH_LABEL = b"kvstreamd-auth-v1"
# Until both sides are authenticated only HELLO and AUTH may arrive, and they are small: an
# unauthenticated peer must not be able to make us buffer max_frame_bytes.
HANDSHAKE_MAX_FRAME_BYTES = 64 * 1024


class State(enum.Enum):
    """Where a connection is. Both sides start in HELLO_SENT (their HELLO is queued at once)."""

    HELLO_SENT = "HELLO_SENT"  # waiting for the peer's HELLO
    AUTH_WAIT = "AUTH_WAIT"  # server: has the client's HELLO, waiting for the client's AUTH
    AUTH_SENT = "AUTH_SENT"  # client: sent its AUTH, waiting for the server's
    READY = "READY"  # authenticated both ways; every message but HELLO/AUTH allowed
    CLOSED = "CLOSED"  # nothing more is received or sent


class LocalProtocolError(ProtocolError):
    """This side tried to send something the protocol does not allow; nothing was sent."""


def auth_proof(secret: bytes, prover: str, client_nonce: bytes, server_nonce: bytes,
               client_id: str, server_id: str) -> bytes:
    """HMAC-SHA256 proof that `prover` ("client" or "server") holds the secret, bound to
    this connection's nonces and node ids (exact layout in docs/protocol.md)."""
    cid, sid = client_id.encode(), server_id.encode()
    # the prover's role is inside the MAC so a peer cannot reflect our own proof back to us;
    # ids are length-prefixed so no two (client_id, server_id) pairs give the same bytes
    data = b"".join([AUTH_LABEL, b"\x00", prover.encode(), b"\x00", client_nonce, server_nonce,
                     len(cid).to_bytes(2, "big"), cid, len(sid).to_bytes(2, "big"), sid])
    return hmac.new(secret, data, hashlib.sha256).digest()


class Connection:
    """One peer connection, either role. Feed it bytes with receive_data(), send with send(),
    write out data_to_send(), and drain next_event() after each call."""

    def __init__(self, role: str, node_id: str, secret: bytes, *,
                 max_frame_bytes: int = frames.DEFAULT_MAX_FRAME_BYTES, caps: dict | None = None,
                 max_buffered_bytes: int | None = DEFAULT_MAX_BUFFERED_BYTES,
                 nonce_source: Callable[[int], bytes] = os.urandom,
                 wall_clock: Callable[[], float] | None = None):
        if role not in ("client", "server"):
            raise ValueError(f"role must be 'client' or 'server', got {role!r}")
        if not secret:
            raise ValueError("the cluster secret must not be empty")
        check_node_id(node_id)
        self.role = role
        self.node_id = node_id
        self.max_frame_bytes = max_frame_bytes
        self.state = State.HELLO_SENT
        self.peer_node_id: str | None = None
        self.peer_caps: dict | None = None
        self.rtt: float | None = None  # seconds, from the latest PONG to our PING
        self.last_activity: float | None = None  # `now` of the latest receive_data() or send()
        self._fetching = Requests(mine=True)  # the FETCHes this side makes (it is their fetcher)
        self._serving = Requests(mine=False)  # the peer's FETCHes (this side is their sender)
        self._buffer = ReceiveBuffer(max_buffered_bytes)
        self._secret = secret
        self._nonce = nonce_source(NONCE_BYTES)
        if len(self._nonce) != NONCE_BYTES:
            raise ValueError(f"nonce_source must return {NONCE_BYTES} bytes")
        self._peer_nonce = b""
        # the wall clock a PONG reports (its `wall`), so the pinger learns the clocks' offset;
        # None: PONGs say nothing of it (the state machine reads no clock of its own)
        self._wall_clock = wall_clock
        self._decoder = frames.FrameDecoder(min(HANDSHAKE_MAX_FRAME_BYTES, max_frame_bytes))
        self._out: list[bytes | memoryview] = []
        self._events: collections.deque[Event] = collections.deque()
        self._queue(Hello(PROTO, node_id, dict(caps or {}), self._nonce))

    # -- the public face -------------------------------------------------------------------

    def receive_data(self, data: bytes, now: float) -> None:
        """Bytes from the peer, split anywhere; b"" is a no-op (EOF is receive_eof())."""
        if self.state is State.CLOSED or not data:
            return
        self.last_activity = now
        self._decoder.feed(data)
        while self.state is not State.CLOSED:
            try:
                frame = self._decoder.next_frame()
            except ProtocolError as e:
                self._fail(e.code, e.msg)
                return
            if frame is None:
                return
            self._receive_frame(*frame, now)

    def receive_eof(self, now: float) -> None:
        """The peer's side of the transport is gone (EOF or reset); a no-op once CLOSED."""
        if self.state is State.CLOSED:
            return
        self.last_activity = now
        partial = self._decoder.buffered
        tail = f", {partial} bytes into an unfinished frame" if partial else ""
        self._closed(CONNECTION_LOST,
                     f"peer closed the connection in state {self.state.value}{tail}", True)

    def send(self, msg: Message, now: float) -> int:
        """Queue a message; returns its wire size in bytes. Raises LocalProtocolError (and
        queues nothing) if the protocol does not allow it now."""
        if self.state is not State.READY:
            raise LocalProtocolError(UNEXPECTED_MESSAGE,
                                     f"cannot send {msg.TYPE} in state {self.state.value}")
        self._check_send(msg, now)
        self.last_activity = now
        return self._queue(msg)

    @property
    def fetching(self) -> dict[int, Request]:
        """This side's open FETCHes, by req (this side is their fetcher)."""
        return self._fetching.open

    @property
    def serving(self) -> dict[int, Request]:
        """The peer's open FETCHes, by req (this side is their sender)."""
        return self._serving.open

    def end_request(self, req: int, now: float, failure: str | None = None) -> End | Error | None:
        """This side has stopped sending the peer's FETCH `req` (`failure`: why it failed, or
        None). Sends what ends it, and returns that: END "cancelled" after the fetcher's CANCEL,
        ERROR internal if it failed or sent fewer than every chunk, END "ok" otherwise, each
        END with deadline_missed if `now` is past the deadline. Returns None, sending nothing,
        when the request is already over or the connection is not READY."""
        r = self._serving.open.get(req)
        if r is None or self.state is not State.READY:
            return None
        msg = requests.ending(r, now, failure)
        self.send(msg, now)
        return msg

    @property
    def buffered_bytes(self) -> int:
        """Bytes of received chunks that the application has not taken() yet."""
        return self._buffer.total

    @property
    def reading_paused(self) -> bool:
        """True while buffered_bytes went over max_buffered_bytes and has not yet fallen to
        half of it: stop reading, so TCP pushes back on the sender."""
        return self._buffer.paused

    def taken(self, msg: Chunk | Text) -> None:
        """The application has taken this received chunk: it no longer counts as buffered. A
        no-op for a fetch that failed or was cancelled (its chunks were released then)."""
        self._buffer.take(msg)

    def ping(self, now: float) -> int:
        """Send a PING stamped with `now`; the PONG sets `rtt`."""
        return self.send(Ping(now), now)

    def next_request_id(self) -> int:
        """The req to use for our next FETCH."""
        return self._fetching.last_req + 1

    def close(self, code: str = NORMAL, msg: str = "") -> None:
        """Queue an ERROR telling the peer why, and go CLOSED. A no-op once CLOSED."""
        if self.state is State.CLOSED:
            return
        self._queue(Error(code, msg))
        self._closed(code, msg, False)

    def data_to_send(self) -> bytes:
        """Everything queued for the peer since the last call, as one buffer."""
        out, self._out = self._out, []
        return b"".join(out)

    def next_event(self) -> Event | None:
        """The oldest event not yet returned, or None."""
        return self._events.popleft() if self._events else None

    # -- receiving -------------------------------------------------------------------------

    def _receive_frame(self, wire: dict, size: int, now: float) -> None:
        try:
            msg = from_wire(wire)
        except ProtocolError as e:
            if e.code == UNKNOWN_TYPE and self.state is State.READY:
                # forward compatible: a newer peer may try a type we lack; it learns and goes on
                self._queue(Error(UNKNOWN_TYPE, f"{e.msg}; ignored"))
                return
            self._fail(e.code, e.msg)
            return
        if self.state is State.READY:
            self._receive_ready(msg, size, now)
            return
        if isinstance(msg, Error):
            # the peer refusing our HELLO or AUTH (version, auth_failed, ...)
            self._closed(msg.code, msg.msg, True)
            return
        expected = {State.HELLO_SENT: Hello, State.AUTH_WAIT: Auth, State.AUTH_SENT: Auth}[self.state]
        if not isinstance(msg, expected):
            self._fail(UNEXPECTED_MESSAGE, f"{msg.TYPE} received before the handshake finished; "
                                           f"only {expected.TYPE} is allowed now")
        elif isinstance(msg, Hello):
            self._receive_hello(msg)
        else:
            self._receive_auth(msg)

    def _receive_hello(self, msg: Hello) -> None:
        if msg.proto != PROTO:
            self._fail(VERSION, f"peer speaks protocol {msg.proto}, this node speaks {PROTO}")
            return
        self.peer_node_id, self.peer_caps, self._peer_nonce = msg.node_id, msg.caps, msg.nonce
        if self.role == "client":
            self._queue(Auth(self._proof("client")))
            self.state = State.AUTH_SENT
        else:
            # the server proves itself only after the client has, so an unauthenticated
            # client never gets a MAC computed over a nonce it chose
            self.state = State.AUTH_WAIT

    def _receive_auth(self, msg: Auth) -> None:
        prover = "server" if self.role == "client" else "client"
        if not hmac.compare_digest(msg.proof, self._proof(prover)):
            self._fail(AUTH_FAILED, f"the {prover}'s AUTH proof does not verify: it does not hold "
                                    "this cluster's secret")
            return
        if self.role == "server":
            self._queue(Auth(self._proof("server")))
        self.state = State.READY
        self._decoder.max_frame_bytes = self.max_frame_bytes
        self._events.append(HandshakeComplete(self.peer_node_id, self.peer_caps))

    def _receive_ready(self, msg: Message, size: int, now: float) -> None:
        if isinstance(msg, (Hello, Auth)):
            self._fail(UNEXPECTED_MESSAGE, f"{msg.TYPE} received after the handshake finished")
            return
        if requests.in_request(msg):
            self._receive_request_message(msg, size, now)
            return
        if isinstance(msg, Error):
            if msg.code != UNKNOWN_TYPE:
                self._closed(msg.code, msg.msg, True)
                return
        elif isinstance(msg, Ping):
            self._queue(Pong(msg.time, self._wall_clock() if self._wall_clock else None))
        elif isinstance(msg, Pong):
            self.rtt = now - msg.time
        self._events.append(MessageReceived(msg, size))

    def _receive_request_message(self, msg: Message, size: int, now: float) -> None:
        try:
            verdict = requests.apply(msg, self._direction(msg, False), False, now)
        except ProtocolError as e:
            self._fail(e.code, e.msg)
            return
        if verdict != DELIVER:
            return
        if isinstance(msg, (Chunk, Text)):
            self._buffer.hold(msg)
            # ACK on receipt, so the sender times delivery rather than its own socket buffer
            ack = Ack(msg.req, msg.i, size)
            requests.apply(ack, self._fetching, True, now)
            self._queue(ack)
            event: Event = ChunkReceived(msg, size)
        elif isinstance(msg, End):
            if msg.status != "ok":
                self._buffer.release(msg.req)  # a failed fetch drops what it buffered
            event = EndReceived(msg)
        elif isinstance(msg, Error):
            self._buffer.release(msg.req)
            event = ErrorReceived(msg)
        elif isinstance(msg, Fetch):
            event = FetchReceived(msg)
        elif isinstance(msg, Ack):
            event = AckReceived(msg)
        else:
            event = CancelReceived(msg)
        self._events.append(event)

    def _direction(self, msg: Message, outgoing: bool) -> Requests:
        return requests.requests_for(msg, outgoing, self._fetching, self._serving)

    # -- sending ---------------------------------------------------------------------------

    def _check_send(self, msg: Message, now: float) -> None:
        if isinstance(msg, (Hello, Auth)):
            raise LocalProtocolError(UNEXPECTED_MESSAGE, f"cannot send {msg.TYPE}: the handshake "
                                                         "is run by the connection itself")
        if isinstance(msg, Ack):
            raise LocalProtocolError(UNEXPECTED_MESSAGE, "cannot send ACK: ACKs are sent by the "
                                                         "connection as chunks arrive")
        if isinstance(msg, Error) and msg.req is None:
            raise LocalProtocolError(UNEXPECTED_MESSAGE, "cannot send ERROR: a connection-level "
                                                         "ERROR closes the connection; use close()")
        if type(msg) not in RULES:
            return
        try:
            requests.apply(msg, self._direction(msg, True), True, now)
        except ProtocolError as e:
            raise LocalProtocolError(e.code, f"cannot send {msg.TYPE}: {e.msg}") from None
        if isinstance(msg, Cancel):
            self._buffer.release(msg.req)  # the application gets no more of this fetch

    def _queue(self, msg: Message) -> int:
        parts, size = frames.encode_parts(to_wire(msg))
        self._out.extend(parts)
        return size

    def _proof(self, prover: str) -> bytes:
        if self.role == "client":
            cn, sn, cid, sid = self._nonce, self._peer_nonce, self.node_id, self.peer_node_id
        else:
            cn, sn, cid, sid = self._peer_nonce, self._nonce, self.peer_node_id, self.node_id
        return auth_proof(self._secret, prover, cn, sn, cid, sid)

    def _fail(self, code: str, msg: str) -> None:
        # a broken rule: tell the peer what and where, then stop; nothing after this counts
        msg = f"{msg} (state {self.state.value})"
        self._queue(Error(code, msg))
        self._closed(code, msg, False)

    def _closed(self, code: str, msg: str, by_peer: bool) -> None:
        self.state = State.CLOSED
        self._buffer.release_all()  # every fetch still open has failed
        self._events.append(ConnectionClosed(code, msg, by_peer))
