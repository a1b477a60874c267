"""What the model process asks of its daemon, as values: one frozen dataclass per request body of
the local API (`FetchRequest`, `PutRequest`, `ContextRequest`, `ProbeRequest`), built once where a
request enters (the API's parser, the clients, the CLI, the vLLM connector) and handed whole to
the node, its fetches and puts, and onto the wire.

Each field says how a JSON body carries it (`Check`: its JSON type, its bounds, and what it
becomes), so that one parser (`parse`) reads every body and one writer (`to_body`) writes it: a new
option is a field, its check, and the code that uses it. kvstreamd/routes.py names each route's
request type; node/api.py parses with it before the node sees anything."""
from __future__ import annotations

import base64
import binascii
import dataclasses
from dataclasses import MISSING, dataclass, field
from typing import Any, Callable, TypeVar

from codec.tuning import catalog
from codec.bitstream import DTYPE_NAMES
from codec.errors import CodecError
from codec.tuning.rate import ChunkCost
from transport.bandwidth import MIN_SAMPLE_BYTES, Probe

from kvstreamd.limits import MAX_DEADLINE_MS

DTYPE_CHOICES = tuple(DTYPE_NAMES.values())  # of a put's KV, of a fetch's buffer (handoff.shm.DTYPES)

# Bounds on request fields, checked at the door so that nothing out of range reaches the node.
MAX_TOKENS = 2**20          # tokens in one request (a context a model can hold, and more)
MAX_RECOMPUTE_TPS = 10**9   # tokens a second a model prefills
MAX_DOUBLING_TOKENS = 10**9  # where a token's prefill costs twice its cost at the start of a prompt
MAX_NAME = 512              # characters of a model id
MAX_DIMS = 8                # dimensions of a put's KV shape
MAX_DIM = 2**31             # one dimension of it
MAX_MESSAGE = 1000          # characters of an error message (longer ones are cut)
# A peer probe (POST /v1/peers/probe, `kvstreamd doctor`): its padding and how long it may take.
PROBE_BYTES = Probe().size  # the largest probe a sender measures a link with: large enough to see past a socket buffer
MIN_PROBE_BYTES = MIN_SAMPLE_BYTES  # smaller measures latency, not bandwidth
MAX_PROBE_BYTES = 16 * 2**20  # per peer: a diagnosis must not be a load test
PROBE_TIMEOUT_S = 5.0
MAX_PROBE_TIMEOUT_S = 30.0

# The orders a fetch's chunk events may come in (FetchRequest.order). "prompt": chunk i's event
# after chunk i-1's. "landed": a KV chunk's event as soon as its KV is in the buffer, ahead of
# chunks before it still decoding (at 1000 Mbit/s an int8 chunk lands in a few ms while the
# entropy-coded chunks sent before it decode for ~100 ms more; in prompt order the model process
# could copy none of them until those were done); TEXT events still come after every chunk
# before them, so a TEXT tail is computed on KV that is all there.
ORDERS = ("prompt", "landed")
DEVICES = ("cpu", "cuda")

NUMBER = (int, float)


class BadRequest(ValueError):
    """A body that is not the request it should be; the message names the field and shows at
    most a few dozen characters of what was sent."""


def cut(text: str, limit: int = MAX_MESSAGE) -> str:
    return text if len(text) <= limit else f"{text[:limit - 40]}... ({len(text)} characters)"


def shown(value: Any, limit: int = 60) -> str:
    """A client's value as messages and the log show it: repr, cut to `limit` characters."""
    if isinstance(value, (str, list, dict)) and len(value) > limit:  # no repr of a megabyte
        value = value[:limit] if isinstance(value, (str, list)) else dict(list(value.items())[:4])
        return f"{cut(repr(value), limit)}..."
    return cut(repr(value), limit)


@dataclass(frozen=True)
class Check:
    """How a body carries one field: its JSON type, its bounds (numbers) or allowed values, and
    what it becomes (`read`, which raises BadRequest) and is written back as (`write`)."""

    kind: type | tuple[type, ...]
    lo: float | None = None
    hi: float | None = None
    choices: tuple | Callable[[], list] | None = None
    read: Callable[[str, Any], Any] | None = None
    write: Callable[[Any], Any] | None = None

    def parse(self, name: str, v: Any) -> Any:
        if not isinstance(v, self.kind) or isinstance(v, bool) and self.kind is not bool:
            raise BadRequest(f"field {name!r} must be {_kind_name(self.kind)}")
        if self.lo is not None and not self.lo <= v <= self.hi:  # NaN fails too
            raise BadRequest(f"field {name!r} must be {self.lo}..{self.hi}, got {shown(v)}")
        if self.choices is not None:
            allowed = self.choices() if callable(self.choices) else self.choices
            if v not in allowed:
                raise BadRequest(f"{name} must be one of {list(allowed)}, not {shown(v)}")
        return v if self.read is None else self.read(name, v)

    def dump(self, v: Any) -> Any:
        if self.write is not None:
            return self.write(v)
        if self.kind is bool:
            return bool(v)
        if self.kind is int:
            return int(v)
        if self.kind is NUMBER:
            return float(v)
        return v


def _kind_name(kind) -> str:
    return "a number" if kind == NUMBER else getattr(kind, "__name__", str(kind))


def checked(kind, default: Any = MISSING, **check) -> Any:
    """A request field read from a body by Check(kind, **check); no default: the body must have it."""
    return field(default=default, metadata={"check": Check(kind, **check)})


# -- the fields' own rules ---------------------------------------------------------------------

def _model_id(name: str, v: str) -> str:
    if not 0 < len(v) <= MAX_NAME:
        raise BadRequest(f"field {name!r} is {len(v)} characters; a model id is 1..{MAX_NAME}")
    return v


def _tokens(name: str, v: list) -> list[int]:
    if not v:
        raise BadRequest(f"field {name!r} must not be empty")
    if len(v) > MAX_TOKENS:
        raise BadRequest(f"field {name!r} has {len(v)} tokens; at most {MAX_TOKENS} a request")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in v):
        raise BadRequest(f"field {name!r} must be a list of token ids (0 <= id < 2**32)")
    return v


def _levels(name: str, v: list) -> list[str]:
    """The levels a fetch accepts, best first (default: the configured ones). One level alone
    means exactly that level for every chunk (what a baseline measurement wants)."""
    known = catalog.names()
    if not v or len(v) > len(known) or not all(isinstance(lv, str) and lv in known for lv in v):
        raise BadRequest(f"{name} must be a non-empty list of {known}; got {shown(v)}")
    if len(set(v)) < len(v):
        raise BadRequest(f"{name} names a level twice: {shown(v)}")
    return v


def _shape(name: str, v: list) -> tuple[int, ...]:
    if not (len(v) <= MAX_DIMS and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM
                                       for d in v)):
        raise BadRequest(f"field {name!r} must be a list of at most {MAX_DIMS} sizes (0..{MAX_DIM}), got {shown(v)}")
    return tuple(v)


def _chunk_costs(name: str, v: list) -> list[ChunkCost]:
    """[[end, last], ...], what coding each chunk of the whole context costs the model
    (codec.tuning.rate), from the first chunk on; a context put piece by piece sends them all with
    every piece, so the list may run past the request's tokens (the node checks that it covers
    them)."""
    if not v or len(v) > MAX_TOKENS:
        raise BadRequest(f"field {name!r} must list one [end, last] per chunk, got {len(v)}")
    try:
        return [ChunkCost.of(c) for c in v]
    except CodecError as e:
        raise BadRequest(f"field {name!r}: {e}") from None


def _base64(name: str, v: str) -> bytes:
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"field {name!r} is not base64") from None


MODEL_ID = dict(read=_model_id)
TOKENS = dict(read=_tokens, write=lambda v: [int(t) for t in v])


# -- the requests ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContextRequest:
    """POST /v1/lookup (where the prompt's longest prefix is held) and POST /v1/pins (pin the
    context held for these tokens): a model's prompt."""

    model_id: str = checked(str, **MODEL_ID)
    tokens: list[int] = checked(list, **TOKENS)


@dataclass(frozen=True)
class FetchRequest:
    """POST /v1/fetch: the longest cached prefix of `tokens`, into a buffer the client maps."""

    model_id: str = checked(str, **MODEL_ID)
    tokens: list[int] = checked(list, **TOKENS)
    dtype: str = checked(str, "float16", choices=DTYPE_CHOICES)  # of the buffer the KV lands in
    deadline_ms: int | None = checked(int, None, lo=1, hi=MAX_DEADLINE_MS)  # None: [fetch] deadline_ms
    # accepted levels, best first; one alone: exactly that level
    levels: list[str] | None = checked(list, None, read=_levels, write=list)
    # the model's prefill rate, to price TEXT chunks
    recompute_tokens_per_s: float | None = checked(NUMBER, None, lo=1, hi=MAX_RECOMPUTE_TPS)
    # "cuda": decode on the daemon's GPU and hand over device memory
    device: str = checked(str, "cpu", choices=DEVICES)
    # TEXT chunks only after every KV chunk: the caller holds a KV prefix, then computes (vLLM)
    text_last: bool = checked(bool, False)
    # the position where a token's prefill costs the model twice what it does at the start of a
    # prompt (recompute_tokens_per_s being the rate there): TEXT is priced by position
    # (transport.policy.text_seconds); None: at recompute_tokens_per_s everywhere
    recompute_doubling_tokens: float | None = checked(NUMBER, None, lo=1, hi=MAX_DOUBLING_TOKENS)
    order: str = checked(str, "prompt", choices=ORDERS)  # of the chunk events: one of ORDERS


@dataclass(frozen=True)
class PutRequest:
    """POST /v1/contexts: store a context whose KV [L, 2, T, H, D] the client left in the
    shared-memory segment `buffer`."""

    model_id: str = checked(str, **MODEL_ID)
    tokens: list[int] = checked(list, **TOKENS)
    buffer: str = checked(str)  # the segment's name
    shape: tuple[int, ...] = checked(list, read=_shape, write=list)
    dtype: str = checked(str, "float16", choices=DTYPE_CHOICES)
    # the segment holds the KV of tokens[start:] only (a multiple of chunk_tokens), the chunks
    # before it held here already: how a long context is put piece by piece
    start: int = checked(int, 0, lo=0, hi=MAX_TOKENS)
    pin: bool = checked(bool, False)  # pin the whole context once stored
    # what coding each chunk of the whole context costs the model (codec.tuning.rate): each chunk is
    # coded at the scale its costs give it at each level; None: at the level's one scale
    chunk_costs: list[ChunkCost] | None = checked(list, None, read=_chunk_costs,
                                                  write=lambda v: [[float(c.end), float(c.last)] for c in v])
    # the whole context's uint8 [L, n] step classes, raw (codec.tuning.token_steps), n >= the tokens;
    # base64 in a body
    token_classes: bytes | None = checked(str, None, read=_base64,
                                          write=lambda v: base64.b64encode(memoryview(v).cast("B")).decode())


@dataclass(frozen=True)
class ProbeRequest:
    """POST /v1/peers/probe: each connected peer probed at once (round trip, bandwidth with
    `bytes` of padding, clock offset), within timeout_s."""

    bytes: int = checked(int, PROBE_BYTES, lo=MIN_PROBE_BYTES, hi=MAX_PROBE_BYTES)
    timeout_s: float = checked(NUMBER, PROBE_TIMEOUT_S, lo=0.1, hi=MAX_PROBE_TIMEOUT_S)


Request = TypeVar("Request")


def parse(cls: type[Request], body: Any) -> Request:
    """The request of type `cls` a JSON body stands for: each field as its Check reads it, a
    missing one its default; BadRequest naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in body:
            values[f.name] = f.metadata["check"].parse(f.name, body[f.name])
        elif f.default is MISSING:
            raise BadRequest(f"missing field {f.name!r}")
    return cls(**values)


def to_body(req: Any) -> dict:
    """The JSON body of a request: its required fields and those set to other than their
    default, as `parse` reads them back."""
    out = {}
    for f in dataclasses.fields(req):
        v = getattr(req, f.name)
        if f.default is MISSING or (v is not None if f.default is None else v != f.default):
            out[f.name] = f.metadata["check"].dump(v)
    return out
