"""The chunk bitstream: a fixed header, the per-(layer, K/V) step table, an index of
independent substreams, the exact sink rows, the substreams, and a CRC32 trailer.

    magic "KVSC" | u16 version | u16 transforms | u8 level | u8 dtype | u16 L | u16 H | u16 D
    | u32 T | u32 start | 16s profile id | u8 anchor group | u8 sink tokens | u16 substreams
    | [u16 profile layer[L], where LAYER_SUBSET] | f32 steps[L*2]
    | [u32 bytes | zlib(u8 token class[L, T - sink tokens]), where TOKEN_STEPS] | f32 anchor step
    | u32 sink bytes | u32 substream bytes[n] | sink | substreams | u32 crc32(everything before)

All integers little-endian. Substream s holds the chunk's layer s // 2, K (s even) or V (s odd).
A chunk holds every layer of its profile, or (LAYER_SUBSET) the profile layers it lists: what
a fetch of a hybrid model's prefix moves for chunks outside its sliding layers' window.
`select` cuts such a chunk out of a whole one without decoding anything.
TOKEN_STEPS: each token of a layer has a class, its step that of its stream times
2**(class / 2) (codec/steps.py; the classes: codec/tuning/token_steps.py); each of the layer's
two substreams is then a u32 length and a lane rANS block per class present in the layer, in
class order, a block holding the class's tokens in token order.
Transform bits say how the chunk was made: keys un-rotated, PCA, anchor/delta, exact sink
rows, and which entropy coder wrote the substreams -- RANS: lane rANS (codec/rans.py, what the
levels use), else constriction's ANS (codec/entropy.py; chunks stored before lane rANS, and
CacheGen's paper configuration). A decoder that meets a bit it does not know refuses the chunk.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import CodecError

MAGIC = b"KVSC"
VERSION = 1

UNROTATE_KEYS = 1
PCA = 2
DELTA = 4
SINK = 8
RANS = 16  # entropy coder: lane rANS (codec/rans.py); without it, constriction's ANS
LAYER_SUBSET = 32  # the chunk holds only the profile layers it lists
TOKEN_STEPS = 64  # per-(layer, token) step classes (codec/steps.py, codec/tuning/token_steps.py)
KNOWN_TRANSFORMS = UNROTATE_KEYS | PCA | DELTA | SINK | RANS | LAYER_SUBSET | TOKEN_STEPS
TOP_CLASS = 6  # the coarsest token class: steps x 2**(6/2) = 8 (codec/steps.py)

# The dtypes a chunk's KV may be in, by their code in a header: the one list of them, which the
# daemon's API, its shared-memory buffers and the client name by DTYPE_NAMES ("float16", ...).
DTYPES = {1: torch.float16, 2: torch.bfloat16, 3: torch.float32}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
DTYPE_NAMES = {v: str(v).removeprefix("torch.") for v in DTYPES.values()}

_FIXED = struct.Struct("<4sHHBBHHHII16sBBH")
MAX_TOKENS = 1 << 20


@dataclass
class Header:
    transforms: int
    level: int
    dtype: torch.dtype
    layers: int
    heads: int
    head_dim: int
    tokens: int
    start: int
    profile_id: bytes
    group: int
    sink_tokens: int
    steps: np.ndarray  # [L, 2] float32
    anchor_step: float
    sink: memoryview  # raw rows of the sink tokens, in dtype
    substreams: list[memoryview]
    layer_ids: tuple[int, ...] | None = None  # the profile layers held; None: all of them, in order
    token_classes: np.ndarray | None = None  # uint8 [L, T - sink_tokens] where TOKEN_STEPS
    _blocks: dict = field(default_factory=dict, repr=False, compare=False)

    def class_blocks(self, layer: int) -> list[tuple[int, np.ndarray]]:
        """class_blocks of a layer's token classes, made once per chunk (both its streams read them)."""
        if layer not in self._blocks:
            self._blocks[layer] = class_blocks(self.token_classes[layer])
        return self._blocks[layer]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.heads, self.head_dim)

    def held_layers(self) -> tuple[int, ...]:
        return self.layer_ids if self.layer_ids is not None else tuple(range(self.layers))


def sink_rows(start: int, sink_tokens: int, tokens: int, transforms: int) -> int:
    """How many of a chunk's first rows travel exact: those of the profile's sink tokens
    (positions below sink_tokens) that the chunk holds, where the SINK transform is on."""
    return min(max(0, sink_tokens - start), tokens) if transforms & SINK else 0


def packed_size(layers: int, sink_bytes: int, substream_bytes: int, subset: bool, classes_bytes: int = 0) -> int:
    """The size pack() gives a chunk of `layers` layers with these sections (classes_bytes:
    the zlib'd token classes, where it has them)."""
    return (_FIXED.size + (2 * layers if subset else 0) + 8 * layers + (4 + classes_bytes if classes_bytes else 0)
            + 8 + 8 * layers + sink_bytes + substream_bytes + 4)


def class_blocks(classes: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """A layer's token classes [n] -> (class, its tokens' rows) for each class present, in class
    order: the blocks each of the layer's substreams holds under TOKEN_STEPS."""
    return [(int(c), np.flatnonzero(classes == c)) for c in np.unique(classes)]


def split_classes(data: bytes | memoryview, count: int) -> list[memoryview]:
    """A TOKEN_STEPS substream -> its `count` blocks (u32 length, block, ...)."""
    data = memoryview(data).cast("B")
    out, pos = [], 0
    for _ in range(count):
        if pos + 4 > len(data):
            raise CodecError("substream truncated inside its class blocks")
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + n > len(data):
            raise CodecError("substream's class block runs past its end")
        out.append(data[pos:pos + n])
        pos += n
    if pos != len(data):
        raise CodecError(f"substream holds {len(data) - pos} bytes after its class blocks")
    return out


def join_classes(blocks: list[bytes]) -> bytes:
    """split_classes's inverse."""
    return b"".join(struct.pack("<I", len(b)) + b for b in blocks)


def pack(h: Header) -> bytes:
    transforms = h.transforms & ~(LAYER_SUBSET | TOKEN_STEPS) | (LAYER_SUBSET if h.layer_ids is not None else 0) \
        | (TOKEN_STEPS if h.token_classes is not None else 0)
    fixed = _FIXED.pack(MAGIC, VERSION, transforms, h.level, DTYPE_CODES[h.dtype], h.layers,
                        h.heads, h.head_dim, h.tokens, h.start, h.profile_id, h.group,
                        h.sink_tokens, len(h.substreams))
    lengths = np.array([len(s) for s in h.substreams], dtype="<u4")
    ids = np.array(h.layer_ids, "<u2").tobytes() if h.layer_ids is not None else b""
    classes = b""
    if h.token_classes is not None:
        packed = zlib.compress(np.ascontiguousarray(h.token_classes, np.uint8).tobytes(), 6)
        classes = struct.pack("<I", len(packed)) + packed
    parts = [fixed, ids, np.asarray(h.steps, "<f4").tobytes(), classes, struct.pack("<fI", h.anchor_step, len(h.sink)),
             lengths.tobytes(), bytes(h.sink), *h.substreams]
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


def unpack(data: bytes | bytearray | memoryview, check_crc: bool = True) -> Header:
    """Parse and validate a chunk bitstream; raises CodecError naming what is wrong.
    check_crc=False only where this very buffer was checked already (the pool's workers)."""
    data = memoryview(data).cast("B")
    if len(data) < 4 or bytes(data[:4]) != MAGIC:
        raise CodecError("not a kvstreamd chunk bitstream (bad magic)")
    if len(data) < _FIXED.size + 4:
        raise CodecError(f"bitstream truncated: {len(data)} bytes, the header alone needs {_FIXED.size + 4}")
    (_, version, transforms, level, dtype_code, layers, heads, head_dim, tokens, start, profile_id,
     group, sink_tokens, n_sub) = _FIXED.unpack_from(data, 0)
    if version != VERSION:
        raise CodecError(f"bitstream format version {version} is not supported (this codec reads {VERSION})")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    if check_crc and zlib.crc32(data[:-4]) != crc:
        raise CodecError("bitstream checksum mismatch: the data is damaged or truncated")
    if transforms & ~KNOWN_TRANSFORMS:
        raise CodecError(f"bitstream uses unknown transforms 0x{transforms:x}")
    if dtype_code not in DTYPES:
        raise CodecError(f"bitstream has unknown dtype code {dtype_code}")
    if not (0 < tokens <= MAX_TOKENS) or 0 in (layers, heads, head_dim):
        raise CodecError(f"bitstream has an impossible shape L={layers} H={heads} D={head_dim} T={tokens}")
    if n_sub != 2 * layers:
        raise CodecError(f"bitstream has {n_sub} substreams for {layers} layers (expected {2 * layers})")
    if transforms & DELTA and transforms & RANS:
        raise CodecError("bitstream combines anchor/delta with lane rANS, which codes only single blocks")
    if transforms & DELTA and group < 2:
        raise CodecError(f"bitstream uses anchor/delta with group size {group}")
    pos = _FIXED.size
    layer_ids = None
    if transforms & LAYER_SUBSET:
        if len(data) < pos + 2 * layers + 4:
            raise CodecError("bitstream truncated inside its layer list")
        layer_ids = tuple(int(x) for x in np.frombuffer(data[pos:pos + 2 * layers], "<u2"))
        if any(b <= a for a, b in zip(layer_ids, layer_ids[1:])):
            raise CodecError(f"bitstream's layer list {list(layer_ids)} is not increasing")
        pos += 2 * layers
    need = pos + 8 * layers + 8 + 4 * n_sub + 4
    if len(data) < need:
        raise CodecError(f"bitstream truncated inside its tables ({len(data)} < {need} bytes)")
    steps = np.frombuffer(data[pos:pos + 8 * layers], "<f4").reshape(layers, 2).astype(np.float32)
    pos += 8 * layers
    token_classes = None
    if transforms & TOKEN_STEPS:
        if not transforms & RANS or transforms & DELTA:
            raise CodecError("bitstream has token steps without lane rANS")
        (clen,) = struct.unpack_from("<I", data, pos)
        if len(data) < pos + 4 + clen + 8 + 4 * n_sub + 4:
            raise CodecError("bitstream truncated inside its token classes")
        rows = tokens - min(sink_tokens, tokens)
        inflate = zlib.decompressobj()
        try:  # never more than the classes can be, plus one byte to tell a longer stream: no zlib bomb
            raw = inflate.decompress(bytes(data[pos + 4:pos + 4 + clen]), layers * rows + 1)
        except zlib.error as e:
            raise CodecError(f"bitstream's token classes are damaged: {e}") from None
        if len(raw) > layers * rows:
            raise CodecError(f"bitstream's token classes inflate past the {layers * rows} bytes of "
                             f"{layers} x {rows} tokens")
        if len(raw) != layers * rows or not inflate.eof:
            raise CodecError(f"bitstream's token classes hold {len(raw)} bytes for {layers} x {rows} tokens")
        token_classes = np.frombuffer(raw, np.uint8).reshape(layers, rows)
        if token_classes.size and int(token_classes.max()) > TOP_CLASS:
            raise CodecError(f"bitstream has token class {int(token_classes.max())} (the top is {TOP_CLASS})")
        pos += 4 + clen
    anchor_step, sink_len = struct.unpack_from("<fI", data, pos)
    pos += 8
    lengths = np.frombuffer(data[pos:pos + 4 * n_sub], "<u4").astype(np.int64)
    pos += 4 * n_sub
    if not np.all(np.isfinite(steps)) or np.any(steps <= 0):
        raise CodecError("bitstream's step table holds non-positive or non-finite steps")
    if pos + sink_len + int(lengths.sum()) + 4 != len(data):
        raise CodecError("bitstream's substream index does not match its length")
    sink = data[pos:pos + sink_len]
    pos += sink_len
    subs = []
    for n in lengths:
        subs.append(data[pos:pos + n])
        pos += int(n)
    return Header(transforms, level, DTYPES[dtype_code], layers, heads, head_dim, tokens, start,
                  bytes(profile_id), group, sink_tokens, steps, float(anchor_step), sink, subs, layer_ids,
                  token_classes)


def select(data: bytes | memoryview, layers: tuple[int, ...]) -> bytes:
    """The chunk `data` cut down to the profile layers `layers` (increasing; all held by it):
    the same substreams and sink rows, a new header and CRC, nothing decoded or re-coded.
    Returns `data` itself (as bytes) where it holds exactly those layers."""
    h = unpack(data)
    held = h.held_layers()
    layers = tuple(int(x) for x in layers)
    if layers == held:
        return bytes(data)
    where = {layer: i for i, layer in enumerate(held)}
    missing = [x for x in layers if x not in where]
    if missing or not layers or any(b <= a for a, b in zip(layers, layers[1:])):
        raise CodecError(f"cannot select layers {list(layers)} from a chunk holding {list(held)}")
    rows = [where[x] for x in layers]
    sink = b""
    if len(h.sink):  # [L, 2, sink rows, H, D] raw: a layer's rows lie together
        sink = np.frombuffer(h.sink, np.uint8).reshape(h.layers, -1)[rows].tobytes()
    subs = [h.substreams[2 * r + kv] for r in rows for kv in range(2)]
    cut = Header(h.transforms, h.level, h.dtype, len(rows), h.heads, h.head_dim, h.tokens, h.start, h.profile_id,
                 h.group, h.sink_tokens, h.steps[rows], h.anchor_step, memoryview(sink), subs, layers,
                 None if h.token_classes is None else h.token_classes[rows])
    return pack(cut)
