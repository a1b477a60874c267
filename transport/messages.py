"""The peer protocol's vocabulary: one frozen dataclass per message type, the error codes,
and the checked mapping between messages and wire maps ({"t": TYPE, field: value, ...})."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

PROTO = 1  # the major protocol version; compatible changes add fields or caps, never bump it
NONCE_BYTES = 32
MAX_NODE_ID_BYTES = 255
KEY_BYTES = 32  # a chunk key is a blake2b-256 digest (kvstreamd/store/keys.py); no other length is one

# Error codes. Connection-level ERRORs (req absent) close the connection, except UNKNOWN_TYPE;
# an ERROR with a req ends only that request. docs/protocol.md lists when each is sent.
BAD_FRAME = "bad_frame"  # a frame that is not one msgpack map, or uses ext types
FRAME_TOO_LARGE = "frame_too_large"  # a length prefix over the receiver's max_frame_bytes
BAD_MESSAGE = "bad_message"  # a known type with a missing, mistyped or out-of-range field
UNKNOWN_TYPE = "unknown_type"  # a message type this node does not know (not fatal once READY)
UNEXPECTED_MESSAGE = "unexpected_message"  # a known type not allowed in the receiver's state
VERSION = "version"  # HELLO with a different major protocol version
AUTH_FAILED = "auth_failed"  # an AUTH proof that does not verify
BAD_CRC = "bad_crc"  # a CHUNK whose payload does not match its crc32
BAD_REQUEST = "bad_request"  # a request-id rule broken (see docs/protocol.md, "Requests")
HANDSHAKE_TIMEOUT = "handshake_timeout"  # the handshake did not finish in time
NORMAL = "normal"  # an orderly close; not an error
NOT_FOUND = "not_found"  # request-scoped: the sender does not hold a requested key
INTERNAL = "internal"  # request-scoped: the sender failed while streaming
CONNECTION_LOST = "connection_lost"  # local only, never sent: the transport closed under us
WRITE_STALLED = "write_stalled"  # local only, never sent: the peer took none of our bytes for write_stall_s


class ProtocolError(Exception):
    """A protocol rule was broken; `code` is one of the codes above, `msg` says which rule
    and where."""

    def __init__(self, code: str, msg: str):
        super().__init__(f"{code}: {msg}")
        self.code = code
        self.msg = msg


class Message:
    """Base of all message types; TYPE is the wire name."""

    TYPE: ClassVar[str]


@dataclass(frozen=True)
class Hello(Message):
    """First frame both ways: who I am, what I speak, and my half of the auth challenge."""

    TYPE: ClassVar[str] = "HELLO"
    proto: int  # major protocol version; a different one is refused with ERROR "version"
    node_id: str  # the sender's stable node name, 1..255 UTF-8 bytes
    caps: dict  # capabilities, msgpack-native values only (e.g. {"levels": [...]})
    nonce: bytes  # 32 fresh random bytes; the peer's proof covers it


@dataclass(frozen=True)
class Auth(Message):
    """Proof that the sender holds the cluster secret (see `auth_proof`)."""

    TYPE: ClassVar[str] = "AUTH"
    proof: bytes  # HMAC-SHA256 over label, prover role, both nonces and both node ids


@dataclass(frozen=True)
class Advertise(Message):
    """Chunk keys the sender now holds."""

    TYPE: ClassVar[str] = "ADVERTISE"
    keys: list[bytes]  # chunk keys, each KEY_BYTES long
    # the levels the sender holds every one of these keys at (a sender groups its keys by the
    # levels held); None: not said (senders before it had it), which counts as any level
    levels: list[str] | None = None


@dataclass(frozen=True)
class Withdraw(Message):
    """Chunk keys the sender no longer holds."""

    TYPE: ClassVar[str] = "WITHDRAW"
    keys: list[bytes]  # chunk keys, each KEY_BYTES long


@dataclass(frozen=True)
class Fetch(Message):
    """Ask the peer to stream these chunks, chunk i answering keys[i]."""

    TYPE: ClassVar[str] = "FETCH"
    req: int  # request id, chosen by the fetcher, strictly increasing per connection direction
    keys: list[bytes]  # the chunks wanted, in order; at least one
    deadline_ms: int  # time budget for the whole transfer, from when the FETCH is received
    levels: list[str]  # levels the fetcher can decode, best first; TEXT is always acceptable
    decode_mbps: float | None = None  # fetcher's decode rate, MB/s of fp16 output; None = unknown
    recompute_tps: float | None = None  # fetcher's prefill rate for TEXT chunks, tokens/s; None = unknown
    # the fetcher uses the first prefix_tokens tokens of the context: of each chunk, only the
    # layers that read some of them are sent (a sliding layer whose window starts after the
    # chunk is left out). None: every layer of every chunk
    prefix_tokens: int | None = None
    # the per-chunk level rule the sender is to use (transport.policy.RULES, e.g. "cachegen"),
    # for an A/B experiment on the policy; a sender that does not know it ends the request with
    # ERROR bad_message. None: the sender's own (kvstreamd: "adaptive")
    rule: str | None = None
    # TEXT only after every chunk sent as KV: the fetcher holds a KV prefix and then computes the
    # rest (a serving engine such as vLLM, which cannot load KV after a hole). None/False: a TEXT
    # head (the fetcher computes it while the rest streams), then KV, then maybe a TEXT tail
    text_last: bool | None = None
    # how long the fetcher waits for the chunks, from when the FETCH is received, where that is
    # longer than deadline_ms: a deadline already lost still leaves chunks worth taking until
    # recomputing them would have been as quick (transport.calls.wait_s). The sender plans for
    # deadline_ms and gives up at this plus grace. None: deadline_ms
    wait_ms: int | None = None
    # where a token's prefill costs twice what it does at the start of a prompt (policy.text_seconds,
    # with recompute_tps the rate at the start), for TEXT priced by position; None: by
    # recompute_tps alone
    recompute_doubling: float | None = None

    @classmethod
    def ask(cls, keys: list[bytes], deadline_ms: int, levels: list[str], **options) -> Fetch:
        """A FETCH to send (PeerConnection.fetch gives it its request id); `options`: the
        optional fields above."""
        return cls(0, list(keys), int(deadline_ms), list(levels), **options)


@dataclass(frozen=True)
class Chunk(Message):
    """Chunk i of request req, encoded at `level`."""

    TYPE: ClassVar[str] = "CHUNK"
    req: int  # the FETCH this answers
    i: int  # index into that FETCH's keys
    level: str  # the level the payload is encoded at
    payload: bytes  # the encoded chunk (a codec bitstream)
    crc: int  # zlib.crc32 of payload, checked by the receiver
    # the key of the chunk the payload is, as the sender's store holds it; the fetcher refuses
    # a chunk whose key is not the one it asked for. None: not said (senders before it had it)
    key: bytes | None = None

    @classmethod
    def of(cls, req: int, i: int, level: str, payload: bytes, key: bytes | None = None) -> Chunk:
        """A CHUNK with its crc computed from the payload."""
        return cls(req, i, level, payload, zlib.crc32(payload), key)


@dataclass(frozen=True)
class Text(Message):
    """Chunk i of request req as token ids, for the receiver to recompute."""

    TYPE: ClassVar[str] = "TEXT"
    req: int  # the FETCH this answers
    i: int  # index into that FETCH's keys
    tokens: list[int]  # the chunk's token ids


@dataclass(frozen=True)
class Ack(Message):
    """The fetcher has chunk i of req in full (sent on receipt, before decoding)."""

    TYPE: ClassVar[str] = "ACK"
    req: int  # the request
    i: int  # the chunk received
    recv_bytes: int  # wire size of the frame that carried chunk i, length prefix included


@dataclass(frozen=True)
class End(Message):
    """The last message of a request: every chunk was sent, or the stream stopped."""

    TYPE: ClassVar[str] = "END"
    req: int  # the request
    status: str  # "ok" (every chunk sent) or "cancelled" (after CANCEL)
    deadline_missed: bool  # True when the stream finished after deadline_ms


@dataclass(frozen=True)
class Cancel(Message):
    """Stop streaming request req; the sender answers with END "cancelled"."""

    TYPE: ClassVar[str] = "CANCEL"
    req: int  # the request to stop


@dataclass(frozen=True)
class Error(Message):
    """Something went wrong: for the connection (req None, then close) or for one request."""

    TYPE: ClassVar[str] = "ERROR"
    code: str  # one of the error codes in this module (a peer may send others)
    msg: str  # what rule was broken and in which state, for people
    req: int | None = None  # the request this ends, or None for the whole connection


@dataclass(frozen=True)
class Ping(Message):
    """Ask for a PONG at once: to measure round-trip time or, padded, the link's rate."""

    TYPE: ClassVar[str] = "PING"
    time: float  # the sender's clock, seconds (not "t": that key names the message type)
    pad: bytes | None = None  # ignored filler; a padded PING is a bandwidth probe, its PONG the ack


@dataclass(frozen=True)
class Pong(Message):
    """Answer to a PING."""

    TYPE: ClassVar[str] = "PONG"
    time: float  # the time of the PING answered, echoed unchanged
    # the answerer's wall clock (Unix seconds) as it answered: with the round trip, the pinger
    # learns how far the two clocks are apart. None: not said (peers before it had it)
    wall: float | None = None


TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Auth, Advertise, Withdraw, Fetch, Chunk, Text, Ack, End, Cancel, Error,
                Ping, Pong)
}


# Field checks: each takes the wire value and returns the field value, or raises ValueError
# saying what was expected. bool is rejected where an int is wanted: msgpack keeps them apart.
def _int(v: Any) -> int:
    if type(v) is not int:
        raise ValueError(f"expected an integer, got {type(v).__name__}")
    return v


def _uint(v: Any) -> int:
    if _int(v) < 0:
        raise ValueError(f"expected an integer >= 0, got {v}")
    return v


def _uint32(v: Any) -> int:
    if not 0 <= _int(v) < 2**32:
        raise ValueError(f"expected an unsigned 32-bit integer, got {v}")
    return v


def _bool(v: Any) -> bool:
    if type(v) is not bool:
        raise ValueError(f"expected a boolean, got {type(v).__name__}")
    return v


def _float(v: Any) -> float:
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ValueError(f"expected a finite number, got {v!r}")
    return float(v)


def _optional_float(v: Any) -> float | None:
    return None if v is None else _float(v)


def _optional_positive_float(v: Any) -> float | None:
    if v is None:
        return None
    if _float(v) <= 0:
        raise ValueError(f"expected a number > 0 or nil, got {v}")
    return float(v)


def _optional_bool(v: Any) -> bool | None:
    return None if v is None else _bool(v)


def _optional_uint(v: Any) -> int | None:
    return None if v is None else _uint(v)


def _str(v: Any) -> str:
    if type(v) is not str:
        raise ValueError(f"expected a string, got {type(v).__name__}")
    return v


def _optional_str(v: Any) -> str | None:
    return None if v is None else _str(v)


def _bytes(v: Any) -> bytes:
    if type(v) is not bytes:
        raise ValueError(f"expected binary (msgpack bin), got {type(v).__name__}")
    return v


def _optional_bytes(v: Any) -> bytes | None:
    return None if v is None else _bytes(v)


def _nonce(v: Any) -> bytes:
    if len(_bytes(v)) != NONCE_BYTES:
        raise ValueError(f"expected {NONCE_BYTES} bytes, got {len(v)}")
    return v


def check_node_id(v: Any) -> str:
    """A valid node id (1..255 UTF-8 bytes) or ValueError."""
    if not 1 <= len(_str(v).encode()) <= MAX_NODE_ID_BYTES:
        raise ValueError(f"expected 1..{MAX_NODE_ID_BYTES} UTF-8 bytes, got {len(v.encode())}")
    return v


def _list(v: Any, item: Callable[[Any], Any], min_len: int = 0) -> list:
    if type(v) is not list:
        raise ValueError(f"expected an array, got {type(v).__name__}")
    if len(v) < min_len:
        raise ValueError(f"expected at least {min_len} item(s), got {len(v)}")
    for n, x in enumerate(v):
        try:
            item(x)
        except ValueError as e:
            raise ValueError(f"item {n}: {e}") from None
    return v


def _key(v: Any) -> bytes:
    if len(_bytes(v)) != KEY_BYTES:
        raise ValueError(f"expected a chunk key of {KEY_BYTES} bytes, got {len(v)}")
    return v


def _optional_key(v: Any) -> bytes | None:
    return None if v is None else _key(v)


MAX_LEVELS = 16  # names in an ADVERTISE's levels, each of at most MAX_LEVEL_NAME bytes: what a
MAX_LEVEL_NAME = 64  # peer makes a node keep per key is bounded like the keys themselves


def _levels(v: Any) -> list[str] | None:
    if v is None:
        return None
    if len(_list(v, _str, 1)) > MAX_LEVELS:
        raise ValueError(f"expected at most {MAX_LEVELS} levels, got {len(v)}")
    for n, x in enumerate(v):
        if len(x.encode()) > MAX_LEVEL_NAME:
            raise ValueError(f"item {n}: a level name of at most {MAX_LEVEL_NAME} bytes, got {len(x.encode())}")
    return v


def _native(v: Any, depth: int = 0) -> None:
    # caps travel back out (logs, the API), so only plain msgpack values are accepted
    if depth > 8:
        raise ValueError("nested deeper than 8 levels")
    if v is None or type(v) in (bool, int, float, str, bytes):
        return
    if type(v) is list:
        for x in v:
            _native(x, depth + 1)
        return
    if type(v) is dict:
        for k, x in v.items():
            if type(k) is not str:
                raise ValueError(f"map key {k!r} is not a string")
            _native(x, depth + 1)
        return
    raise ValueError(f"{type(v).__name__} is not a plain msgpack value")


def _caps(v: Any) -> dict:
    if type(v) is not dict:
        raise ValueError(f"expected a map, got {type(v).__name__}")
    _native(v)
    return v


_CHECKS: dict[type[Message], dict[str, Callable[[Any], Any]]] = {
    Hello: {"proto": _uint, "node_id": check_node_id, "caps": _caps, "nonce": _nonce},
    Auth: {"proof": _bytes},
    Advertise: {"keys": lambda v: _list(v, _key), "levels": _levels},
    Withdraw: {"keys": lambda v: _list(v, _key)},
    Fetch: {"req": _uint, "keys": lambda v: _list(v, _key, 1), "deadline_ms": _uint,
            "levels": lambda v: _list(v, _str), "decode_mbps": _optional_positive_float,
            "recompute_tps": _optional_positive_float, "prefix_tokens": _optional_uint,
            "rule": _optional_str, "text_last": _optional_bool, "wait_ms": _optional_uint,
            "recompute_doubling": _optional_positive_float},
    Chunk: {"req": _uint, "i": _uint, "level": _str, "payload": _bytes, "crc": _uint32, "key": _optional_key},
    Text: {"req": _uint, "i": _uint, "tokens": lambda v: _list(v, _uint)},
    Ack: {"req": _uint, "i": _uint, "recv_bytes": _uint},
    End: {"req": _uint, "status": _str, "deadline_missed": _bool},
    Cancel: {"req": _uint},
    Error: {"code": _str, "msg": _str, "req": _optional_uint},
    Ping: {"time": _float, "pad": _optional_bytes},
    Pong: {"time": _float, "wall": _optional_float},
}
_OPTIONAL = {(Fetch, "decode_mbps"), (Fetch, "recompute_tps"), (Fetch, "prefix_tokens"), (Fetch, "rule"),
             (Fetch, "text_last"), (Fetch, "wait_ms"), (Fetch, "recompute_doubling"), (Chunk, "key"),
             (Error, "req"), (Advertise, "levels"),
             (Ping, "pad"), (Pong, "wall")}  # may be absent on the wire (= nil)


def to_wire(msg: Message) -> dict:
    """The wire map of a message: {"t": TYPE, field: value, ...}; None optionals are left out.
    Field values are passed through as they are, so a large payload is not copied here."""
    out: dict[str, Any] = {"t": msg.TYPE}
    for f in fields(msg):
        v = getattr(msg, f.name)
        if v is None and (type(msg), f.name) in _OPTIONAL:
            continue
        out[f.name] = v
    return out


def from_wire(d: dict) -> Message:
    """The message a wire map carries, checked field by field; raises ProtocolError
    (BAD_MESSAGE naming the field, or UNKNOWN_TYPE). Unknown extra fields are ignored."""
    t = d.get("t")
    if type(t) is not str:
        raise ProtocolError(BAD_MESSAGE, f"field 't' (message type) must be a string, got {t!r}")
    cls = TYPES.get(t)
    if cls is None:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {t[:64]!r}")
    values = {}
    for name, check in _CHECKS[cls].items():
        if name not in d:
            if (cls, name) in _OPTIONAL:
                continue
            raise ProtocolError(BAD_MESSAGE, f"{t}: missing field {name!r}")
        try:
            values[name] = check(d[name])
        except ValueError as e:
            raise ProtocolError(BAD_MESSAGE, f"{t}.{name}: {e}") from None
    return cls(**values)
