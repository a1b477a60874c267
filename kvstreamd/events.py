"""The events the daemon streams back for a fetch (kvstreamd.requests.FetchRequest) as NDJSON
lines: `Start`, one `Chunk` per chunk as it lands, then `End`, or `Failed`. The daemon builds
them, the API writes them and the client parses them, all from these definitions;
`to_json`/`from_json` are the only wire mapping."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Union


@dataclass(frozen=True)
class Start:
    """The fetch is planned: how much of the prompt was found and the buffer to map."""

    event: ClassVar[str] = "start"
    buffer: str | None  # the buffer's name (None when nothing was found)
    shape: list[int]  # [L, 2, found_tokens, H, D]: the prefix's KV, every layer's every token
    dtype: str
    device: str  # where the buffer lies: "cpu" (shared memory) or "cuda:N"
    prompt_tokens: int
    found_tokens: int  # tokens [0, found_tokens) will arrive, as KV or as TEXT to recompute
    chunk_tokens: int
    local_tokens: int  # of those, held by this node itself
    lease_s: float  # the buffer is released this long after the fetch unless the client does it
    cuda_ipc: str | None = None  # cudaIpcMemHandle_t as hex, for a buffer on a GPU
    gpu_unavailable: str | None = None  # why a fetch that asked for device "cuda" got host memory
    # What the buffer holds, back to back: per group of layers {"layers", "start", "window"},
    # `[len(layers), 2, found_tokens - start, H, D]` (codec.layout.fetch_parts). One part of
    # every layer from token 0 for a model whose layers all hold every token (the `shape`
    # tensor); a hybrid model's sliding layers hold their window only. None: that one part.
    parts: list[dict] | None = None


@dataclass(frozen=True)
class Chunk:
    """One chunk has landed: its KV is in the buffer at [start, end), or it must be recomputed.
    Events come in prompt order, or KV ones as they land (requests.FetchRequest.order, requests.ORDERS)."""

    event: ClassVar[str] = "chunk"
    i: int
    start: int  # token positions [start, end) of the prompt
    end: int
    kind: str  # "kv": decoded into the buffer; "text": the model must recompute these tokens
    level: str
    source: str  # "local", the peer's node id, or "fallback"
    t_ms: float  # since the fetch began: when the chunk was ready in the buffer
    bytes: int = 0  # the chunk's encoded size (its wire bytes when it came from a peer)
    arrived_ms: float | None = None  # since the fetch began: when the receive stage had it
    error: str | None = None  # why a chunk meant to be KV became TEXT


@dataclass(frozen=True)
class End:
    """Every chunk has landed: totals, and each stage's busy time."""

    event: ClassVar[str] = "end"
    found_tokens: int
    kv_tokens: int
    text_tokens: int
    text_ranges: list[list[int]]  # [start, end) of each TEXT chunk
    prefill_from: int  # the model prefills the prompt from here on
    prefill_tokens: int
    levels: list[str]  # per chunk, in order
    bytes: int  # wire bytes received from peers
    deadline_missed: bool
    errors: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # total_s, receive_s, decode_s, fill_s


@dataclass(frozen=True)
class Failed:
    """The fetch stopped before its end (the daemon is stopping, or an internal error)."""

    event: ClassVar[str] = "error"
    code: str
    message: str


Event = Union[Start, Chunk, End, Failed]
EVENTS: dict[str, type] = {cls.event: cls for cls in (Start, Chunk, End, Failed)}


def to_json(ev: Event) -> dict:
    """The NDJSON object of an event; optional fields that are unset are left out."""
    out = {"event": ev.event}
    for f in dataclasses.fields(ev):
        v = getattr(ev, f.name)
        if v is None and f.default is None:
            continue
        out[f.name] = v
    return out


def from_json(obj: dict) -> Event:
    """The event an NDJSON object stands for. Fields this version does not know are ignored
    (a newer daemon may add some); a missing required field or an unknown event is ValueError."""
    cls = EVENTS.get(obj.get("event")) if isinstance(obj, dict) else None
    if cls is None:
        raise ValueError(f"not a fetch event: {str(obj)[:200]}")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in obj.items() if k in names})
    except TypeError as e:
        raise ValueError(f"{cls.event} event: {e}") from None
