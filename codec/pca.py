"""The PCA rotation of one (layer, K/V) stream: channels minus their mean, rotated into
orthonormal components sorted by variance, in independent blocks of channels (one block per
KV head, or one block of all heads). Orthonormal, so a quantization error in components is
the same error in channels.

A profile may weight the channels first (`scale` [C], each channel's error weight's square
root): the rotation is then fitted to, and applied on, the weighted channels, so a uniform step
on the components spends its error where it costs least -- the weighted KLT, which decorrelates
the signal in the metric the model's error is measured in. Without a scale, the plain
rotation of before."""
from __future__ import annotations

import torch


def fit(x: torch.Tensor, block: int, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, C] samples; scale: [C] channel weights' roots, or None. Returns mean [C] (of the
    channels, unweighted) and bases [C // block, block, block] (float64) of the (weighted)
    channels, columns by decreasing variance within each block."""
    mean = x.mean(0)
    xc = (x - mean).to(torch.float64)
    if scale is not None:
        xc = xc * scale.to(torch.float64)
    bases = []
    for b in xc.split(block, dim=1):
        evals, evecs = torch.linalg.eigh(b.T @ b / b.shape[0])
        bases.append(evecs[:, torch.argsort(evals, descending=True)])
    return mean, torch.stack(bases)


def forward(x: torch.Tensor, mean: torch.Tensor, bases: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[T, C] channels -> [T, C] components (block-major, as fit orders them); scale as fit's."""
    nb, b, _ = bases.shape
    xc = x - mean
    if scale is not None:
        xc = xc * scale
    xc = xc.view(-1, nb, b).transpose(0, 1)  # [nb, T, b]
    return torch.bmm(xc, bases).transpose(0, 1).reshape(x.shape[0], nb * b)


def scaled_bases(steps: torch.Tensor, bases: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[blocks, b, b]: each block's basis with column c scaled by the step of component c (and
    row i divided by channel i's `scale`, which undoes the weighting) -- the transpose of the
    inverse's GEMM operand (to_channels), kept contiguous: the layout the GEMM has always been
    given, which decides how it rounds. Depends only on the stream and its step, so decoders
    keep it."""
    nb, b, _ = bases.shape
    out = bases * steps.view(nb, 1, b)
    return out if scale is None else out / scale.view(nb, b, 1)


def to_channels(symbols: torch.Tensor, means: torch.Tensor, scaled: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """The inverse rotation of S streams at once: component-major symbols [S, C, T] (float32)
    times their steps, rotated back, plus the mean -> channels [S, T, C]. means [S * blocks, 1,
    b] and scaled [S * blocks, b, b] (scaled_bases) on the symbols' device: one batched GEMM
    with the step, the transpose and the mean folded in; `alpha`: a multiplier on every step
    (a class of tokens' under per-token steps, codec.steps), folded in too."""
    S, C, n = symbols.shape
    b = scaled.shape[-1]
    nb = C // b
    y = symbols.view(S * nb, b, n).transpose(-1, -2)  # [blocks, T, b]
    w = scaled.transpose(-1, -2)
    if symbols.device.type == "cpu" and n * b * b < 400:
        # torch's CPU baddbmm takes a naive loop below this size, which rounds unlike the
        # BLAS GEMM that decodes every other chunk: block by block, as chunks always were.
        x = torch.empty((S * nb, n, b), dtype=torch.float32)
        for i in range(S * nb):
            torch.addmm(means[i, 0], y[i], w[i], alpha=alpha, out=x[i])
    else:
        x = torch.baddbmm(means, y, w, alpha=alpha)
    if nb == 1:
        return x.view(S, n, C)
    return x.view(S, nb, n, b).permute(0, 2, 1, 3).reshape(S, n, C)
