"""One decoder: a Decoder(profile, device) turns chunks back into KV, the inverse transforms
-- components to channels (PCA), keys re-rotated, the exact sink rows, one converting write
-- run as batched tensor ops over many streams at once, the same code on the CPU and a GPU.

Only the entropy decode differs by device: on the CPU the C library decodes stream by stream
into a slab of streams small enough to stay in cache; on a GPU (codec/gpu.py) the kernel
decodes every lane of a batch of chunks at once and the transforms take a chunk's streams in
one go. A Decoder owns what it precomputes, bounded: per step table (a chunk's header fixes
its streams' steps; the chunks of a level share them) the step-scaled PCA bases and the
lane models, and the RoPE tables of the last positions it decoded. `for_profile` keeps one
per profile for codec.decode and the pool's workers.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import torch

from . import anchor, bitstream as bs, entropy, pca, rans, rope
from .errors import CodecError
from .profile import Profile
from .quantize import dequantize
from .steps import Coding, class_step, multipliers

# On the CPU, the streams transformed together hold at most this many bytes of float32
# symbols, so that the GEMM's input and output and the rotation's passes stay in cache. A
# 1024-token SmolLM2 stream is 0.75 MiB: one at a time, as before the decoder batched (the
# whole 45 MiB chunk at once decodes ~30% slower on a 2-core EPYC with 32 MiB of L3); a
# 64-token chunk's 60 streams go together, ~35% faster than one by one.
CPU_SLAB_BYTES = 1 << 20
# Step-scaled bases are kept for as many step tables as fit this many bytes (oldest dropped
# first); a table larger than it is never kept, and each slab scales its own.
TABLE_BUDGET = {"cpu": 64 << 20, "cuda": 2 << 30}
ROPE_BUDGET = {"cpu": 8 << 20, "cuda": 256 << 20}  # RoPE tables, by bytes, newest kept
# Each token class's step multiplier (codec.steps), as the float32 the symbols are scaled by.
MULTIPLIERS = [float(m) for m in multipliers(np.arange(bs.TOP_CLASS + 1, dtype=np.uint8))]
DECODERS_KEPT = 4  # for_profile: decoders kept, one per profile, least recently used dropped


def read(data: bytes | memoryview, profile: Profile | None = None, check_crc: bool = True,
         find: Callable[[bytes], Profile] | None = None) -> tuple[bs.Header, Profile]:
    """Validate a bitstream and find its profile (the one given, else `find` of the id the chunk
    names: codec.tuning.registry.find, which codec.decode passes), restricted to the layers the
    chunk holds (Profile.subset) where it holds only some."""
    h = bs.unpack(data, check_crc)
    if profile is None or profile.id != h.profile_id:
        if find is None:
            raise CodecError(f"bitstream was coded with profile {h.profile_id.hex()}, not the one given")
        profile = find(h.profile_id)
    if h.layer_ids is not None or profile.meta.get("subset_of"):
        profile = profile.whole().subset(h.held_layers())
    _check(h, profile)
    return h, profile


def _check(h: bs.Header, profile: Profile) -> None:
    profile.check_shape(h.layers, h.heads, h.head_dim)
    if h.sink_tokens != bs.sink_rows(h.start, profile.sink_tokens, h.tokens, h.transforms):
        raise CodecError(f"bitstream keeps {h.sink_tokens} sink rows, its profile implies otherwise")
    if len(h.sink) != h.sink_tokens * 2 * h.layers * h.heads * h.head_dim * h.dtype.itemsize:
        raise CodecError("bitstream's sink section has the wrong size")


def fill_sink(h: bs.Header, out: torch.Tensor) -> None:
    """The exact sink rows into out [L, 2, T, H, D] (on any device)."""
    if h.sink_tokens:
        raw = torch.frombuffer(bytearray(h.sink), dtype=h.dtype)
        out[:, :, :h.sink_tokens] = raw.view(h.layers, 2, h.sink_tokens, h.heads, h.head_dim).to(out.dtype)


def tf32(device: torch.device):
    """TF32 tensor cores for the inverse-PCA GEMM on a GPU: symbols are small integers (exact
    in TF32's 10-bit mantissa up to 2048) and the basis loses ~2^-11 relative, about the fp16
    output's own rounding; in plain fp32 the GEMM alone would cap a 7B-shaped decode near
    60 GB/s on an H200. No effect on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def scope():
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    return scope()


@dataclass
class StepTables:
    """What the chunks of one step table need, built once and on the decoder's device."""

    steps: np.ndarray  # [L, 2] float32, as the headers carry them
    step: torch.Tensor  # [2L, 1, 1] float32: each stream's step (streams without PCA)
    bases: torch.Tensor | None = None  # [2L * blocks, b, b] pca.scaled_bases of every stream
    lanes: object = None  # gpu.LaneTables: every stream's lane models, for the batched entropy decode


@dataclass
class Batch:
    """Chunks parsed and validated (and, with lanes, their words uploaded): what run() needs."""

    headers: list[bs.Header]
    data: list[bytes | memoryview]
    tokens: int
    dtype: torch.dtype
    lanes: object = None  # gpu.Prepared: the lanes parsed and uploaded
    tables: list[StepTables | None] = field(default_factory=list)


class Decoder:
    """Decodes chunks coded with `profile` into tensors on `device` ("cpu", "cuda", "cuda:N").

    lanes: a gpu.LaneDecoder on the same device, to entropy-decode a batch's lanes all at once
    rather than stream by stream: what a GPU decoder does (codec.gpu.device_decoder makes
    one). On the CPU the C library stands in for the kernel, so that path is exercised without
    a GPU (tests/codec/test_gpu.py).
    """

    def __init__(self, profile: Profile, device: str | torch.device = "cpu", lanes=None):
        self.device = torch.device(device)
        if self.device.type != "cpu" and (lanes is None or lanes.device != self.device):
            raise ValueError(f"a decoder on {self.device} needs a gpu.LaneDecoder there: codec.gpu.device_decoder()")
        self.profile = profile
        self.lanes = lanes
        self._lock = threading.Lock()
        self._tables: OrderedDict[bytes, StepTables] = OrderedDict()
        self._rope: OrderedDict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._means: torch.Tensor | None = None
        self._host: Decoder | None = None  # on a GPU: decodes what the lanes do not code

    # -- what the decoder keeps ----------------------------------------------------------------
    def _blocks(self) -> tuple[int, int]:
        """(blocks, b): the PCA's blocks per stream and their size."""
        nb, b = self.profile.tensors["pca_basis"].shape[2:4]
        return int(nb), int(b)

    def _scaled(self, steps: np.ndarray, streams: range) -> torch.Tensor:
        p = self.profile
        return torch.cat([pca.scaled_bases(p.component_steps(s // 2, s % 2, float(steps[s // 2, s % 2])),
                                           p.basis(s // 2, s % 2), p.channel_scale(s // 2, s % 2))
                          for s in streams]).to(self.device)

    def tables(self, steps: np.ndarray, pca_bases: bool = False, lane_models: bool = False) -> StepTables:
        """The tables of one step table [L, 2], built on first use (the parts asked for)."""
        key = np.ascontiguousarray(steps, np.float32).tobytes()
        L = self.profile.layers
        nb, b = self._blocks()
        bases_bytes = 2 * L * nb * b * b * 4
        budget = TABLE_BUDGET[self.device.type]
        with self._lock:
            t = self._tables.get(key)
            if t is None:
                step = torch.from_numpy(np.array(steps, np.float32).reshape(2 * L, 1, 1)).to(self.device)
                t = self._tables[key] = StepTables(np.array(steps, np.float32), step)
                keep = max(1, min(32, budget // bases_bytes)) if bases_bytes <= budget else 8
                if len(self._tables) > keep and self.device.type == "cuda":
                    # Built on whichever stream parsed a chunk, read on the decode stream: let
                    # queued decodes finish before the allocator may hand the memory out again.
                    torch.cuda.synchronize(self.device)
                while len(self._tables) > keep:
                    self._tables.popitem(last=False)
            self._tables.move_to_end(key)
            if pca_bases and t.bases is None and bases_bytes <= budget:
                t.bases = self._scaled(t.steps, range(2 * L))
            if lane_models and t.lanes is None:
                t.lanes = self.lanes.tables(t.steps)
            return t

    def _means_for(self, s0: int, S: int) -> torch.Tensor:
        if self._means is None:
            _, b = self._blocks()
            self._means = torch.from_numpy(self.profile.tensors["pca_mean"]).to(torch.float32).reshape(-1, 1, b).to(self.device)
        nb, _ = self._blocks()
        return self._means[s0 * nb:(s0 + S) * nb]

    def _rerotation(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.profile
        key = (p.rope_kind(layer), start, n)
        with self._lock:
            tables = self._rope.get(key)
            if tables is not None:
                self._rope.move_to_end(key)
                return tables
        cos, sin = rope.rerotation(start, n, p.heads, p.inv_freq(layer))
        tables = (cos.to(self.device), sin.to(self.device))
        with self._lock:
            self._rope[key] = tables
            budget = ROPE_BUDGET[self.device.type]
            while len(self._rope) > 1 and sum(c.numel() * 8 for c, _ in self._rope.values()) > budget:
                self._rope.popitem(last=False)
        return tables

    def warm(self, coding: Coding, streams: range | None = None, classes: Iterable[int] = (0,)) -> None:
        """Build what decoding chunks coded as `coding` needs ahead of the first one (its
        entropy models for `streams` only, where given: a pool worker's share; at each token
        class in `classes` too, codec.steps: built at a chunk's first use, they held the last
        chunk of a 16K Gemma-3 fetch 0.39 s). By a level's name: codec.tuning.named.warm."""
        steps = coding.steps
        self.tables(steps, pca_bases=bool(coding.transforms & bs.PCA),
                    lane_models=bool(self.lanes is not None and coding.transforms & bs.RANS))
        for s in range(2 * self.profile.layers) if streams is None else streams:
            layer, kv = divmod(s, 2)
            step = float(steps[layer, kv])
            if coding.transforms & bs.DELTA:
                self.profile.models("anchor", layer, kv, coding.anchor_step)
                self.profile.models("delta", layer, kv, step)
            elif coding.transforms & bs.RANS:  # and each token class's steps where the level has them
                for c in classes:
                    self.profile.rans_models(layer, kv, class_step(step, c))
            else:
                self.profile.models("pca", layer, kv, step)

    # -- the inverse transforms, shared by every device ----------------------------------------
    def _channels(self, h: bs.Header, t: StepTables, sym: torch.Tensor, s0: int, alpha: float = 1.0) -> torch.Tensor:
        """Component-major values [S, C, n] (float32) of streams s0.. -> channels [S, n, C];
        `alpha`: a multiplier on every step (PCA streams: a class of tokens', codec.steps)."""
        S, C, n = sym.shape
        if not h.transforms & bs.PCA:
            x = torch.empty((S, n, C), dtype=torch.float32, device=sym.device)
            return torch.mul(sym.transpose(-1, -2), t.step[s0:s0 + S], out=x)
        nb, _ = self._blocks()
        scaled = t.bases[s0 * nb:(s0 + S) * nb] if t.bases is not None else self._scaled(t.steps, range(s0, s0 + S))
        if self.device.type == "cpu":
            return pca.to_channels(sym, self._means_for(s0, S), scaled, alpha)
        with tf32(self.device):
            return pca.to_channels(sym, self._means_for(s0, S), scaled, alpha)

    def _write(self, h: bs.Header, x: torch.Tensor, scratch: torch.Tensor | None, s0: int, dst: torch.Tensor) -> None:
        """Channels x [S, n, C] (float32, overwritten) of streams s0.. into the chunk's tensor
        dst [L, 2, T, H, D]: keys re-rotated, every stream in one converting write. scratch: a
        dead float32 buffer of x's size, or None."""
        S, n, _ = x.shape
        H, D = h.heads, h.head_dim
        x = x.view(S, n, H, D)
        out = dst.view(2 * h.layers, h.tokens, H, D)[s0:s0 + S, h.sink_tokens:]
        if not h.transforms & bs.UNROTATE_KEYS:
            out.copy_(x)
            return
        keys, values = slice(s0 % 2, None, 2), slice(1 - s0 % 2, None, 2)  # stream s is a key where s is even
        key_streams = range(s0, s0 + S)[keys]
        if len(key_streams):
            work = torch.empty_like(x) if scratch is None else scratch.view(S, n, H, D)
            start = h.start + h.sink_tokens
            kinds = [self.profile.rope_kind(s // 2) for s in key_streams]
            # Runs of key streams whose layers share their frequencies take one table each (one
            # run for a model with one kind of rotary embedding).
            i = 0
            while i < len(kinds):
                j = i
                while j + 1 < len(kinds) and kinds[j + 1] == kinds[i]:
                    j += 1
                run = slice(keys.start + 2 * i, keys.start + 2 * j + 1, 2)
                rope.rerotate_into(x[run], self._rerotation(key_streams[i] // 2, start, n), out[run], work[run])
                i = j + 1
        if len(range(S)[values]):
            out[values].copy_(x[values])

    # -- the CPU's entropy decode, a slab of streams at a time ---------------------------------
    def _slab(self, h: bs.Header, t: StepTables | None, s0: int, S: int, dst: torch.Tensor) -> None:
        p = self.profile
        C = p.heads * p.head_dim
        n = h.tokens - h.sink_tokens
        if h.transforms & bs.DELTA:
            x = torch.empty((S, n, C), dtype=torch.float32)
            for j, s in enumerate(range(s0, s0 + S)):
                x[j] = self._delta_stream(h, s, n)
            self._write(h, x, None, s0, dst)
            return
        if h.token_classes is not None:
            x = torch.empty((S, n, C), dtype=torch.float32)
            for j, s in enumerate(range(s0, s0 + S)):
                self._class_channels(h, t, s, self._class_symbols(h, s), x[j])
            self._write(h, x, None, s0, dst)
            return
        sym = np.empty((S, C, n), np.int32)
        for j, s in enumerate(range(s0, s0 + S)):
            layer, kv = divmod(s, 2)
            step = float(h.steps[layer, kv])
            if h.transforms & bs.RANS:
                rans.decode_block(h.substreams[s], n, p.rans_models(layer, kv, step), out=sym[j])
            else:
                ((sym[j], _),) = entropy.decode_blocks(h.substreams[s], [(n, p.models("pca", layer, kv, step))])
        # Converted in place (int32 and float32 have the same size): one buffer fewer.
        values = torch.from_numpy(sym.view(np.float32))
        values.copy_(torch.from_numpy(sym))
        x = self._channels(h, t, values, s0)
        self._write(h, x, values, s0, dst)  # the symbols are dead once the GEMM has run

    # -- a chunk with per-token steps (bitstream.TOKEN_STEPS): class by class -----------------
    def _class_symbols(self, h: bs.Header, s: int) -> list[tuple[int, np.ndarray, torch.Tensor]]:
        """Stream s's class blocks entropy-decoded: (class, its tokens' rows, their symbols
        [C, rows] float32) per class it holds."""
        layer, kv = divmod(s, 2)
        step = float(h.steps[layer, kv])
        blocks = h.class_blocks(layer)
        out = []
        for (c, rows), data in zip(blocks, bs.split_classes(h.substreams[s], len(blocks))):
            sym, _ = rans.decode_block(data, len(rows), self.profile.rans_models(layer, kv, class_step(step, c)))
            values = torch.from_numpy(sym.view(np.float32))
            values.copy_(torch.from_numpy(sym))  # converted in place, as _slab does
            out.append((c, rows, values))
        return out

    def _class_channels(self, h: bs.Header, t: StepTables, s: int, parts: list, x: torch.Tensor) -> None:
        """Stream s's symbols, class by class (_class_symbols), into its channels x [n, C]: each
        class's tokens through the stream's inverse with their multiplier on its steps, written
        to their rows (rows of a token-major tensor: a copy per token, where scattering the
        symbols' component-major columns cost a third of the decode)."""
        for c, rows, values in parts:
            x.index_copy_(0, torch.from_numpy(rows), self._channels(h, t, values[None], s, MULTIPLIERS[c])[0])

    def _delta_stream(self, h: bs.Header, s: int, n: int) -> torch.Tensor:
        """CacheGen's anchor/delta stream s -> channels [n, C] (the paper's configuration)."""
        p = self.profile
        layer, kv = divmod(s, 2)
        step = float(h.steps[layer, kv])
        rows_a = len(anchor.anchor_rows(n, h.group))
        (a_sym, _), (d_sym, _) = entropy.decode_blocks(h.substreams[s], [(rows_a, p.models("anchor", layer, kv, h.anchor_step)),
                                                                         (n - rows_a, p.models("delta", layer, kv, step))])
        a_hat = dequantize(a_sym.T, torch.from_numpy(p.tensors["anchor_sigma"][layer, kv]) * h.anchor_step)
        d_hat = dequantize(d_sym.T, torch.from_numpy(p.tensors["delta_sigma"][layer, kv]) * step)
        return anchor.merge(a_hat, d_hat, n, h.group) + torch.from_numpy(p.tensors["chan_mean"][layer, kv])

    def from_symbols(self, h: bs.Header, values: torch.Tensor, out: torch.Tensor) -> None:
        """Every stream of chunk h from its quantized symbols, values [2L, C, n] (float32, as
        entropy decoding gives them; overwritten), into out [L, 2, T, H, D] on the CPU, the sink
        rows aside (fill_sink's): the decode's inverse without its entropy decode."""
        t = self.tables(h.steps, pca_bases=bool(h.transforms & bs.PCA))
        if h.token_classes is not None:
            x = torch.empty((values.shape[0], values.shape[2], values.shape[1]), dtype=torch.float32)
            for s in range(values.shape[0]):
                parts = [(c, rows, values[s][:, rows]) for c, rows in h.class_blocks(s // 2)]
                self._class_channels(h, t, s, parts, x[s])
            self._write(h, x, None, 0, out)
            return
        self._write(h, self._channels(h, t, values, 0), values, 0, out)

    def decode_streams(self, h: bs.Header, streams: range, out: torch.Tensor) -> None:
        """Streams `streams` (consecutive) of chunk h into out [L, 2, T, H, D] on the CPU (the
        pool's workers each take some); the sink rows are fill_sink's."""
        if out.device.type != "cpu":
            raise ValueError("decode_streams decodes on the CPU; a GPU decoder takes chunks (run)")
        n = h.tokens - h.sink_tokens
        t = None if h.transforms & bs.DELTA else self.tables(h.steps, pca_bases=bool(h.transforms & bs.PCA))
        per = max(1, CPU_SLAB_BYTES // max(1, 4 * h.heads * h.head_dim * n))
        for s0 in range(streams.start, streams.stop, per):
            self._slab(h, t, s0, min(per, streams.stop - s0), out)

    def read(self, data: bytes | memoryview, check_crc: bool = True) -> bs.Header:
        """Validate a chunk, which must have been coded with this decoder's profile and hold
        its layers (a chunk holding some layers: a decoder of profile.subset(those))."""
        h = bs.unpack(data, check_crc)
        if h.profile_id != self.profile.id:
            raise CodecError(f"chunk was coded with profile {h.profile_id.hex()}, this decoder's is "
                             f"{self.profile.id.hex()}")
        if h.held_layers() != self.profile.layer_indices:
            raise CodecError(f"chunk holds layers {list(h.held_layers())}, this decoder decodes "
                             f"{list(self.profile.layer_indices)}")
        _check(h, self.profile)
        return h

    def decode(self, data: bytes | memoryview) -> torch.Tensor:
        """One chunk -> [L, 2, T, H, D] on the device, in the dtype it was encoded from."""
        return self.run(self.prepare([data]))

    # -- a batch of chunks (one context, in token order) ---------------------------------------
    def prepare(self, chunks: list[bytes | memoryview]) -> Batch:
        """Parse and validate the chunks (CRC, tables); with lanes, upload their words."""
        headers = []
        for i, data in enumerate(chunks):
            h = self.read(data)
            if headers and h.dtype != headers[0].dtype:
                raise CodecError(f"chunk {i} is {h.dtype}, the batch {headers[0].dtype}: one context has one dtype")
            headers.append(h)
        batch = Batch(headers, list(chunks), sum(h.tokens for h in headers),
                      headers[0].dtype if headers else torch.float16)
        if self.lanes is not None:
            # Chunks with token steps code a block per class: the CPU decodes them (run)
            batch.tables = [self.tables(h.steps, pca_bases=bool(h.transforms & bs.PCA), lane_models=True)
                            if h.transforms & bs.RANS and h.token_classes is None else None for h in headers]
            batch.lanes = self.lanes.prepare(headers, [t.lanes if t else None for t in batch.tables])
        return batch

    def run(self, batch: Batch, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decode a prepared batch into out [L, 2, tokens, H, D] (allocated on the device in
        the chunks' dtype when not given); returns out."""
        p = self.profile
        shape = (p.layers, 2, batch.tokens, p.heads, p.head_dim)
        if out is None:
            out = torch.empty(shape, dtype=batch.dtype, device=self.device)
        elif tuple(out.shape) != shape:
            raise ValueError(f"out is {tuple(out.shape)}, the batch decodes to {shape}")
        values = self.lanes.values(batch.lanes) if self.lanes is not None else None
        t0 = 0
        for i, h in enumerate(batch.headers):
            dst = out[:, :, t0:t0 + h.tokens]
            t0 += h.tokens
            if values is not None and batch.tables[i] is not None:
                sym = self.lanes.chunk_values(batch.lanes, i, values)
                self._write(h, self._channels(h, batch.tables[i], sym, 0), sym, 0, dst)
            elif dst.device.type == "cpu":
                self.decode_streams(h, range(2 * h.layers), dst)
            else:  # not lane-coded, on a GPU: the CPU decodes it
                dst.copy_(self._cpu().decode(batch.data[i]), non_blocking=True)
                continue
            fill_sink(h, dst)
        return out

    def _cpu(self) -> "Decoder":
        if self._host is None:
            self._host = Decoder(self.profile)
        return self._host

    def decode_many(self, chunks: list[bytes | memoryview], out: torch.Tensor | None = None) -> torch.Tensor:
        """The chunks of one context, in token order -> [L, 2, sum of T, H, D]."""
        return self.run(self.prepare(chunks), out)

    def symbols(self, batch: Batch) -> list[torch.Tensor | None]:
        """Per chunk, the lanes' entropy-decoded symbol indices [2L, C, n] (int32; 0 for
        components not coded), None for a chunk the lanes do not code: to compare with
        gpu.cpu_symbols."""
        if self.lanes is None:
            raise ValueError("symbols() reads the batched lanes: make the decoder with codec.gpu.device_decoder")
        return self.lanes.symbols(batch.lanes)


# -- one decoder per profile, for codec.decode and the pool's workers -----------------------------
_decoders: OrderedDict[bytes, Decoder] = OrderedDict()
_decoders_lock = threading.Lock()


def for_profile(profile: Profile) -> Decoder:
    """The CPU decoder of `profile`, kept: the last DECODERS_KEPT profiles' decoders (with
    their tables) live as long as the process, each bounded as Decoder says."""
    key = profile.id + bytes(np.array(profile.layer_indices, "<u2"))  # a layer subset has its own
    with _decoders_lock:
        dec = _decoders.get(key)
        if dec is None or dec.profile is not profile:
            dec = _decoders[key] = Decoder(profile, "cpu")
        _decoders.move_to_end(key)
        while len(_decoders) > DECODERS_KEPT:
            _decoders.popitem(last=False)
        return dec


def decode(data: bytes | memoryview, profile: Profile | None = None,
           find: Callable[[bytes], Profile] | None = None) -> torch.Tensor:
    """Decompress one chunk on the CPU to [L, 2, T, H, D] in the dtype it was encoded from; its
    profile: `profile`, else `find` (read()).

    Raises CodecError for damaged, truncated, foreign or mismatched input."""
    h, profile = read(data, profile, find=find)
    out = torch.empty(h.shape, dtype=h.dtype)
    for_profile(profile).decode_streams(h, range(2 * h.layers), out)
    fill_sink(h, out)
    return out
