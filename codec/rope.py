"""Undo and redo rotary position embeddings on keys (Llama's rotate-half layout).

Keys in a model's cache are post-RoPE; rotating them back to position 0 removes the
position-dependent spin, which concentrates their variance into fewer PCA components.
"""
from __future__ import annotations

import torch


def _cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    # float64 angles: positions up to ~1e5 times frequencies near 1 lose precision in fp32.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, sign: float) -> torch.Tensor:
    """x: [T, H, D] float32; rotate each token by sign * its position's angles."""
    d = x.shape[-1]
    cos, sin = _cos_sin(positions, d, theta)
    cos, sin = cos[:, None, :], sin[:, None, :] * sign
    half = d // 2
    rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated_half * sin


def unrotate(keys: torch.Tensor, start: int, theta: float) -> torch.Tensor:
    """Post-RoPE keys [T, H, D] at positions start.. -> the same keys at position 0."""
    positions = torch.arange(start, start + keys.shape[0])
    return _rotate(keys, positions, theta, -1.0)


def rerotate(keys: torch.Tensor, start: int, theta: float) -> torch.Tensor:
    """Inverse of unrotate: keys at position 0 -> post-RoPE keys at positions start.."""
    positions = torch.arange(start, start + keys.shape[0])
    return _rotate(keys, positions, theta, 1.0)
