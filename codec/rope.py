"""Undo and redo rotary position embeddings on keys (the rotate-half layout of Llama, Qwen,
Mistral, Gemma), at any frequencies: the model's own, per layer where it has several kinds.

Keys in a model's cache are post-RoPE; rotating them back to position 0 removes the
position-dependent spin, which concentrates their variance into fewer PCA components. The
un-rotation need not match the model's float32 angles bit for bit: the decoder re-rotates by
the same angles the encoder un-rotated by, so the round trip is exact whatever they are, and a
frequency-independent scale (yarn's attention factor) passes through untouched.
"""
from __future__ import annotations

import torch


def default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """[head_dim/2] float64: the frequencies of plain RoPE with base `theta` (Llama's "default").
    Models with other schemes (linear, yarn, llama3, per layer type) give their own, which a
    profile records (codec.profile.Profile.inv_freq)."""
    return 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def angles(start: int, n: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 1, head_dim/2] float32 cos and sin of positions start..start+n at frequencies inv_freq."""
    # float64 angles: positions up to ~1e5 times frequencies near 1 lose precision in fp32.
    a = torch.arange(start, start + n, dtype=torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    return a.cos().to(torch.float32)[:, None, :], a.sin().to(torch.float32)[:, None, :]


def _rotate(x: torch.Tensor, start: int, inv_freq: torch.Tensor, sign: float,
            cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """x: [T, H, D] float32 -> a new tensor, each token rotated by sign * its position's angles."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin if cos_sin is not None else angles(start, x.shape[0], inv_freq)
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin * sign)
    torch.mul(x2, cos, out=out[..., half:]).add_(x1 * sin * sign)
    return out


def unrotate(keys: torch.Tensor, start: int, inv_freq: torch.Tensor,
             cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Post-RoPE keys [T, H, D] at positions start.. -> the same keys at position 0. cos_sin:
    angles(start, T, inv_freq) where the caller has them (every key stream of a chunk whose
    layers share the frequencies shares them)."""
    return _rotate(keys, start, inv_freq, -1.0, cos_sin)


def rerotate(keys: torch.Tensor, start: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Inverse of unrotate: keys at position 0 -> post-RoPE keys at positions start.."""
    return _rotate(keys, start, inv_freq, 1.0, None)


def rerotation(start: int, n: int, heads: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, heads, head_dim] float32 (cos, cos) and (-sin, sin), laid out like the keys so the
    decoder's multiplies run over plain contiguous memory (broadcasting over heads is slower).
    Every key stream of a chunk with these frequencies shares one: decoders keep them."""
    cos, sin = angles(start, n, inv_freq)
    head_dim = 2 * inv_freq.numel()
    shape = (n, heads, head_dim)
    return (torch.cat([cos, cos], -1).expand(shape).contiguous(),
            torch.cat([-sin, sin], -1).expand(shape).contiguous())


def rerotate_into(keys: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor,
                  scratch: torch.Tensor) -> None:
    """out = rerotate(keys, start, theta) for keys [..., n, heads, head_dim] float32 (any
    number of streams) and tables = rerotation(start, n, ...) on keys' device, written in out's
    dtype with a single rounding. keys is overwritten; scratch is a float32 buffer of keys'
    shape to work in. The same products and sums as _rotate -- x1*cos - x2*sin is exactly
    x1*cos + x2*(-sin) -- so the values are bit-identical."""
    half = keys.shape[-1] // 2
    cos, sin = tables
    torch.mul(keys[..., half:], sin[..., :half], out=scratch[..., :half])
    torch.mul(keys[..., :half], sin[..., half:], out=scratch[..., half:])
    keys.mul_(cos)
    torch.add(keys, scratch, out=out)
