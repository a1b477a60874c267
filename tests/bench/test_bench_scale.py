"""`kvstreamd bench scale` end to end on a tiny shape: two real daemon processes, a context put
on one in several requests and fetched by the other; the JSON's fields and floors are computed
(no timing assertions: the floors' pass/fail on timings is the benchmark's to report)."""
from __future__ import annotations

import json

import pytest
import torch

from kvstreamd import cli, client as client_mod
from kvstreamd.bench import scale


@pytest.mark.system  # daemon processes
def test_bench_scale_puts_fetches_and_reports_its_floors(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(client_mod, "PUT_PIECE_BYTES", 3 * 2 * 256 * 16 * 2 * 2)  # two 256-token chunks a put
    out = tmp_path / "scale.json"
    rc = cli.main(["bench", "scale", "--shapes", "tiny:3x2x8", "--tokens", "tiny:512,1280",
                   "--chunk-tokens", "256", "--workers", "1", "--json", str(out), "--quiet"])
    report = json.loads(out.read_text())
    assert rc == (0 if report["pass"] else 1)
    assert [(r["shape"], r["tokens"]) for r in report["runs"]] == [("tiny", 512), ("tiny", 1280)]
    assert set(report["shapes"]) == {"tiny"} and report["level"] == "high"
    for r in report["runs"]:
        token_bytes = r["layers"] * 2 * r["heads"] * r["head_dim"] * 2
        assert r["fp16_bytes"] == r["buffer_bytes"] == r["tokens"] * token_bytes
        assert r["kv_tokens"] == r["tokens"] and r["text_tokens"] == 0 and r["sources"] == ["a"]
        assert r["floors"]["fetch_complete"] and r["levels"] == ["high"]
        assert r["chunks"] == -(-r["tokens"] // 256) and r["stored_chunks"] > 0
        assert 0 < r["stored_bytes"] < r["fp16_bytes"] and r["wire_bytes"] >= r["stored_bytes"] * 0.9
        assert r["max_rel_err"] < 0.2  # what was fetched is the context that was put
        assert r["fetch_s"] > 0 and r["warmup_s"] > 0
        assert r["fetch_s_per_token"] == pytest.approx(r["fetch_s"] / r["tokens"], abs=6e-4 / r["tokens"])
        for phase in ("warmup", "put", "fetch"):
            for d in ("a", "b"):
                peak = r["peak"][phase][d]
                assert 0 < peak["rss"] <= peak["tree_rss"] and 0 < peak["tree_pss"] <= peak["tree_rss"]
                assert peak["processes"] >= 2  # the daemon and its codec worker
            assert r["peak"][phase]["client"]["rss"] > 0
        fl = r["floors"]
        assert fl["receiver_memory"]["limit"] == r["buffer_bytes"] + scale.SLACK
        assert fl["receiver_memory"]["peak"] == r["peak"]["fetch"]["b"]["tree_pss"]
        assert fl["sender_memory"]["limit"] == r["store_bytes_a"] + scale.SLACK and r["store_bytes_a"] > r["stored_bytes"]
        assert fl["sender_memory"]["pass"] == (fl["sender_memory"]["peak"] <= fl["sender_memory"]["limit"])
    assert report["runs"][1]["put_requests"] == 3  # 1280 tokens, two chunks a request
    pt = report["per_token"]
    assert (pt["shape"], pt["from_tokens"], pt["to_tokens"]) == ("tiny", 512, 1280)
    runs = {r["tokens"]: r for r in report["runs"] if r["shape"] == "tiny"}
    assert pt["ratio"] == pytest.approx(runs[1280]["fetch_s_per_token"] / runs[512]["fetch_s_per_token"], rel=1e-3)
    fl = report["floors"]
    assert set(fl) == {"fetch_completes_longest", "fetch_completes_all", "receiver_memory", "sender_memory",
                       "per_token"}
    assert fl["per_token"]["pass"] == (pt["ratio"] <= scale.PER_TOKEN_RATIO)
    assert fl["fetch_completes_longest"]["tokens"] == 1280 and fl["fetch_completes_all"]["pass"]
    assert report["pass"] == all(f["pass"] for f in fl.values())
    assert "floors:" in scale.table(report)


def test_repositioned_chunks_are_the_pool_chunk_turned_to_their_positions():
    from codec import profile as profiles, rope
    from kvstreamd.bench.gpu import ROPE_THETA, SOURCE_PROFILE, SyntheticKV

    synth = SyntheticKV(profiles.Profile.load(SOURCE_PROFILE), 2, 2, 16, seed=0)
    kv = scale.RepeatedKV(synth, 64, seed=0)
    i = 5 * len(kv.pool) + 1
    got = kv.chunk(i, 40).float()
    src = kv.pool[1][:, :, :40].float()
    assert torch.equal(got[:, 1], src[:, 1].half().float())
    for layer in range(2):  # back to position 0, then on to i*64..: the pool chunk's keys at that place
        f = rope.default_inv_freq(ROPE_THETA, src.shape[-1])
        at0 = rope.unrotate(src[layer, 0], 0, f)
        want = rope.rerotate(at0, i * 64, f)
        assert torch.allclose(got[layer, 0], want, atol=2e-3 * float(want.abs().max()))
    piece = kv.piece(64 * 3, 64 * 5 + 10)
    assert torch.equal(piece[:, :, 64:128], kv.chunk(4, 64)) and piece.shape[2] == 138


def test_shape_and_token_options_parse_and_refuse_nonsense():
    assert scale.parse_shape("small:24x2x64") == ("small", (24, 2, 64))
    assert scale.parse_shape("llama8b") == ("llama8b", (32, 8, 128))
    for bad in ("x:1x2", "x:0x2x4", "x:1x2x3", "nosuch"):
        with pytest.raises(ValueError):
            scale.parse_shape(bad)
    assert scale.parse_tokens(None, ["small", "llama8b", "x"]) == {
        "small": [8192, 32768, 102400], "llama8b": [8192, 32768], "x": [8192, 32768]}
    assert scale.parse_tokens(["small:100,200", "50"], ["small", "x"]) == {"small": [100, 200], "x": [50]}
    for bad in (["nosuch:5"], ["small:0"], ["small:"]):
        with pytest.raises(ValueError):
            scale.parse_tokens(bad, ["small"])
