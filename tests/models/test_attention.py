"""The adapter's attention (models/attention.py): queries packed per KV head give what
transformers' own sdpa gives, on tiny random models of both shipped architectures (Llama's
grouped queries; Gemma-3's sliding and global layers), for the blocks a receiver runs on a
cache: a TEXT chunk after a prefix, a question after a fetched context (on a cache long enough
for the matrix-product path too), and one token."""
from __future__ import annotations

import pytest
import torch

from kvstreamd.models import attention
from kvstreamd.models.adapter import cache_kwarg, empty_cache


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                        max_position_embeddings=4096)).eval()


def _gemma():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(1)
    return Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=40,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()


def _logits(model, impl: str, prefix: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    model.set_attn_implementation(impl)
    cache = {cache_kwarg(model): empty_cache(model.config)}
    with torch.no_grad():
        model(input_ids=prefix[None], use_cache=True, **cache)
        return model(input_ids=block[None], use_cache=True, **cache).logits[0]


@pytest.mark.parametrize("make", [_llama, _gemma], ids=["llama", "gemma3"])
@pytest.mark.parametrize("prefix,block", [(100, 19), (64, 64), (130, 1), (30, 25), (40, 200),
                                          (attention.PRODUCTS_MIN_KEYS + 20, 17)])
def test_packed_queries_give_transformers_sdpa_logits_on_a_cache(make, prefix, block, monkeypatch):
    monkeypatch.setattr(attention.torch, "get_num_threads", lambda: 2)  # Gemma's long cache: the products, on any machine
    model = make()
    ids = torch.randint(2, 300, (prefix + block,), generator=torch.Generator().manual_seed(prefix))
    attention.register()
    want = _logits(model, "sdpa", ids[:prefix], ids[prefix:])
    got = _logits(model, attention.NAME, ids[:prefix], ids[prefix:])
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())


def test_a_short_block_on_a_cache_takes_the_packed_path_and_a_long_one_transformers(monkeypatch):
    """The packed path is the one run for a question-sized block on a cache; a prefill's long
    block (where packing is slower) goes to transformers' sdpa."""
    from transformers.integrations import sdpa_attention

    model, calls = _llama(), []
    real = sdpa_attention.sdpa_attention_forward
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    attention.register()
    ids = torch.arange(2, 60)
    _logits(model, attention.NAME, ids[:40], ids[40:])
    assert calls == [1, 1]  # the prefix (no cache, causal without a mask) went to transformers'; the block did not
    calls.clear()
    long = torch.arange(2, 42 + attention.PACK_MAX_QUERIES + 1) % 300
    _logits(model, attention.NAME, long[:40], long[40:])
    assert calls == [1, 1, 1, 1]  # both layers, both blocks


def test_a_block_on_a_long_cache_is_computed_as_matrix_products(monkeypatch):
    """A question-sized block over a cache of PRODUCTS_MIN_KEYS tokens or more, with fewer KV
    heads than threads, goes through _products (Gemma-3's full-attention layers; its sliding ones
    hold a window), a shorter cache, or as many KV heads as threads, through torch's sdpa."""
    calls = []
    real = attention._products
    monkeypatch.setattr(attention, "_products", lambda *a: calls.append(a[1].shape[2]) or real(*a))
    monkeypatch.setattr(attention.torch, "get_num_threads", lambda: 2)
    attention.register()
    n = attention.PRODUCTS_MIN_KEYS
    ids = torch.arange(n + 19) % 298 + 2
    _logits(_gemma(), attention.NAME, ids[:100], ids[100:119])
    assert calls == []
    _logits(_gemma(), attention.NAME, ids[:n], ids[n:])
    assert calls == [n + 19] * 2  # the two full-attention layers, over the cache and the block
    calls.clear()
    _logits(_llama(), attention.NAME, ids[:n], ids[n:])  # 2 KV heads on 2 threads: sdpa's work already spreads
    assert calls == []


def test_products_give_zeros_for_a_row_that_sees_no_key():
    q, k = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 5, 8)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = attention._products(q, k, k, mask, 8 ** -0.5)
    assert torch.equal(out[0, 0, 1], torch.zeros(8))
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, [0, 2]], k, k)
    assert torch.allclose(out[:, :, [0, 2]], want, atol=1e-6)
