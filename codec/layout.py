"""Which tokens each layer of a model holds, and the KV of a prefix laid out that way.

A full-attention layer holds every token of a prefix; a sliding-window layer (Gemma-2/3's
local layers, Mistral's window) attends to the last W tokens only, so that is all a model's
cache keeps of it, and all a fetch needs to move. `Layout` says it per layer (from a profile's
`layer_windows`), `PrefixKV` is the KV of an n-token prefix in that shape: one tensor per group
of layers that hold the same token range. A model whose layers all hold every token has one
group, the `[L, 2, n, H, D]` tensor of before (`PrefixKV.dense()`).

Stores keep every layer of every chunk (any prefix of a stored context can be asked for);
what a fetch of an n-token prefix moves of chunk [s, e) is `Layout.chunk_layers(s, e, n)`."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def needed_from(window: int | None, n: int) -> int:
    """The first of an n-token prefix's tokens a layer with `window` reads (None: all of them)."""
    return 0 if window is None else max(0, n - window + 1)


@dataclass(frozen=True)
class Group:
    """Layers that hold the same tokens: every token (window None) or the last `window`."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    windows: tuple[int | None, ...]  # per layer: None (every token) or its window

    @classmethod
    def dense(cls, layers: int) -> "Layout":
        return cls((None,) * layers)

    @property
    def layers(self) -> int:
        return len(self.windows)

    @property
    def is_dense(self) -> bool:
        return all(w is None for w in self.windows)

    def groups(self) -> list[Group]:
        """Full-attention layers first, then each window, smallest first; layers in order."""
        keys = sorted(set(self.windows), key=lambda w: (w is not None, w or 0))
        return [Group(w, tuple(i for i, x in enumerate(self.windows) if x == w)) for w in keys]

    def first_token(self, window: int | None, n: int, chunk_tokens: int | None = None) -> int:
        """The first token of an n-token prefix a layer with `window` needs: a query attends to
        itself and the window - 1 tokens before it, which is what a model's cache keeps. With
        chunk_tokens, rounded down to its chunk's start (fetches move whole chunks)."""
        first = needed_from(window, n)
        return first if chunk_tokens is None else first - first % chunk_tokens

    def chunk_layers(self, start: int, end: int, n: int) -> tuple[int, ...]:
        """The layers whose tokens of an n-token prefix overlap chunk [start, end)."""
        return tuple(i for i, w in enumerate(self.windows) if end > needed_from(w, n))

    def token_layers(self, n: int, chunk_tokens: int | None = None) -> int:
        """Token-layers an n-token prefix holds (whole chunks where chunk_tokens is given)."""
        return sum(len(g.layers) * (n - self.first_token(g.window, n, chunk_tokens)) for g in self.groups())


@dataclass
class Part:
    """One group's KV: tokens [start, start + kv.shape[2]) of its layers, `[Lg, 2, T, H, D]`."""

    layers: tuple[int, ...]
    start: int
    kv: torch.Tensor
    window: int | None = None  # the layers' window (None: they attend to every token)
    # Tokens of free space after kv's last token, per head, in the heads-first tensor kv views
    # (PrefixKV.empty_heads_first(room=...)): a model's cache made on this part appends the
    # tokens run after the prefix there, in place (models.cache_from_kv). 0: none, or kv views
    # a tensor whose next rows hold tokens of its own.
    room: int = 0


@dataclass
class PrefixKV:
    """The KV of a `tokens`-token prefix: per group of layers, the token range they hold."""

    tokens: int
    parts: list[Part]

    @classmethod
    def from_dense(cls, kv: torch.Tensor, layout: Layout | None = None, chunk_tokens: int | None = None) -> "PrefixKV":
        """Views of a `[L, 2, n, H, D]` tensor that holds every layer's every token, each
        windowed group cut to the tokens it needs (copies for groups of scattered layers)."""
        n = kv.shape[2]
        layout = layout or Layout.dense(kv.shape[0])
        parts = []
        for g in layout.groups():
            first = layout.first_token(g.window, n, chunk_tokens)
            idx = list(g.layers)
            sel = kv[idx[0]:idx[-1] + 1] if idx == list(range(idx[0], idx[-1] + 1)) else kv[idx]
            parts.append(Part(g.layers, first, sel[:, :, first:], g.window))
        return cls(n, parts)

    @property
    def layers(self) -> int:
        return sum(len(p.layers) for p in self.parts)

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].kv.dtype

    @property
    def device(self) -> torch.device:
        return self.parts[0].kv.device

    @property
    def nbytes(self) -> int:
        return sum(p.kv.numel() * p.kv.element_size() for p in self.parts)

    def layer(self, i: int) -> tuple[int, torch.Tensor]:
        """(first token, `[2, T, H, D]`) of layer i."""
        for p in self.parts:
            if i in p.layers:
                return p.start, p.kv[p.layers.index(i)]
        raise IndexError(f"layer {i} is not in this prefix's KV")

    def dense(self) -> torch.Tensor:
        """The `[L, 2, n, H, D]` tensor, where every layer holds every token (no copy for one
        group); ValueError where some layers hold only a window."""
        if len(self.parts) == 1 and self.parts[0].start == 0:
            return self.parts[0].kv
        if any(p.start for p in self.parts):
            raise ValueError("some layers of this KV hold only their window of the prefix: use the parts")
        first = self.parts[0].kv
        out = torch.empty((self.layers, *first.shape[1:]), dtype=first.dtype, device=first.device)
        for p in self.parts:
            out[list(p.layers)] = p.kv
        return out

    def to(self, device=None, dtype=None, copy: bool = False) -> "PrefixKV":
        return PrefixKV(self.tokens, [Part(p.layers, p.start, p.kv.to(device=device, dtype=dtype, copy=copy), p.window)
                                      for p in self.parts])

    def empty_heads_first(self, device=None, dtype=None, room: int = 0, empty=torch.empty) -> "PrefixKV":
        """A PrefixKV of this one's parts, uninitialised, laid out heads-first in memory
        (`[Lg, 2, H, T, D]`, seen as `[Lg, 2, T, H, D]` like any part): the layout transformers'
        caches hold, so that a model's cache can take the tensors as they are
        (models.cache_from_kv(..., copy=False)) rather than copy them once more. `room`: tokens
        of space left after each head's rows (Part.room), where that cache appends the tokens
        run after the prefix rather than copy the whole prefix into a longer tensor at each step.
        `empty(shape, dtype=, device=)` makes each part's tensor (torch.empty, or memory kept
        for reuse: models.host_memory)."""
        if room < 0:
            raise ValueError(f"room for {room} tokens")
        parts = []
        for p in self.parts:
            L, _, T, H, D = p.kv.shape
            hf = empty((L, 2, H, T + room, D), dtype=dtype or p.kv.dtype, device=device or p.kv.device)
            parts.append(Part(p.layers, p.start, hf[:, :, :, :T].permute(0, 1, 3, 2, 4), p.window, room))
        return PrefixKV(self.tokens, parts)

    def copy_tokens_(self, src: "PrefixKV", start: int, end: int, serial: bool = False) -> None:
        """Tokens [start, end) of src (of the same parts) into this one: each part takes those it
        holds. `serial`: on the calling thread alone (copy_serial_), for copies made beside
        other busy processes."""
        copy = copy_serial_ if serial else torch.Tensor.copy_
        for d, s in zip(self.parts, src.parts):
            lo, hi = max(start, d.start) - d.start, min(end, self.tokens) - d.start
            if hi > lo:
                copy(d.kv[:, :, lo:hi], s.kv[:, :, lo:hi])

    def copy_heads_first(self, device=None, dtype=None, room: int = 0) -> "PrefixKV":
        """A copy, heads-first (empty_heads_first)."""
        out = self.empty_heads_first(device, dtype, room)
        out.copy_tokens_(self, 0, self.tokens)
        return out

    def prefix(self, n: int) -> "PrefixKV":
        """The KV of the first n tokens: views (with the parts' room where n is every token,
        none where the rows after the n-th hold tokens). ValueError where a windowed group does
        not hold the tokens the shorter prefix needs of it."""
        if not 0 < n <= self.tokens:
            raise ValueError(f"a prefix of {n} tokens of a {self.tokens}-token KV")
        parts = []
        for p in self.parts:
            need = needed_from(p.window, n)
            if p.start > need:
                raise ValueError(f"layers {list(p.layers)} hold tokens from {p.start}; a {n}-token prefix "
                                 f"needs them from {need}")
            parts.append(Part(p.layers, p.start, p.kv[:, :, :n - p.start], p.window,
                              p.room if n == self.tokens else 0))
        return PrefixKV(n, parts)


# torch splits a CPU copy of more elements than this among its threads (at::internal::GRAIN_SIZE)
SERIAL_ELEMENTS = 32768


def copy_serial_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), on the calling thread alone: in pieces torch copies without its thread
    pool. A model process copying a fetched chunk at a time out of the daemon's buffer does so
    beside the daemon's codec workers; a pooled copy's idle thread then spins between chunks
    (OpenMP's wait), and at 1000 Mbit/s that spinning took ~100 ms of the two cores' time from
    the decode in a 0.35 s fetch (16 chunks copied pooled: 180 ms of the process's CPU time; in
    pieces: 70 ms; docs/benchmarks.md). A tensor off the CPU is copied whole."""
    if dst.device.type != "cpu" or src.device.type != "cpu" or dst.numel() <= SERIAL_ELEMENTS:
        dst.copy_(src)
        return
    inner = dst[0].numel()
    if inner > SERIAL_ELEMENTS:
        for i in range(dst.shape[0]):
            copy_serial_(dst[i], src[i])
        return
    step = SERIAL_ELEMENTS // max(inner, 1)
    for i in range(0, dst.shape[0], step):
        dst[i:i + step].copy_(src[i:i + step])


def fetch_parts(layout: Layout, n: int, chunk_tokens: int) -> list[dict]:
    """The parts a fetch of an n-token prefix fills, in buffer order: per group its layers, its
    first token (its window's first chunk) and window. What the start event tells a client."""
    return [{"layers": list(g.layers), "start": layout.first_token(g.window, n, chunk_tokens), "window": g.window}
            for g in layout.groups()]


def parts_numel(parts: list[dict], n: int, heads: int, head_dim: int) -> int:
    return sum(len(p["layers"]) * 2 * (n - p["start"]) * heads * head_dim for p in parts)


def over(flat: torch.Tensor, parts: list[dict], n: int, heads: int, head_dim: int) -> PrefixKV:
    """A PrefixKV of views into `flat` (1-D, parts_numel elements): the parts back to back, each
    `[len(layers), 2, n - start, H, D]`."""
    out, offset = [], 0
    for p in parts:
        shape = (len(p["layers"]), 2, n - int(p["start"]), heads, head_dim)
        size = shape[0] * shape[1] * shape[2] * heads * head_dim
        out.append(Part(tuple(int(x) for x in p["layers"]), int(p["start"]), flat[offset:offset + size].view(shape),
                        p.get("window")))
        offset += size
    if offset > flat.numel():
        raise ValueError(f"{flat.numel()} elements do not hold parts of {offset}")
    return PrefixKV(n, out)
