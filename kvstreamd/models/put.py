"""Store a context this process has prefilled: measure what coding each of its chunks costs the
model (rate_probe), then put it with those costs, so that the daemon codes each chunk at its own
steps (codec.tuning.rate), and, for a profile that takes them, how much the probes read each token
(token_weight), so that it codes each token at its own step (codec.tuning.token_steps). The HF side's
one way to put; the vLLM connector, which has no model forward of its own to probe with, puts
without either (each chunk at its level's one scale, every token at its stream's step)."""
from __future__ import annotations

import time

import torch

from codec.tuning import rate, registry, token_steps
from codec.errors import CodecError
from codec.profile import Profile

from ..client import Client
from .adapter import LoadedModel, prefill
from . import token_weight
from .rate_probe import chunk_costs, probe_rows


def put_context(lm: LoadedModel, client: Client, tokens: list[int], kv: torch.Tensor | None = None, *,
                dtype: torch.dtype = torch.float16, pin: bool = False, measure: bool = True) -> dict:
    """Put `tokens` with their KV `[L, 2, T, H, D]` (prefilled here when None) at `dtype`.
    Returns the daemon's reply plus `prefill_s` and `probe_s` (the rate probes and the token
    weights; `measure=False`, or a model whose profile takes neither, skips them, and the daemon
    codes every chunk at its level's one scale and every token at its stream's step)."""
    t0 = time.perf_counter()
    profile = _profile(lm.model_id) if measure else None
    probing = profile is not None and rate.tuned(profile)  # an untuned profile codes every chunk at its level's one scale
    weighing = profile is not None and token_steps.power(profile) is not None
    chunk_tokens = client.status()["chunk_tokens"] if probing else 0
    rows = probe_rows(len(tokens), chunk_tokens) if probing else None
    exact = weights = None
    if kv is None:  # the prefill keeps the logits the probes compare with (a forward fewer for each), and weighs the tokens
        if weighing:
            logits, kv, weights = token_weight.weighed_prefill(lm, tokens, all_logits=False, logits_at=rows)
        else:
            logits, kv = prefill(lm, tokens, all_logits=False, logits_at=rows)
        exact = logits if probing else None
    t1 = time.perf_counter()
    kv = kv.to(dtype)
    costs = classes = None
    if probing:
        costs = [c.to_list() for c in chunk_costs(lm, tokens, kv, chunk_tokens, profile, exact)]
    if weighing:
        weights = token_weight.measure(lm, tokens, kv) if weights is None else weights
        classes = token_steps.classes(weights, profile)
    t2 = time.perf_counter()
    reply = client.put(lm.model_id, tokens, kv, pin=pin, costs=costs, token_classes=classes)
    return {**reply, "prefill_s": round(t1 - t0, 3), "probe_s": round(t2 - t1, 3)}


def _profile(model_id: str) -> Profile | None:
    """The model's profile as this process finds it (codec.tuning.registry), None where it finds none:
    a daemon given the profile by `[codec] profile` codes what it is sent without costs."""
    try:
        return registry.for_model(model_id)
    except CodecError:
        return None
