"""What passes between a fetch's three stages (node/fetch.py): a chunk on its way (`Item`), the
time a stage was busy (`Busy`), and what the fetch reports when it ends (`FetchResult`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class Busy:
    """The seconds during which at least one of a stage's overlapping jobs ran (`with busy:`)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._active = 0
        self._since = 0.0

    def __enter__(self) -> None:
        if not self._active:
            self._since = time.perf_counter()
        self._active += 1

    def __exit__(self, *exc) -> None:
        self._active -= 1
        if not self._active:
            self.total += time.perf_counter() - self._since


@dataclass
class Item:
    """One chunk between the stages: received (payload), decoded (kv, or staged on a device),
    filled."""

    i: int
    kind: str  # "kv": to decode and fill; "text": tokens the model recomputes
    level: str
    source: str  # "local", a peer's node id, or "fallback"
    payload: bytes | None = None
    arrived: float = 0.0
    error: str | None = None
    kv: torch.Tensor | None = None  # decoded on the CPU: [layers the chunk holds, 2, T, H, D]
    on_device: object = None  # codec.gpu.Staged: decoded on the device, filled on its fill stream
    nbytes: int = 0  # wire bytes of the chunk (payload, or the TEXT's whole frame: frames.text_wire_bytes)
    staged: object = None  # codec.gpu.Staged: parsed and uploaded on the receive stream
    filled: bool = False  # decoded straight into the buffer: nothing for the fill stage to copy


@dataclass
class FetchResult:
    events: int = 0
    levels: list[str] = field(default_factory=list)  # of each chunk, in prompt order
    bytes: int = 0
    errors: list[str] = field(default_factory=list)
    deadline_missed: bool = False
    stage_s: dict[str, float] = field(default_factory=lambda: {"receive": 0.0, "decode": 0.0, "fill": 0.0})
