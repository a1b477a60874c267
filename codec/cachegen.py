"""encode() and decode(): CacheGen's steps composed in the paper's order -- transform,
quantize, entropy-code -- per (layer, K/V) substream, each independent of the others."""
from __future__ import annotations

import numpy as np
import torch

from . import anchor, bitstream as bs, entropy, levels, pca, profile as profiles, rope
from .errors import CodecError
from .profile import Profile
from .quantize import dequantize, quantize


def _sink_rows(h_start: int, sink_tokens: int, tokens: int, transforms: int) -> int:
    return min(max(0, sink_tokens - h_start), tokens) if transforms & bs.SINK else 0


def encode(kv: torch.Tensor, level: str | levels.Level = "balanced", profile: Profile | None = None,
           start: int = 0) -> bytes:
    """Compress one chunk of KV [L, 2, T, H, D] (fp16, bf16 or fp32) whose first token sits at
    absolute position `start`. Pure CPU work that holds the GIL: never call it on an event loop."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"KV must be [L, 2, T, H, D], got {tuple(kv.shape)}")
    if kv.dtype not in bs.DTYPE_CODES:
        raise ValueError(f"KV dtype {kv.dtype} not supported (fp16, bf16, fp32)")
    lv = levels.get(level)
    L, _, T, H, D = kv.shape
    if T == 0:
        raise ValueError("cannot encode an empty chunk")
    if profile is None:
        raise ValueError("encode needs the model's profile (codec.profile.for_model(model_id))")
    profile.check_shape(L, H, D)
    steps = lv.steps(profile)
    ns = _sink_rows(start, profile.sink_tokens, T, lv.transforms)
    sink = kv[:, :, :ns].contiguous().view(torch.uint8).numpy().tobytes() if ns else b""
    subs = [encode_stream(kv[layer, k_or_v], layer, k_or_v, lv.transforms, steps, lv.anchor_step, start, ns, profile)
            for layer in range(L) for k_or_v in range(2)]
    header = bs.Header(lv.transforms, lv.code, kv.dtype, L, H, D, T, start, profile.id, profile.group,
                       ns, steps, lv.anchor_step, memoryview(sink), subs)
    return bs.pack(header)


def encode_stream(x: torch.Tensor, layer: int, k_or_v: int, transforms: int, steps: np.ndarray,
                  anchor_step: float, start: int, sink_rows: int, profile: Profile) -> bytes:
    """One substream: x [T, H, D] of one (layer, K/V)."""
    x = x[sink_rows:].to(torch.float32)
    n = x.shape[0]
    step = float(steps[layer, k_or_v])
    if transforms & bs.UNROTATE_KEYS and k_or_v == 0:
        x = rope.unrotate(x, start + sink_rows, profile.rope_theta)
    x = x.reshape(n, x.shape[1] * x.shape[2])
    if transforms & bs.DELTA:
        mean = torch.from_numpy(profile.tensors["chan_mean"][layer, k_or_v])
        xc = x - mean
        a_step = torch.from_numpy(profile.tensors["anchor_sigma"][layer, k_or_v]) * anchor_step
        d_step = torch.from_numpy(profile.tensors["delta_sigma"][layer, k_or_v]) * step
        a_sym = quantize(xc[anchor.anchor_rows(n, profile.group)], a_step)
        a_hat = dequantize(a_sym, a_step)
        d_sym = quantize(anchor.deltas(xc, a_hat, profile.group), d_step)
        return entropy.encode_blocks([(a_sym, profile.models("anchor", layer, k_or_v, anchor_step)),
                                      (d_sym, profile.models("delta", layer, k_or_v, step))])
    if transforms & bs.PCA:
        x = pca.forward(x, torch.from_numpy(profile.tensors["pca_mean"][layer, k_or_v]), profile.basis(layer, k_or_v))
        sym = quantize(x, profile.component_steps(layer, k_or_v, step))
    else:
        sym = quantize(x, torch.tensor(step))
    return entropy.encode_blocks([(sym, profile.models("pca", layer, k_or_v, step))])


def decode_stream_into(h: bs.Header, s: int, profile: Profile, out: torch.Tensor) -> None:
    """Substream s -> out [T - sink, H, D] (a view into the chunk's tensor, any float dtype).
    The work happens in a small float32 buffer that stays in cache; out gets one converting copy."""
    if out.dtype != torch.float32 or not out.is_contiguous():
        work = torch.empty(out.shape, dtype=torch.float32)
        decode_stream_into(h, s, profile, work)
        out.copy_(work)
        return
    layer, k_or_v = divmod(s, 2)
    n = h.tokens - h.sink_tokens
    step = float(h.steps[layer, k_or_v])
    data = h.substreams[s]
    flat = out.view(n, h.heads * h.head_dim)
    if h.transforms & bs.DELTA:
        rows_a = len(anchor.anchor_rows(n, h.group))
        (a_sym, _), (d_sym, _) = entropy.decode_blocks(data, [(rows_a, profile.models("anchor", layer, k_or_v, h.anchor_step)),
                                                              (n - rows_a, profile.models("delta", layer, k_or_v, step))])
        a_hat = dequantize(a_sym.T, torch.from_numpy(profile.tensors["anchor_sigma"][layer, k_or_v]) * h.anchor_step)
        d_hat = dequantize(d_sym.T, torch.from_numpy(profile.tensors["delta_sigma"][layer, k_or_v]) * step)
        flat.copy_(anchor.merge(a_hat, d_hat, n, h.group) + torch.from_numpy(profile.tensors["chan_mean"][layer, k_or_v]))
    else:
        ((sym, _),) = entropy.decode_blocks(data, [(n, profile.models("pca", layer, k_or_v, step))])
        if h.transforms & bs.PCA:
            pca.inverse_into(flat, torch.from_numpy(sym).to(torch.float32), profile.component_steps(layer, k_or_v, step),
                             torch.from_numpy(profile.tensors["pca_mean"][layer, k_or_v]), profile.basis(layer, k_or_v))
        else:
            flat.copy_(dequantize(sym.T, torch.tensor(step)))
    if h.transforms & bs.UNROTATE_KEYS and k_or_v == 0:
        out.copy_(rope.rerotate(out, h.start + h.sink_tokens, profile.rope_theta))


def warm(profile: Profile, level: str | levels.Level) -> None:
    """Build every entropy model that coding at `level` uses, ahead of the first chunk."""
    lv = levels.get(level)
    steps = lv.steps(profile)
    for layer in range(profile.layers):
        for k_or_v in range(2):
            step = float(steps[layer, k_or_v])
            if lv.transforms & bs.DELTA:
                profile.models("anchor", layer, k_or_v, lv.anchor_step)
                profile.models("delta", layer, k_or_v, step)
            else:
                profile.models("pca", layer, k_or_v, step)


def read(data: bytes | memoryview, profile: Profile | None = None) -> tuple[bs.Header, Profile]:
    """Validate a bitstream and find its profile (the one given, or the registry's)."""
    h = bs.unpack(data)
    if profile is None or profile.id != h.profile_id:
        profile = profiles.find(h.profile_id)
    profile.check_shape(h.layers, h.heads, h.head_dim)
    if h.sink_tokens != _sink_rows(h.start, profile.sink_tokens, h.tokens, h.transforms):
        raise CodecError(f"bitstream keeps {h.sink_tokens} sink rows, its profile implies otherwise")
    if len(h.sink) != h.sink_tokens * 2 * h.layers * h.heads * h.head_dim * h.dtype.itemsize:
        raise CodecError("bitstream's sink section has the wrong size")
    return h, profile


def fill_sink(h: bs.Header, out: torch.Tensor) -> None:
    if h.sink_tokens:
        raw = torch.frombuffer(bytearray(h.sink), dtype=h.dtype)
        out[:, :, :h.sink_tokens] = raw.view(h.layers, 2, h.sink_tokens, h.heads, h.head_dim).to(out.dtype)


def decode(data: bytes | memoryview, profile: Profile | None = None) -> torch.Tensor:
    """Decompress one chunk to [L, 2, T, H, D] in the dtype it was encoded from.

    Raises CodecError for damaged, truncated, foreign or mismatched input."""
    h, profile = read(data, profile)
    out = torch.empty(h.shape, dtype=h.dtype)
    for s in range(2 * h.layers):
        layer, k_or_v = divmod(s, 2)
        decode_stream_into(h, s, profile, out[layer, k_or_v, h.sink_tokens:])
    fill_sink(h, out)
    return out
