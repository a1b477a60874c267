"""encode(): CacheGen's steps composed in the paper's order -- transform, quantize,
entropy-code -- per (layer, K/V) substream, each independent of the others. The inverse is
codec/decoder.py's."""
from __future__ import annotations

import numpy as np
import torch

from . import anchor, bitstream as bs, entropy, levels, pca, rans, rope
from .profile import Profile
from .quantize import dequantize, quantize


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
    ns = bs.sink_rows(start, profile.sink_tokens, T, lv.transforms)
    sink = kv[:, :, :ns].contiguous().view(torch.uint8).numpy().tobytes() if ns else b""
    cos_sin = key_angles(lv.transforms, start, ns, T, profile)
    subs = [encode_stream(kv[layer, k_or_v], layer, k_or_v, lv.transforms, steps, lv.anchor_step, start, ns, profile,
                          cos_sin) for layer in range(L) for k_or_v in range(2)]
    header = bs.Header(lv.transforms, lv.code, kv.dtype, L, H, D, T, start, profile.id, profile.group,
                       ns, steps, lv.anchor_step, memoryview(sink), subs)
    return bs.pack(header)


def key_angles(transforms: int, start: int, sink_rows: int, tokens: int,
               profile: Profile) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The RoPE angles every key stream of a chunk is un-rotated by (None if it is not)."""
    if not transforms & bs.UNROTATE_KEYS:
        return None
    return rope.angles(start + sink_rows, tokens - sink_rows, profile.head_dim, profile.rope_theta)


def encode_stream(x: torch.Tensor, layer: int, k_or_v: int, transforms: int, steps: np.ndarray,
                  anchor_step: float, start: int, sink_rows: int, profile: Profile,
                  cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> bytes:
    """One substream: x [T, H, D] of one (layer, K/V); cos_sin: key_angles of its chunk."""
    x = x[sink_rows:].to(torch.float32)
    n = x.shape[0]
    step = float(steps[layer, k_or_v])
    if transforms & bs.UNROTATE_KEYS and k_or_v == 0:
        x = rope.unrotate(x, start + sink_rows, profile.rope_theta, cos_sin)
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
    if transforms & bs.RANS:
        return rans.encode_block(sym, profile.rans_models(layer, k_or_v, step))
    return entropy.encode_blocks([(sym, profile.models("pca", layer, k_or_v, step))])
