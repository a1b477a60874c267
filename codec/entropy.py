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
# The modelled range ends where the shape's two tails hold this much mass: the rare symbol
# beyond costs 32 raw bits, while every extra symbol in the alphabet slows each decode
# (constriction's categorical searches its CDF).
TAIL_MASS = 1e-4
# Components with alphabets this small are coded two tokens per ANS symbol (the product
# distribution, so the rate is the same): decode cost grows with log(alphabet), so one
# search over A^2 symbols is cheaper than two over A.
PAIR_MAX_ALPHABET = 16


@dataclass
class ComponentModels:
    """The categorical distributions of a block of components, with their ranges."""

    categoricals: list
    half: np.ndarray  # M per component: symbols -M..M map to 0..2M, 2M+1 is the escape
    pairs: list  # the pair model of each component, or None where its alphabet is too large

    def __len__(self) -> int:
        return len(self.categoricals)


def build_models(sigma: np.ndarray, step: np.ndarray, grid: np.ndarray, cdf: np.ndarray) -> ComponentModels:
    """Distributions for components with standard deviations sigma[C] quantized with step[C].

    grid/cdf: the pooled CDF of value/sigma for this block, on an increasing grid.
    """
    sigma = np.maximum(np.asarray(sigma, dtype=np.float64), 1e-12)
    ratio = np.broadcast_to(np.asarray(step, dtype=np.float64), sigma.shape) / sigma
    tails = np.interp(-grid, grid, cdf) + (1.0 - cdf)  # mass beyond |u| for u on the grid
    inside = grid[(grid >= 0) & (tails <= TAIL_MASS)]
    extent = float(inside[0]) if inside.size else float(grid[-1])
    halves = np.clip(np.ceil(extent / ratio), 1, MAX_HALF_ALPHABET).astype(np.int64)
    cats, pairs = [], []
    for r, m in zip(ratio, halves):
        edges = (np.arange(-m, m + 2, dtype=np.float64) - 0.5) * r
        f = np.interp(edges, grid, cdf, left=0.0, right=1.0)
        probs = np.empty(2 * m + 2, dtype=np.float64)
        probs[:-1] = np.diff(f)
        probs[-1] = f[0] + (1.0 - f[-1])  # both tails -> escape
        probs = np.maximum(probs, 0.0) + PROB_FLOOR
        probs /= probs.sum()
        cats.append(constriction.stream.model.Categorical(probs.astype(np.float32), perfect=False))
        if probs.size <= PAIR_MAX_ALPHABET:
            # Radix 16 whatever the alphabet, so pairs split with shifts, for a whole block at once.
            joint = np.zeros((PAIR_MAX_ALPHABET, PAIR_MAX_ALPHABET))
            joint[:probs.size, :probs.size] = np.outer(probs, probs)
            pairs.append(constriction.stream.model.Categorical(joint.reshape(-1).astype(np.float32), perfect=False))
        else:
            pairs.append(None)
    return ComponentModels(cats, halves.astype(np.int32), pairs)


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
    columns = []  # (symbols, models, component) of coded components, in decode order
    flags = []
    for symbols, models in blocks:
        if symbols.shape[1] != len(models):
            raise CodecError(f"block has {symbols.shape[1]} components but {len(models)} models")
        coded = np.any(symbols != 0, axis=0) if symbols.shape[0] else np.zeros(symbols.shape[1], bool)
        flags.append(coded)
        for c in np.flatnonzero(coded):
            columns.append((np.ascontiguousarray(symbols[:, c]), models, c))
    bitmap = np.packbits(np.concatenate(flags) if flags else np.zeros(0, bool), bitorder="little")

    indexed = [_escapes(col, int(models.half[c])) for col, models, c in columns]
    escaped = np.concatenate([e for _, e in indexed]).astype("<i4") if indexed else np.zeros(0, "<i4")
    coder = constriction.stream.stack.AnsCoder()
    # ANS is a stack: encode the last component first, and within a component its odd last
    # token before its pairs, so that decoding runs forwards.
    for (idx, _), (_, models, c) in zip(reversed(indexed), reversed(columns)):
        pair = models.pairs[c]
        if pair is None:
            coder.encode_reverse(idx, models.categoricals[c])
            continue
        n2 = idx.size // 2
        if idx.size % 2:
            coder.encode_reverse(idx[-1:], models.categoricals[c])
        if n2:
            coder.encode_reverse(idx[0:2 * n2:2] * PAIR_MAX_ALPHABET + idx[1:2 * n2:2], pair)
    words = coder.get_compressed().astype("<u4")
    return bitmap.tobytes() + struct.pack("<I", escaped.size) + escaped.tobytes() + words.tobytes()


def decode_blocks(data: bytes | memoryview, blocks: list[tuple[int, ComponentModels]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Inverse of encode_blocks. blocks: (rows N_b, models). Returns, per block, the symbols
    component-major [C_b, N_b] and the mask of components that were coded."""
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
    for rows, models in blocks:
        coded = coded_all[start:start + len(models)]
        start += len(models)
        # Component-major so each decode fills a contiguous row; offsets and escapes are then
        # handled for the whole block at once.
        symbols = np.zeros((len(models), rows), dtype=np.int32)
        n2 = rows // 2
        paired = np.zeros((len(models), n2), dtype=np.int32)
        is_paired = np.zeros(len(models), dtype=bool)
        for c in np.flatnonzero(coded):
            pair = models.pairs[c]
            if pair is None:
                symbols[c] = coder.decode(models.categoricals[c], rows)
                continue
            is_paired[c] = True
            if n2:
                paired[c] = coder.decode(pair, n2)
            if rows % 2:
                symbols[c, -1] = coder.decode(models.categoricals[c], 1)[0]
        if n2 and is_paired.any():
            rows_p = np.flatnonzero(is_paired)
            p = paired[rows_p]
            symbols[rows_p, 0:2 * n2:2] = p >> 4
            symbols[rows_p, 1:2 * n2:2] = p & (PAIR_MAX_ALPHABET - 1)
        half = models.half[:, None]
        esc = (symbols == 2 * half + 1) & coded[:, None]
        symbols -= half * coded[:, None]
        out.append((symbols, coded, esc))
    n_esc_found = sum(int(e.sum()) for _, _, e in out)
    if n_esc_found != escaped.size or not coder.is_empty():
        raise CodecError("substream did not decode to its exact end (damaged or mismatched profile)")
    result = []
    for symbols, coded, esc in out:
        if n_esc_found:
            # Escaped values were written in decode order: component by component.
            k = int(esc.sum())
            symbols[esc] = escaped[:k]
            escaped = escaped[k:]
        result.append((symbols, coded))
    return result
