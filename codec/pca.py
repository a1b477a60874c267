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
    inverse_scaled_into(out, symbols, mean, scaled_inverse(steps, bases))


def scaled_inverse(steps: torch.Tensor, bases: torch.Tensor) -> list[torch.Tensor]:
    """Per block, the GEMM operand of inverse_into: the basis transposed, row c scaled by the
    step of component c -- a transposed view of a contiguous tensor (the layout the GEMM has
    always been given: it decides how the GEMM rounds). Depends only on the stream and its
    step, so decoders cache it."""
    nb, b, _ = bases.shape
    return [(bases[i] * steps[i * b:(i + 1) * b]).T for i in range(nb)]


def inverse_scaled_into(out: torch.Tensor, symbols: torch.Tensor, mean: torch.Tensor,
                        scaled: list[torch.Tensor]) -> None:
    """inverse_into with the operands of scaled_inverse."""
    if len(scaled) == 1:
        torch.addmm(mean, symbols.T, scaled[0], out=out)
        return
    b = scaled[0].shape[0]
    for i, m in enumerate(scaled):
        blk = slice(i * b, (i + 1) * b)
        out[:, blk] = torch.addmm(mean[blk], symbols[blk].T, m)
