"""Lane rANS: the C build of lane_rans.h (the CPU path; the GPU kernel compiles the same
header) against the NumPy lane-vectorised reference, on random models and lanes."""
from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import codec
from codec import entropy, rans
from codec.errors import CodecError
from tests.fixtures import REPO


def _models(rng, n_models, max_alphabet=64):
    """Laplace-like models of random widths, with the escape last, like the profile's."""
    halves = rng.integers(1, max_alphabet // 2, n_models)
    dists = []
    for m in halves:
        u = np.arange(-m, m + 1)
        p = np.exp(-np.abs(u) / rng.uniform(0.3, 4.0))
        dists.append(np.append(p, rng.uniform(1e-7, 1e-3)))
    return rans.RansModels.build(dists, halves)


def _symbols(rng, models, comps, rows):
    """Indices drawn from each component's own quantized model: [C, rows] int32."""
    out = np.zeros((len(models), rows), np.int32)
    for c in comps:
        cum = models.cum[models.cum_off[c]:models.cum_off[c] + models.alphabet[c] + 1]
        out[c] = np.searchsorted(cum, rng.integers(0, rans.TOTAL, rows), side="right") - 1
    return out


def _case(seed, n_comp=24, rows=37, per_lane=5, max_alphabet=64):
    rng = np.random.default_rng(seed)
    models = _models(rng, n_comp, max_alphabet)
    comps = np.sort(rng.choice(n_comp, size=max(1, n_comp * 2 // 3), replace=False))
    sym = _symbols(rng, models, comps, rows)
    return models, sym, rans.block_lanes(comps, rows, per_lane)


def test_quantized_models_are_exact_and_keep_every_symbol():
    rng = np.random.default_rng(0)
    for a in (2, 3, 17, 256, 2048):
        p = rng.dirichlet(np.full(a, 0.2))
        p[0] = 0.0  # even a zero-probability symbol stays codable
        cum = rans.quantize_probs(p)
        freq = np.diff(cum.astype(np.int64))
        assert cum[0] == 0 and cum[-1] == rans.TOTAL and freq.min() >= 1
        # close to the target: no symbol is off by more than a slot plus its floor share
        assert np.all(np.abs(freq - p / p.sum() * (rans.TOTAL - a)) <= 2.0)
        b = rans.bucket_table(cum)
        starts = np.arange(rans.BUCKETS) << rans.BUCKET_SHIFT
        assert np.all(cum[b] <= starts) and np.all(starts < cum[b.astype(np.int64) + 1])
    with pytest.raises(ValueError):
        rans.quantize_probs(np.ones(1))


# -- the tables, one component at a time: the rule as it reads, to hold the block builders to it --
def _one_probs(r: float, m: int, grid, cdf) -> np.ndarray:
    edges = (np.arange(-m, m + 2, dtype=np.float64) - 0.5) * r
    f = np.interp(edges, grid, cdf, left=0.0, right=1.0)
    probs = np.empty(2 * m + 2, dtype=np.float64)
    probs[:-1] = np.diff(f)
    probs[-1] = f[0] + (1.0 - f[-1])
    probs = np.maximum(probs, 0.0) + entropy.PROB_FLOOR
    return probs / probs.sum()


def _one_cum(probs: np.ndarray) -> np.ndarray:
    a = probs.size
    p = probs / probs.sum()
    scaled = p * (rans.TOTAL - a)
    base = np.floor(scaled)
    freq = base.astype(np.int64) + 1
    rest = rans.TOTAL - int(freq.sum())
    if rest > 0:
        freq[np.argsort(-(scaled - base), kind="stable")[:rest]] += 1
    return np.concatenate([[0], np.cumsum(freq)]).astype(np.uint32)


def _one_bucket(cum: np.ndarray) -> np.ndarray:
    return (np.searchsorted(cum, np.arange(rans.BUCKETS) << rans.BUCKET_SHIFT, side="right") - 1).astype(np.uint16)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_a_blocks_tables_are_bit_for_bit_each_components_own(name):
    """The tables of a (layer, K/V) block, built for the whole block at once (the profile's
    rans_models), are the same integers as each component's built alone by the rule as it
    reads: a chunk coded by one build decodes with the other's tables, so stored chunks and
    peers of other versions keep decoding. Steps from far finer than any level to coarser."""
    prof = codec.Profile.load(REPO / "codec" / "profiles" / f"{name}.kvprofile")
    layers = prof.tensors["pca_sigma"].shape[0]
    for layer in sorted({0, 1, layers // 2, layers - 1}):
        for kv in (0, 1):
            for step in (0.002, 0.07, 0.4, 1.5092, 2.2516, 4.5364, 13.0):
                sigma, steps, grid, cdf = prof._model_inputs("pca", layer, kv, step)
                halves, probs, offsets = entropy.block_probs(sigma, steps, grid, cdf)
                models = prof.rans_models(layer, kv, step)
                ratio = np.asarray(steps, np.float64) / np.maximum(np.asarray(sigma, np.float64), 1e-12)
                assert np.array_equal(models.half, halves)
                for c, (r, m) in enumerate(zip(ratio, halves)):
                    one = _one_probs(r, int(m), grid, cdf)
                    assert np.array_equal(probs[offsets[c]:offsets[c + 1]], one), (layer, kv, step, c)
                    cum = _one_cum(one)
                    at = int(models.cum_off[c])
                    assert models.alphabet[c] == one.size
                    assert np.array_equal(models.cum[at:at + one.size + 1], cum), (layer, kv, step, c)
                    assert np.array_equal(models.bucket[c], _one_bucket(cum)), (layer, kv, step, c)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 12), equal=st.booleans())
def test_quantize_block_is_each_distributions_own_table(seed, n, equal):
    """Mixed alphabet sizes (and all alike: the unpadded path), ties among the fractions
    included (repeated probabilities)."""
    rng = np.random.default_rng(seed)
    sizes = np.full(n, int(rng.integers(2, 300))) if equal else rng.integers(2, 300, n)
    dists = [np.round(rng.dirichlet(np.full(a, 0.3)), int(rng.integers(2, 9))) + 1e-9 for a in sizes]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    cum, cum_off = rans.quantize_block(np.concatenate(dists), offsets)
    for c, p in enumerate(dists):
        want = _one_cum(p)
        assert np.array_equal(cum[cum_off[c]:cum_off[c] + p.size + 1], want)
    buckets = rans.bucket_tables(cum, cum_off, sizes)
    assert all(np.array_equal(buckets[c], _one_bucket(_one_cum(p))) for c, p in enumerate(dists))


@pytest.mark.parametrize("seed,rows,per_lane,max_alphabet", [
    (1, 37, 5, 64), (2, 1, 16, 8), (3, 256, 1, 2048), (4, 5, 3, 4), (5, 100, 24, 600), (6, 29, 2, 64)])
def test_c_library_and_numpy_reference_write_the_same_words_and_symbols(seed, rows, per_lane, max_alphabet):
    assert rans.library() is not None, "the C library must build on CI machines (cc is installed)"
    models, sym, lanes = _case(seed, rows=rows, per_lane=per_lane, max_alphabet=max_alphabet)
    used_c, words_c = rans.encode_lanes(sym, lanes, models)
    used_r, words_r = rans.encode_lanes_ref(sym, lanes, models)
    assert np.array_equal(used_c, used_r) and np.array_equal(words_c, words_r)
    start = np.concatenate([[0], np.cumsum(used_c)]).astype(np.int64)
    out_c = np.full_like(sym, -7)
    out_r = np.full_like(sym, -7)
    assert rans.decode_lanes(words_c, start, lanes, models, out_c) == (rans.OK, 0)
    assert rans.decode_lanes_ref(words_c, start, lanes, models, out_r) == (rans.OK, 0)
    coded = np.zeros(len(models), bool)
    coded[lanes.comp_model] = True
    assert np.array_equal(out_c[coded], sym[coded]) and np.array_equal(out_r[coded], sym[coded])
    assert np.all(out_c[~coded] == -7)  # lanes write only their own components


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), flips=st.integers(1, 4))
def test_damaged_words_fail_the_same_way_in_both_and_never_escape_their_buffers(seed, flips):
    # 14 lanes, the last of one component: the C library decodes them 8 at a time, interleaved,
    # and must still name the first lane that fails, as the reference does
    models, sym, lanes = _case(seed % 1000, n_comp=40, rows=29, per_lane=3)
    used, words = rans.encode_lanes(sym, lanes, models)
    start = np.concatenate([[0], np.cumsum(used)]).astype(np.int64)
    rng = np.random.default_rng(seed)
    bad = words.copy()
    for pos in rng.integers(0, bad.size, flips):
        bad[pos] ^= np.uint16(rng.integers(1, 1 << 16))
    # Output with guard bands on both sides: nothing may land outside the symbols.
    guard = np.full(len(models) * 29 + 64, -9, np.int32)
    out_c = guard[32:-32].reshape(len(models), 29)
    out_r = np.full_like(out_c, -9)
    res_c = rans.decode_lanes(bad, start, lanes, models, out_c)
    res_r = rans.decode_lanes_ref(bad, start, lanes, models, out_r)
    assert res_c == res_r
    assert np.all(guard[:32] == -9) and np.all(guard[-32:] == -9)
    if res_c[0] == rans.OK:  # rANS cannot always tell; the chunk CRC is the first line
        assert np.array_equal(out_c, out_r)
    # a shortened stream always fails
    short = start.copy()
    short[-1] -= 1
    assert rans.decode_lanes(words, short, lanes, models, out_c)[0] != rans.OK
    assert rans.decode_lanes_ref(words, short, lanes, models, out_r)[0] != rans.OK


def test_block_round_trip_with_escapes_and_uncoded_components():
    rng = np.random.default_rng(7)
    models = _models(rng, 40)
    n = 300
    sym = rng.laplace(0, 2, (n, 40)).round().astype(np.int32)
    sym[:, 5:9] = 0  # uncoded: cost one bitmap bit each
    sym[17, 3] = 100_000  # beyond any alphabet: escapes, travel raw
    sym[0, 39] = -123_456
    data = rans.encode_block(sym, models)
    out, coded = rans.decode_block(data, n, models)
    assert np.array_equal(out, sym.T) and not coded[5:9].any() and coded[:5].all()


def test_block_rejects_inconsistent_tables():
    rng = np.random.default_rng(8)
    models = _models(rng, 10)
    sym = rng.laplace(0, 2, (50, 10)).round().astype(np.int32)
    data = bytearray(rans.encode_block(sym, models))
    with pytest.raises(CodecError, match="lane"):
        rans.decode_block(bytes(data), 51, models)  # coded for 50 rows: the lanes do not end right
    bad = bytearray(data)
    pos = (10 + 7) // 8 + 4 + 4 * struct.unpack_from("<I", data, 2)[0]  # bitmap, escapes: lane table
    struct.pack_into("<I", bad, pos + 4, 99)  # lanes claimed
    with pytest.raises(CodecError, match="lanes"):
        rans.decode_block(bytes(bad), 50, models)
    with pytest.raises(CodecError, match="words"):
        rans.decode_block(bytes(data[:-2]), 50, models)
    with pytest.raises(CodecError):
        rans.decode_block(bytes(data[:3]), 50, models)


def test_codec_works_without_a_compiler(tmp_path, small_profile):
    """No cc: a warning, then the NumPy reference codes the very bytes the C library does."""
    import codec
    from tests.fixtures import synthetic_kv

    path = small_profile.save(tmp_path / "small.kvprofile")
    code = ("import sys, logging; logging.basicConfig();"
            "from codec import encode, profile, rans, registry; from tests.fixtures import synthetic_kv;"
            f"p = profile.Profile.load({str(path)!r}); registry.register(p);"
            "d = encode(synthetic_kv(21, seed=5).half(), 'high', p, start=3);"
            "assert rans.library() is None; sys.stdout.buffer.write(d)")
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path), HOME=str(tmp_path))
    env.pop("CACHE_DIRECTORY", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env,
                         cwd=str(REPO))
    assert res.returncode == 0, res.stderr.decode()
    assert b"NumPy reference" in res.stderr
    assert res.stdout == codec.encode(synthetic_kv(21, seed=5).half(), "high", small_profile, start=3)


def test_a_lane_size_chosen_by_another_encoder_still_decodes(monkeypatch):
    """Lanes per substream are the encoder's choice, recorded in the stream: retuning
    LANE_SYMBOLS must not strand chunks already stored."""
    rng = np.random.default_rng(12)
    models = _models(rng, 30)
    sym = rng.laplace(0, 3, (40, 30)).round().astype(np.int32)
    monkeypatch.setattr(rans, "LANE_SYMBOLS", 7)
    small_lanes = rans.encode_block(sym, models)
    monkeypatch.undo()
    assert small_lanes != rans.encode_block(sym, models)
    out, _ = rans.decode_block(small_lanes, 40, models)
    assert np.array_equal(out, sym.T)
