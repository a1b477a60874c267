"""Framing: a 4-byte big-endian length, then one msgpack map. Encoding hands large binary
values through uncopied; decoding takes arbitrary byte slices and yields whole frames."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import msgpack

from .messages import BAD_FRAME, FRAME_TOO_LARGE, ProtocolError, Text, to_wire

DEFAULT_MAX_FRAME_BYTES = 128 * 2**20  # a raw fp16 4096-token chunk of a small model fits
LENGTH_BYTES = 4
_INLINE_BIN = 64 * 1024  # binary values at least this big are referenced, not copied
# msgpack builds a Python object per element, 8-60 bytes for a 1-byte one (4 MiB of empty arrays
# took 300 MiB), so what one frame may hold is bounded, not only its length: every message's
# arrays are flat and short (keys, tokens, levels), and only HELLO's caps nest.
MAX_ARRAY_ITEMS = 1 << 16  # the longest array: FETCH/ADVERTISE keys, TEXT tokens
MAX_MAP_ITEMS = 64
MAX_CONTAINERS = 16  # arrays and maps in a frame over SMALL_FRAME_BYTES (the handshake's own cap)
SMALL_FRAME_BYTES = 64 * 1024


def _bin_header(n: int) -> bytes:
    if n < 2**8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 2**16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def encode_parts(fields: dict[str, Any]) -> tuple[list[bytes | memoryview], int]:
    """One frame as a list of buffers (to join or writelines) and its total size. Large
    bytes values are appended as they are, so the only copy of a payload is the final join."""
    packer = msgpack.Packer(use_bin_type=True)  # one per call: a Packer is not thread-safe
    parts: list[bytes | memoryview] = [b"", packer.pack_map_header(len(fields))]
    small: list[bytes] = []
    for k, v in fields.items():
        if isinstance(v, memoryview):
            v = v.cast("B")  # lengths below count bytes, not items
        if isinstance(v, (bytes, bytearray, memoryview)) and len(v) >= _INLINE_BIN:
            small.append(packer.pack(k))
            small.append(_bin_header(len(v)))
            parts.append(b"".join(small))
            parts.append(v)
            small = []
        else:
            small.append(packer.pack(k))
            small.append(packer.pack(v))
    parts.append(b"".join(small))
    body = sum(len(p) for p in parts)
    parts[0] = body.to_bytes(LENGTH_BYTES, "big")
    return parts, LENGTH_BYTES + body


def encode_frame(fields: dict[str, Any]) -> bytes:
    """One frame as bytes (length prefix included)."""
    return b"".join(encode_parts(fields)[0])


def text_wire_bytes(tokens: Sequence[int], req: int = 0, i: int = 0) -> int:
    """What a TEXT of these token ids costs on the wire: its whole frame, length prefix
    included, which is what the fetcher's ACK reports as recv_bytes. Exact, since it is the
    encoding itself: msgpack spends 1 byte on an id below 128, 2 below 256, 3 below 65,536
    and 5 above, plus about 25 bytes of prefix, map and field names (req and i: 1-5 each)."""
    return encode_parts(to_wire(Text(req, i, list(tokens))))[1]


def text_wire_bytes_for(n: int, vocab: int) -> int:
    """A TEXT of `n` token ids from a vocabulary of `vocab` when the ids are not known: every id
    as wide as the largest (vocab - 1), so no list of n such ids costs more."""
    return text_wire_bytes([vocab - 1] * n)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not allowed")


class _Containers:
    """Counts the arrays and maps msgpack has built so far, and stops it past `limit`: inner
    ones are built first, so a frame of many small containers is refused after a few."""

    def __init__(self, limit: int):
        self.left = limit

    def __call__(self, obj: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ValueError(f"more than {MAX_CONTAINERS} arrays and maps in one frame")
        return obj


class FrameDecoder:
    """Buffers byte slices and hands out whole frames as (map, wire size) pairs.
    After an error it is dead: every later call raises the same ProtocolError."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes  # may be changed between frames
        self._buf = bytearray()
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a whole frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        """Add received bytes; call next_frame() until it returns None."""
        if self._error is None:
            self._buf += data

    def next_frame(self) -> tuple[dict, int] | None:
        """The next whole frame and its wire size, or None until more bytes arrive.
        Raises ProtocolError FRAME_TOO_LARGE (seen from the length alone) or BAD_FRAME."""
        if self._error is not None:
            raise self._error
        buf = self._buf
        if len(buf) < LENGTH_BYTES:
            return None
        n = int.from_bytes(buf[:LENGTH_BYTES], "big")
        if n > self.max_frame_bytes:
            # decided on the prefix alone, so a hostile length never makes us buffer its body
            return self._fail(FRAME_TOO_LARGE,
                              f"frame of {n} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
        end = LENGTH_BYTES + n
        if len(buf) < end:
            return None
        with memoryview(buf) as view, view[LENGTH_BYTES:end] as body:
            hook = _Containers(MAX_CONTAINERS) if n > SMALL_FRAME_BYTES else None
            try:
                obj = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True,
                                      ext_hook=_reject_ext, timestamp=0, max_array_len=MAX_ARRAY_ITEMS,
                                      max_map_len=MAX_MAP_ITEMS, list_hook=hook, object_hook=hook)
            except Exception as e:  # msgpack raises many types for bad input; all mean the same
                return self._fail(BAD_FRAME, f"{n}-byte frame is not valid msgpack: {e}")
        # bytearray drops a prefix in O(1), so consuming frames one by one stays linear
        del buf[:end]
        if type(obj) is not dict:
            return self._fail(BAD_FRAME, f"frame holds a msgpack {type(obj).__name__}, not a map")
        return obj, end

    def __iter__(self) -> Iterator[tuple[dict, int]]:
        """Every whole frame buffered so far."""
        while (frame := self.next_frame()) is not None:
            yield frame

    def _fail(self, code: str, msg: str) -> None:
        self._error = ProtocolError(code, msg)
        self._buf = bytearray()
        raise self._error
