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
from dataclasses import dataclass, field

import numpy as np
import torch

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
    # What the decoder derives once from these models and keeps with them (_pair_runs).
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.categoricals)


def component_probs(sigma: np.ndarray, step: np.ndarray, grid: np.ndarray,
                    cdf: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The alphabet half-widths M [C] and distributions (float64 [2M + 2], escape last) of
    components with standard deviations sigma[C] quantized with step[C].

    grid/cdf: the pooled CDF of value/sigma for this block, on an increasing grid.
    """
    halves, probs, offsets = block_probs(sigma, step, grid, cdf)
    return halves, [probs[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def block_probs(sigma: np.ndarray, step: np.ndarray, grid: np.ndarray,
                cdf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """component_probs for a whole block at once: (halves [C], every distribution back to back
    (float64), offsets [C + 1]: component c's is probs[offsets[c]:offsets[c + 1]]).

    Component c's distribution integrates the CDF over its bins, edges (i - M - 0.5) * ratio for
    i = 0..2M + 1: the mass between neighbouring edges, both tails in the escape, a floor under
    every symbol, normalised. Every step is elementwise except each component's own sum, which
    is taken over its own slice, so a distribution is bit for bit what it is computed alone
    (entropy tables must be the same integers in every process and version that codes a chunk).
    """
    sigma = np.maximum(np.asarray(sigma, dtype=np.float64), 1e-12)
    ratio = np.broadcast_to(np.asarray(step, dtype=np.float64), sigma.shape) / sigma
    tails = np.interp(-grid, grid, cdf) + (1.0 - cdf)  # mass beyond |u| for u on the grid
    inside = grid[(grid >= 0) & (tails <= TAIL_MASS)]
    extent = float(inside[0]) if inside.size else float(grid[-1])
    halves = np.clip(np.ceil(extent / ratio), 1, MAX_HALF_ALPHABET).astype(np.int64)
    sizes = 2 * halves + 2
    offsets = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    first, last = offsets[:-1], offsets[1:] - 1
    index = np.arange(offsets[-1], dtype=np.int64) - np.repeat(first + halves, sizes)  # -M..M+1 in each
    f = np.interp((index.astype(np.float64) - 0.5) * np.repeat(ratio, sizes), grid, cdf, left=0.0, right=1.0)
    probs = np.empty_like(f)
    probs[:-1] = np.diff(f)
    probs[last] = f[first] + (1.0 - f[last])  # both tails -> escape
    probs = np.maximum(probs, 0.0) + PROB_FLOOR
    return halves, per_slice_normalised(probs, offsets), offsets


def per_slice_normalised(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """values with each slice offsets[c]:offsets[c + 1] divided by its own sum (the sum NumPy
    gives that slice alone: a sum over padded rows may round differently)."""
    add = np.add.reduce
    sums = np.array([add(values[a:b]) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())])
    return values / np.repeat(sums, np.diff(offsets))


def build_models(sigma: np.ndarray, step: np.ndarray, grid: np.ndarray, cdf: np.ndarray) -> ComponentModels:
    """constriction's distributions for components with standard deviations sigma[C]
    quantized with step[C] (see component_probs)."""
    import constriction  # here, not at import: hosts that only see lane-rANS chunks need not have it

    halves, dists = component_probs(sigma, step, grid, cdf)
    cats, pairs = [], []
    for probs in dists:
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


def write_head(coded: np.ndarray, escaped: np.ndarray) -> bytes:
    """The head of a substream, shared by both entropy coders: the bitmap of coded components,
    u32 escape count, the escaped values (int32, in decode order)."""
    return (np.packbits(coded, bitorder="little").tobytes() + struct.pack("<I", escaped.size)
            + escaped.astype("<i4").tobytes())


def read_head(data: memoryview, n_comp: int, rest: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """write_head's inverse: (coded [n_comp], escaped values, where the rest starts), checking
    that at least `rest` bytes follow."""
    nbitmap = (n_comp + 7) // 8
    if len(data) < nbitmap + 4:
        raise CodecError(f"substream of {len(data)} bytes is shorter than its bitmap and escape count")
    coded = np.unpackbits(np.frombuffer(data[:nbitmap], np.uint8), count=n_comp, bitorder="little").astype(bool)
    (n_esc,) = struct.unpack_from("<I", data, nbitmap)
    pos = nbitmap + 4
    if n_esc * 4 + rest > len(data) - pos:
        raise CodecError(f"substream claims {n_esc} escaped symbols but holds {len(data) - pos} bytes")
    return coded, np.frombuffer(data[pos:pos + 4 * n_esc], "<i4"), pos + 4 * n_esc


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

    indexed = [_escapes(col, int(models.half[c])) for col, models, c in columns]
    escaped = np.concatenate([e for _, e in indexed]).astype("<i4") if indexed else np.zeros(0, "<i4")
    import constriction

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
    return write_head(np.concatenate(flags) if flags else np.zeros(0, bool), escaped) + words.tobytes()


def decode_blocks(data: bytes | memoryview, blocks: list[tuple[int, ComponentModels]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Inverse of encode_blocks. blocks: (rows N_b, models). Returns, per block, the symbols
    component-major [C_b, N_b] and the mask of components that were coded."""
    data = memoryview(data)
    coded_all, escaped, pos = read_head(data, sum(len(m) for _, m in blocks))
    if (len(data) - pos) % 4:
        raise CodecError("substream's ANS payload is not a whole number of 32-bit words")
    words = np.frombuffer(data[pos:], "<u4").astype(np.uint32)
    import constriction

    try:
        coder = constriction.stream.stack.AnsCoder(words)
    except ValueError as e:
        raise CodecError(f"substream's ANS payload is invalid: {e}") from None

    out = []
    start = 0
    n_esc_found = 0
    for rows, models in blocks:
        coded = coded_all[start:start + len(models)]
        start += len(models)
        symbols, esc = _decode_block(coder, rows, models, coded)
        n_esc_found += esc[0].size
        out.append((symbols, coded, esc))
    if n_esc_found != escaped.size or not coder.is_empty():
        raise CodecError("substream did not decode to its exact end (damaged or mismatched profile)")
    result = []
    k = 0
    for symbols, coded, esc in out:
        if esc[0].size:
            # Escaped values were written in decode order: component by component, tokens in order.
            symbols[esc] = escaped[k:k + esc[0].size]
            k += esc[0].size
        result.append((symbols, coded))
    return result


def _pair_runs(models: ComponentModels) -> list[tuple[int, int]]:
    """[lo, hi) ranges of consecutive components coded in pairs (a few per stream: small
    alphabets go with the low-variance components)."""
    runs = models.derived.get("pair_runs")
    if runs is None:
        paired = np.array([p is not None for p in models.pairs] + [False])
        edges = np.flatnonzero(np.diff(np.concatenate([[False], paired]).astype(np.int8)))
        runs = models.derived["pair_runs"] = [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]
    return runs


def _decode_block(coder, rows: int, models: ComponentModels,
                  coded: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """One block's coded components from the coder, in order. Returns the symbols [C, rows]
    (offset back to signed values, zero rows for uncoded components, escapes not yet filled
    in) and the (component, token) positions of the escapes in the order their raw values
    were written."""
    n_models = len(models)
    n2, odd = divmod(rows, 2)
    symbols = np.empty((n_models, rows), dtype=np.int32)
    pair_syms = np.empty((n_models, n2), dtype=np.int32)  # rows of the paired components only
    if not coded.all():
        symbols[~coded] = 0
        pair_syms[~coded] = 0  # splits into two zeros
    cats, pairs = models.categoricals, models.pairs
    decode = coder.decode
    odd_rows, odd_syms = [], []
    # The decoder's only Python-level work per component: one call and one row copy each.
    for c in np.flatnonzero(coded).tolist():
        pair = pairs[c]
        if pair is None:
            symbols[c] = decode(cats[c], rows)
            continue
        if n2:
            pair_syms[c] = decode(pair, n2)
        if odd:
            odd_rows.append(c)
            odd_syms.append(decode(cats[c]))
    if n2:
        # Split the pairs of each run of paired components straight into their rows.
        for lo, hi in _pair_runs(models):
            np.right_shift(pair_syms[lo:hi], 4, out=symbols[lo:hi, 0:2 * n2:2])
            np.bitwise_and(pair_syms[lo:hi], PAIR_MAX_ALPHABET - 1, out=symbols[lo:hi, 1:2 * n2:2])
    if odd_rows:
        symbols[odd_rows, rows - 1] = odd_syms
    if not rows:
        return symbols, (np.zeros(0, np.intp), np.zeros(0, np.intp))
    half = models.half
    top = 2 * half + 1  # the escape symbol; nothing above it is valid, so row maxima find escapes
    maybe = np.flatnonzero(coded & (symbols.max(axis=1) >= top))
    comp, tok = np.divmod(np.flatnonzero(symbols[maybe] == top[maybe, None]), rows)  # the written order
    torch.from_numpy(symbols).sub_(torch.from_numpy((half * coded).astype(np.int32)[:, None]))
    return symbols, (maybe[comp], tok)
