"""`kvstreamd bench agreement`: where a scheme's answer first leaves the exact cache's, its summary,
and coding a context chunk by chunk at a level or a baseline; the bench itself on the real model."""
from __future__ import annotations

import pytest
import torch

from kvstreamd.bench import agreement
from tests.fixtures import synthetic_kv


def test_the_first_change_is_the_first_token_that_differs():
    assert agreement.first_change([1, 2, 3], [1, 2, 3]) is None
    assert agreement.first_change([1, 2, 3], [1, 5, 3]) == 1
    assert agreement.first_change([1, 2, 3], [9, 2, 3]) == 0


def test_the_summary_counts_first_tokens_and_whole_answers_kept():
    rows = [{"schemes": {"max": {"changed_at": c, "ratio": 2.0}}} for c in (None, None, 5, 0)]
    (got,) = agreement.summarise(rows, ["max"])
    assert got == {"scheme": "max", "documents": 4, "ratio": 2.0, "first_kept": 3, "all_kept": 2, "changed_at": [0, 5]}


@pytest.mark.parametrize("scheme", ["max", "high", "int8"])
def test_a_context_is_coded_chunk_by_chunk_and_comes_back_whole(small_profile, scheme):
    kv = synthetic_kv(100, seed=4).to(torch.float16)
    got, size = agreement.coded(kv, scheme, small_profile, chunk_tokens=32)
    assert got.shape == kv.shape and got.dtype == kv.dtype and 0 < size < kv.numel() * 2
    assert float((got.float() - kv.float()).abs().max()) < float(kv.float().abs().max())


@pytest.mark.system
def test_the_bench_compares_each_schemes_answer_with_the_exact_caches(lm):
    report = agreement.run(tokens=512, docs=1, schemes=["fp16", "max"], new_tokens=3, log=lambda *_: None)
    (doc,) = report["documents"]
    assert len(doc["reference"]) == 3
    fp16, mx = report["results"]
    assert fp16["scheme"] == "fp16" and fp16["all_kept"] == 1  # the cache as the model made it: no change
    assert 2.0 < mx["ratio"] < 4.0 and mx["documents"] == 1
    assert "max" in agreement.table(report)
