"""Entropy coding with constriction's ANS: one categorical distribution per component
(per (layer, K/V, channel or PCA component)), taken from the profile rather than shipped
with each chunk.

A component's distribution is the profile's pooled shape CDF for its (layer, K/V), scaled
by the component's standard deviation and integrated over the quantizer's bins. Symbols
outside the modelled range take an escape symbol and travel raw, so nothing is clipped.
Components whose symbols are all zero in a chunk are flagged in a bitmap and cost nothing
to decode, which is where most of the decode speed at the coarser levels comes from.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import constriction
import numpy as np

from .errors import CodecError

MAX_HALF_ALPHABET = 1023  # symbols -M..M plus one escape; wider ranges escape
PROB_FLOOR = 1e-7  # every symbol, the escape included, stays encodable


@dataclass
class ComponentModels:
    """The categorical distributions of a block of components, with their ranges."""

    categoricals: list
    half: np.ndarray  # M per component: symbols -M..M map to 0..2M, 2M+1 is the escape

    def __len__(self) -> int:
        return len(self.categoricals)


def build_models(sigma: np.ndarray, step: np.ndarray, grid: np.ndarray, cdf: np.ndarray) -> ComponentModels:
    """Distributions for components with standard deviations sigma[C] quantized with step[C].

    grid/cdf: the pooled CDF of value/sigma for this block, on an increasing grid.
    """
    sigma = np.maximum(np.asarray(sigma, dtype=np.float64), 1e-12)
    ratio = np.broadcast_to(np.asarray(step, dtype=np.float64), sigma.shape) / sigma
    extent = float(grid[-1])
    halves = np.clip(np.ceil(extent / ratio), 1, MAX_HALF_ALPHABET).astype(np.int64)
    cats = []
    for r, m in zip(ratio, halves):
        edges = (np.arange(-m, m + 2, dtype=np.float64) - 0.5) * r
        f = np.interp(edges, grid, cdf, left=0.0, right=1.0)
        probs = np.empty(2 * m + 2, dtype=np.float64)
        probs[:-1] = np.diff(f)
        probs[-1] = f[0] + (1.0 - f[-1])  # both tails -> escape
        probs = np.maximum(probs, 0.0) + PROB_FLOOR
        probs /= probs.sum()
        cats.append(constriction.stream.model.Categorical(probs.astype(np.float32), perfect=False))
    return ComponentModels(cats, halves.astype(np.int32))


def _escapes(column: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray]:
    idx = column + half
    out = (idx < 0) | (idx > 2 * half)
    if out.any():
        idx = idx.copy()
        idx[out] = 2 * half + 1
        return idx.astype(np.int32, copy=False), column[out]
    return idx.astype(np.int32, copy=False), column[:0]


def encode_blocks(blocks: list[tuple[np.ndarray, ComponentModels]]) -> bytes:
    """blocks: (symbols [N_b, C_b] int32, models for the C_b components). One substream.

    Layout: bitmap of coded components (all blocks, in order), u32 escape count, the
    escaped values as int32, then the ANS words.
    """
    columns = []  # (symbols, categorical, half) of coded components, in decode order
    flags = []
    for symbols, models in blocks:
        if symbols.shape[1] != len(models):
            raise CodecError(f"block has {symbols.shape[1]} components but {len(models)} models")
        coded = np.any(symbols != 0, axis=0) if symbols.shape[0] else np.zeros(symbols.shape[1], bool)
        flags.append(coded)
        for c in np.flatnonzero(coded):
            columns.append((np.ascontiguousarray(symbols[:, c]), models.categoricals[c], int(models.half[c])))
    bitmap = np.packbits(np.concatenate(flags) if flags else np.zeros(0, bool), bitorder="little")

    indexed = [_escapes(col, half) for col, _, half in columns]
    escaped = np.concatenate([e for _, e in indexed]).astype("<i4") if indexed else np.zeros(0, "<i4")
    coder = constriction.stream.stack.AnsCoder()
    # ANS is a stack: encode the last component first so decoding runs in order.
    for (idx, _), (_, cat, _) in zip(reversed(indexed), reversed(columns)):
        coder.encode_reverse(idx, cat)
    words = coder.get_compressed().astype("<u4")
    return bitmap.tobytes() + struct.pack("<I", escaped.size) + escaped.tobytes() + words.tobytes()


def decode_blocks(data: bytes | memoryview, blocks: list[tuple[int, ComponentModels]]) -> list[np.ndarray]:
    """Inverse of encode_blocks. blocks: (rows N_b, models). Returns the symbol matrices."""
    data = memoryview(data)
    n_comp = sum(len(m) for _, m in blocks)
    nbitmap = (n_comp + 7) // 8
    if len(data) < nbitmap + 4:
        raise CodecError(f"substream of {len(data)} bytes is shorter than its bitmap and escape count")
    coded_all = np.unpackbits(np.frombuffer(data[:nbitmap], np.uint8), count=n_comp, bitorder="little").astype(bool)
    (n_esc,) = struct.unpack_from("<I", data, nbitmap)
    pos = nbitmap + 4
    if n_esc * 4 > len(data) - pos:
        raise CodecError(f"substream claims {n_esc} escaped symbols but holds {len(data) - pos} bytes")
    escaped = np.frombuffer(data[pos:pos + 4 * n_esc], "<i4")
    pos += 4 * n_esc
    if (len(data) - pos) % 4:
        raise CodecError("substream's ANS payload is not a whole number of 32-bit words")
    words = np.frombuffer(data[pos:], "<u4").astype(np.uint32)
    try:
        coder = constriction.stream.stack.AnsCoder(words)
    except ValueError as e:
        raise CodecError(f"substream's ANS payload is invalid: {e}") from None

    out = []
    start = 0
    esc_used = 0
    for rows, models in blocks:
        coded = coded_all[start:start + len(models)]
        start += len(models)
        symbols = np.zeros((rows, len(models)), dtype=np.int32)
        for c in np.flatnonzero(coded):
            half = int(models.half[c])
            idx = coder.decode(models.categoricals[c], rows)
            col = idx - half
            esc = idx == 2 * half + 1
            if esc.any():
                k = int(esc.sum())
                if esc_used + k > escaped.size:
                    raise CodecError("substream decodes more escaped symbols than it carries")
                col[esc] = escaped[esc_used:esc_used + k]
                esc_used += k
            symbols[:, c] = col
        out.append(symbols)
    if esc_used != escaped.size or not coder.is_empty():
        raise CodecError("substream did not decode to its exact end (damaged or mismatched profile)")
    return out
