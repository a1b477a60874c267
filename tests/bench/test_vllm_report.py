"""`kvstreamd bench vllm`'s report: what the model needs in fp16, and the floors it is judged by
(pure functions of the report; the bench itself runs real vLLM engines and is run by hand)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from codec.layout import Layout
from kvstreamd.bench import vllm


def _lm(windows, heads, head_dim):
    return SimpleNamespace(layout=Layout(tuple(windows)), num_kv_heads=heads, head_dim=head_dim)


def test_a_dense_model_needs_every_layer_of_every_held_token():
    smollm2 = _lm([None] * 30, 3, 64)
    assert vllm.needed_fp16_bytes(smollm2, 4096, 256) == 4096 * 30 * 2 * 3 * 64 * 2  # 94.4 MB, as measured
    # the tokens past the last whole chunk are computed by vLLM, never fetched
    assert vllm.needed_fp16_bytes(smollm2, 4096 + 100, 256) == vllm.needed_fp16_bytes(smollm2, 4096, 256)


def test_a_hybrid_model_needs_its_sliding_layers_only_for_the_window_in_whole_chunks():
    gemma3 = _lm(([512] * 5 + [None]) * 3, 1, 256)  # Gemma-3-270M: 15 sliding (512), 3 global
    # global layers: all 16384 tokens; sliding: from chunk 62's start (15872), the chunk that
    # holds the window's first token (16384 - 511), to the end: 512 tokens
    assert vllm.needed_fp16_bytes(gemma3, 16384, 256) == (3 * 16384 + 15 * 512) * 2 * 256 * 2  # 58.2 MB
    # a window that starts mid-chunk moves that whole chunk
    assert vllm.needed_fp16_bytes(gemma3, 16384 + 128, 256) == (3 * 16384 + 15 * 512) * 2 * 256 * 2


def _report(**changes):
    result = {"runs": 10, "ttft_runs_s": [], "eight_s": 0, "daemon_fetch_s": 0}
    report = {
        "model": "m", "tokens": 4096, "bandwidth_mbit": 100.0, "shaped": True, "chunk_tokens": 256,
        "deadline_ms": 2000, "ttft_floor": 3.0, "needed_fp16_bytes": 94_371_840,
        "miss": {"connector_s": [10.3], "vllm_s": [10.0], "cost": 0.03},
        "results": [
            {**result, "method": "vllm", "ttft_s": 15.0, "speed_up": 1.0, "bytes": 0,
             "first_token_match": [True] * 10, "tokens_match": [True] * 10},
            {**result, "method": "kvstreamd", "ttft_s": 2.0, "speed_up": 7.5, "bytes": 21_000_000,
             "first_token_match": [True] * 10, "tokens_match": [True] * 9 + [False]},
            {**result, "method": "fp16", "ttft_s": 8.0, "speed_up": 1.9, "bytes": 94_371_840 + 5_000,
             "first_token_match": [True] * 10, "tokens_match": [True] * 10}]}
    for path, value in changes.items():
        *keys, last = path.split(".")
        node = report
        for k in keys:
            node = node["results"][int(k)] if k.isdigit() else node[k]
        node[last] = value
    return report


def test_every_floor_passes_on_a_report_that_meets_them():
    assert vllm.floors(_report()) == {"ttft_3x": True, "first_token_every_run": True, "eight_tokens_90pct": True,
                                      "bytes_as_needed": True, "miss_cost_5pct": True}


@pytest.mark.parametrize("change, floor", [
    ({"1.speed_up": 2.9}, "ttft_3x"),
    ({"1.first_token_match": [True] * 9 + [False]}, "first_token_every_run"),
    ({"1.tokens_match": [True] * 8 + [False] * 2}, "eight_tokens_90pct"),
    ({"2.bytes": int(94_371_840 * 1.02)}, "bytes_as_needed"),  # past the 1% allowed for framing
    ({"miss.cost": 0.06}, "miss_cost_5pct"),
])
def test_each_floor_fails_on_its_own(change, floor):
    verdict = vllm.floors(_report(**change))
    assert [k for k, ok in verdict.items() if not ok] == [floor]


def test_the_model_sets_the_ttft_floor_and_the_table_says_each_verdict():
    report = _report(ttft_floor=4.0, **{"1.speed_up": 3.5})
    assert vllm.floors(report)["ttft_4x"] is False
    text = vllm.table(copy.deepcopy(report))
    assert "ttft_4x FAIL" in text and "miss_cost_5pct PASS" in text
    assert "+3.0%" in text and "94.4 MB" in text
    assert vllm.TTFT_FLOOR == {"smollm2-135m": 3.0, "gemma3-270m": 4.0}
