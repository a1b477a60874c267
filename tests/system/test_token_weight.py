"""How much the probes read each token (kvstreamd.models.token_weight), on the real models:
recorded during the prefill, the squared attention probabilities the probe rows give each
token, as transformers' own eager attention computes them (Gemma-3's sliding window
included); measured again on a prefilled KV, the same; and a put through models.put sends the
classes they give, which the daemon codes each chunk's tokens with."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import codec
from codec import bitstream as bs
from codec.tuning import registry, token_steps
from kvstreamd import models
from kvstreamd.lab import corpus
from kvstreamd.models import put as put_mod, rate_probe, token_weight
from tests.node.test_api import client
from tests.fixtures import MODEL_THREADS

pytestmark = pytest.mark.system

CHUNK = 256


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def model(request):
    torch.set_num_threads(MODEL_THREADS)
    return models.load(request.param)


def _eager_weights(lm, ids: list[int], rows: list[int]) -> np.ndarray:
    lm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = lm.model(torch.tensor([ids]), output_attentions=True, use_cache=False)
    finally:
        lm.model.set_attn_implementation(models.adapter.ATTN_IMPLEMENTATION)
    return np.stack([(a[0][:, rows].double() ** 2).sum((0, 1)).numpy() for a in out.attentions])


def test_the_weights_recorded_in_the_prefill_are_the_models_own_attention(model):
    ids = corpus.windows(model.tokenizer, "test", 1, 1300)[0]  # past a probe boundary and Gemma's 512-token window
    rows = token_weight.rows(len(ids))
    assert rows == rate_probe.probe_rows(len(ids), token_steps.PROBE_EVERY)
    _, kv, recorded = token_weight.weighed_prefill(model, ids, all_logits=False)
    want = _eager_weights(model, ids, rows)
    assert recorded.shape == (model.num_layers, len(ids))
    assert np.allclose(recorded, want, rtol=1e-3, atol=1e-4)
    assert np.allclose(token_weight.measure(model, ids, kv), want, rtol=1e-3, atol=1e-4)
    # what the probes read: in most layers that still see it the sink far above the mean (Gemma's
    # sliding layers do not: the probes lie past their window), most tokens below it
    full = [i for i, w in enumerate(model.layout.windows) if w is None]
    assert (recorded[full, 0] > 5 * recorded[full].mean(1)).mean() > 0.5
    assert np.median(recorded / recorded.mean(1, keepdims=True)) < 0.5


async def test_a_put_of_a_profile_with_token_steps_codes_each_token_at_its_probes_class(lm, inprocess, monkeypatch,
                                                                                      request):
    shipped = registry.for_model(lm.model_id)
    stepped = codec.Profile(dict(shipped.meta, token_steps={"power": 0.25}), dict(shipped.tensors))
    monkeypatch.setattr(put_mod, "_profile", lambda model_id: stepped)  # as if calibrated so and found first
    # the daemon registers the profile it is given, which would then code this model in the
    # tests after this one: the shipped one is registered again, last, when it ends
    request.addfinalizer(lambda: registry.register(shipped))
    (d,) = await inprocess(["a"], profile=stepped)
    ids = corpus.windows(lm.tokenizer, "test", 1, 600, kind="legal")[0]
    _, _, weights = token_weight.weighed_prefill(lm, ids, all_logits=False)
    want = token_steps.classes(weights, stepped)
    async with client(d) as c:
        from kvstreamd.client import Client
        reply = await asyncio.to_thread(put_mod.put_context, lm, Client(d.cfg.api.socket, timeout=120), ids)
        assert reply["stored_chunks"] == 3 and reply["probe_s"] >= 0
        for i, key in enumerate(reply["keys"]):
            h = bs.unpack(d.store.get(bytes.fromhex(key)).levels["balanced"])
            s = i * CHUNK + h.sink_tokens
            assert np.array_equal(h.token_classes, want[:, s:i * CHUNK + h.tokens])
        assert set(np.unique(want)) == {0, 2, 4}  # the classes spread over all the rule gives (1x, 2x, 4x)
        got = await c.fetch(lm.model_id, ids, levels=["balanced"])
        async with got as f:
            await f.wait()
            assert f.kv.shape[2] == len(ids)
