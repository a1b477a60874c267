"""Lane rANS: the entropy coder of kvstreamd's levels (bitstream transform RANS).

Each component's symbols are coded with a static 16-bit model derived from the profile (the
same distributions as the constriction path, quantized to integers). Components are grouped
into lanes of about LANE_SYMBOLS symbols, each its own rANS stream, so a chunk's lanes decode
independently: one GPU thread each (codec/gpu.py), and a tight C loop on the CPU
(lane_rans.h, built here with the system compiler at first use).

Three implementations of one algorithm, kept equal by tests:
- lane_rans.h through the C library (the CPU path),
- the same header through NVRTC (the GPU path),
- decode_lanes_ref / encode_lanes_ref below: NumPy, vectorised across lanes, each array
  element one GPU thread doing the same 32-bit integer arithmetic in the same order. It is
  also what runs when no C compiler is present (correct, about 100x slower).

Substream layout (after the component bitmap and the escapes, as in entropy.py):
    u32 components per lane | u32 lanes | u32 words per lane[lanes] | u16 words
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import struct
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import entropy
from .errors import CodecError

log = logging.getLogger(__name__)

PROB_BITS = 16
TOTAL = 1 << PROB_BITS
RANS_L = 1 << 16
BUCKET_SHIFT = 8
BUCKETS = 256
LANE_SYMBOLS = 4096  # symbols per lane: 8 bytes of lane overhead per ~1.4 KB at `high`

OK, E_WORDS, E_END, E_SYMBOL, E_SPACE = 0, -1, -2, -3, -4
ERRORS = {E_WORDS: "a lane needs more words than its stream holds",
          E_END: "a lane did not end in the encoder's initial state",
          E_SYMBOL: "a symbol lies outside its model's alphabet",
          E_SPACE: "the output buffer is too small"}

HERE = Path(__file__).parent
SOURCES = (HERE / "lane_rans.h", HERE / "lane_rans.c")


def quantize_probs(probs: np.ndarray) -> np.ndarray:
    """Probabilities [A] (A >= 2) -> cumulative table uint32 [A + 1] with cum[A] = 2^16 and
    every symbol at least 1 (quantize_block's rule for one distribution)."""
    p = np.asarray(probs, dtype=np.float64)
    cum, _ = quantize_block(p, np.array([0, p.size]))
    return cum


def quantize_block(probs: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distributions back to back (distribution c is probs[offsets[c]:offsets[c + 1]], A_c >= 2
    symbols) -> (their cumulative tables uint32 back to back, each A_c + 1 long from 0 to 2^16,
    and where each starts [C]). Every symbol gets at least 1: deterministic integer rounding
    1 + floor(p * (2^16 - A)) of the renormalised p, the remainder to the largest fractional
    parts (ties to the lower symbol). Integer arithmetic across the block, and each
    distribution's float sum taken over its own slice, so a table is the same integers as the
    distribution's alone."""
    offsets = np.asarray(offsets, dtype=np.int64)
    sizes = np.diff(offsets)
    if sizes.size and (sizes.min() < 2 or sizes.max() > TOTAL // 2):
        raise ValueError(f"alphabet of {int(sizes.min() if sizes.min() < 2 else sizes.max())} symbols cannot be "
                         f"coded with {PROB_BITS}-bit probabilities")
    first = offsets[:-1]
    scaled = entropy.per_slice_normalised(np.asarray(probs, dtype=np.float64), offsets) * np.repeat(TOTAL - sizes, sizes)
    base = np.floor(scaled)
    freq = base.astype(np.int64) + 1
    if sizes.size:
        rest = TOTAL - np.add.reduceat(freq, first)
        # each distribution's largest fractions first: a stable sort of each row (padding last)
        width = int(sizes.max())
        if sizes.min() == width:  # no padding needed (every alphabet at its bound, or all alike)
            padded = base - scaled
        else:
            padded = np.full(sizes.size * width, np.inf)
            padded[np.arange(freq.size) + np.repeat(np.arange(sizes.size) * width - first, sizes)] = base - scaled
        order = np.argsort(padded.reshape(sizes.size, width), axis=1, kind="stable")
        freq[np.repeat(first, rest) + order[np.arange(width) < rest[:, None]]] += 1
    # each table: 0, then the running sum of its frequencies
    cum_off = first + np.arange(sizes.size)
    running = np.cumsum(freq)
    cum = np.zeros(freq.size + sizes.size, dtype=np.int64)
    cum[np.arange(freq.size) + np.repeat(np.arange(1, sizes.size + 1), sizes)] = \
        running - np.repeat(np.concatenate([[0], running])[first], sizes)
    assert np.all(cum[cum_off + sizes] == TOTAL)
    return cum.astype(np.uint32), cum_off.astype(np.uint32)


def bucket_table(cum: np.ndarray) -> np.ndarray:
    """uint16 [256]: the symbol holding slot b << 8 for each top byte b."""
    return bucket_tables(np.asarray(cum), np.array([0]), np.array([np.asarray(cum).size - 1]))[0]


def bucket_tables(cum: np.ndarray, cum_off: np.ndarray, alphabet: np.ndarray) -> np.ndarray:
    """uint16 [C, 256]: for each table of quantize_block's (back to back in cum), the symbol
    holding slot b << 8 for each top byte b. Symbol i holds the buckets b with
    cum[i] <= b << 8 < cum[i + 1], ceil(cum[i] / 256) up to ceil(cum[i + 1] / 256): one repeat of
    each table's symbol indices serves the whole block."""
    cum_off = np.asarray(cum_off, dtype=np.int64)
    alphabet = np.asarray(alphabet, dtype=np.int64)
    up = (cum.astype(np.int64) + (1 << BUCKET_SHIFT) - 1) >> BUCKET_SHIFT
    symbol = np.arange(up.size - 1) - np.repeat(cum_off, alphabet + 1)[:-1]  # a table's last entry: its size
    counts = up[1:] - up[:-1]
    keep = symbol < np.repeat(alphabet, alphabet + 1)[:-1]
    return np.repeat(symbol[keep], counts[keep]).astype(np.uint16).reshape(cum_off.size, BUCKETS)


@dataclass
class RansModels:
    """The integer models of a block of components (component c uses model c)."""

    half: np.ndarray  # int32 [C]: symbols -M..M are indices 0..2M, 2M+1 is the escape
    alphabet: np.ndarray  # uint32 [C] = 2M + 2
    cum: np.ndarray  # uint32, every model's table back to back
    cum_off: np.ndarray  # uint32 [C]
    bucket: np.ndarray  # uint16 [C, 256]
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.half)

    @classmethod
    def build(cls, probs: list[np.ndarray], halves: np.ndarray) -> "RansModels":
        """From each component's distribution (a list)."""
        offsets = np.zeros(len(probs) + 1, dtype=np.int64)
        np.cumsum([p.size for p in probs], out=offsets[1:])
        flat = np.concatenate(probs).astype(np.float64) if probs else np.zeros(0)
        return cls.from_block(flat, offsets, halves)

    @classmethod
    def from_block(cls, probs: np.ndarray, offsets: np.ndarray, halves: np.ndarray) -> "RansModels":
        """From a block's distributions back to back (entropy.block_probs's)."""
        cum, cum_off = quantize_block(probs, offsets)
        alphabet = np.diff(np.asarray(offsets, dtype=np.int64)).astype(np.uint32)
        return cls(np.asarray(halves, np.int32), alphabet, cum, cum_off, bucket_tables(cum, cum_off, alphabet))


# -- the C library -------------------------------------------------------------------------

_lib = None
_lib_lock = threading.Lock()
_I64P = ctypes.POINTER(ctypes.c_int64)


def _lib_dirs() -> list[Path]:
    dirs = []
    for var in ("CACHE_DIRECTORY", "XDG_CACHE_HOME"):  # systemd's CacheDirectory=, then XDG
        if os.environ.get(var):
            dirs.append(Path(os.environ[var].split(":")[0]) / ("lib" if var == "CACHE_DIRECTORY" else "kvstreamd/lib"))
    dirs.append(Path.home() / ".cache" / "kvstreamd" / "lib")
    dirs.append(Path(tempfile.gettempdir()) / f"kvstreamd-{os.getuid()}" / "lib")
    return dirs


def _build(flags: list[str]) -> Path:
    cc = os.environ.get("CC", "cc")
    digest = hashlib.blake2b(b"".join(p.read_bytes() for p in SOURCES) + " ".join([cc, *flags]).encode(),
                             digest_size=8).hexdigest()
    errors = []
    for d in _lib_dirs():
        path = d / f"lane_rans-{digest}.so"
        if path.exists():
            return path
        try:
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".lane_rans-{digest}-{os.getpid()}.so"
            res = subprocess.run([cc, *flags, "-o", str(tmp), str(SOURCES[1])], capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-500:]}")
            os.replace(tmp, path)  # several processes may build at once; each rename is whole
            return path
        except (OSError, RuntimeError) as e:
            errors.append(f"{d}: {e}")
    raise RuntimeError("; ".join(errors))


def library():
    """The CPU build of lane_rans.h, or None where it cannot be built (then the NumPy
    reference decodes, slowly, and a warning says so once)."""
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                if os.environ.get("KVSTREAMD_RANS") == "numpy":
                    _lib = False
                    return None
                try:
                    lib = ctypes.CDLL(str(_build(["-O2", "-shared", "-fPIC", "-std=c99"])))
                    for fn in (lib.lane_rans_decode, lib.lane_rans_encode):
                        fn.restype = ctypes.c_int
                    _lib = lib
                except (OSError, RuntimeError) as e:
                    log.warning("lane rANS C library unavailable (%s); using the NumPy reference, "
                                "which is about 100x slower", e)
                    _lib = False
    return _lib or None


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


# -- lanes ------------------------------------------------------------------------------------

@dataclass
class Lanes:
    """The lane layout of one decode or encode call (any number of substreams)."""

    comp_start: np.ndarray  # uint32 [n + 1]: lane l codes components comp_start[l]..comp_start[l+1]
    rows: np.ndarray  # uint32 [n]: symbols per component in lane l
    comp_model: np.ndarray  # uint32: model of each component slot
    out_off: np.ndarray  # int64: where each component slot's symbols start in the output

    def __len__(self) -> int:
        return len(self.rows)


def comps_per_lane(rows: int) -> int:
    return max(1, -(-LANE_SYMBOLS // max(rows, 1)))


def block_lanes(coded_idx: np.ndarray, rows: int, per_lane: int) -> Lanes:
    """Lanes of one substream: its coded components in order, per_lane to a lane, output
    [C, rows] component-major."""
    n = len(coded_idx)
    n_lanes = -(-n // per_lane)
    comp_start = np.minimum(np.arange(n_lanes + 1, dtype=np.int64) * per_lane, n).astype(np.uint32)
    return Lanes(comp_start, np.full(n_lanes, rows, np.uint32), coded_idx.astype(np.uint32),
                 coded_idx.astype(np.int64) * rows)


def decode_lanes(words: np.ndarray, word_start: np.ndarray, lanes: Lanes, models: RansModels,
                 out: np.ndarray) -> tuple[int, int]:
    """Decode every lane into out (int32, flat view used with out_off). Returns (error, lane)."""
    lib = library()
    if lib is None:
        return decode_lanes_ref(words, word_start, lanes, models, out)
    bad = np.zeros(1, np.int64)
    err = lib.lane_rans_decode(ctypes.c_uint32(len(lanes)), _ptr(words), _ptr(word_start), _ptr(lanes.comp_start),
                               _ptr(lanes.rows), _ptr(lanes.comp_model), _ptr(lanes.out_off), _ptr(models.cum),
                               _ptr(models.cum_off), _ptr(models.bucket), _ptr(models.alphabet), _ptr(out), _ptr(bad))
    return err, int(bad[0])


def encode_lanes(sym: np.ndarray, lanes: Lanes, models: RansModels) -> tuple[np.ndarray, np.ndarray]:
    """Encode symbol indices sym (int32, flat) lane by lane. Returns (words per lane uint32,
    the lanes' words back to back uint16)."""
    lib = library()
    if lib is None:
        return encode_lanes_ref(sym, lanes, models)
    n_sym = np.diff(lanes.comp_start.astype(np.int64)) * lanes.rows
    cap = n_sym + 2
    start = np.concatenate([[0], np.cumsum(cap)]).astype(np.int64)
    words = np.empty(int(start[-1]), np.uint16)
    scratch = np.empty(int(cap.max()) if cap.size else 1, np.uint16)
    used = np.zeros(len(lanes), np.int64)
    err = lib.lane_rans_encode(ctypes.c_uint32(len(lanes)), _ptr(sym), _ptr(start), _ptr(lanes.comp_start),
                               _ptr(lanes.rows), _ptr(lanes.comp_model), _ptr(lanes.out_off), _ptr(models.cum),
                               _ptr(models.cum_off), _ptr(models.alphabet), _ptr(words), _ptr(scratch), _ptr(used))
    if err:
        raise CodecError(f"lane rANS encoder: {ERRORS.get(err, err)}")
    keep = np.concatenate([words[s:s + u] for s, u in zip(start[:-1].tolist(), used.tolist())]) if len(lanes) else words[:0]
    return used.astype(np.uint32), keep


# -- the NumPy reference: one array element per GPU thread ------------------------------------

def _lane_steps(lanes: Lanes):
    """Per lane: symbol count; and a function giving, for step t of every lane, the
    component slot and the position within it."""
    cs = lanes.comp_start.astype(np.int64)
    rows = lanes.rows.astype(np.int64)
    length = (cs[1:] - cs[:-1]) * rows
    safe_rows = np.maximum(rows, 1)

    def at(t: int):
        slot = cs[:-1] + t // safe_rows
        return np.minimum(slot, max(len(lanes.comp_model) - 1, 0)), t % safe_rows
    return length, at


def decode_lanes_ref(words: np.ndarray, word_start: np.ndarray, lanes: Lanes, models: RansModels,
                     out: np.ndarray) -> tuple[int, int]:
    """lane_rans.h's rans_decode_lane, every lane at once: step t decodes each lane's t-th
    symbol with the same 32-bit arithmetic (held in uint64 so nothing wraps unseen)."""
    n = len(lanes)
    if n == 0:
        return OK, 0
    words = words.astype(np.uint64)
    ws = word_start.astype(np.int64)
    nw = ws[1:] - ws[:-1]
    length, at = _lane_steps(lanes)
    err = np.where(nw < 2, E_WORDS, OK).astype(np.int64)
    live = err == OK
    x = np.zeros(n, np.uint64)
    x[live] = words[ws[:-1][live]] | (words[ws[:-1][live] + 1] << np.uint64(16))
    p = ws[:-1] + 2
    cum = models.cum.astype(np.int64)
    cum_off = models.cum_off.astype(np.int64)
    bucket = models.bucket.astype(np.int64)
    flat = out.reshape(-1)
    for t in range(int(length.max()) if n else 0):
        act = live & (t < length)
        if not act.any():
            break
        slot_c, i = at(t)
        m = lanes.comp_model[slot_c].astype(np.int64)
        base = cum_off[m]
        slot = (x & np.uint64(0xFFFF)).astype(np.int64)
        s = bucket[m, slot >> BUCKET_SHIFT]
        while True:  # the forward scan, lanes that are done stand still
            adv = act & (cum[base + s + 1] <= slot)
            if not adv.any():
                break
            s = s + adv
        lo = cum[base + s]
        y = (cum[base + s + 1] - lo).astype(np.uint64) * (x >> np.uint64(16)) + (slot - lo).astype(np.uint64)
        need = act & (y < RANS_L)
        short = need & (p >= ws[1:])
        err[short] = E_WORDS
        live &= ~short
        need &= ~short
        safe_p = np.where(need, p, 0)
        y = np.where(need, (y << np.uint64(16)) | words[safe_p], y)
        p = p + need
        act &= ~short
        x = np.where(act, y, x)
        flat[lanes.out_off[slot_c[act]] + i[act]] = s[act]
    end = live & ((x != RANS_L) | (p != ws[1:]))
    err[end] = E_END
    bad = np.flatnonzero(err != OK)
    return (int(err[bad[0]]), int(bad[0])) if bad.size else (OK, 0)


def encode_lanes_ref(sym: np.ndarray, lanes: Lanes, models: RansModels) -> tuple[np.ndarray, np.ndarray]:
    """rans_encode_lane, every lane at once, from each lane's last symbol to its first."""
    n = len(lanes)
    if n == 0:
        return np.zeros(0, np.uint32), np.zeros(0, np.uint16)
    length, at = _lane_steps(lanes)
    cap = int(length.max()) + 2
    buf = np.zeros((n, cap), np.uint16)
    p = np.full(n, cap, np.int64)
    x = np.full(n, RANS_L, np.uint64)
    cum = models.cum.astype(np.int64)
    cum_off = models.cum_off.astype(np.int64)
    flat = sym.reshape(-1)
    rows_idx = np.arange(n)
    for t in range(cap - 3, -1, -1):
        act = t < length
        slot_c, i = at(t)
        m = lanes.comp_model[slot_c].astype(np.int64)
        s = np.where(act, flat[np.where(act, lanes.out_off[slot_c] + i, 0)], 0).astype(np.int64)
        if np.any(act & ((s < 0) | (s >= models.alphabet[m]))):
            raise CodecError(f"lane rANS encoder: {ERRORS[E_SYMBOL]}")
        lo = cum[cum_off[m] + s]
        f = (cum[cum_off[m] + s + 1] - lo).astype(np.uint64)
        emit = act & (x >= (f << np.uint64(16)))
        p = p - emit
        buf[rows_idx[emit], p[emit]] = (x[emit] & np.uint64(0xFFFF)).astype(np.uint16)
        x = np.where(emit, x >> np.uint64(16), x)
        x = np.where(act, ((x // f) << np.uint64(16)) + (x % f) + lo.astype(np.uint64), x)
    buf[rows_idx, p - 1] = (x >> np.uint64(16)).astype(np.uint16)
    buf[rows_idx, p - 2] = (x & np.uint64(0xFFFF)).astype(np.uint16)
    p -= 2
    used = (cap - p).astype(np.uint32)
    return used, np.concatenate([buf[l, p[l]:] for l in range(n)])


# -- one substream ------------------------------------------------------------------------------

def encode_block(symbols: np.ndarray, models: RansModels) -> bytes:
    """symbols [N, C] int32 (signed) -> substream bytes."""
    n, c = symbols.shape
    if c != len(models):
        raise CodecError(f"block has {c} components but {len(models)} models")
    cols = np.ascontiguousarray(symbols.T)  # [C, N], component-major like the decoder's output
    coded = np.any(cols != 0, axis=1) if n else np.zeros(c, bool)
    half = models.half[:, None]
    idx = cols + half
    out_of_range = (idx < 0) | (idx > 2 * half)
    escaped = cols[out_of_range].astype("<i4")  # component by component, tokens in order
    if escaped.size:
        idx = np.where(out_of_range, 2 * half + 1, idx)
    idx = np.ascontiguousarray(idx, dtype=np.int32)
    per_lane = comps_per_lane(n)
    lanes = block_lanes(np.flatnonzero(coded), n, per_lane)
    used, words = encode_lanes(idx, lanes, models)
    return b"".join([entropy.write_head(coded, escaped), struct.pack("<II", per_lane, len(lanes)),
                     used.astype("<u4").tobytes(), words.astype("<u2").tobytes()])


@dataclass
class Block:
    """One parsed substream: what decoding it needs, its words not yet decoded."""

    coded: np.ndarray  # bool [C]
    escaped: np.ndarray  # int32: raw values of the escapes, in decode order
    lanes: Lanes
    word_start: np.ndarray  # int64 [lanes + 1], into words
    words: np.ndarray  # uint16


def parse_block(data: bytes | memoryview, rows: int, n_comp: int) -> Block:
    """Validate a substream's tables against its size; raises CodecError naming what is off."""
    data = memoryview(data).cast("B")
    coded, escaped, pos = entropy.read_head(data, n_comp, rest=8)
    per_lane, n_lanes = struct.unpack_from("<II", data, pos)
    pos += 8
    coded_idx = np.flatnonzero(coded)
    # Any lane size decodes (the encoder's choice, comps_per_lane, may be retuned); the count must fit it.
    if per_lane < 1 or n_lanes != -(-coded_idx.size // per_lane):
        raise CodecError(f"substream has {n_lanes} lanes of {per_lane} components for {coded_idx.size} "
                         f"coded components of {rows} rows")
    if 4 * n_lanes > len(data) - pos:
        raise CodecError("substream truncated inside its lane table")
    lane_words = np.frombuffer(data[pos:pos + 4 * n_lanes], "<u4").astype(np.int64)
    pos += 4 * n_lanes
    word_start = np.zeros(n_lanes + 1, np.int64)
    np.cumsum(lane_words, out=word_start[1:])
    if 2 * int(word_start[-1]) != len(data) - pos:
        raise CodecError(f"substream's lanes hold {2 * int(word_start[-1])} bytes of words, "
                         f"{len(data) - pos} follow")
    words = np.frombuffer(data[pos:], "<u2")
    return Block(coded, escaped, block_lanes(coded_idx, rows, per_lane), word_start, words)


def decode_block(data: bytes | memoryview, rows: int, models: RansModels,
                 out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Substream bytes -> (symbols [C, rows] int32 signed, coded mask [C]); the symbols are
    written into out (C-contiguous int32 [C, rows]) where one is given."""
    c = len(models)
    b = parse_block(data, rows, c)
    symbols = np.empty((c, rows), dtype=np.int32) if out is None else out
    if not b.coded.all():
        symbols[~b.coded] = 0
    if len(b.lanes):
        words = b.words if b.words.flags.aligned else b.words.copy()
        err, lane = decode_lanes(words, b.word_start, b.lanes, models, symbols)
        if err:
            raise CodecError(f"substream lane {lane}: {ERRORS.get(err, err)} (damaged or mismatched profile)")
    finish(symbols, b.coded, models.half, b.escaped)
    return symbols, b.coded


def finish(symbols: np.ndarray, coded: np.ndarray, half: np.ndarray, escaped: np.ndarray) -> None:
    """Symbol indices [C, rows] -> signed values in place, escapes filled from `escaped`
    (written component by component, tokens in order)."""
    rows = symbols.shape[1]
    top = 2 * half + 1
    n_found = 0
    if rows:
        maybe = np.flatnonzero(coded & (symbols.max(axis=1) >= top))
        if maybe.size:
            hit = symbols[maybe] == top[maybe, None]
            n_found = int(hit.sum())
            if n_found == escaped.size:
                sub = symbols[maybe]
                sub[hit] = escaped + half[maybe, None].repeat(rows, 1)[hit]
                symbols[maybe] = sub
    if n_found != escaped.size:
        raise CodecError(f"substream holds {escaped.size} escaped values for {n_found} escape symbols")
    symbols -= (half * coded).astype(np.int32)[:, None]
