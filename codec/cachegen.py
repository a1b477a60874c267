"""encode() and decode(): CacheGen's steps composed in the paper's order -- transform,
quantize, entropy-code -- per (layer, K/V) substream, each independent of the others."""
from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from . import anchor, bitstream as bs, entropy, levels, pca, profile as profiles, rans, rope
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
    if transforms & bs.RANS:
        return rans.encode_block(sym, profile.rans_models(layer, k_or_v, step))
    return entropy.encode_blocks([(sym, profile.models("pca", layer, k_or_v, step))])


def decode_stream_into(h: bs.Header, s: int, profile: Profile, out: torch.Tensor) -> None:
    """Substream s -> out [T - sink, H, D] (a view into the chunk's tensor, any float dtype).
    The work happens in a small float32 buffer that stays in cache; out gets one converting
    write (for keys, the re-rotation's last step writes it)."""
    direct = out.dtype == torch.float32 and out.is_contiguous()
    work = out if direct else torch.empty(out.shape, dtype=torch.float32)
    layer, k_or_v = divmod(s, 2)
    n = h.tokens - h.sink_tokens
    step = float(h.steps[layer, k_or_v])
    data = h.substreams[s]
    flat = work.view(n, h.heads * h.head_dim)
    scratch = None
    if h.transforms & bs.DELTA:
        rows_a = len(anchor.anchor_rows(n, h.group))
        (a_sym, _), (d_sym, _) = entropy.decode_blocks(data, [(rows_a, profile.models("anchor", layer, k_or_v, h.anchor_step)),
                                                              (n - rows_a, profile.models("delta", layer, k_or_v, step))])
        a_hat = dequantize(a_sym.T, torch.from_numpy(profile.tensors["anchor_sigma"][layer, k_or_v]) * h.anchor_step)
        d_hat = dequantize(d_sym.T, torch.from_numpy(profile.tensors["delta_sigma"][layer, k_or_v]) * step)
        flat.copy_(anchor.merge(a_hat, d_hat, n, h.group) + torch.from_numpy(profile.tensors["chan_mean"][layer, k_or_v]))
    else:
        if h.transforms & bs.RANS:
            sym, _ = rans.decode_block(data, n, profile.rans_models(layer, k_or_v, step))
        else:
            ((sym, _),) = entropy.decode_blocks(data, [(n, profile.models("pca", layer, k_or_v, step))])
        if h.transforms & bs.PCA:
            mean, scaled = _pca_inverse(h, profile, layer, k_or_v)
            # Converted in place (int32 and float32 have the same size): one buffer fewer.
            scratch = torch.from_numpy(sym.view(np.float32))
            scratch.copy_(torch.from_numpy(sym))
            pca.inverse_scaled_into(flat, scratch, mean, scaled)
        else:
            flat.copy_(dequantize(sym.T, torch.tensor(step)))
    if h.transforms & bs.UNROTATE_KEYS and k_or_v == 0:
        # The symbols' float copy is dead once the GEMM has run: the rotation works in it.
        rope.rerotate_into(work, h.start + h.sink_tokens, profile.rope_theta, out, scratch)
    elif not direct:
        out.copy_(work)


# The GEMM operands of the inverse PCA (pca.scaled_inverse) of every stream, one tensor per
# (profile, step table): a chunk's header fixes all its streams' steps, and the chunks of a
# level share them. Built in one piece (many small long-lived tensors among the decoder's
# large short-lived buffers fragment the heap), least recently used dropped first, and only
# while they fit SCALED_BASES_BUDGET bytes; beyond it, each stream scales its own.
SCALED_BASES_BUDGET = 64 << 20
_scaled_bases: OrderedDict[tuple[bytes, bytes], torch.Tensor] = OrderedDict()
_scaled_bases_lock = threading.Lock()


def _scaled_bases_table(profile: Profile, steps: np.ndarray) -> torch.Tensor | None:
    """[L, 2, blocks, b, b] for the steps [L, 2] of a chunk (each block transposed), or None
    where it would not fit."""
    L = profile.layers
    nb, b, _ = profile.basis(0, 0).shape
    table_bytes = L * 2 * nb * b * b * 4
    if table_bytes > SCALED_BASES_BUDGET:
        return None
    key = (profile.id, np.ascontiguousarray(steps, np.float32).tobytes())
    with _scaled_bases_lock:
        table = _scaled_bases.get(key)
        if table is not None:
            _scaled_bases.move_to_end(key)
            return table
    # Stored as the contiguous tensors that scaled_inverse's operands are transposed views of:
    # the GEMM must see the same layout to round the same way.
    blocks = [m.T for layer in range(L) for kv in range(2)
              for m in pca.scaled_inverse(profile.component_steps(layer, kv, float(steps[layer, kv])),
                                          profile.basis(layer, kv))]
    table = torch.stack(blocks).view(L, 2, nb, b, b)
    with _scaled_bases_lock:
        _scaled_bases[key] = table
        while len(_scaled_bases) * table_bytes > SCALED_BASES_BUDGET:
            _scaled_bases.popitem(last=False)
    return table


def _pca_inverse(h: bs.Header, profile: Profile, layer: int, k_or_v: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The mean and the step-scaled bases of one PCA stream of chunk h."""
    mean = torch.from_numpy(profile.tensors["pca_mean"][layer, k_or_v])
    table = _scaled_bases_table(profile, h.steps)
    if table is None:
        step = float(h.steps[layer, k_or_v])
        return mean, pca.scaled_inverse(profile.component_steps(layer, k_or_v, step), profile.basis(layer, k_or_v))
    return mean, [m.T for m in table[layer, k_or_v]]


def warm(profile: Profile, level: str | levels.Level) -> None:
    """Build every entropy model that coding at `level` uses, and what decoding it uses, ahead
    of the first chunk."""
    lv = levels.get(level)
    steps = lv.steps(profile)
    if lv.transforms & bs.PCA:
        _scaled_bases_table(profile, steps)
    for layer in range(profile.layers):
        for k_or_v in range(2):
            step = float(steps[layer, k_or_v])
            if lv.transforms & bs.DELTA:
                profile.models("anchor", layer, k_or_v, lv.anchor_step)
                profile.models("delta", layer, k_or_v, step)
            elif lv.transforms & bs.RANS:
                profile.rans_models(layer, k_or_v, step)
            else:
                profile.models("pca", layer, k_or_v, step)


def read(data: bytes | memoryview, profile: Profile | None = None, check_crc: bool = True) -> tuple[bs.Header, Profile]:
    """Validate a bitstream and find its profile (the one given, or the registry's)."""
    h = bs.unpack(data, check_crc)
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
