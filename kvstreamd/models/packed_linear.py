"""The linear layers the adapter runs on a CPU: a block of a few rows (the question after a
fetched context, each generated token) goes through oneDNN with the weight packed once, at its
first such block, where `F.linear` hands it to MKL.

Measured on this machine's two cores (fp32, weights read cold, scratch over 60 layers each):
Gemma-3-270M's MLP projections for 17 rows 19 against 53 ms (640 -> 2048) and 18 against 38 ms
(2048 -> 640), one row 13 against 27 ms; its tied 262144 x 640 output head (671 MB) for one row
22-24 against 55 ms, where MKL's one-row GEMV runs on one core. The question after a 16K-token
Gemma-3 context ran 0.132 against 0.217 s with this and attention.py's products together
(docs/benchmarks.md "The question on a CPU"). Longer blocks (a prefill's steps, a TEXT chunk)
go as before, so a context's KV is computed as it always was. The sums are the same products in
another order: within 1e-5 of `F.linear` (tests/models/test_packed_linear.py). The packed copy is memory of its own (the size of the
weights it packs), taken only by a process that runs such blocks."""
from __future__ import annotations

import torch
from torch import nn

# Blocks of at most this many rows are packed: a question (17-25 tokens), a generated token, a rate
# probe (64). A prefill's steps (128 tokens and up) and TEXT chunks are not: at 128, a 500-token
# SmolLM2 prefill in steps came 1.5e-4 from one pass's KV (2.4e-5 with both on MKL).
MAX_ROWS = 64
_OPS = getattr(torch.ops, "mkldnn", None)


def available() -> bool:
    return (torch.backends.mkldnn.is_available() and _OPS is not None
            and hasattr(_OPS, "_linear_pointwise") and hasattr(_OPS, "_reorder_linear_weight"))


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward, for at most MAX_ROWS rows of float32 on a CPU without
    autograd, runs oneDNN on a packed copy of its weight (made at the first such call, made
    again if the weight changes). Made by `pack` from a model's own layers: the same
    Parameters, so a head tied to the embedding stays tied."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (not 0 < rows <= MAX_ROWS or x.device.type != "cpu" or x.dtype != torch.float32
                or self.weight.dtype != torch.float32 or torch.is_grad_enabled()):
            return super().forward(x)
        packed = self.__dict__.get("_packed")
        if packed is None or packed[0] != self.weight._version:
            packed = (self.weight._version, _OPS._reorder_linear_weight(self.weight.detach(), rows))
            self.__dict__["_packed"] = packed
        out = _OPS._linear_pointwise(x.reshape(rows, x.shape[-1]).contiguous(), packed[1], self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])


def pack(model) -> int:
    """Make every plain nn.Linear of `model` a PackedLinear, in place (nothing is packed
    until it runs a few rows); returns how many (0 where this torch lacks oneDNN's ops)."""
    if not available():
        return 0
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
            n += 1
    return n
