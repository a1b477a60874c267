"""A stored chunk cut down to some of its profile's layers, for a fetch that needs only those
(a hybrid model's sliding layers outside the window of the prefix the caller will use).

A chunk bitstream keeps each (layer, K/V) substream apart, so cutting one is a new header over
the same bytes (bitstream.select); a baseline frame (fp16, int8, ...) is decoded, cut and coded
again, as its header does not list layers: its rows are the layers asked for, in order."""
from __future__ import annotations

from . import baselines, bitstream as bs
from .errors import CodecError


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
