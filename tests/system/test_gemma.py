"""The real Gemma-3-270M (the hybrid model) through the adapter: what it is read as, and that a
cache holding its sliding layers' window only continues exactly as one long pass does."""
from __future__ import annotations

import pytest
import torch

from codec.tuning import registry
from codec.layout import PrefixKV
from tests.fixtures import MODEL_THREADS, system_fixture


@pytest.fixture(scope="module")
@system_fixture  # the real Gemma-3-270M
def gemma():
    from kvstreamd import models

    torch.set_num_threads(MODEL_THREADS)
    return models.load("gemma3-270m")


def test_gemma_is_read_as_hybrid_with_two_rotary_bases(gemma):
    assert gemma.model_id.startswith("gemma-3-270m-Q4_K_M:")
    assert (gemma.num_layers, gemma.num_kv_heads, gemma.head_dim, gemma.max_positions) == (18, 1, 256, 32768)
    assert [i for i, w in enumerate(gemma.layout.windows) if w is None] == [5, 11, 17]
    assert {w for w in gemma.layout.windows if w is not None} == {512}
    assert {i["layer_type"]: i["rope_theta"] for i in gemma.rotary.info} == {"sliding_attention": 10_000.0,
                                                                            "full_attention": 1_000_000.0}
    assert gemma.tokenizer.document("Hello")[0] == gemma.tokenizer.bos_id == 2


def test_the_shipped_profile_is_this_models(gemma):
    prof = registry.for_model(gemma.model_id)
    assert prof.layer_windows == gemma.layout.windows
    assert prof.unrotates_keys and prof.rope_kind(5) != prof.rope_kind(0)


def test_a_window_cut_cache_continues_as_one_pass(gemma):
    from kvstreamd import models
    from kvstreamd.lab import corpus

    ids = corpus.windows(gemma.tokenizer, "test", 1, 760)[0]
    _, kv = models.prefill(gemma, ids[:700], all_logits=False)
    assert kv.shape == (18, 2, 700, 1, 256)
    ref = models.continuation_logits(gemma, None, ids)[700:]
    cut = PrefixKV.from_dense(kv, gemma.layout, chunk_tokens=256)
    assert [p.start for p in cut.parts] == [0, 0]  # 700 - 511 = 189: the window starts in chunk 0
    cut = PrefixKV.from_dense(kv, gemma.layout)
    assert cut.parts[1].start == 189 and cut.nbytes == (3 * 700 + 15 * 511) * 2 * 256 * 4
    got = models.continuation_logits(gemma, cut, ids[700:])
    assert (got - ref).abs().max() < 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
