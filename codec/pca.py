"""The PCA rotation of one (layer, K/V) stream: channels minus their mean, rotated into
orthonormal components sorted by variance, in independent blocks of channels (one block per
KV head, or one block of all heads). Orthonormal, so a quantization error in components is
the same error in channels."""
from __future__ import annotations

import torch


def fit(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, C] samples. Returns mean [C] and bases [C // block, block, block] (float64),
    columns by decreasing variance within each block."""
    mean = x.mean(0)
    xc = (x - mean).to(torch.float64)
    bases = []
    for b in xc.split(block, dim=1):
        evals, evecs = torch.linalg.eigh(b.T @ b / b.shape[0])
        bases.append(evecs[:, torch.argsort(evals, descending=True)])
    return mean, torch.stack(bases)


def forward(x: torch.Tensor, mean: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """[T, C] channels -> [T, C] components (block-major, as fit orders them)."""
    nb, b, _ = bases.shape
    xc = (x - mean).view(-1, nb, b).transpose(0, 1)  # [nb, T, b]
    return torch.bmm(xc, bases).transpose(0, 1).reshape(x.shape[0], nb * b)


def inverse(y: torch.Tensor, mean: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """[T, C] components -> [T, C] channels."""
    nb, b, _ = bases.shape
    yb = y.view(-1, nb, b).transpose(0, 1)
    return torch.bmm(yb, bases.transpose(1, 2)).transpose(0, 1).reshape(y.shape[0], nb * b) + mean


def inverse_into(out: torch.Tensor, symbols: torch.Tensor, steps: torch.Tensor, mean: torch.Tensor,
                 bases: torch.Tensor) -> None:
    """out [T, C] = component-major symbols [C, T] times their steps [C], rotated back, plus the mean.

    The decoder's hot path: step and the transpose fold into one GEMM per block, written
    straight into the destination."""
    nb, b, _ = bases.shape
    if nb == 1:
        torch.addmm(mean, symbols.T, bases[0].T * steps[:, None], out=out)
        return
    for i in range(nb):
        blk = slice(i * b, (i + 1) * b)
        out[:, blk] = torch.addmm(mean[blk], symbols[blk].T, bases[i].T * steps[blk, None])
