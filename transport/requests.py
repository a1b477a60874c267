"""The request lifecycle of the peer protocol, sans-IO: one table of rules (RULES) applied
alike to what a side sends and what it receives, how a sender's request ends (END or ERROR),
and the accounting of received chunks the application has not taken yet."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from .frames import text_wire_bytes
from .messages import (BAD_CRC, BAD_REQUEST, INTERNAL, Ack, Cancel, Chunk, End, Error, Fetch,
                       Message, ProtocolError, Text)

__all__ = ["FETCHER", "SENDER", "Rule", "RULES", "Request", "Requests", "in_request", "requests_for", "DELIVER", "DROP",
           "apply", "ending", "held_bytes", "ReceiveBuffer", "DEFAULT_MAX_BUFFERED_BYTES"]

# The two sides of a request: the fetcher sent the FETCH; the sender answers it.
FETCHER, SENDER = "fetcher", "sender"
# What apply() says to do with a message that broke no rule.
DELIVER, DROP = "deliver", "drop"
DEFAULT_MAX_BUFFERED_BYTES = 64 * 2**20  # received chunks not yet taken by the application


@dataclass(frozen=True)
class Rule:
    """What one request message needs of its request and does to it. Every rule holds in both
    directions: a side refuses to send what it would refuse to receive."""

    by: str  # which side of the request sends it: FETCHER or SENDER
    opens: bool = False  # starts a request; its req must be above the previous FETCH's
    chunk: bool = False  # carries chunk i: i < n and not twice; after the fetcher's CANCEL, dropped
    crc: bool = False  # its payload's crc32 is checked on receipt (bad_crc closes the connection)
    acks: bool = False  # names chunk i, which must have been sent
    ends: bool = False  # the request is over after it; END "ok" needs every chunk
    cancels: bool = False  # the fetcher stops the request; the sender still ends it
    late: str | None = None  # arriving for a request this side has ended (it crossed the END
    # on the wire): DELIVER or DROP; None means bad_request. Only a received message can be late.


RULES: dict[type[Message], Rule] = {
    Fetch: Rule(FETCHER, opens=True),
    Chunk: Rule(SENDER, chunk=True, crc=True),
    Text: Rule(SENDER, chunk=True),
    End: Rule(SENDER, ends=True),
    Error: Rule(SENDER, ends=True),  # with a req; an ERROR without one is the connection's
    Ack: Rule(FETCHER, acks=True, late=DELIVER),  # the last chunks' timings are still worth having
    Cancel: Rule(FETCHER, cancels=True, late=DROP),  # the END it wanted has already gone
}


@dataclass
class Request:
    """One FETCH as one end tracks it; the fetcher's copy and the sender's follow the same rules."""

    req: int
    n: int  # how many chunks (keys) it asks for
    deadline_at: float  # `now` when the FETCH was sent or received, plus its deadline_ms
    done: set[int] = field(default_factory=set)  # chunk indices sent (sender) or received (fetcher)
    cancelled: bool = False  # CANCEL sent (fetcher) or received (sender)


class Requests:
    """The requests of one direction: the FETCHes one side of the connection makes."""

    def __init__(self, mine: bool):
        self.mine = mine  # True: this side is their fetcher; False: their sender
        self.open: dict[int, Request] = {}  # by req, until END or a request ERROR
        self.last_req = -1  # the req of the latest FETCH in this direction

    def whose(self) -> str:
        return "this side" if self.mine else "the peer"


def in_request(msg: Message) -> bool:
    """`msg` belongs to a request, so RULES apply to it: a message of a type RULES lists, but an
    ERROR without a req (the whole connection's)."""
    return type(msg) in RULES and not (isinstance(msg, Error) and msg.req is None)


def requests_for(msg: Message, outgoing: bool, fetching: Requests, serving: Requests) -> Requests:
    """The direction `msg` belongs to: a message from a request's fetcher that this side sends,
    or one from its sender that this side receives, is about this side's own FETCH."""
    return fetching if (RULES[type(msg)].by == FETCHER) == outgoing else serving


def apply(msg: Message, requests: Requests, outgoing: bool, now: float) -> str:
    """Check a request message against RULES and update its request; returns DELIVER or DROP.
    Raises ProtocolError (bad_request, or bad_crc) naming the rule broken, with nothing
    changed. `outgoing`: this side is sending msg; otherwise it has just arrived."""
    rule = RULES[type(msg)]
    verb = "sent" if outgoing else "arrived"
    if rule.opens:
        assert isinstance(msg, Fetch)
        if msg.req <= requests.last_req:
            raise ProtocolError(BAD_REQUEST, f"FETCH req {msg.req} is not above the previous FETCH "
                                             f"req {requests.last_req}")
        requests.last_req = msg.req
        requests.open[msg.req] = Request(msg.req, len(msg.keys), now + msg.deadline_ms / 1000)
        return DELIVER
    r = requests.open.get(msg.req)
    if r is None:
        if msg.req > requests.last_req:
            raise ProtocolError(BAD_REQUEST, f"{msg.TYPE} for req {msg.req}, which was never "
                                             f"fetched by {requests.whose()}")
        if rule.late is not None and not outgoing:
            return rule.late
        raise ProtocolError(BAD_REQUEST, f"{msg.TYPE} for req {msg.req}, which is not an open "
                                         f"FETCH of {requests.whose()}")
    if rule.chunk:
        if r.cancelled and not outgoing:
            return DROP  # in flight when the fetcher cancelled: no ACK, no checks, not counted
        if msg.i >= r.n:
            raise ProtocolError(BAD_REQUEST, f"{msg.TYPE} i={msg.i} is out of range: req "
                                             f"{msg.req} asked for {r.n} chunks")
        if msg.i in r.done:
            raise ProtocolError(BAD_REQUEST, f"{msg.TYPE} i={msg.i} of req {msg.req} {verb} twice")
        if rule.crc and not outgoing and zlib.crc32(msg.payload) != msg.crc:
            raise ProtocolError(BAD_CRC, f"CHUNK req={msg.req} i={msg.i}: crc32 of the "
                                         f"{len(msg.payload)}-byte payload is not {msg.crc}")
        r.done.add(msg.i)
    elif rule.acks:
        if msg.i not in r.done:
            raise ProtocolError(BAD_REQUEST, f"ACK for chunk {msg.i} of req {msg.req}, which was "
                                             "not sent")
    elif rule.ends:
        # a fetcher that has cancelled stopped counting chunks, so it cannot hold END to this
        counted = not (r.cancelled and not outgoing)
        if isinstance(msg, End) and msg.status == "ok" and counted and len(r.done) < r.n:
            raise ProtocolError(BAD_REQUEST, f"END ok for req {msg.req} after only {len(r.done)} "
                                             f"of {r.n} chunks")
        del requests.open[msg.req]
    elif rule.cancels:
        r.cancelled = True
    return DELIVER


def ending(r: Request, now: float, failure: str | None = None) -> End | Error:
    """What ends request `r` once its sender stops (`failure`: why it failed, or None): END
    "cancelled" after the fetcher's CANCEL; ERROR internal if the sender failed or sent fewer
    than every chunk; END "ok" otherwise. deadline_missed: `now` is past the deadline."""
    missed = now > r.deadline_at
    if r.cancelled:
        return End(r.req, "cancelled", missed)
    if failure is not None:
        return Error(INTERNAL, failure, r.req)
    if len(r.done) < r.n:
        return Error(INTERNAL, f"the sender stopped after {len(r.done)} of {r.n} chunks", r.req)
    return End(r.req, "ok", missed)


def held_bytes(msg: Chunk | Text) -> int:
    """What a received chunk costs to hold until the application takes it."""
    return len(msg.payload) if isinstance(msg, Chunk) else text_wire_bytes(msg.tokens, msg.req, msg.i)


class ReceiveBuffer:
    """Received chunks the application has not taken yet, in bytes per request, and whether
    to stop reading: above `limit` reading pauses (TCP then pushes back on the sender), at
    half of it reading resumes. A request that fails or is cancelled drops what it held."""

    def __init__(self, limit: int | None = DEFAULT_MAX_BUFFERED_BYTES):
        self.limit = limit  # None: never pause
        self.total = 0
        self.paused = False
        self._by_req: dict[int, int] = {}

    def hold(self, msg: Chunk | Text) -> None:
        n = held_bytes(msg)
        self._by_req[msg.req] = self._by_req.get(msg.req, 0) + n
        self.total += n
        self._update()

    def take(self, msg: Chunk | Text) -> None:
        """The application took `msg`; a no-op for a request already released."""
        held = self._by_req.get(msg.req)
        if held is None:
            return
        n = min(held_bytes(msg), held)
        if held == n:
            del self._by_req[msg.req]
        else:
            self._by_req[msg.req] = held - n
        self.total -= n
        self._update()

    def release(self, req: int) -> None:
        """Request `req` failed or was cancelled: what it held is dropped, not taken."""
        self.total -= self._by_req.pop(req, 0)
        self._update()

    def release_all(self) -> None:
        self._by_req.clear()
        self.total = 0
        self._update()

    def _update(self) -> None:
        if self.limit is None:
            return
        if not self.paused and self.total > self.limit:
            self.paused = True
        elif self.paused and self.total <= self.limit // 2:
            self.paused = False
