"""A slow link: the sender gives the prompt's head as TEXT and its tail as KV, and the model
process prefills the head while the tail streams in. Joined, they are the exact cache: the
head bit for bit what a prefill here of those chunks, in the passes it ran, makes (and within fp32 kernel noise of
the sender's one-pass prefill: CPU kernels pick their paths by shape, ~4e-5 apart for 256-token
steps, bit-equal for 512), the tail within fp16 rounding (fetched at fp16), and the model
answers as it does on the exact cache."""
from __future__ import annotations

import pytest
import torch

from kvstreamd import models
from kvstreamd.bench import e2e
from kvstreamd.lab import corpus, netns
from kvstreamd.lab.daemons import wait_for
from kvstreamd.models.adapter import empty_cache, run
from kvstreamd.models.prefix import generate

CHUNK = 256
TOKENS = 2048
ok, why = netns.available()


@pytest.mark.skipif(not ok, reason=f"cannot build network namespaces here (a shaped link needs them): {why}")
def test_head_computed_here_joins_the_tail_fetched_at_fp16_exactly(tmp_path, lm):
    doc = corpus.windows(lm.tokenizer, "test", 1, TOKENS)[0]
    question = lm.tokenizer.encode(lm.spec.turn_close)
    prompt = doc + question
    _, exact = models.prefill(lm, doc, all_logits=False)
    reference = models.generate_greedy(lm, exact, question, 4)
    # The hosts store fp16 only, and b asks for fp16 or int8: the adaptive rule plans (one level
    # asked for is a baseline's fixed level, with no TEXT), and every KV chunk comes as fp16.
    with e2e.hosts(tmp_path, chunk_tokens=CHUNK, b_keeps_fetched=False, codec={"levels": ["fp16"]}) as (h, _):
        h.a.client().put(lm.model_id, doc, exact.to(torch.float16))
        wait_for(lambda: h.b.client().lookup(lm.model_id, prompt)["found_tokens"] == TOKENS, timeout=30,
                 what="host b to see host a's chunks")
        # 8 x 5.9 MB of fp16 at 20 Mbit/s is ~19 s of link, a chunk's prefill here (priced at
        # 400 tokens/s) 0.64 s: the plan that fits 12 s with the fewest TEXT chunks computes
        # a head of 4 here and streams the other 4 (~10 s of link, so none is cut at the deadline).
        h.shape(20)
        new, reuse = generate(lm.model, prompt, h.b.client(), lm.model_id, max_new_tokens=4, deadline_ms=12_000,
                              levels=["fp16", "int8"], recompute_tokens_per_s=400.0, keep_kv=True)
        # A deadline lost from the start (2 s): priced at 200 tokens/s, the fastest plan computes
        # 6 chunks here and streams 2 (~5 s of link), and the fetch waits for them as long as
        # recomputing the 8 would take (10 s), not only until the deadline plus grace (2.5 s).
        _, late = generate(lm.model, prompt, h.b.client(), lm.model_id, max_new_tokens=1, deadline_ms=2000,
                           levels=["fp16", "int8"], recompute_tokens_per_s=200.0)
    arrived = [e.arrived_ms for e in late.events if e.kind == "kv"]
    assert arrived and max(arrived) > 2500 and not late.errors, (late.levels, arrived, late.errors)
    kinds = [e.kind for e in reuse.events]
    head = kinds.index("kv") * CHUNK if "kv" in kinds else 0
    kv_chunks = kinds.count("kv")
    # TEXT as a head, then KV, then (if the link fell short of its estimate) a TEXT tail: never between
    assert head and kinds == ["text"] * (head // CHUNK) + ["kv"] * kv_chunks + ["text"] * (len(kinds) - head // CHUNK - kv_chunks), kinds
    tail = head + kv_chunks * CHUNK  # where the KV ends
    assert reuse.text_ranges == [(s, s + CHUNK) for s in [*range(0, head, CHUNK), *range(tail, TOKENS, CHUNK)]]
    assert reuse.kv_tokens == kv_chunks * CHUNK and reuse.text_tokens == TOKENS - reuse.kv_tokens
    assert not reuse.errors
    # the head was computed while the tail streamed: not all of it waited for the fetch's end
    assert reuse.recompute_after_s < reuse.recompute_s
    got = reuse.kv.dense()
    # the head ran in passes of whole chunks (those that came together: one pass, most often),
    # and is bit for bit what a prefill here in those passes makes
    blocks = [b for b in reuse.text_blocks if b[1] <= head]
    assert blocks[0][0] == 0 and blocks[-1][1] == head and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    assert all(s % CHUNK == 0 and e % CHUNK == 0 for s, e in reuse.text_blocks)
    cache = empty_cache(lm.model.config)
    with torch.no_grad():
        here = torch.cat([run(lm.model, torch.tensor(doc[s:e]), cache, all_logits=False, keep_kv=True)[1]
                          for s, e in blocks], dim=2)
    assert torch.equal(got[:, :, :head], here)
    assert torch.allclose(got[:, :, :head], exact[:, :, :head], rtol=0, atol=1e-4)
    fetched = exact[:, :, head:tail]
    assert torch.equal(got[:, :, head:tail], fetched.to(torch.float16).to(fetched.dtype))
    assert new == reference
