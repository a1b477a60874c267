"""Per-chunk rate control (codec.tuning.rate): the allocation of each chunk's scale from its costs, and
a chunk coded at its own scale. The probes that measure the costs with the real model are
tests/system/test_codec_model.py's."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import codec
from codec import bitstream
from codec.errors import CodecError
from codec.tuning import levels, rate
from codec.tuning.rate import ChunkCost
from codec.tuning.tuned import DEFAULT_MARGIN
from tests.fixtures import synthetic_kv


@pytest.fixture
def tuned(small_profile):
    """The small profile with rate control's targets (what calibrate.tune_targets writes)."""
    rc = {"targets": {"high": 2e-3, "balanced": 5e-3, "fast": 2e-2}, "bounds": [0.5, 3.0]}
    return codec.Profile(dict(small_profile.meta, rate_control=rc), dict(small_profile.tensors))


def spent(costs, scales):
    return sum(c.end * s * s for c, s in zip(costs, scales))


@pytest.mark.parametrize("level", levels.LADDER)
def test_a_context_spends_at_most_its_target_and_no_chunk_passes_it_alone(tuned, level):
    small_profile = tuned
    rng = np.random.default_rng(0)
    lv = levels.get(level)
    target = rate.settings(small_profile).target(lv)
    for _ in range(50):
        n = int(rng.integers(1, 12))
        last = rng.uniform(0.1, 4.0, n) * target  # each chunk's own ceiling within the bounds, or near
        end = last * rng.uniform(0.01, 1.0, n)
        costs = [ChunkCost(float(e), float(l)) for e, l in zip(end, last)]
        got = rate.scales(level, small_profile, costs)
        lo, hi = (b * lv.scale_in(small_profile) for b in rate.settings(small_profile).bounds)
        assert all(rate.on_grid(lo) - 1e-9 <= s <= hi + 1e-9 for s in got)
        if all(s > rate.on_grid(lo) for s in got):  # the bounds did not force any chunk finer
            assert spent(costs, got) <= target * (1 + 1e-6)
            assert all(c.last * s * s <= target * (1 + 1e-6) for c, s in zip(costs, got))


def test_a_dearer_chunk_gets_finer_steps_and_equal_chunks_equal_steps(tuned):
    small_profile = tuned
    same = rate.scales("balanced", small_profile, [ChunkCost(1e-4, 1e-4)] * 4)
    assert len(set(same)) == 1
    cheap, dear = rate.scales("balanced", small_profile, [ChunkCost(1e-5, 1e-4), ChunkCost(1e-3, 1e-3)])
    assert cheap > dear
    # A chunk that costs little from the end but much to a prompt ending right after it is held
    # to what that prompt allows.
    target = rate.settings(tuned).target(levels.get("balanced"))
    early, _ = rate.scales("balanced", small_profile, [ChunkCost(1e-9, target / 4), ChunkCost(1e-3, 1e-3)])
    assert early <= 2.0 + 1e-9


def test_scales_lie_on_the_grid_at_or_below_the_allocation():
    for x in (0.37, 1.0, 1.5, 2.4, 7.9):
        g = rate.on_grid(x)
        assert g <= x + 1e-12 and x / g < 2 ** (1 / rate.GRID_PER_OCTAVE) + 1e-9
        assert math.isclose(math.log2(g) * rate.GRID_PER_OCTAVE, round(math.log2(g) * rate.GRID_PER_OCTAVE), abs_tol=1e-6)


def test_a_profile_without_targets_codes_every_chunk_at_its_levels_one_scale(small_profile):
    assert not rate.tuned(small_profile)
    assert rate.scales("fast", small_profile, [ChunkCost(1e-9, 1e-9), ChunkCost(1.0, 1.0)]) == [None, None]


def test_max_keeps_an_eighth_of_highs_steps_in_any_profile_and_is_never_rate_controlled(tuned):
    tightened = codec.Profile(dict(tuned.meta, level_scales={"high": 0.8}), dict(tuned.tensors))
    for prof in (tuned, tightened):
        assert levels.get("max").scale_in(prof) == pytest.approx(levels.get("high").scale_in(prof) / 8)
        assert np.allclose(levels.get("max").steps(prof), levels.get("high").steps(prof) / 8)
    assert rate.scales("max", tuned, [ChunkCost(1e-9, 1e-9), ChunkCost(1.0, 1.0)]) == [None, None]
    # a chunk at `max` decodes, and is nearer the original than one at `high`, for more bytes
    kv = synthetic_kv(64, seed=3)
    err, size = {}, {}
    for name in ("max", "high"):
        data = codec.encode(kv, name, tuned)
        size[name], err[name] = len(data), float((codec.decode(data, tuned).float() - kv.float()).pow(2).mean())
    assert err["max"] < err["high"] / 16 and size["max"] > size["high"]


def test_a_level_defined_on_another_is_priced_from_it_by_the_square_of_their_steps(small_profile):
    prof = codec.Profile(dict(small_profile.meta, level_dppl={"high": 0.16, "balanced": 0.5}), dict(small_profile.tensors))
    assert levels.expected_dppl(prof) == {"high": 0.16, "balanced": 0.5, "max": pytest.approx(0.0025)}
    assert levels.expected_dppl(small_profile) == {}  # nothing measured: the catalog's prices


def test_a_profiles_own_targets_and_bounds_are_what_it_codes_by(small_profile):
    lv = levels.get("fast")
    own = codec.Profile(dict(small_profile.meta, rate_control={"targets": {"fast": 0.5}, "bounds": [1, 1]}),
                        small_profile.tensors)
    assert rate.settings(own).target(lv) == 0.5
    assert rate.settings(own).target(levels.get("high")) == pytest.approx(DEFAULT_MARGIN * 0.002)
    assert rate.scales("fast", own, [ChunkCost(1e-9, 1e-9)]) == [rate.on_grid(lv.scale_in(own))]  # bounds [1, 1]


@pytest.mark.parametrize("bad", [[1.0], [1.0, 2.0, 3.0], [-1.0, 1.0], [float("nan"), 1.0], ["x", 1.0], "ab", None])
def test_a_malformed_cost_is_a_codec_error(bad):
    with pytest.raises(CodecError):
        ChunkCost.of(bad)


def test_a_chunk_coded_at_its_own_scale_carries_its_steps_and_decodes_without_them(small_profile):
    kv = synthetic_kv(300, seed=3).half()
    fine = codec.encode(kv, "balanced", small_profile, start=0, scale=1.0)
    coarse = codec.encode(kv, "balanced", small_profile, start=0, scale=4.0)
    assert len(coarse) < len(fine)
    h = bitstream.unpack(coarse)
    assert np.allclose(h.steps, small_profile.base_step * 4.0)
    err = [float((codec.decode(d, small_profile).float() - kv.float()).pow(2).mean()) for d in (fine, coarse)]
    assert err[0] < err[1]


def test_a_level_with_steps_per_third_of_layers_takes_no_scale(small_profile):
    with pytest.raises(ValueError, match="takes no scale"):
        levels.get("cachegen-paper").steps(small_profile, 2.0)


@pytest.mark.parametrize("level,scale,start", [("high", None, 0), ("fast", 3.0, 0), ("balanced", 1.7, 512)])
def test_roundtrip_is_what_decoding_the_encoded_chunk_gives(small_profile, level, scale, start):
    """The probes' roundtrip: the same symbols through the decoder's own inverse, no entropy coder."""
    kv = synthetic_kv(300, seed=4).half()
    want = codec.decode(codec.encode(kv, level, small_profile, start=start, scale=scale), small_profile)
    got = codec.tuning.named.roundtrip(kv, level, small_profile, start=start, scale=scale)
    assert got.dtype == kv.dtype and torch.equal(got, want)


def test_roundtrip_refuses_the_anchor_delta_levels(small_profile):
    with pytest.raises(ValueError, match="PCA levels"):
        codec.tuning.named.roundtrip(synthetic_kv(64).half(), "cachegen-paper", small_profile)


def test_a_pool_asked_builds_the_tables_of_every_grid_scale_of_a_tuned_profile_in_the_background(tuned, tmp_path):
    """A chunk at a scale its workers have not coded before would build its tables in the middle
    of a fetch; the pool builds them ahead, each worker its share of the streams."""
    import time

    from codec.pool.parallel import CodecPool, split
    path = tuned.save(tmp_path / "tuned.kvprofile")
    codec.tuning.registry.register(codec.Profile.load(path))
    scales = rate.grid_scales(tuned)
    lo, hi = min(scales), max(scales)
    assert len(scales) == len(set(scales)) > 10 and lo < tuned.meta.get("level_scales", {}).get("high", 1.0) < hi
    with CodecPool(2, profile_paths=(str(path),), warm_levels=()) as pool:
        assert pool.table_steps(tuned) == [[], []]  # nothing until a fetch or a put of per-chunk scales asks
        assert not pool.warming
        pool.warm_grid(tuned)
        pool.warm_grid(tuned)  # once per profile
        assert pool.warming  # what a daemon's status says (tables_warming)
        deadline = time.monotonic() + 120
        while pool.warming and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pool.grid_warm == {tuned.id} and not pool.warming
        held = pool.table_steps(tuned)
        for k, run in enumerate(split(2 * tuned.layers, 2)):
            for scale in scales:
                steps = levels.get("high").steps(tuned, scale)
                assert all((s, float(steps[s // 2, s % 2])) in held[k] for s in run), (k, scale)
        kv = synthetic_kv(64, 7).half()
        data = codec.encode(kv, "fast", tuned, start=0, scale=scales[3])
        assert torch.equal(pool.decode(data), codec.decode(data))
    assert rate.grid_scales(codec.Profile(dict(tuned.meta, rate_control=None), tuned.tensors)) == []


def test_a_pool_starts_warming_at_the_first_chunk_it_decodes_at_a_scale_of_its_own(tuned, tmp_path):
    """A daemon whose chunks all come at their level's own scale (a vLLM connector puts no costs)
    never spends the CPU on the grid; the first chunk coded at a scale of its own starts it."""
    from codec.pool.parallel import CodecPool
    path = tuned.save(tmp_path / "tuned.kvprofile")
    codec.tuning.registry.register(codec.Profile.load(path))
    kv = synthetic_kv(64, 7).half()
    own = rate.grid_scales(tuned)[3]
    with CodecPool(1, profile_paths=(str(path),), warm_levels=()) as pool:
        for level in levels.LADDER:
            pool.decode(codec.encode(kv, level, tuned))
        assert not pool.warming and not pool.grid_warm
        pool.decode(codec.encode(kv, "fast", tuned, start=0, scale=own))
        assert pool.warming or pool.grid_warm == {tuned.id}


def test_warming_waits_while_the_workers_code_and_goes_on_once_they_are_quiet(tuned, tmp_path):
    """Warming is background work: a put's encodes or a fetch's decodes coming one after another
    never wait behind it (on a 2-core host, 34 scales of SmolLM2 took one worker 12.5 s, which
    slowed the fetches and puts that came meanwhile)."""
    import time

    from codec.pool.parallel import CodecPool
    from codec.pool.quiet import QUIET_S
    path = tuned.save(tmp_path / "tuned.kvprofile")
    codec.tuning.registry.register(codec.Profile.load(path))
    kv = synthetic_kv(64, 7).half()
    with CodecPool(1, profile_paths=(str(path),), warm_levels=()) as pool:
        pool.encode(kv, "high", tuned)  # the level's own tables, built by coding
        coded = pool.table_steps(tuned)
        pool.warm_grid(tuned)
        busy_until = time.monotonic() + max(2.0, 4 * QUIET_S)
        while time.monotonic() < busy_until:  # coding, with gaps far under QUIET_S
            pool.encode(kv, "high", tuned)
        assert pool.table_steps(tuned) == coded and pool.warming  # no scale's tables built while it coded
        deadline = time.monotonic() + 120
        while pool.warming and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.grid_warm == {tuned.id}
        assert len(pool.table_steps(tuned)[0]) > len(coded[0])
