"""Chunks stored by an earlier kvstreamd decode now: bitstreams written by the codec before its
decoder was rewritten (tests/data/codec-v1, see the README there) are written byte for byte by
today's encoder and decode to the values they decoded to then, within fp16 rounding (the inverse
transforms now run batched, so a sum may round in another order)."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

import codec
from codec import registry
from tests import fixtures

DATA = fixtures.DATA / "codec-v1"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
MODEL = "SmolLM2-135M-Instruct-Q4_1:bad8a3c4602d479c"
# The profile these chunks were coded with. SmolLM2 has since been recalibrated: that profile
# now ships in codec/profiles/retired/, which the registry knows by id (to decode what was
# stored with it) and never hands out to encode with.
WRITTEN_WITH = json.loads((DATA / "profile.json").read_text())


@pytest.fixture(scope="module")
def prof():
    old = registry.find(bytes.fromhex(WRITTEN_WITH["id"]))
    assert old.meta["level_scales"] == WRITTEN_WITH["meta"]["level_scales"]
    assert registry.for_model(MODEL).id != old.id  # encoding takes the current profile
    return old


def golden_kv(prof, tokens: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((prof.layers, 2, tokens, prof.heads, prof.head_dim)).astype(np.float32)
    scale = np.linspace(0.5, 2.0, prof.heads * prof.head_dim, dtype=np.float32).reshape(prof.heads, prof.head_dim)
    return torch.from_numpy(x * scale * 0.1).half()


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_todays_encoder_writes_the_stored_bytes(name, prof):
    m = MANIFEST[name]
    data = codec.encode(golden_kv(prof, m["tokens"], m["seed"]), m["level"], prof, start=m["start"])
    assert hashlib.sha256(data).hexdigest() == m["bytes_sha256"] == \
        hashlib.sha256((DATA / f"{name}.kvcodec").read_bytes()).hexdigest()


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_a_stored_chunk_decodes_to_what_it_decoded_to_before(name, prof):
    m = MANIFEST[name]
    kv = codec.decode((DATA / f"{name}.kvcodec").read_bytes())
    assert list(kv.shape) == m["shape"] and str(kv.dtype) == m["dtype"]
    sample = kv.reshape(-1)[::997].float()
    # one fp16 step of the sampled values at most (values here are below 1)
    assert torch.allclose(sample, torch.tensor(m["decoded_sample"]), rtol=0, atol=2 ** -10)
    assert float(kv.double().abs().sum()) == pytest.approx(m["decoded_abs_sum"], rel=1e-5)
