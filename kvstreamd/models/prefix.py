"""Generate with a prompt, reusing whatever prefix the cluster holds: the drop-in for a
HuggingFace-transformers model (any decoder whose cache is a `DynamicCache` of `[1, H, T, D]`
layers, keys post-RoPE: Llama, Qwen, Mistral, Gemma; a hybrid model's sliding layers get
their window of the prefix only, as its own cache holds them).

    from kvstreamd.client import Client
    from kvstreamd.models.prefix import generate
    new_tokens, reuse = generate(model, prompt_ids, Client(), model_id, max_new_tokens=64)

It asks the local daemon for the prompt's longest cached prefix, lets the daemon stream it into
shared memory, recomputes TEXT chunks on top of the chunks before them, and hands the cache to
`model.generate`, which prefills only the rest of the prompt."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from codec.layout import PrefixKV

from ..client import ChunkEvent, Client
from ..events import End
from .adapter import cache_from_kv, empty_cache, generate_cache_kwarg, run


@dataclass
class Reuse:
    """What one prompt got from the cluster."""

    prompt_tokens: int
    found_tokens: int = 0  # the prefix held somewhere (KV or TEXT chunks)
    kv_tokens: int = 0  # of which arrived as KV
    text_tokens: int = 0  # of which this process recomputed (TEXT chunks)
    events: list[ChunkEvent] = field(default_factory=list)
    end: End | None = None  # the daemon's end event (timings, levels, bytes, errors)
    fetch_s: float = 0.0  # from the request to the last chunk in the buffer
    recompute_s: float = 0.0  # TEXT chunks, run here
    ttft_s: float | None = None  # prompt in -> first generated token (set by generate)
    kv: PrefixKV | None = None  # the prefix KV used, when generate(keep_kv=True)
    cache_s: float = 0.0  # building the model's cache from the fetched KV

    @property
    def levels(self) -> list[str]:
        return [e.level for e in self.events]

    errors: list[str] = field(default_factory=list)  # why some of what was found was not used

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.events if e.source not in ("local", "fallback"))


@torch.no_grad()
def prefix_kv(model, prompt: list[int], client: Client, model_id: str, *, deadline_ms: int | None = None,
              levels: list[str] | None = None, recompute_tokens_per_s: float | None = None,
              on_chunk: Callable[[ChunkEvent], None] | None = None) -> tuple[PrefixKV | None, Reuse]:
    """The KV (the model's dtype; codec.layout.PrefixKV, `.dense()` is `[L, 2, n, H, D]` for a
    model whose layers all hold every token) of the prompt's longest prefix the cluster holds,
    TEXT chunks recomputed here, and what it took; (None, reuse) when nothing was found."""
    reuse = Reuse(len(prompt))
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    t0 = time.perf_counter()
    # A model on a GPU asks for the KV in device memory (the daemon decodes it on its GPU and
    # hands it over by CUDA IPC, or says why not and uses shared memory).
    with client.fetch(model_id, prompt, deadline_ms, levels=levels, recompute_tokens_per_s=recompute_tokens_per_s,
                      device="cuda" if device.type == "cuda" else "cpu") as f:
        # A copy, always (even in the same dtype and device): the buffer is released on exit. Laid
        # out heads-first, as the model's cache holds it, so that generate() need not copy it again;
        # each chunk is copied out as it lands, while the next ones stream in.
        src = f.prefix
        kv = src.empty_heads_first(device=device, dtype=dtype) if src is not None else None
        copied = np.zeros(src.tokens if src is not None else 0, bool)
        for ev in f:
            reuse.events.append(ev)
            if kv is not None and ev.kind == "kv":
                kv.copy_tokens_(src, ev.start, ev.end)
                copied[ev.start:ev.end] = True
            if on_chunk is not None:
                on_chunk(ev)
        reuse.end = f.end
        reuse.found_tokens = f.found_tokens
        if kv is not None:  # what no KV chunk brought (TEXT chunks, recomputed below) is the buffer's, as it stands
            for start, end in _runs(~copied):
                kv.copy_tokens_(src, start, end)
        del src
    reuse.fetch_s = time.perf_counter() - t0
    if kv is None:
        return None, reuse
    t1 = time.perf_counter()
    for ev in reuse.events:  # in prompt order: each TEXT chunk runs on top of every chunk before it
        if ev.kind != "text":
            continue
        if ev.start == 0:
            before = None
        else:
            try:
                before = kv.prefix(ev.start)
            except ValueError as e:
                # A hybrid model's sliding layers were fetched for the prefix's last window only:
                # a TEXT chunk before it cannot run on them. The whole prompt is prefilled here.
                reuse.errors.append(f"chunk at {ev.start} came as text outside the sliding window ({e}): "
                                    "the prompt is prefilled whole")
                reuse.recompute_s = time.perf_counter() - t1
                reuse.found_tokens = reuse.kv_tokens = reuse.text_tokens = 0
                return None, reuse
        cache = cache_from_kv(before, dtype, model.config) if before is not None else empty_cache(model.config)
        _, new = run(model, torch.tensor(prompt[ev.start:ev.end]), cache, all_logits=False, keep_kv=True)
        for part in kv.parts:  # new holds every layer of the chunk; each part takes its layers' tokens
            if part.start < ev.end:
                lo = max(ev.start, part.start)
                part.kv[:, :, lo - part.start:ev.end - part.start] = new[list(part.layers), :, lo - ev.start:]
        reuse.text_tokens += ev.end - ev.start
    reuse.recompute_s = time.perf_counter() - t1
    reuse.kv_tokens = reuse.found_tokens - reuse.text_tokens
    return kv, reuse


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


class _FirstToken:
    """A `generate` streamer that notes when the first new token comes out (its first put()
    is the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.at: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.at is None:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


@torch.no_grad()
def generate(model, prompt: list[int], client: Client | None, model_id: str, *, max_new_tokens: int = 32,
             deadline_ms: int | None = None, levels: list[str] | None = None,
             recompute_tokens_per_s: float | None = None, on_chunk: Callable[[ChunkEvent], None] | None = None,
             keep_kv: bool = False, **generate_kwargs) -> tuple[list[int], Reuse]:
    """Greedy-generate after `prompt`, reusing the cluster's longest cached prefix of it
    (`client` None: no reuse, the whole prompt is prefilled here). Returns the new token ids and
    what was reused, with `ttft_s` from the call to the first new token."""
    t0 = time.perf_counter()
    kv, reuse = (None, Reuse(len(prompt))) if client is None else prefix_kv(
        model, prompt, client, model_id, deadline_ms=deadline_ms, levels=levels,
        recompute_tokens_per_s=recompute_tokens_per_s, on_chunk=on_chunk)
    kwargs = dict(generate_kwargs)
    if kv is not None:
        t1 = time.perf_counter()
        n = min(kv.tokens, len(prompt) - 1)  # generate needs one prompt token left to run
        # kv is this call's own copy, already in the cache's layout: the cache holds it as it is
        kwargs[generate_cache_kwarg()] = cache_from_kv(kv.prefix(n), next(model.parameters()).dtype, model.config,
                                                       copy=False)
        reuse.cache_s = time.perf_counter() - t1
    streamer = _FirstToken()
    out = model.generate(torch.tensor([prompt], device=next(model.parameters()).device), max_new_tokens=max_new_tokens, do_sample=False,
                         streamer=streamer, **kwargs)
    reuse.ttft_s = (streamer.at or time.perf_counter()) - t0
    if keep_kv:
        reuse.kv = kv
    return out[0, len(prompt):].tolist(), reuse

