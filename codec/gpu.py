"""What only a GPU decode needs: the lane-rANS entropy decode of a whole batch of chunks at
once, and the pipeline's three CUDA streams (CudaStages).

The entropy decode runs one CUDA thread per lane: the kernel is lane_rans.h -- the very
source the CPU library is built from -- compiled by NVRTC through CuPy, in a variant whose
store writes the dequantizer's input (the signed value as float32, NaN for an escape) so that
decode and dequantize are one pass; the escapes are then filled in order. The inverse
transforms that follow are codec/decoder.py's, the same on every device.

LaneDecoder on device "cpu" runs the same batching with the C library standing in for the
kernel, so everything here but the kernel launch is exercised on machines without a GPU
(tests/codec/test_gpu.py); the kernel itself is checked on a GPU by scripts/gpu_check.sh.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from . import bitstream as bs, rans
from .decoder import Batch, Decoder
from .errors import CodecError
from .profile import Profile

THREADS = 128  # per block; a lane per thread

_PRELUDE = r"""
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned short uint16_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#define RANS_FN __device__ __forceinline__
"""
# Decode fused with the dequantizer's first step: symbol index -> signed value, escape -> NaN.
_FLOAT_STORE = r"""
#define RANS_OUT_T float
#define RANS_STORE(s, a) ((s) + 1u == (a) ? __int_as_float(0x7fc00000) \
                                          : (float)((int32_t)(s) - (int32_t)(((a) - 2u) >> 1)))
"""
_KERNEL = r"""
extern "C" __global__ void lane_rans_decode(uint32_t n_lanes, const uint16_t *words,
    const int64_t *word_start, const uint32_t *comp_start, const uint32_t *rows,
    const uint32_t *comp_model, const int64_t *out_off, const uint32_t *cum,
    const uint32_t *cum_off, const uint16_t *bucket, const uint32_t *alphabet,
    RANS_OUT_T *out, int32_t *status)
{
    uint32_t l = blockIdx.x * blockDim.x + threadIdx.x;
    if (l >= n_lanes)
        return;
    int64_t w0 = word_start[l], w1 = word_start[l + 1];
    uint32_t c0 = comp_start[l];
    status[l] = (w1 < w0 || w1 - w0 > 0xFFFFFFFFll)
        ? RANS_E_WORDS
        : rans_decode_lane(words + w0, (uint32_t)(w1 - w0), comp_model + c0, out_off + c0,
                           comp_start[l + 1] - c0, rows[l], cum, cum_off, bucket, alphabet, out);
}
"""


def kernel_source(float_out: bool) -> str:
    """The CUDA source of the decode kernel: float_out fuses the dequantizer's first step."""
    return _PRELUDE + (_FLOAT_STORE if float_out else "") + rans.SOURCES[0].read_text() + _KERNEL


def available() -> tuple[bool, str]:
    """(True, "") where a CUDA device and CuPy are both there, else (False, why not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return False, f"CuPy is not installed ({e})"
    return True, ""


class Kernels:
    """The decode kernel's two variants for one device, compiled on first use."""

    def __init__(self, device: torch.device):
        self.device = device
        self._compiled: dict[bool, object] = {}

    def get(self, float_out: bool):
        if float_out not in self._compiled:
            import cupy

            with cupy.cuda.Device(self.device.index or 0):
                module = cupy.RawModule(code=kernel_source(float_out))
                self._compiled[float_out] = module.get_function("lane_rans_decode")
        return self._compiled[float_out]


def _as_signed(a: np.ndarray) -> torch.Tensor:
    """torch has no uint32/uint16 arithmetic to speak of; the kernel reads the same bits."""
    kind = {np.dtype(np.uint32): np.int32, np.dtype(np.uint16): np.int16}.get(a.dtype)
    return torch.from_numpy(np.ascontiguousarray(a).view(kind) if kind else np.ascontiguousarray(a))


# -- the models of one step table, all streams back to back -------------------------------------

@dataclass
class LaneTables:
    """Every (layer, K/V) stream's rANS models for one step table: model s * C + c is
    component c of stream s = 2 * layer + k_or_v. A Decoder keeps one per step table."""

    models: rans.RansModels
    half: torch.Tensor  # float32 [2L, C, 1] on the device
    device: dict = field(default_factory=dict)  # name -> tensor on the device


# -- a batch -------------------------------------------------------------------------------------

@dataclass
class _Chunk:
    header: bs.Header
    sym_base: int  # where its [2L, C, n] symbols start in the batch's flat buffer
    group: int  # index into Prepared.groups, or -1: not lane-coded (the decoder's CPU path takes it)
    coded: np.ndarray | None = None  # bool [2L, C]


@dataclass
class _Group:
    tables: LaneTables
    lanes: rans.Lanes
    word_start: np.ndarray  # int64 [lanes + 1], into words
    lane_where: np.ndarray  # int64 [lanes, 2]: (chunk, stream) of each lane, for error messages
    words: np.ndarray  # uint16: its lanes' words, back to back
    device: dict = field(default_factory=dict)  # the lane arrays on the device


@dataclass
class Prepared:
    """A batch's lanes parsed on the host and uploaded: what the entropy decode needs."""

    chunks: list[_Chunk]
    groups: list[_Group]
    escaped: torch.Tensor  # float32: every escape's raw value, in the flat buffer's order
    n_sym: int


class LaneDecoder:
    """The entropy decode of a batch of lane-rANS chunks on `device`: the kernel on a GPU,
    the C library standing in for it on the CPU. Owned by a codec.decoder.Decoder, which
    keeps its LaneTables and runs the inverse transforms on what it decodes."""

    def __init__(self, profile: Profile, device: str | torch.device = "cuda"):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            ok, why = available()
            if not ok:
                raise RuntimeError(f"GPU decode unavailable: {why}")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        self.profile = profile
        self.kernels = Kernels(self.device) if self.device.type == "cuda" else None

    # -- host side --------------------------------------------------------------------------
    def tables(self, steps: np.ndarray) -> LaneTables:
        """Every stream's models of one step table, back to back (and on the device)."""
        p = self.profile
        per = [p.rans_models(layer, kv, float(steps[layer, kv])) for layer in range(p.layers) for kv in range(2)]
        sizes = np.array([m.cum.size for m in per], np.int64)
        base = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        models = rans.RansModels(
            half=np.concatenate([m.half for m in per]),
            alphabet=np.concatenate([m.alphabet for m in per]),
            cum=np.concatenate([m.cum for m in per]),
            cum_off=np.concatenate([m.cum_off.astype(np.int64) + b for m, b in zip(per, base)]).astype(np.uint32),
            bucket=np.concatenate([m.bucket for m in per]))
        C = len(per[0])
        t = LaneTables(models, torch.from_numpy(models.half.astype(np.float32)).view(2 * p.layers, C, 1).to(self.device))
        if self.device.type == "cuda":
            for name in ("cum", "cum_off", "bucket", "alphabet"):
                t.device[name] = _as_signed(getattr(models, name)).to(self.device)
        return t

    def prepare(self, headers: list[bs.Header], tables: list[LaneTables | None]) -> Prepared:
        """Parse the lane tables of validated chunks (tables[i] None: chunk i is not
        lane-coded) on the host and upload their words."""
        p = self.profile
        C = p.heads * p.head_dim
        out_chunks: list[_Chunk] = []
        groups: dict[int, dict] = {}
        esc_parts: list[np.ndarray] = []
        n_sym = 0
        for i, (h, t) in enumerate(zip(headers, tables)):
            n = h.tokens - h.sink_tokens
            if t is None:
                out_chunks.append(_Chunk(h, n_sym, -1))
                continue
            # One group per step table (a fetch mixes levels); each with its own words, so that
            # its lanes lie back to back: lane l reads words[ws[l]:ws[l + 1]].
            g = groups.setdefault(id(t), {"tables": t, "index": len(groups), "lanes": [], "starts": [],
                                          "words": [], "n_words": 0, "where": []})
            coded = np.zeros((2 * p.layers, C), bool)
            for s in range(2 * p.layers):
                try:
                    b = rans.parse_block(h.substreams[s], n, C)
                except CodecError as e:
                    raise CodecError(f"chunk {i} stream {s}: {e}") from None
                coded[s] = b.coded
                ln = b.lanes
                g["lanes"].append(rans.Lanes(ln.comp_start, ln.rows, ln.comp_model + np.uint32(s * C),
                                             ln.out_off + (n_sym + s * C * n)))
                g["starts"].append(b.word_start[:-1] + g["n_words"])
                g["where"].append(np.tile(np.array([i, s], np.int64), (len(ln), 1)))
                g["words"].append(b.words)
                g["n_words"] += b.words.size
                esc_parts.append(b.escaped)
            out_chunks.append(_Chunk(h, n_sym, g["index"], coded=coded))
            n_sym += 2 * p.layers * C * n
        built = [self._group(g) for g in sorted(groups.values(), key=lambda g: g["index"])]
        escaped = np.concatenate(esc_parts).astype(np.float32) if esc_parts else np.zeros(0, np.float32)
        return Prepared(out_chunks, built, torch.from_numpy(escaped).to(self.device), n_sym)

    def _group(self, g: dict) -> _Group:
        ws = np.append(np.concatenate(g["starts"]), g["n_words"]).astype(np.int64)
        words = np.concatenate(g["words"])
        grp = _Group(g["tables"], _concat_lanes(g["lanes"]), ws, np.concatenate(g["where"]), words)
        if self.device.type == "cuda":
            for name in ("comp_start", "rows", "comp_model", "out_off"):
                grp.device[name] = _as_signed(getattr(grp.lanes, name)).to(self.device, non_blocking=True)
            grp.device["word_start"] = torch.from_numpy(ws).to(self.device, non_blocking=True)
            host = torch.from_numpy(words.view(np.int16))
            pinned = torch.empty(host.shape, dtype=torch.int16, pin_memory=True)
            pinned.copy_(host)
            grp.device["words"] = pinned.to(self.device, non_blocking=True)
        return grp

    # -- device side ------------------------------------------------------------------------
    def entropy_decode(self, prep: Prepared, float_out: bool) -> torch.Tensor:
        """The flat symbol buffer: float32 values (NaN at escapes) or int32 indices."""
        dtype = torch.float32 if float_out else torch.int32
        flat = torch.zeros(prep.n_sym, dtype=dtype, device=self.device)
        for gi, g in enumerate(prep.groups):
            n = len(g.lanes)
            if n == 0:
                continue
            if self.device.type == "cuda":
                status = self._launch(g, flat, float_out)
                bad = torch.nonzero(status).flatten()
                if bad.numel():
                    lane = int(bad[0])
                    err = int(status[lane])
                else:
                    err = rans.OK
            else:
                out = flat.numpy() if not float_out else np.zeros(prep.n_sym, np.int32)
                err, lane = rans.decode_lanes(g.words, g.word_start, g.lanes, g.tables.models, out)
                if float_out and not err:
                    self._to_values(prep, gi, torch.from_numpy(out), flat)
            if err:
                chunk, stream = (int(v) for v in g.lane_where[lane])
                raise CodecError(f"chunk {chunk} stream {stream}: {rans.ERRORS.get(err, err)} "
                                 "(damaged or mismatched profile)")
        return flat

    def _launch(self, g: _Group, out: torch.Tensor, float_out: bool) -> torch.Tensor:
        import cupy

        n = len(g.lanes)
        status = torch.empty(n, dtype=torch.int32, device=self.device)
        t = g.tables.device
        kernel = self.kernels.get(float_out)
        with cupy.cuda.ExternalStream(torch.cuda.current_stream(self.device).cuda_stream):
            args = [cupy.asarray(a) for a in (g.device["words"], g.device["word_start"], g.device["comp_start"], g.device["rows"],
                                              g.device["comp_model"], g.device["out_off"], t["cum"], t["cum_off"],
                                              t["bucket"], t["alphabet"], out, status)]
            kernel(((n + THREADS - 1) // THREADS,), (THREADS,), (np.uint32(n), *args))
        return status

    def _to_values(self, prep: Prepared, gi: int, idx: torch.Tensor, flat: torch.Tensor) -> None:
        """CPU stand-in for the kernel's float store: index - half, NaN at the escape."""
        p = self.profile
        C = p.heads * p.head_dim
        for c in prep.chunks:
            if c.group != gi:
                continue
            n = c.header.tokens - c.header.sink_tokens
            sl = slice(c.sym_base, c.sym_base + 2 * p.layers * C * n)
            ix = idx[sl].view(2 * p.layers, C, n)
            half = prep.groups[gi].tables.half
            vals = ix.to(torch.float32) - half
            vals[ix == (2 * half + 1).to(torch.int32)] = float("nan")
            vals[~torch.from_numpy(c.coded)] = 0.0
            flat[sl].view(2 * p.layers, C, n).copy_(vals)

    def values(self, prep: Prepared) -> torch.Tensor:
        """The flat buffer of signed values (float32), escapes filled: what the inverse
        transforms take. Holds the batch's one synchronisation (the escape count)."""
        flat = self.entropy_decode(prep, float_out=True)
        esc = torch.isnan(flat)
        n_esc = int(esc.sum())
        if n_esc != prep.escaped.numel():
            raise CodecError(f"batch holds {prep.escaped.numel()} escaped values for {n_esc} escape symbols")
        if n_esc:
            flat[esc] = prep.escaped
        return flat

    def chunk_values(self, prep: Prepared, i: int, flat: torch.Tensor) -> torch.Tensor:
        """Chunk i's values [2L, C, n], a view into values()' buffer."""
        c = prep.chunks[i]
        p = self.profile
        C = p.heads * p.head_dim
        n = c.header.tokens - c.header.sink_tokens
        return flat[c.sym_base:c.sym_base + 2 * p.layers * C * n].view(2 * p.layers, C, n)

    def symbols(self, prep: Prepared) -> list[torch.Tensor | None]:
        """Per chunk, the entropy-decoded symbol indices [2L, C, n] (int32; 0 for components
        not coded) as the device computed them, None for a chunk not lane-coded."""
        flat = self.entropy_decode(prep, float_out=False)
        return [self.chunk_values(prep, i, flat) if c.group >= 0 else None for i, c in enumerate(prep.chunks)]


def device_decoder(profile: Profile, device: str | torch.device = "cuda") -> Decoder:
    """A codec.decoder.Decoder on `device` whose entropy decode is a LaneDecoder's: the kernel
    on a GPU, the C library standing in for it on "cpu"."""
    lanes = LaneDecoder(profile, device)
    return Decoder(profile, lanes.device, lanes=lanes)


def _concat_lanes(parts: list[rans.Lanes]) -> rans.Lanes:
    if not parts:
        return rans.Lanes(np.zeros(1, np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.int64))
    comp_start, base = [np.zeros(1, np.uint32)], 0
    for ln in parts:
        comp_start.append((ln.comp_start[1:].astype(np.int64) + base).astype(np.uint32))
        base += len(ln.comp_model)
    return rans.Lanes(np.concatenate(comp_start), np.concatenate([ln.rows for ln in parts]),
                      np.concatenate([ln.comp_model for ln in parts]), np.concatenate([ln.out_off for ln in parts]))


def cpu_symbols(chunk: bytes | memoryview, profile: Profile) -> torch.Tensor:
    """The entropy-decoded symbol indices [2L, C, n] of one chunk from the CPU library (0 for
    components not coded): what LaneDecoder.symbols must reproduce bit for bit."""
    h = bs.unpack(chunk)
    if h.profile_id != profile.id:
        raise CodecError(f"chunk was coded with profile {h.profile_id.hex()}, not {profile.id.hex()}")
    if not h.transforms & bs.RANS:
        raise CodecError("chunk is not lane-rANS coded")
    C = profile.heads * profile.head_dim
    n = h.tokens - h.sink_tokens
    out = np.zeros((2 * profile.layers, C, n), np.int32)
    for s in range(2 * profile.layers):
        layer, kv = divmod(s, 2)
        b = rans.parse_block(h.substreams[s], n, C)
        words = b.words if b.words.flags.aligned else b.words.copy()
        err, lane = rans.decode_lanes(words, b.word_start, b.lanes,
                                      profile.rans_models(layer, kv, float(h.steps[layer, kv])), out[s])
        if err:
            raise CodecError(f"stream {s} lane {lane}: {rans.ERRORS.get(err, err)}")
    return torch.from_numpy(out)


# -- the pipeline's GPU stages ---------------------------------------------------------------------

@dataclass
class Staged:
    """A chunk on its way through CudaStages."""

    prep: Batch | None  # the chunk parsed and, on a GPU, uploaded
    ready: object = None  # torch.cuda.Event recorded when the stage that made it finished
    kv: torch.Tensor | None = None  # [L, 2, T, H, D] on the device, once decoded


class CudaStages:
    """Receive, decode and fill as three CUDA streams with events between them, so that the
    upload of chunk i+1, the decode of chunk i and the copy of chunk i-1 overlap on the
    device; each call returns once its work is queued (decode() waits for its one check).

    receive(): host parse into pinned memory, upload on the receive stream; decode(): waits
    for that upload's event, decodes on the decode stream; fill(): waits for the decode's
    event, copies into the destination (e.g. a CUDA IPC buffer the model process maps) on the
    fill stream and returns an event the caller can poll. On device "cpu" the same calls run
    in order with no streams, so callers need not tell the two apart.
    """

    def __init__(self, profile: Profile, device: str | torch.device = "cuda"):
        # On the CPU too the lanes are decoded as one batch (the C library standing in for the
        # kernel), so that the stages behave as on a GPU.
        self.decoder = device_decoder(profile, device)
        self.device = self.decoder.device
        cuda = self.device.type == "cuda"
        self.streams = {name: torch.cuda.Stream(self.device) for name in ("receive", "decode", "fill")} if cuda else {}

    def _on(self, name: str):
        return torch.cuda.stream(self.streams[name]) if self.streams else contextlib.nullcontext()

    def _event(self, name: str):
        if not self.streams:
            return None
        ev = torch.cuda.Event()
        ev.record(self.streams[name])
        return ev

    def receive(self, payload: bytes | memoryview) -> Staged:
        with self._on("receive"):
            batch = self.decoder.prepare([payload])
        return Staged(batch, self._event("receive"))

    def decode(self, staged: Staged) -> Staged:
        with self._on("decode"):
            if self.streams:
                self.streams["decode"].wait_event(staged.ready)
                if staged.prep.lanes is not None:
                    _record_prepared(staged.prep.lanes, self.streams["decode"])
            staged.kv = self.decoder.run(staged.prep)
        staged.ready = self._event("decode")
        return staged

    def fill(self, staged: Staged, dst: torch.Tensor):
        """Queue dst.copy_(staged.kv); returns an event (None on CPU, where it is done)."""
        with self._on("fill"):
            if self.streams:
                self.streams["fill"].wait_event(staged.ready)
                staged.kv.record_stream(self.streams["fill"])  # freed only once the copy ran
            dst.copy_(staged.kv, non_blocking=True)
        done = self._event("fill")
        staged.kv = None
        staged.prep = None
        return done


def _record_prepared(prep: Prepared, stream) -> None:
    """The caching allocator must not reuse a batch's uploads before the decode stream has
    read them: they were allocated on the receive stream."""
    prep.escaped.record_stream(stream)
    for g in prep.groups:
        for t in g.device.values():
            t.record_stream(stream)
