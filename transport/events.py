"""What a sans-IO `protocol.Connection` reports from `next_event()`: one small event per
kind, each checked against every rule before it is returned."""
from __future__ import annotations

from dataclasses import dataclass, field

from .messages import Ack, Cancel, Chunk, End, Error, Fetch, Message, Text

__all__ = ["Event", "HandshakeComplete", "FetchReceived", "ChunkReceived", "AckReceived",
           "EndReceived", "CancelReceived", "ErrorReceived", "MessageReceived", "ConnectionClosed"]


class Event:
    """Base of what `Connection.next_event()` returns."""


@dataclass(frozen=True)
class HandshakeComplete(Event):
    """Both sides proved they hold the secret; the connection is READY."""

    peer_node_id: str  # the node id from the peer's HELLO
    peer_caps: dict  # the caps from the peer's HELLO


# -- requests: this side as the fetcher ------------------------------------------------------


@dataclass(frozen=True)
class ChunkReceived(Event):
    """A CHUNK or TEXT of one of this side's fetches: in range, the first for its index, crc
    good. Its ACK is already queued; its bytes count as buffered until `Connection.taken()`."""

    msg: Chunk | Text  # the chunk
    wire_bytes: int  # size of the frame that carried it, length prefix included (its ACK's recv_bytes)


@dataclass(frozen=True)
class EndReceived(Event):
    """END of one of this side's fetches; the request is over. Status "ok" arrives only
    after every chunk has (else the connection closes with bad_request)."""

    msg: End  # the END

    @property
    def complete(self) -> bool:
        """True for status "ok": every chunk arrived. Any other status is a failed request."""
        return self.msg.status == "ok"


@dataclass(frozen=True)
class ErrorReceived(Event):
    """The sender ended one of this side's fetches with a request ERROR (not_found,
    internal, ...); the request is over, the connection stays open."""

    msg: Error  # the ERROR; msg.req is set


# -- requests: this side as the sender -------------------------------------------------------


@dataclass(frozen=True)
class FetchReceived(Event):
    """The peer asks for chunks: this side is the sender of request `msg.req` and owes it
    one CHUNK or TEXT per key, then END or ERROR (`Connection.end_request()` picks which)."""

    msg: Fetch  # the FETCH


@dataclass(frozen=True)
class AckReceived(Event):
    """The fetcher has chunk `msg.i` of a request this side sends, in full. It may arrive
    after this side's END (it was in flight); it still times the chunk's delivery."""

    msg: Ack  # the ACK


@dataclass(frozen=True)
class CancelReceived(Event):
    """The fetcher cancelled a request this side is still sending: stop, then
    `Connection.end_request()` sends END "cancelled". Not reported for an ended request."""

    msg: Cancel  # the CANCEL


# -- everything else -----------------------------------------------------------------------


@dataclass(frozen=True)
class MessageReceived(Event):
    """A message outside any request (ADVERTISE, WITHDRAW, PING, PONG, ERROR unknown_type)
    that passed every check; PINGs are already answered."""

    msg: Message  # the message
    size: int = field(default=0, compare=False)  # its frame's wire size (what the inbox counts)


@dataclass(frozen=True)
class ConnectionClosed(Event):
    """The connection is CLOSED; always the last event."""

    code: str  # an error code, NORMAL for an orderly close, CONNECTION_LOST for EOF
    msg: str  # what happened, for people
    by_peer: bool  # True when the peer closed (its ERROR or EOF), False when this side did
