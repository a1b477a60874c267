"""The attention the adapter loads models with: transformers' "sdpa", with the queries of a
grouped-query model packed per KV head where transformers would copy the keys and values.

On a CPU, transformers' sdpa hands torch grouped-query attention only without a mask, so a
block of tokens run on a cache (the question after a fetched context) first copies every
layer's cached K and V once per query head sharing them (`repeat_kv`: 3x for SmolLM2, 4x for
Gemma-3-270M). Packing a short block's queries instead, as transformers itself does for a single
token (`pack_gqa`), attends over the cache as it lies:
the same sums, bit for bit on SmolLM2, and the e2e question's 19 tokens on a 4096-token cache
in 0.19 s where the copies take 0.26 s (8192: 0.27 s against 0.39 s; two cores,
docs/benchmarks.md)."""
from __future__ import annotations

import contextvars

import torch

NAME = "kvstreamd_sdpa"
# Blocks of at most this many queries are packed. The copies packing saves grow with the cache
# alone, the mask rows it repeats with the block too: on a 4096-token SmolLM2 cache, packing saved
# 0.09-0.12 s for blocks of 19-128 tokens and nothing at 256, and a 2048-token block (a prefill's
# second) ran 0.2-1.0 s slower packed.
PACK_MAX_QUERIES = 128
# A packed block of at most PRODUCTS_MAX_ROWS rows over at least PRODUCTS_MIN_KEYS cached tokens,
# with fewer KV heads than the process has threads, is computed as two matrix products and a
# softmax (_products), which MKL spreads over every core: torch's CPU flash attention splits its
# work by KV head and query block, and the question's 68 packed rows on Gemma-3-270M's one KV head
# are one piece of it. Two cores: 14.0 against 19.1 ms a layer over 16384 tokens, 0.69 against
# 0.86 ms over 1024; SmolLM2's three KV heads keep every core busy in sdpa, which stays 1.3-2.3x
# faster there, as it is for Gemma's 512 rows of a 128-token block (docs/benchmarks.md).
PRODUCTS_MIN_KEYS = 1024
PRODUCTS_MAX_ROWS = 128
# What else sees each call's queries and keys, while it is set: (module, query, key, scaling,
# softcap) -> None (token_weight.recording). None: nothing does.
OBSERVER: contextvars.ContextVar = contextvars.ContextVar("kvstreamd_attention_observer", default=None)


def sdpa_packed(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature: query [B, Hq, q, D], key and value
    [B, Hkv, k, D]; returns ([B, q, Hq, D], None). Anything but a block of 2 to PACK_MAX_QUERIES
    queries over a mask that every head shares goes to transformers' sdpa unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    observer = OBSERVER.get()
    if observer is not None:
        observer(module, query, key, scaling, kwargs.get("softcap"))
    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q, d = query.shape
    if (groups == 1 or not 1 < q <= PACK_MAX_QUERIES or attention_mask is None or attention_mask.shape[1] != 1
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions", False)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    # query head h reads KV head h // groups: rows [kv head, group member, token]
    packed = query.reshape(b, heads // groups, groups * q, d)
    mask = attention_mask[:, :, :, : key.shape[2]].repeat(1, 1, groups, 1)
    if (key.shape[2] >= PRODUCTS_MIN_KEYS and packed.shape[2] <= PRODUCTS_MAX_ROWS and key.device.type == "cpu"
            and b * key.shape[1] < torch.get_num_threads() and not dropout):
        out = _products(packed, key, value, mask, d ** -0.5 if scaling is None else scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask,
                                                               dropout_p=dropout, scale=scaling)
    return out.reshape(b, heads, q, value.shape[-1]).transpose(1, 2).contiguous(), None


def _products(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
              scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v as two matrix products and a softmax: for a few rows
    over a long cache, what torch's CPU flash attention runs on one core per KV head. A row
    that sees no key at all gives zeros, as sdpa's does."""
    scores = torch.matmul(query, key.transpose(-1, -2)).mul_(scale)
    if mask.dtype == torch.bool:
        scores.masked_fill_(~mask, float("-inf"))
    else:
        scores.add_(mask)
    return torch.matmul(torch.softmax(scores, dim=-1).nan_to_num_(0.0), value)


def register() -> str:
    """Make NAME known to transformers (idempotent), with sdpa's masks; returns it, for
    from_pretrained. (Without a mask function of its own a name gets no mask at all.)"""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, sdpa_packed)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME
