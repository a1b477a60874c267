"""Real models for kvstreamd: any HuggingFace causal LM through one adapter over transformers'
Cache API (models.adapter), named by `--model`: a shipped name (`smollm2-135m`, the default,
and `gemma3-270m`), a .gguf file, or a local folder with config.json + safetensors."""

from kvstreamd.models.adapter import (
    LoadedModel,
    cache_from_kv,
    cache_kwarg,
    continuation_logits,
    extend,
    generate_greedy,
    kv_from_cache,
    load,
    model_id,
    prefill,
    prefill_timed,
)
from kvstreamd.models.registry import DEFAULT, resolve, shipped_names
from kvstreamd.models.tokenizer import Tokenizer
from kvstreamd.models.weights import cache_dir

__all__ = [
    "DEFAULT",
    "LoadedModel",
    "Tokenizer",
    "cache_dir",
    "cache_from_kv",
    "cache_kwarg",
    "continuation_logits",
    "extend",
    "generate_greedy",
    "kv_from_cache",
    "load",
    "model_id",
    "prefill",
    "prefill_timed",
    "resolve",
    "shipped_names",
]
