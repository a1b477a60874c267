"""The adapter's linear layers (models/packed_linear.py): a few rows through oneDNN give
F.linear's, a model's head stays tied to its embedding, a prompt's many rows and autograd go
as before, and a changed weight is packed again."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvstreamd.models import packed_linear

def _tied():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).eval()


def _packed(lin: nn.Linear) -> nn.Linear:
    holder = nn.Sequential(lin)
    assert packed_linear.pack(holder) == 1
    return lin


@pytest.mark.parametrize("rows", [1, 17, packed_linear.MAX_ROWS, packed_linear.MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_rows_give_linear_outputs(rows, bias):
    lin = nn.Linear(64, 300, bias=bias)
    x = torch.randn(1, rows, 64)
    with torch.no_grad():
        want = lin(x)
        got = _packed(lin)(x)
    assert isinstance(lin, packed_linear.PackedLinear)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())


def test_only_a_few_rows_without_autograd_are_packed():
    lin = _packed(nn.Linear(16, 32, bias=False))
    with torch.no_grad():
        lin(torch.randn(packed_linear.MAX_ROWS + 1, 16))
        assert "_packed" not in lin.__dict__  # a prefill's block: F.linear
    out = lin(torch.randn(3, 16))  # autograd on: F.linear, and the gradient flows
    out.sum().backward()
    assert lin.weight.grad is not None and "_packed" not in lin.__dict__
    with torch.no_grad():
        lin(torch.randn(3, 16))
    assert "_packed" in lin.__dict__


def test_a_changed_weight_is_packed_again():
    lin = _packed(nn.Linear(16, 32, bias=False))
    x = torch.randn(2, 16)
    with torch.no_grad():
        lin(x)
        lin.weight.mul_(2)
        assert torch.allclose(lin(x), x @ lin.weight.t(), atol=1e-5)


def test_a_model_keeps_its_tied_head_and_gives_its_logits():
    model = _tied()
    ids = torch.tensor([[5, 17, 300, 2]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert packed_linear.pack(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the head
        assert model.lm_head.weight is model.model.embed_tokens.weight
        got = model(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())
