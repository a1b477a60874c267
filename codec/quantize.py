"""Uniform scalar quantization with a step per (layer, K/V) -- or per channel in CacheGen's
paper configuration -- and the sensitivity-driven choice of those steps."""
from __future__ import annotations

import numpy as np
import torch


def quantize(y: torch.Tensor, step: torch.Tensor) -> np.ndarray:
    """y: [N, C] float32; step: scalar or [C]. Returns int32 symbols (round to nearest)."""
    return torch.round(y / step).to(torch.int32).numpy()


def dequantize(symbols: np.ndarray, step: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(symbols).to(torch.float32, memory_format=torch.contiguous_format) * step


def equal_slope_steps(sensitivity: np.ndarray, kl_budget: float) -> np.ndarray:
    """Steps for each (layer, K/V) stream so that every stream adds the same predicted KL.

    sensitivity[l, kv] is the KL divergence per unit of per-element squared error when only
    that stream is perturbed. Uniform quantization adds step^2/12 per element, so giving each
    of the N streams kl_budget / N makes the step 1/sqrt(sensitivity), scaled to the budget.
    """
    w = np.maximum(np.asarray(sensitivity, dtype=np.float64), 1e-12)
    n = w.size
    return np.sqrt(12.0 * kl_budget / (n * w)).astype(np.float32)
