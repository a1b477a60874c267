"""Reference schemes the benchmark compares against, each a real byte format:
fp16 (raw), int8 (per-token symmetric, CacheGen's baseline), kivi2 (KIVI 2-bit: keys per
channel in groups of tokens, values per token in groups of channels) and zstd-fp16 (lossless).

    magic "KVB1" | u8 scheme | u8 dtype | u16 L | u16 H | u16 D | u32 T | payload | u32 crc32
"""
from __future__ import annotations

import struct
import warnings
import zlib

import numpy as np
import torch

from . import bitstream as bs
from .errors import CodecError

MAGIC = b"KVB1"
_HEAD = struct.Struct("<4sBBHHHI")
KIVI_GROUP = 32


def _frame(code: int, kv: torch.Tensor, payload: bytes) -> bytes:
    L, _, T, H, D = kv.shape
    body = _HEAD.pack(MAGIC, code, bs.DTYPE_CODES[kv.dtype], L, H, D, T) + payload
    return body + struct.pack("<I", zlib.crc32(body))


def header(data: bytes | memoryview) -> tuple[int, tuple[int, ...], torch.dtype]:
    """A baseline bitstream's scheme code, shape [L, 2, T, H, D] and dtype as its header
    declares them, read without checking or decoding the rest (CodecError if it is none)."""
    data = memoryview(data).cast("B")
    if len(data) < _HEAD.size + 4 or bytes(data[:4]) != MAGIC:
        raise CodecError("not a kvstreamd baseline bitstream")
    _, code, dtype, L, H, D, T = _HEAD.unpack_from(data)
    if dtype not in bs.DTYPES:
        raise CodecError(f"unknown dtype code {dtype}")
    return code, (L, 2, T, H, D), bs.DTYPES[dtype]


def _unframe(data: bytes, code: int) -> tuple[tuple[int, ...], torch.dtype, memoryview]:
    got, shape, dtype = header(data)
    data = memoryview(data).cast("B")
    if got != code:
        raise CodecError(f"baseline bitstream is scheme {got}, expected {code}")
    if zlib.crc32(data[:-4]) != struct.unpack_from("<I", data, len(data) - 4)[0]:
        raise CodecError("baseline bitstream checksum mismatch")
    return shape, dtype, data[_HEAD.size:-4]


def _take(buf: memoryview, pos: int, n: int) -> tuple[memoryview, int]:
    if pos + n > len(buf):
        raise CodecError("baseline bitstream truncated")
    return buf[pos:pos + n], pos + n


def _read_only(buf: memoryview, dtype) -> torch.Tensor:
    """A tensor over `buf` as it lies (no copy), for reading only: torch warns that it cannot
    write-protect it, and nothing here writes to it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(buf, dtype))


def _check_out(shape: tuple[int, ...], out: torch.Tensor) -> None:
    if tuple(out.shape) != tuple(shape):
        raise CodecError(f"chunk is {list(shape)}, its destination {list(out.shape)}")


class Scheme:
    """A baseline scheme: encode a chunk's KV `[L, 2, T, H, D]` to bytes, decode them back."""

    name: str
    code: int

    def encode(self, kv: torch.Tensor) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes) -> torch.Tensor:
        raise NotImplementedError

    def decode_into(self, data: bytes | memoryview, out: torch.Tensor) -> None:
        """decode(data), in out's dtype, written into `out` (a view of the chunk's shape, in a
        receive buffer). CodecError, before any write, where the chunk is not of out's shape."""
        got = self.decode(data)
        _check_out(tuple(got.shape), out)
        out.copy_(got)


class FP16(Scheme):
    name, code = "fp16", 1

    def encode(self, kv: torch.Tensor) -> bytes:
        return _frame(self.code, kv, kv.to(torch.float16).contiguous().numpy().tobytes())

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, p = _unframe(data, self.code)
        raw, _ = _take(p, 0, int(np.prod(shape)) * 2)
        return torch.from_numpy(np.frombuffer(raw, np.float16).copy()).view(shape).to(dtype)

    def decode_into(self, data: bytes | memoryview, out: torch.Tensor) -> None:
        """The fp16 values straight from the payload into `out` (one pass; decode() copies
        twice). A chunk of another dtype than fp16 or fp32 goes the general way (its values
        round to that dtype first)."""
        shape, dtype, p = _unframe(data, self.code)
        _check_out(shape, out)
        if dtype not in (torch.float16, torch.float32):
            return super().decode_into(data, out)
        raw, _ = _take(p, 0, int(np.prod(shape)) * 2)
        out.copy_(_read_only(raw, np.float16).view(shape))


class ZstdFP16(FP16):
    name, code = "zstd-fp16", 2
    decode_into = Scheme.decode_into

    def encode(self, kv: torch.Tensor) -> bytes:
        import zstandard  # here: a comparison baseline, not a dependency of decoding the levels

        raw = kv.to(torch.float16).contiguous().numpy().tobytes()
        return _frame(self.code, kv, zstandard.ZstdCompressor(level=3).compress(raw))

    @staticmethod
    def declared_bytes(data: bytes | memoryview) -> int | None:
        """How many bytes the bitstream's zstd frame says it decompresses to (None: it does not
        say), read from the frame header alone; CodecError if there is no zstd frame."""
        import zstandard

        data = memoryview(data).cast("B")
        try:
            n = zstandard.frame_content_size(data[_HEAD.size:-4])
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd payload invalid: {e}") from None
        return None if n < 0 else n

    def decode(self, data: bytes) -> torch.Tensor:
        import zstandard

        shape, dtype, p = _unframe(data, self.code)
        want = int(np.prod(shape)) * 2
        # A zstd frame that declares its content size is decompressed into that many bytes,
        # whatever max_output_size says: believe the declaration only when it is the shape's.
        declared = self.declared_bytes(data)
        if declared not in (None, want):
            raise CodecError(f"zstd payload declares {declared} bytes, its shape {list(shape)} is {want}")
        try:
            raw = zstandard.ZstdDecompressor().decompress(bytes(p), max_output_size=want)
        except zstandard.ZstdError as e:
            raise CodecError(f"zstd payload invalid: {e}") from None
        if len(raw) != want:
            raise CodecError(f"zstd payload holds {len(raw)} bytes, its shape {list(shape)} is {want}")
        return torch.from_numpy(np.frombuffer(raw, np.float16).copy()).view(shape).to(dtype)


class Int8(Scheme):
    """Per-token symmetric int8 over each (layer, K/V) token's H*D channels; fp16 scales."""

    name, code = "int8", 3

    def encode(self, kv: torch.Tensor) -> bytes:
        x = kv.to(torch.float32).flatten(3)  # [L, 2, T, C]
        scale = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-8).to(torch.float16)
        q = torch.round(x / scale.float()).clamp(-127, 127).to(torch.int8)
        return _frame(self.code, kv, scale.numpy().tobytes() + q.numpy().tobytes())

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, p = _unframe(data, self.code)
        L, _, T, H, D = shape
        s, pos = _take(p, 0, L * 2 * T * 2)
        q, _ = _take(p, pos, L * 2 * T * H * D)
        scale = torch.from_numpy(np.frombuffer(s, np.float16).copy()).view(L, 2, T, 1).float()
        x = torch.from_numpy(np.frombuffer(q, np.int8).copy()).view(L, 2, T, H * D).float() * scale
        return x.view(shape).to(dtype)

    def decode_into(self, data: bytes | memoryview, out: torch.Tensor) -> None:
        """For an fp16 chunk into fp16 `out`: q x scale in float32 a layer at a time, rounded
        into out (decode() makes three chunk-sized fp32 temporaries and a copy): decode()'s
        values, 1.6 ms a 256-token SmolLM2 chunk on one core, checksum included, where decode and
        copy took 2.7-4.5 ms."""
        shape, dtype, p = _unframe(data, self.code)
        _check_out(shape, out)
        if not dtype == out.dtype == torch.float16:
            return super().decode_into(data, out)
        L, _, T, H, D = shape
        s, pos = _take(p, 0, L * 2 * T * 2)
        q, _ = _take(p, pos, L * 2 * T * H * D)
        try:
            dst = out.view(L, 2, T, H * D)  # each token's channels adjacent, as in any receive buffer
        except RuntimeError:
            return super().decode_into(data, out)
        scale = _read_only(s, np.float16).view(L, 2, T, 1)
        q = _read_only(q, np.int8).view(L, 2, T, H * D)
        for layer in range(L):  # a layer at a time: its float32 product stays in cache (~2x faster)
            x = q[layer].float()
            x.mul_(scale[layer])
            dst[layer].copy_(x)


def _pack2(q: np.ndarray) -> bytes:
    q = q.reshape(-1).astype(np.uint8)
    q = np.concatenate([q, np.zeros((-q.size) % 4, np.uint8)]).reshape(-1, 4)
    return (q[:, 0] | q[:, 1] << 2 | q[:, 2] << 4 | q[:, 3] << 6).astype(np.uint8).tobytes()


def _unpack2(b: memoryview, n: int) -> np.ndarray:
    p = np.frombuffer(b, np.uint8)
    return np.stack([p & 3, p >> 2 & 3, p >> 4 & 3, p >> 6 & 3], axis=1).reshape(-1)[:n]


def _asym2(x: torch.Tensor, dim: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    lo16, scale16 = lo.to(torch.float16), ((hi - lo) / 3).clamp_min(1e-6).to(torch.float16)
    q = torch.round((x - lo16.float()) / scale16.float()).clamp(0, 3).to(torch.uint8)
    return q.numpy(), lo16, scale16


class Kivi2(Scheme):
    """KIVI 2-bit: keys per channel over groups of 32 tokens, values per token over groups of
    32 channels, asymmetric with fp16 zero point and scale."""

    name, code = "kivi2", 4

    def encode(self, kv: torch.Tensor) -> bytes:
        L, _, T, H, D = kv.shape
        x = kv.to(torch.float32).flatten(3)  # [L, 2, T, C]
        C = H * D
        tp = (-T) % KIVI_GROUP
        k = torch.nn.functional.pad(x[:, 0], (0, 0, 0, tp), mode="replicate").view(L, -1, KIVI_GROUP, C)
        cp = (-C) % KIVI_GROUP
        v = torch.nn.functional.pad(x[:, 1], (0, cp), mode="replicate").view(L, T, -1, KIVI_GROUP)
        kq, klo, ks = _asym2(k, 2)
        vq, vlo, vs = _asym2(v, 3)
        parts = [klo, ks, vlo, vs]
        return _frame(self.code, kv, b"".join(t.numpy().tobytes() for t in parts) + _pack2(kq) + _pack2(vq))

    def decode(self, data: bytes) -> torch.Tensor:
        shape, dtype, p = _unframe(data, self.code)
        L, _, T, H, D = shape
        C = H * D
        tg, cg = -(-T // KIVI_GROUP), -(-C // KIVI_GROUP)
        pos = 0
        meta = []
        for n in (L * tg * C, L * tg * C, L * T * cg, L * T * cg):
            b, pos = _take(p, pos, 2 * n)
            meta.append(torch.from_numpy(np.frombuffer(b, np.float16).copy()).float())
        nk, nv = L * tg * KIVI_GROUP * C, L * T * cg * KIVI_GROUP
        kb, pos = _take(p, pos, -(-nk // 4))
        vb, pos = _take(p, pos, -(-nv // 4))
        k = torch.from_numpy(_unpack2(kb, nk).astype(np.float32)).view(L, tg, KIVI_GROUP, C)
        v = torch.from_numpy(_unpack2(vb, nv).astype(np.float32)).view(L, T, cg, KIVI_GROUP)
        k = k * meta[1].view(L, tg, 1, C) + meta[0].view(L, tg, 1, C)
        v = v * meta[3].view(L, T, cg, 1) + meta[2].view(L, T, cg, 1)
        k = k.view(L, tg * KIVI_GROUP, C)[:, :T]
        v = v.view(L, T, cg * KIVI_GROUP)[:, :, :C]
        return torch.stack([k, v], 1).view(shape).to(dtype)


SCHEMES = {s.name: s for s in (FP16(), ZstdFP16(), Int8(), Kivi2())}
