"""A stored chunk cut down to some of its profile's layers, for a fetch that needs only those
(a hybrid model's sliding layers outside the window of the prefix the caller will use).

A chunk bitstream keeps each (layer, K/V) substream apart, so cutting one is a new header over
the same bytes (bitstream.select); a baseline frame (fp16, int8, ...) is decoded, cut and coded
again, as its header does not list layers: its rows are the layers asked for, in order."""
from __future__ import annotations

from . import baselines, bitstream as bs
from .errors import CodecError


def selected_size(data: bytes | memoryview, layers: tuple[int, ...]) -> int:
    """The size select_layers(data, layers) will have, read from the header (exact for a chunk
    bitstream; for a baseline frame, its size in proportion to the layers kept), without
    building it: what a sender prices a level with before it chooses."""
    if bytes(data[:4]) == bs.MAGIC:
        h = bs.unpack(data, check_crc=False)
        where = {layer: i for i, layer in enumerate(h.held_layers())}
        rows = [where[x] for x in layers if x in where]
        if len(rows) == h.layers:
            return len(data)
        subs = sum(len(h.substreams[2 * r + kv]) for r in rows for kv in range(2))
        return bs.packed_size(len(rows), len(h.sink) // h.layers * len(rows), subs, subset=True)
    _, shape, _ = baselines.header(data)
    return len(data) * len(layers) // shape[0]


def select_layers(data: bytes | memoryview, layers: tuple[int, ...]) -> bytes:
    """`data` (a chunk holding every layer of its profile) holding only `layers` (increasing)."""
    layers = tuple(int(x) for x in layers)
    if bytes(data[:4]) == bs.MAGIC:
        return bs.select(data, layers)
    code, shape, _ = baselines.header(data)
    if layers == tuple(range(shape[0])):
        return bytes(data)
    if not layers or layers[-1] >= shape[0] or any(b <= a for a, b in zip(layers, layers[1:])):
        raise CodecError(f"cannot select layers {list(layers)} of a {shape[0]}-layer chunk")
    scheme = next(s for s in baselines.SCHEMES.values() if s.code == code)
    return scheme.encode(scheme.decode(bytes(data))[list(layers)].contiguous())
