"""Store a context this process has prefilled: measure what coding each of its chunks costs the
model (rate_probe), then put it with those costs, so that the daemon codes each chunk at its own
steps (codec.rate). The HF side's one way to put; the vLLM connector, which has no model forward
of its own to probe with, puts without costs (each chunk at its level's one scale)."""
from __future__ import annotations

import time

import torch

from codec import rate, registry
from codec.errors import CodecError
from codec.profile import Profile

from ..client import Client
from .adapter import LoadedModel, prefill
from .rate_probe import chunk_costs, probe_rows


def put_context(lm: LoadedModel, client: Client, tokens: list[int], kv: torch.Tensor | None = None, *,
                dtype: torch.dtype = torch.float16, pin: bool = False, measure: bool = True) -> dict:
    """Put `tokens` with their KV `[L, 2, T, H, D]` (prefilled here when None) at `dtype`.
    Returns the daemon's reply plus `prefill_s` and `probe_s` (the rate probes; `measure=False`,
    or a model whose profile is not tuned for rate control, skips them, and the daemon codes
    every chunk at its level's one scale)."""
    t0 = time.perf_counter()
    profile = _profile(lm.model_id) if measure else None
    probing = profile is not None and rate.tuned(profile)  # an untuned profile codes every chunk at its level's one scale
    chunk_tokens = client.status()["chunk_tokens"] if probing else 0
    exact = None
    if kv is None:  # the prefill keeps the logits the probes compare with: a forward fewer for each
        rows = probe_rows(len(tokens), chunk_tokens) if probing else None
        logits, kv = prefill(lm, tokens, all_logits=False, logits_at=rows)
        exact = logits if probing else None
    t1 = time.perf_counter()
    kv = kv.to(dtype)
    costs = None
    if probing:
        costs = [c.to_list() for c in chunk_costs(lm, tokens, kv, chunk_tokens, profile, exact)]
    t2 = time.perf_counter()
    reply = client.put(lm.model_id, tokens, kv, pin=pin, costs=costs)
    return {**reply, "prefill_s": round(t1 - t0, 3), "probe_s": round(t2 - t1, 3)}


def _profile(model_id: str) -> Profile | None:
    """The model's profile as this process finds it (codec.registry), None where it finds none:
    a daemon given the profile by `[codec] profile` codes what it is sent without costs."""
    try:
        return registry.for_model(model_id)
    except CodecError:
        return None
