"""encode(): CacheGen's steps composed in the paper's order, per (layer, K/V) substream, each
independent of the others; the inverse is codec/decoder.py's. One stream of a chunk:

    x [T, H, D] of (layer, K/V)
      -> the sink rows, kept exact               (bitstream.sink_rows: the header's sink section)
      -> un-rotate the keys' RoPE                (rope.unrotate; UNROTATE_KEYS)
      -> PCA: channels [n, H*D] -> components     (pca.forward, the profile's basis; PCA)
      -> quantize at each symbol's step          (steps.stream_steps, quantize.quantize)
      -> rANS, a block per token class           (rans.encode_block; RANS, TOKEN_STEPS)
      -> bytes                                   (bitstream.pack: header + substreams)

or, at CacheGen's own levels (DELTA), raw channels -> anchors and deltas (anchor) -> quantized
at each channel's sigma -> constriction's coder (entropy). What a chunk is coded with (its
level's transforms, its streams' steps, its token classes) comes in as a value, steps.Coding:
tuning chooses it (codec.tuning.named: `codec.encode(kv, "balanced", profile)` by a level's name).
"""
from __future__ import annotations

import numpy as np
import torch

from . import anchor, bitstream as bs, entropy, pca, rans, rope
from .profile import Profile
from .quantize import dequantize, quantize
from .steps import Coding, check_classes, class_step, stream_steps


def encode(kv: torch.Tensor, coding: Coding, profile: Profile, start: int = 0) -> bytes:
    """Compress one chunk of KV [L, 2, T, H, D] (fp16, bf16 or fp32) whose first token sits at
    absolute position `start`, coded as `coding` says (module docstring). Pure CPU work that
    holds the GIL: never call it on an event loop."""
    check(kv)
    L, _, T, H, D = kv.shape
    profile.check_shape(L, H, D)
    h = header_of(kv, coding, profile, start)
    angles = key_angles(h.transforms, start, h.sink_tokens, T, profile)
    h.substreams = [encode_stream(kv[layer, k_or_v], layer, k_or_v, h.transforms, h.steps, h.anchor_step, start,
                                  h.sink_tokens, profile, angles, layer_classes(h, layer))
                    for layer in range(L) for k_or_v in range(2)]
    return bs.pack(h)


def check(kv: torch.Tensor) -> None:
    """ValueError unless kv is a chunk the codec takes: [L, 2, T, H, D], T > 0, fp16, bf16 or fp32."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"KV must be [L, 2, T, H, D], got {tuple(kv.shape)}")
    if kv.dtype not in bs.DTYPE_CODES:
        raise ValueError(f"KV dtype {kv.dtype} not supported (fp16, bf16, fp32)")
    if kv.shape[2] == 0:
        raise ValueError("cannot encode an empty chunk")


def header_of(kv: torch.Tensor, coding: Coding, profile: Profile, start: int) -> bs.Header:
    """The header of chunk kv [L, 2, T, H, D] coded as `coding` with `profile` from position
    `start`, its substreams still to fill in: the transforms, sink rows, steps and token classes
    they are coded with, and what the bitstream says of itself (its layers among them). Every
    encoder (encode, codec.pool.parallel's pool) builds it here, so their chunks cannot differ.
    Token classes are kept only where the transforms take them (rANS) and rows follow the sink."""
    L, _, T, H, D = kv.shape
    transforms = transforms_for(coding.transforms, profile)
    ns = bs.sink_rows(start, profile.sink_tokens, T, transforms)
    sink = kv[:, :, :ns].contiguous().view(torch.uint8).numpy().tobytes() if ns else b""
    classes = None
    if coding.token_classes is not None and transforms & bs.RANS and T > ns:
        classes = np.ascontiguousarray(check_classes(coding.token_classes, L, T)[:, ns:])
    return bs.Header(transforms, coding.level, kv.dtype, L, H, D, T, start, profile.id, profile.group,
                     ns, coding.steps, coding.anchor_step, memoryview(sink), [], layer_ids_of(profile),
                     classes)


def layer_classes(h: bs.Header, layer: int) -> np.ndarray | None:
    """The token classes [T - sink rows] of a layer of chunk h, None without token steps."""
    return None if h.token_classes is None else h.token_classes[layer]


def transforms_for(transforms: int, profile: Profile) -> int:
    """A level's transforms, less key un-rotation for a model whose rotary scheme the codec
    cannot invert (its profile says so)."""
    return transforms if profile.unrotates_keys else transforms & ~bs.UNROTATE_KEYS


def layer_ids_of(profile: Profile) -> tuple[int, ...] | None:
    """What a chunk coded with `profile` records of its layers: None for all of them."""
    ids = profile.layer_indices
    return None if ids == tuple(range(profile.layers)) and not profile.meta.get("subset_of") else ids


def key_angles(transforms: int, start: int, sink_rows: int, tokens: int,
               profile: Profile) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """The RoPE angles the key streams of a chunk are un-rotated by, per rope kind of their
    layers (None if they are not un-rotated)."""
    if not transforms & bs.UNROTATE_KEYS:
        return None
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(profile.layers):
        kind = profile.rope_kind(layer)
        if kind not in out:
            out[kind] = rope.angles(start + sink_rows, tokens - sink_rows, profile.inv_freq(layer))
    return out


def encode_stream(x: torch.Tensor, layer: int, k_or_v: int, transforms: int, steps: np.ndarray,
                  anchor_step: float, start: int, sink_rows: int, profile: Profile,
                  angles: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                  classes: np.ndarray | None = None) -> bytes:
    """One substream: x [T, H, D] of one (layer, K/V); angles: key_angles of its chunk;
    classes: its layer's token classes (layer_classes), None where the chunk has none."""
    x = _channels(x, layer, k_or_v, transforms, start, sink_rows, profile, angles)
    n = x.shape[0]
    step = float(steps[layer, k_or_v])
    if transforms & bs.DELTA:
        mean = torch.from_numpy(profile.tensors["chan_mean"][layer, k_or_v])
        xc = x - mean
        d_step, a_step = stream_steps(profile, transforms, layer, k_or_v, step, anchor_step)
        a_sym = quantize(xc[anchor.anchor_rows(n, profile.group)], a_step)
        a_hat = dequantize(a_sym, a_step)
        d_sym = quantize(anchor.deltas(xc, a_hat, profile.group), d_step)
        return entropy.encode_blocks([(a_sym, profile.models("anchor", layer, k_or_v, anchor_step)),
                                      (d_sym, profile.models("delta", layer, k_or_v, step))])
    sym = transformed_symbols(x, layer, k_or_v, transforms, step, profile, classes)
    if classes is not None:  # a block per class, each with its step's models (bitstream.TOKEN_STEPS)
        return bs.join_classes([rans.encode_block(sym[rows], profile.rans_models(layer, k_or_v, class_step(step, c)))
                                for c, rows in bs.class_blocks(classes)])
    if transforms & bs.RANS:
        return rans.encode_block(sym, profile.rans_models(layer, k_or_v, step))
    return entropy.encode_blocks([(sym, profile.models("pca", layer, k_or_v, step))])


def _channels(x: torch.Tensor, layer: int, k_or_v: int, transforms: int, start: int, sink_rows: int,
              profile: Profile, angles: dict | None) -> torch.Tensor:
    """x [T, H, D] of one (layer, K/V) -> the channels [T - sink_rows, H*D] (float32) its
    quantizer sees: keys un-rotated where the transforms say."""
    x = x[sink_rows:].to(torch.float32)
    n = x.shape[0]
    if transforms & bs.UNROTATE_KEYS and k_or_v == 0:
        x = rope.unrotate(x, start + sink_rows, profile.inv_freq(layer),
                          angles.get(profile.rope_kind(layer)) if angles else None)
    return x.reshape(n, x.shape[1] * x.shape[2])


def transformed_symbols(x: torch.Tensor, layer: int, k_or_v: int, transforms: int, step: float,
                        profile: Profile, classes: np.ndarray | None = None) -> np.ndarray:
    """Channels x [n, C] of one stream -> its quantized symbols [n, C] (int32): PCA components
    at their steps (each token's times its class's multiplier, where it has classes), or the
    channels at one step (steps.stream_steps)."""
    if transforms & bs.PCA:
        x = pca.forward(x, torch.from_numpy(profile.tensors["pca_mean"][layer, k_or_v]), profile.basis(layer, k_or_v),
                        profile.channel_scale(layer, k_or_v))
    return quantize(x, stream_steps(profile, transforms, layer, k_or_v, step, 0.0, classes).symbols)


def roundtrip(kv: torch.Tensor, coding: Coding, profile: Profile, start: int = 0) -> torch.Tensor:
    """What decode(encode(kv, coding, profile, start)) gives, without the entropy coder either
    way (the same symbols, through the decoder's own inverse): what coding a chunk does to it,
    for a probe that prices it (kvstreamd.models.rate_probe). Levels without the entropy
    coder's lossless step between them (anchor/delta) are refused."""
    from .decoder import for_profile, fill_sink  # the inverse is the decoder's: one definition

    h = header_of(kv, coding, profile, start)
    if h.transforms & bs.DELTA:
        raise ValueError(f"roundtrip() takes the PCA levels, not anchor/delta (level code {h.level})")
    angles = key_angles(h.transforms, start, h.sink_tokens, kv.shape[2], profile)
    sym = np.stack([transformed_symbols(_channels(kv[layer, k_or_v], layer, k_or_v, h.transforms, start,
                                                  h.sink_tokens, profile, angles),
                                        layer, k_or_v, h.transforms, float(h.steps[layer, k_or_v]), profile,
                                        layer_classes(h, layer)).T
                    for layer in range(h.layers) for k_or_v in range(2)])
    out = torch.empty(kv.shape, dtype=kv.dtype)
    for_profile(profile).from_symbols(h, torch.from_numpy(np.ascontiguousarray(sym, np.float32)), out)
    fill_sink(h, out)
    return out
