"""CacheGen's anchor/delta step: tokens in groups, the first of each group is the anchor and
the others are coded as deltas against it (not against the previous token), so every token
decodes independently of its neighbours."""
from __future__ import annotations

import torch


def anchor_rows(n_tokens: int, group: int) -> torch.Tensor:
    """Indices of the anchor tokens: 0, group, 2*group, ..."""
    return torch.arange(0, n_tokens, group)


def delta_rows(n_tokens: int, group: int) -> torch.Tensor:
    """Indices of the non-anchor tokens, in order."""
    idx = torch.arange(n_tokens)
    return idx[idx % group != 0]


def deltas(x: torch.Tensor, anchors: torch.Tensor, group: int) -> torch.Tensor:
    """x: [T, C]; anchors: [ceil(T/group), C] (the reconstructed anchors, so the encoder
    codes against what the decoder will have). Returns [T - n_anchors, C]."""
    rows = delta_rows(x.shape[0], group)
    return x[rows] - anchors[rows // group]


def merge(anchors: torch.Tensor, delta: torch.Tensor, n_tokens: int, group: int) -> torch.Tensor:
    """Inverse of the split: anchors and deltas -> [T, C]."""
    out = torch.empty((n_tokens, anchors.shape[1]), dtype=anchors.dtype)
    out[anchor_rows(n_tokens, group)] = anchors
    rows = delta_rows(n_tokens, group)
    out[rows] = delta + anchors[rows // group]
    return out
