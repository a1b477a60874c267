"""The codec on real KV caches of the real model (SmolLM2-135M): the shipped profile fits the
model, every level keeps the model's predictions close at the size it promises, the pool
gives the same bytes, and calibration makes a working profile from scratch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import codec
from codec.tuning import rate, registry
from codec.pool.parallel import CodecPool
from kvstreamd import models
from kvstreamd.models import rate_probe
from kvstreamd.lab import calibrate, corpus, quality

CHUNK = 256


@pytest.fixture(scope="module")
def case(lm):
    w = corpus.windows(lm.tokenizer, "test", 1, 700)[0]
    _, kv = models.prefill(lm, w[:600], all_logits=False)
    cont = w[600:]
    return kv.to(torch.float16), cont, models.continuation_logits(lm, kv, cont)


@pytest.fixture(scope="module")
def shipped(lm):
    return registry.for_model(lm.model_id)


def roundtrip(kv, level, profile):
    parts, nbytes = [], 0
    for start in range(0, kv.shape[2], CHUNK):
        data = codec.encode(kv[:, :, start:start + CHUNK], level, profile, start=start)
        nbytes += len(data)
        parts.append(codec.decode(data))
    return torch.cat(parts, 2), nbytes * 8 / kv.numel()


@pytest.fixture(scope="module")
def coded(lm, case, shipped):
    """`coded(level)`: the case's KV round-tripped at `level` (the decoded KV, bits per element)
    and the continuation's logits on it, made once for the module, though several tests judge a
    level (the codec's bytes are deterministic, and so are the decode and the logits)."""
    kv, cont, _ = case
    made: dict[str, tuple] = {}

    def at(level: str) -> tuple[torch.Tensor, float, torch.Tensor]:
        if level not in made:
            dec, bits = roundtrip(kv, level, shipped)
            made[level] = (dec, bits, models.continuation_logits(lm, dec, cont))
        return made[level]
    return at


def test_shipped_profile_matches_the_model(lm, shipped):
    assert shipped.model_id == lm.model_id
    assert (shipped.layers, shipped.heads, shipped.head_dim) == (lm.num_layers, lm.num_kv_heads, lm.head_dim)
    assert set(shipped.meta["level_scales"]) == {"high", "balanced", "fast"}
    assert "valid.txt" in shipped.meta["source"]  # never calibrated on the text we report on


@pytest.mark.parametrize("level,max_bits,max_kl", [("high", 4.0, 0.004), ("balanced", 3.0, 0.01),
                                                    ("fast", 1.9, 0.05)])
def test_each_level_keeps_predictions_close_at_its_size(case, coded, level, max_bits, max_kl):
    kv, cont, ref = case
    dec, bits, logits = coded(level)
    assert dec.dtype == kv.dtype and dec.shape == kv.shape
    assert torch.equal(dec[:, :, 0], kv[:, :, 0])  # the attention sink is exact
    assert bits < max_bits
    assert quality.kl(ref, logits) < max_kl
    assert quality.top1_agreement(ref, logits) > 0.85


def test_levels_are_ordered_by_size_and_quality(case, coded):
    kv, cont, ref = case
    sizes, kls = [], []
    for level in codec.LADDER:
        _, bits, logits = coded(level)
        sizes.append(bits)
        kls.append(quality.kl(ref, logits))
    assert sizes[0] > sizes[1] > sizes[2]
    assert kls[0] < kls[2]


def test_max_sits_between_int8_and_high_in_size_and_below_both_in_kl(lm, case, coded):
    # `max` is for answers that must not move: nearer the exact cache than int8, in fewer bytes.
    from codec import baselines

    kv, cont, ref = case
    _, bits, max_logits = coded("max")
    _, high_bits, _ = coded("high")
    int8 = baselines.SCHEMES["int8"]
    as_int8 = torch.cat([int8.decode(int8.encode(kv[:, :, s:s + CHUNK].contiguous())) for s in range(0, kv.shape[2], CHUNK)], 2)
    kl = {"max": quality.kl(ref, max_logits), "int8": quality.kl(ref, models.continuation_logits(lm, as_int8, cont))}
    assert high_bits < bits < 8.0
    assert kl["max"] < kl["int8"] / 2, kl


@pytest.mark.parametrize("level", ["high", "balanced"])
def test_no_confident_prediction_flips(case, coded, level):
    # WikiText is full of near-ties (greedy runs part ways on them), so the property is about
    # the predictions the exact cache is sure of: a top-1/top-2 margin above one nat.
    kv, cont, ref = case
    _, _, logits = coded(level)
    top2 = ref.topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > 1.0
    assert sure.sum() > 20
    assert torch.equal(logits[sure].argmax(-1), ref[sure].argmax(-1))


def test_rate_probes_price_each_chunk_and_its_scales_meet_the_target(lm, case, shipped):
    kv, _, _ = case
    tokens = corpus.windows(lm.tokenizer, "test", 1, 700)[0][:600]
    costs = rate_probe.chunk_costs(lm, tokens, kv, CHUNK, shipped)
    assert len(costs) == 3 and all(c.end > 0 and c.last > 0 for c in costs)
    assert costs[-1].end == costs[-1].last  # one probe: the context's end is right after its last chunk
    # Given the prefill's own logits at the probes' tokens, the costs are the same (up to the
    # fp16 rounding of the KV the probes run on) and the probes run a forward fewer per chunk.
    rows = rate_probe.probe_rows(len(tokens), CHUNK)
    exact, _ = models.prefill(lm, tokens, all_logits=False, logits_at=rows)
    again = rate_probe.chunk_costs(lm, tokens, kv, CHUNK, shipped, exact)
    for a, b in zip(again, costs):
        assert a.end == pytest.approx(b.end, rel=0.05, abs=1e-7) and a.last == pytest.approx(b.last, rel=0.05, abs=1e-7)
    # What the probes code with is what decoding the coded chunk gives, on real KV too.
    chunk = kv[:, :, CHUNK:2 * CHUNK]
    assert torch.equal(codec.tuning.named.roundtrip(chunk, "balanced", shipped, start=CHUNK, scale=2.4),
                       codec.decode(codec.encode(chunk, "balanced", shipped, start=CHUNK, scale=2.4), shipped))
    # Coded at the scales the costs give them, the chunks meet the level's target on the probe.
    level = "balanced"
    scales = rate.scales(level, shipped, costs)
    target = rate.settings(shipped).target(codec.tuning.levels.get(level))
    assert sum(c.end * s * s for c, s in zip(costs, scales)) <= target * 1.001


def test_a_prefill_gives_the_logits_of_the_tokens_asked_for(lm):
    tokens = corpus.windows(lm.tokenizer, "test", 1, 300)[0]
    every, kv = models.prefill(lm, tokens)
    rows = [0, 5, 6, 7, 150, 299]
    some, kv_again = models.prefill(lm, tokens, all_logits=False, logits_at=rows)
    assert some.shape == (len(rows), every.shape[1]) and torch.allclose(some, every[rows], atol=1e-4)
    assert torch.equal(kv_again, kv)


def test_pool_gives_the_same_bytes_and_tensors_on_real_kv(case, shipped):
    kv = case[0][:, :, :CHUNK].contiguous()
    with CodecPool(2) as pool:
        data = codec.encode(kv, "balanced", shipped, start=0)
        assert pool.encode(kv, "balanced", shipped, start=0) == data
        assert torch.equal(pool.decode(data), codec.decode(data))


@pytest.fixture(scope="module")
def calibrated(lm):
    """`calibrated(rate_control)`: the whole calibration at a toy size, made once a module. The
    one without rate control takes the sensitivity the one with it measured (calibrate's
    `sensitivity`, as `profile calibrate --sensitivity-from`): that measurement does not depend
    on rate control, and it is most of a calibration's time."""
    made: dict[bool, codec.Profile] = {}

    def run(rate_control: bool) -> codec.Profile:
        if rate_control not in made:
            first = None if rate_control else run(True).tensors["sensitivity"]
            made[rate_control] = calibrate.calibrate(
                lm, contexts=1, tokens=160, sensitivity_contexts=1, sensitivity_tokens=128, continuation=16,
                tuning_contexts=1, tuning_tokens=128, tuning_continuation=16, sensitivity=first,
                rate_control=rate_control, log=lambda _msg: None)
        return made[rate_control]
    return run


@pytest.mark.parametrize("rate_control", [True, False])
def test_calibration_makes_a_working_profile(lm, tmp_path, calibrated, rate_control):
    """The whole calibration at a toy size (what it makes is checked to work, not to be good:
    the shipped profile's quality is test_shipped_profile_matches_the_model's and the levels' tests'),
    with per-chunk rate control and without (`profile calibrate --no-rate-control`)."""
    prof = calibrated(rate_control)
    path = prof.save(tmp_path / "small.kvprofile")
    loaded = codec.Profile.load(path)
    assert loaded.id == prof.id
    assert (loaded.tensors["sensitivity"] > 0).all()
    assert "stream sensitivity (codec error, worst kind) and level scales on valid.txt of wikitext, legal, code" \
        in loaded.meta["source"]
    scales = loaded.meta["level_scales"]
    assert scales["high"] < scales["balanced"] < scales["fast"]
    assert loaded.tensors["pca_channel_scale"].shape == loaded.tensors["pca_mean"].shape  # the weighted rotation
    if rate_control:
        targets = loaded.meta["rate_control"]["targets"]  # per-chunk rate control's, tuned as the scales are
        assert set(targets) == set(codec.LADDER) and targets["high"] < targets["balanced"] < targets["fast"]
    else:
        assert "rate_control" not in loaded.meta and not rate.tuned(loaded)
    costs = loaded.meta["level_dppl"]  # measured with the chunks coded as the daemon codes them
    assert set(costs) == set(codec.LADDER) and 0 < costs["high"] < costs["fast"]
    w = corpus.windows(lm.tokenizer, "test", 1, 300)[0]
    _, kv = models.prefill(lm, w, all_logits=False)
    out = codec.decode(codec.encode(kv, "balanced", loaded), loaded)
    assert (out - kv).abs().mean() < 0.2 * kv.abs().mean()


def quiet(_msg):
    pass


@pytest.fixture(scope="module")
def short_cases(lm):
    return calibrate.tuning_cases(lm, texts=("wikitext", "legal"), contexts=1, tokens=192, continuation=24, log=quiet)


def test_codec_sensitivity_prices_each_stream_on_its_worst_kind(lm, shipped, short_cases, monkeypatch):
    monkeypatch.setattr(calibrate, "SENSITIVITY_FLOOR", 0.0)
    each = [calibrate.codec_sensitivity(lm, shipped, {kind: c}, log=quiet) for kind, c in short_cases.items()]
    both = calibrate.codec_sensitivity(lm, shipped, short_cases, log=quiet)
    assert both.shape == (30, 2) and (both >= 0).all()
    assert np.allclose(both, np.maximum(*each))
    assert (each[0] > each[1]).any() and (each[1] > each[0]).any()  # neither kind is the worst everywhere


def test_codec_sensitivity_follows_what_an_error_costs_the_model(lm, shipped, short_cases):
    """Four times layer 0's output projection: an error in layer 0's values reaches the
    residual stream four times as large, so its KL per unit error grows ~16x against the rest."""
    cases = {"wikitext": short_cases["wikitext"]}
    before = calibrate.codec_sensitivity(lm, shipped, cases, log=quiet)
    o_proj = calibrate.decoder_layers(lm.model)[0].self_attn.o_proj
    with torch.no_grad():
        o_proj.weight.mul_(4)
    try:
        louder = calibrate.tuning_cases(lm, texts=("wikitext",), contexts=1, tokens=192, continuation=24, log=quiet)
        after = calibrate.codec_sensitivity(lm, shipped, louder, log=quiet)
    finally:
        with torch.no_grad():
            o_proj.weight.div_(4)
    share = lambda s: s[0, 1] / np.median(s)  # noqa: E731
    assert share(after) > 4 * share(before)


def _own_copy(shipped) -> "codec.Profile":
    """The shipped profile's tables as a profile of the user's own (another id)."""
    return codec.Profile(dict(shipped.meta, source="the user's own"), dict(shipped.tensors))


def test_bench_codec_command_writes_its_json(tmp_path, shipped):
    """...coding with the user folder's profile (a profile calibrated there is measured)."""
    folder = tmp_path / "user-profiles"
    folder.mkdir()
    mine = _own_copy(shipped)
    path = mine.save(folder / "smollm2-mine.kvprofile")
    out = tmp_path / "codec.json"
    proc = subprocess.run([sys.executable, "-m", "kvstreamd.cli", "bench", "codec", "--tokens", "384",
                           "--contexts", "1", "--continuation", "32", "--chunk-tokens", "256",
                           "--schemes", "fp16", "int8", "cachegen:fast", "--texts", "wikitext", "legal",
                           "--json", str(out), "--plot", str(tmp_path / "plot.png")],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, registry.PROFILE_DIR_ENV: str(folder)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["profile"] == {"id": mine.id.hex(), "path": str(path), "source": "user"}
    assert report["tokens"] == 384 and report["contexts"] == 1
    assert report["text"] == "wikitext" and list(report["texts"]) == ["wikitext", "legal"]
    assert report["results"] == report["texts"]["wikitext"]["results"]  # the top level: the first kind's
    for kind, t in report["texts"].items():
        assert t["split"] == "test" and t["contexts"] == 1 and t["exact_ppl"] > 1
        by = {r["scheme"]: r for r in t["results"]}
        assert set(by) == {"fp16", "int8", "cachegen:fast"}
        for r in by.values():
            assert set(r) >= {"scheme", "bits_per_element", "ratio_vs_fp16", "ratio_vs_int8", "ppl", "ppl_delta_pct",
                              "top1_agreement", "kl", "encode_MBps", "decode_MBps"}
        assert by["fp16"]["kl"] < 1e-4 and by["cachegen:fast"]["ratio_vs_fp16"] > 5
        # a prompt ending at the chunk boundary inside the context (256 of 384 tokens)
        assert by["fp16"]["prefix_kl"] < 1e-4
        assert 1e-4 < by["cachegen:fast"]["prefix_kl"] <= by["cachegen:fast"]["prefix_kl_max"]
        spread = by["cachegen:fast"]["chunk_scales"]  # each chunk's scale over the level's one
        assert 0 < spread["min"] <= spread["median"] <= spread["max"] and by["int8"]["chunk_scales"] is None
        assert t["probe_s"] > 0
    assert report["texts"]["wikitext"]["exact_ppl"] != report["texts"]["legal"]["exact_ppl"]
    assert (tmp_path / "plot.png").stat().st_size > 1000
    assert "cachegen:fast" in proc.stdout and "legal test contexts" in proc.stdout
    assert "| scheme | wikitext: KL | Δppl | x fp16 | legal: KL" in proc.stdout
    assert "| prefix KL (worst) |" in proc.stdout


def test_bench_codec_codes_with_the_profile_named(tmp_path, shipped):
    """--profile PATH, a file in no folder the registry searches: the report names it, and the
    pool's workers coded with it (bench codec checks their bytes against the parent's). Another
    model's profile is refused in one line."""
    mine = _own_copy(shipped)
    path = mine.save(tmp_path / "named.kvprofile")
    out = tmp_path / "codec.json"
    argv = [sys.executable, "-m", "kvstreamd.cli", "bench", "codec", "--tokens", "256", "--contexts", "1",
            "--continuation", "16", "--chunk-tokens", "256", "--schemes", "cachegen:fast", "--texts", "wikitext",
            "--json", str(out), "--plot", ""]
    proc = subprocess.run([*argv, "--profile", str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["profile"] == {"id": mine.id.hex(), "path": str(path), "source": "explicit"}
    assert f"coded with the explicit profile {mine.id.hex()}" in proc.stdout

    other = codec.Profile(dict(shipped.meta, model_id="another-model:0000000000000000"), dict(shipped.tensors))
    proc = subprocess.run([*argv, "--profile", str(other.save(tmp_path / "other.kvprofile"))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"kvstreamd bench codec: {tmp_path / 'other.kvprofile'}: "
                                                           "the profile of model 'another-model:")
