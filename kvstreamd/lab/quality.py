"""How much a decompressed KV cache changes what the model predicts: perplexity, KL
divergence of next-token distributions and top-1 agreement against the exact cache."""
from __future__ import annotations

import math

import torch

from ..models.rate_probe import kl  # noqa: F401  (one definition: what rate control aims at is what the benches report)


def nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean negative log-likelihood of targets [N] under logits [N, vocab]."""
    return float(torch.nn.functional.cross_entropy(logits.float(), targets.long()))


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(nll(logits, targets))


def top1_agreement(reference: torch.Tensor, test: torch.Tensor) -> float:
    return float((reference.argmax(-1) == test.argmax(-1)).float().mean())
