"""The adapter's attention (models/attention.py): queries packed per KV head give what
transformers' own sdpa gives, on tiny random models of both shipped architectures (Llama's
grouped queries; Gemma-3's sliding and global layers), for the blocks a receiver runs on a
cache: a TEXT chunk after a prefix, a question after a fetched context, and one token."""
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
@pytest.mark.parametrize("prefix,block", [(100, 19), (64, 64), (130, 1), (30, 25), (40, 200)])
def test_packed_queries_give_transformers_sdpa_logits_on_a_cache(make, prefix, block):
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
