"""Limits and names more than one room of kvstreamd holds to, each written once: the daemon's API
and config, the vLLM connector (engines/) and the harness import them from here. A base module
(every room but store/ and handoff/ may import it, tests/test_layering.py); plain values and
arithmetic, it imports nothing, so the connector inside a serving engine pays nothing for it.

A fact that codec/ or transport/ needs too lives there instead (below kvstreamd): the TEXT level
name in `codec.tuning.catalog`, the KV dtypes in `codec.bitstream`."""
from __future__ import annotations

# A fetch's deadline is at most an hour: the API's bound on a request's deadline_ms, [fetch] and
# [prefetch] deadline_ms, and the vLLM connector's deadline from its `speedup`.
MAX_DEADLINE_MS = 3_600_000

# In a model folder made by `kvstreamd model-folder` (kvstreamd.models.engine_folder): the file
# naming the model id its contexts are filed under, which the vLLM connector reads
# (kvstreamd.engines.options.model_id_of).
MODEL_META = "kvstreamd.json"


def speedup_deadline_ms(tokens: int, recompute_tokens_per_s: float, speedup: float) -> int:
    """A fetch's deadline, ms, as a speed-up over computing: the engine's own prefill time of
    `tokens` tokens at `recompute_tokens_per_s`, over `speedup`, within 1..MAX_DEADLINE_MS (the
    vLLM connector's `speedup` option; `kvstreamd bench vllm` reports it)."""
    return min(max(1, round(1000 * tokens / recompute_tokens_per_s / speedup)), MAX_DEADLINE_MS)
