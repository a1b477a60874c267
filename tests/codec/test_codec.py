"""The codec as a specification: round trips in every dtype and shape, error bounds that
follow from the quantizer, exact sink rows, escapes, and a clear CodecError for bad input."""
from __future__ import annotations

import os
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import codec
from codec import baselines, bitstream as bs, profile as profiles, rope
from codec.tuning import levels
from codec.pool.parallel import CodecPool
from tests.fixtures import SMALL, synthetic_kv

OURS = ["high", "balanced", "fast"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
prop = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _refresh_crc(data: bytes) -> bytes:
    body = data[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def _dtype_eps(dtype) -> float:
    return {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}[dtype]


@prop
@given(tokens=st.integers(1, 70), start=st.integers(0, 3000), level=st.sampled_from(OURS),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_roundtrip_error_is_bounded_by_the_quantizer(small_profile, tokens, start, level, dtype, seed):
    kv = synthetic_kv(tokens, seed).to(dtype)
    data = codec.encode(kv, level, small_profile, start=start)
    out = codec.decode(data)
    assert out.shape == kv.shape and out.dtype == dtype
    steps = levels.get(level).steps(small_profile)
    # The profile's rotation is orthonormal in the channels scaled by its channel scale (the
    # weighted KLT; ones for a profile without): the error is bounded there.
    scale = torch.from_numpy(small_profile.tensors["pca_channel_scale"]).view(SMALL["layers"], 2, 1, -1)
    # keys compared un-rotated, where they were quantized (a rotary pair's channels may be weighted unalike)
    kv, out = (torch.stack([torch.stack([rope.unrotate(x[layer, 0].float(), start, small_profile.inv_freq(layer)),
                                         x[layer, 1].float()]) for layer in range(SMALL["layers"])]) for x in (kv, out))
    err = (out - kv).flatten(3) * scale  # [L, 2, T, C]
    # Rounding each PCA component to its step moves a token's vector by at most
    # sqrt(sum of (step_c / 2)^2); the rotations are orthonormal, so that holds in the scaled channels too.
    bound = torch.tensor([[float(small_profile.component_steps(l, k, float(steps[l, k])).pow(2).sum().sqrt()) / 2
                           for k in range(2)] for l in range(SMALL["layers"])]).view(-1, 2, 1)
    mag = (kv.float().flatten(3) * scale).norm(dim=-1)
    assert torch.all(err.norm(dim=-1) <= bound * 1.001 + mag * 2 * _dtype_eps(dtype) + 1e-5)


@prop
@given(tokens=st.integers(1, 40), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_sink_token_is_exact_at_position_zero(small_profile, tokens, dtype, seed):
    kv = synthetic_kv(tokens, seed).to(dtype)
    out = codec.decode(codec.encode(kv, "fast", small_profile, start=0))
    assert torch.equal(out[:, :, :1], kv[:, :, :1])


@prop
@given(tokens=st.integers(1, 45), dtype=st.sampled_from(DTYPES), start=st.integers(0, 500))
def test_cachegen_paper_configuration_round_trips(small_profile, tokens, dtype, start):
    kv = synthetic_kv(tokens, 3).to(dtype)
    out = codec.decode(codec.encode(kv, "cachegen-paper", small_profile, start=start))
    assert out.shape == kv.shape and out.dtype == dtype
    rel = (out.float() - kv.float()).norm() / kv.float().norm()
    assert rel < 0.5


def test_levels_trade_size_for_error(small_profile):
    kv = synthetic_kv(300, 7)
    sizes, errors = [], []
    for level in OURS:
        data = codec.encode(kv, level, small_profile)
        sizes.append(len(data))
        errors.append(float(((codec.decode(data) - kv) ** 2).mean()))
    assert sizes[0] > sizes[1] > sizes[2]
    assert errors[0] < errors[1] < errors[2]


def test_outliers_take_the_escape_path_and_are_not_clipped(small_profile):
    kv = synthetic_kv(50, 9)
    kv[1, 1, 20, 0, 3] = 5e4  # far outside anything the profile has seen
    kv[2, 0, 33, 1, 5] = -3e4
    out = codec.decode(codec.encode(kv, "balanced", small_profile, start=10))
    assert abs(out[1, 1, 20, 0, 3] - 5e4) < 1
    assert abs(out[2, 0, 33, 1, 5] + 3e4) < 1


def test_encoding_is_deterministic(small_profile):
    kv = synthetic_kv(64, 11)
    assert codec.encode(kv, "high", small_profile, start=5) == codec.encode(kv, "high", small_profile, start=5)


def test_rope_unrotate_inverts_rerotate():
    x = torch.randn(17, 3, 64)
    f = rope.default_inv_freq(100000.0, x.shape[-1])
    back = rope.rerotate(rope.unrotate(x, 4000, f), 4000, f)
    assert torch.allclose(back, x, atol=1e-5)


# -- bad input --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chunk(small_profile) -> bytes:
    return codec.encode(synthetic_kv(60, 5), "balanced", small_profile, start=0)


def test_every_truncation_raises_codec_error(chunk):
    for n in sorted(set(range(0, 64)) | set(range(0, len(chunk), 7)) | {len(chunk) - 1}):
        with pytest.raises(codec.CodecError):
            codec.decode(chunk[:n])


def test_bit_flips_raise_codec_error(chunk):
    rng = np.random.default_rng(0)
    for pos in rng.integers(0, len(chunk), 200):
        damaged = bytearray(chunk)
        damaged[pos] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(codec.CodecError):
            codec.decode(bytes(damaged))


@pytest.mark.parametrize("data,msg", [(b"", "magic"), (b"\x89PNG\r\n\x1a\n" + bytes(100), "magic"),
                                      (os.urandom(5000), "magic")])
def test_foreign_bytes_raise_codec_error(data, msg):
    with pytest.raises(codec.CodecError, match=msg):
        codec.decode(data)


def test_wrong_version_is_named(chunk):
    data = bytearray(chunk)
    struct.pack_into("<H", data, 4, 99)
    with pytest.raises(codec.CodecError, match="version 99"):
        codec.decode(_refresh_crc(bytes(data)))


def test_unknown_profile_is_named(chunk):
    data = bytearray(chunk)
    data[24:40] = bytes(16)  # profile id field
    with pytest.raises(codec.CodecError, match="profile 0000"):
        codec.decode(_refresh_crc(bytes(data)))


def test_damaged_payload_with_valid_checksum_never_decodes_silently_wrong(chunk, small_profile):
    # The CRC is recomputed, so only the decoder's own consistency checks stand between a
    # damaged substream and a wrong tensor: it must raise or reproduce the original exactly.
    original = codec.decode(chunk)
    h = bs.unpack(chunk)
    first = len(chunk) - 4 - sum(len(s) for s in h.substreams)
    rng = np.random.default_rng(1)
    raised = 0
    for pos in rng.integers(first, len(chunk) - 4, 100):
        data = bytearray(chunk)
        data[pos] ^= 0xFF
        try:
            out = codec.decode(_refresh_crc(bytes(data)))
        except codec.CodecError:
            raised += 1
            continue
        assert out.shape == original.shape  # decoded: shapes hold, no crash
    assert raised > 50


def test_profile_with_strided_tensors_saves_what_it_holds(small_profile, tmp_path):
    # safetensors writes memory as it lies: a Fortran-ordered array once came back transposed
    tensors = {k: np.asfortranarray(v) if v.ndim == 2 else v for k, v in small_profile.tensors.items()}
    assert any(not v.flags.c_contiguous for v in tensors.values())
    again = profiles.Profile.load(profiles.Profile(dict(small_profile.meta), tensors).save(tmp_path / "p.kvprofile"))
    for k, v in small_profile.tensors.items():
        assert np.array_equal(again.tensors[k], v), k


def test_profile_file_that_is_not_a_profile_is_rejected(tmp_path):
    p = tmp_path / "bad.kvprofile"
    p.write_bytes(b"not a profile")
    with pytest.raises(codec.CodecError, match="not a readable profile"):
        codec.Profile.load(p)


def test_a_profile_file_cut_short_or_lying_about_its_tensors_is_rejected(tmp_path, small_profile):
    """Profiles are mapped from their file, tensors as views: a file cut short, or a header whose
    byte ranges do not hold the shapes it names, is refused (CodecError), never read past."""
    import json as json_mod
    data = small_profile.to_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json_mod.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [x * 2 for x in header[name]["shape"]]
    lying = json_mod.dumps(header).encode()
    for i, bad in enumerate([data[:len(data) // 2], data[:8 + n - 3],
                             len(lying).to_bytes(8, "little") + lying + data[8 + n:], b""]):
        p = tmp_path / f"bad{i}.kvprofile"
        p.write_bytes(bad)
        with pytest.raises(codec.CodecError, match="not a readable profile"):
            codec.Profile.load(p)
    loaded = codec.Profile.load(small_profile.save(tmp_path / "good.kvprofile"))
    assert loaded.id == small_profile.id and loaded.tensors["pca_basis"].base is not None  # a view


def test_kv_of_another_model_shape_is_rejected(small_profile):
    with pytest.raises(codec.CodecError, match="does not match profile"):
        codec.encode(torch.zeros(2, 2, 4, 2, 8), "high", small_profile)


# -- the decoder object -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed(small_profile) -> list[bytes]:
    """One context's chunks at every level and start, the first with the sink token."""
    kv = synthetic_kv(120, 17).to(torch.float16)
    plan = [(0, 30, "high"), (30, 70, "fast"), (70, 101, "balanced"), (101, 120, "cachegen-paper")]
    return [codec.encode(kv[:, :, a:b].contiguous(), lv, small_profile, start=a) for a, b, lv in plan]


def test_a_decoder_gives_codec_decode_bit_for_bit_one_chunk_or_many(small_profile, mixed):
    want = [codec.decode(c) for c in mixed]
    dec = codec.Decoder(small_profile)
    for c, w in zip(mixed, want):
        assert torch.equal(dec.decode(c), w)
    assert torch.equal(dec.decode_many(mixed), torch.cat(want, dim=2))


def test_decoding_does_not_depend_on_what_was_decoded_before(small_profile, mixed):
    first = codec.Decoder(small_profile).decode(mixed[1])
    warm = codec.Decoder(small_profile)
    for c in mixed[::-1] + mixed:
        warm.decode(c)
    assert torch.equal(warm.decode(mixed[1]), first)


def test_bases_over_the_table_budget_are_scaled_per_slab_to_the_same_tensor(small_profile, mixed, monkeypatch):
    from codec import decoder
    want = codec.Decoder(small_profile).decode_many(mixed)
    monkeypatch.setitem(decoder.TABLE_BUDGET, "cpu", 0)
    monkeypatch.setattr(decoder, "CPU_SLAB_BYTES", 1)  # and one stream at a time
    dec = codec.Decoder(small_profile)
    assert torch.equal(dec.decode_many(mixed), want)
    assert all(t.bases is None for t in dec._tables.values())


def test_a_decoder_refuses_a_chunk_of_another_profile(small_profile, mixed):
    other = profiles.Profile(dict(small_profile.meta, source="another"), dict(small_profile.tensors))
    with pytest.raises(codec.CodecError, match="profile"):
        codec.Decoder(other).decode(mixed[0])


# -- parallel ---------------------------------------------------------------------------------
def test_pool_matches_single_process_and_leaves_no_shared_memory(small_profile):
    ours = f"-{os.getpid()}-"  # segments this process made (codec.pool.segments names them so): not another run's
    before = {n for n in os.listdir("/dev/shm") if ours in n}
    kv = synthetic_kv(90, 13).to(torch.bfloat16)
    with CodecPool(2, profile_paths=(small_profile.path,)) as pool:
        for level in OURS + ["cachegen-paper"]:
            data = codec.encode(kv, level, small_profile, start=0)
            assert pool.encode(kv, level, small_profile, start=0) == data
            assert torch.equal(pool.decode(data), codec.decode(data))
        with pytest.raises(codec.CodecError):
            pool.decode(data[:-1])
    assert {n for n in os.listdir("/dev/shm") if ours in n} <= before


# -- baselines --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(baselines.SCHEMES))
@pytest.mark.parametrize("tokens", [1, 33, 100])
def test_baselines_round_trip_and_reject_damage(name, tokens):
    scheme = baselines.SCHEMES[name]
    kv = synthetic_kv(tokens, 2, layers=2, heads=3, head_dim=64).to(torch.float16)
    data = scheme.encode(kv)
    out = scheme.decode(data)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    # int8: half a step of the token's scale; kivi2: half a step of 3 over a group's range.
    span = float(kv.float().abs().max())
    tol = {"fp16": 0, "zstd-fp16": 0, "int8": span / 254 * 1.01, "kivi2": 2 * span / 6 * 1.01}[name]
    assert (out.float() - kv.float()).abs().max() <= tol
    with pytest.raises(codec.CodecError):
        scheme.decode(data[:-3])


@pytest.mark.parametrize("name", list(baselines.SCHEMES))
@pytest.mark.parametrize("chunk_dtype,out_dtype", [(torch.float16, torch.float16), (torch.float16, torch.float32),
                                                   (torch.float32, torch.float16), (torch.bfloat16, torch.float32)])
def test_baselines_decode_into_a_buffer_writes_what_decode_gives(name, chunk_dtype, out_dtype):
    """decode_into (what a fetch does with a chunk: write it where it goes in the receive
    buffer, a token range of a bigger tensor) gives decode()'s values in the buffer's dtype, bit
    for bit, and touches nothing else; a chunk of another shape or a damaged one is refused
    before anything is written."""
    scheme = baselines.SCHEMES[name]
    kv = (synthetic_kv(33, 5, layers=2, heads=3, head_dim=64) * 3).to(chunk_dtype)
    data = scheme.encode(kv)
    buffer = torch.full((2, 2, 100, 3, 64), 7.0, dtype=out_dtype)
    scheme.decode_into(memoryview(data), buffer[:, :, 40:73])
    assert torch.equal(buffer[:, :, 40:73], scheme.decode(data).to(out_dtype))
    assert (buffer[:, :, :40] == 7).all() and (buffer[:, :, 73:] == 7).all()
    for bad, dst in ((data, buffer[:, :, 40:72]), (data[:-3], buffer[:, :, 40:73])):
        before = buffer.clone()
        with pytest.raises(codec.CodecError):
            scheme.decode_into(bad, dst)
        assert torch.equal(buffer, before)


def test_pool_reuses_its_segments_and_a_result_outlives_the_pool(small_profile):
    """decode_many's results are views of the pool's segments: a segment is reused only once
    every view of the result it held is gone, and closing the pool unlinks them all while
    results still read correctly."""
    from codec.pool import segments
    kv = synthetic_kv(64, 21).to(torch.float16)
    data = codec.encode(kv, "high", small_profile, start=0)
    want = codec.decode(data)
    # this process's codec segments, less those of pools it ran before (the in-process daemons' shared one)
    mine = lambda: {n for n in os.listdir("/dev/shm") if n.startswith(f"{segments.SEG_PREFIX}-{os.getpid()}-")}  # noqa: E731
    others = mine()
    ours = lambda: mine() - others  # noqa: E731
    with CodecPool(1, profile_paths=(small_profile.path,)) as pool:
        first = pool.decode(data)
        view = first[:, :, 3:7]
        del first
        second = pool.decode(data)  # `view` keeps the first segment: a second one is made
        assert len(ours()) == 2 and torch.equal(view, want[:, :, 3:7]) and torch.equal(second, want)
        del view, second
        import gc
        gc.collect()
        third = pool.decode(data)
        assert len(ours()) == 2 and torch.equal(third, want)  # reused, not a third segment
    assert not ours()  # closed: unlinked, while `third` is still mapped and whole
    assert torch.equal(third, want)


# -- a worker that dies ------------------------------------------------------------------------
def _replaced(pool, restarts: int, timeout: float = 60.0) -> bool:
    """Wait until the pool has replaced its workers `restarts` times; True if fault() said so
    on the way."""
    import time
    seen, t0 = False, time.monotonic()
    while pool.restarts < restarts:
        seen = seen or pool.fault() is not None
        assert time.monotonic() - t0 < timeout, "the pool did not replace its workers"
        time.sleep(0.01)
    return seen


def test_a_killed_worker_is_replaced_and_the_next_calls_succeed(small_profile):
    import signal
    kv = synthetic_kv(64, 5).to(torch.float16)
    data = codec.encode(kv, "balanced", small_profile, start=0)
    with CodecPool(2, profile_paths=(small_profile.path,), warm_levels=()) as pool:
        victim = pool.pids()[0]
        os.kill(victim, signal.SIGKILL)
        assert _replaced(pool, 1), "fault() never said the pool was short of a worker"
        assert pool.fault() is None and len(pool.pids()) == 2 and victim not in pool.pids()
        assert pool.last_loss == f"codec worker process {victim} was killed by SIGKILL"
        assert torch.equal(pool.decode(data), codec.decode(data))
        assert pool.encode(kv, "balanced", small_profile, start=0) == data


def test_each_worker_keeps_the_tables_of_its_share_of_the_streams(small_profile):
    """Worker k codes run k of every chunk's streams, so it builds (at warm-up and after) the
    entropy models of those streams only: a large model's tables are not in every worker."""
    from codec.pool.parallel import split
    kv = synthetic_kv(64, 7).to(torch.float16)
    data = codec.encode(kv, "high", small_profile, start=0)
    with CodecPool(2, profile_paths=(small_profile.path,), warm_levels=("high",)) as pool:
        runs = [list(r) for r in split(2 * small_profile.layers, 2)]
        assert pool.streams_with_tables(small_profile) == runs
        for _ in range(3):
            assert torch.equal(pool.decode(data), codec.decode(data))
        assert pool.streams_with_tables(small_profile) == runs


def test_a_pool_warming_no_level_starts_without_tables_and_builds_its_share_at_the_first_chunk(small_profile):
    """No warm levels (a daemon's [codec] warm_tables = "lazy"): the workers start with no
    entropy tables, and the first chunk decoded builds each worker's share, the very tables a
    warmed pool holds, and decodes as codec.decode does."""
    from codec.pool.parallel import split
    data = codec.encode(synthetic_kv(64, 7).to(torch.float16), "high", small_profile, start=0)
    with CodecPool(2, profile_paths=(small_profile.path,), warm_levels=()) as pool:
        assert pool.streams_with_tables(small_profile) == [[], []]
        assert torch.equal(pool.decode(data), codec.decode(data))
        assert pool.streams_with_tables(small_profile) == [list(r) for r in split(2 * small_profile.layers, 2)]


def test_decode_into_writes_the_chunk_where_the_buffer_holds_it_and_nothing_else(small_profile):
    """The workers decode straight into a token range of a shared-memory [L, 2, T, H, D]
    buffer (the fetch buffer): the same values as codec.decode, in the buffer's dtype, and
    every byte around the range untouched. A chunk of another shape is refused before any
    write, and so is a view whose (layer, K/V) planes are not contiguous."""
    from codec.errors import CodecError
    from kvstreamd.handoff.shm import Segment

    kv = synthetic_kv(64, 8)  # float32: decoded in float32, written as the buffer's fp16
    data = codec.encode(kv, "high", small_profile, start=64)
    L, _, _, H, D = kv.shape
    with Segment.create(L * 2 * 200 * H * D * 2) as seg, CodecPool(2, profile_paths=(small_profile.path,)) as pool:
        whole = seg.tensor((L * 2 * 200 * H * D,), "float16")
        whole.fill_(7.0)
        buf = whole.view(L, 2, 200, H, D)
        pool.decode_into(data, buf[:, :, 64:128], seg.name, whole)
        assert torch.equal(buf[:, :, 64:128], codec.decode(data).half())
        assert bool((buf[:, :, :64] == 7).all()) and bool((buf[:, :, 128:] == 7).all())
        with pytest.raises(CodecError, match="destination"):
            pool.decode_into(data, buf[:, :, 0:63], seg.name, whole)
        assert bool((buf[:, :, :64] == 7).all())
        with pytest.raises(ValueError, match="contiguous"):
            interleaved = whole.view(L, 200, 2, H, D).transpose(1, 2)  # K and V of a token side by side
            pool.decode_into(data, interleaved[:, :, 64:128], seg.name, whole)
        seg.unlink()  # the name goes (the model process let the buffer go mid-fetch); the mapping stays
        buf.fill_(7.0)
        pool.decode_into(data, buf[:, :, 64:128], seg.name, whole)
        assert torch.equal(buf[:, :, 64:128], codec.decode(data).half())
        del whole, buf, interleaved


def test_a_staged_chunk_is_coded_where_it_lies_at_every_level(small_profile):
    kv = synthetic_kv(80, 9).to(torch.float16)
    with CodecPool(2, profile_paths=(small_profile.path,), warm_levels=()) as pool:
        with pool.staged(tuple(kv.shape), kv.dtype) as chunk:
            chunk.copy_(kv)
            assert pool._staged  # encode() finds it by where it lies
            for level in OURS:
                assert pool.encode(chunk, level, small_profile, start=80) == codec.encode(kv, level, small_profile, start=80)
            del chunk
        assert not pool._staged


def test_a_call_whose_worker_is_killed_under_it_runs_again_on_new_workers(small_profile):
    import signal
    import threading
    import time
    with CodecPool(1, profile_paths=(small_profile.path,), warm_levels=()) as pool:
        victim, out = pool.pids()[0], []
        t = threading.Thread(target=lambda: out.append(pool._run([(0, time.sleep, 1.0)])))
        t.start()
        time.sleep(0.3)  # the sleep is running in the worker
        os.kill(victim, signal.SIGKILL)
        t.join(60)
        assert out == [[None]] and pool.restarts == 1


def test_a_call_that_kills_its_worker_twice_fails_naming_how_and_the_pool_lives_on(small_profile):
    from codec.pool.parallel import WorkerLost
    kv = synthetic_kv(64, 6).to(torch.float16)
    data = codec.encode(kv, "fast", small_profile, start=0)
    with CodecPool(1, profile_paths=(small_profile.path,), warm_levels=()) as pool:
        with pytest.raises(WorkerLost, match=r"codec worker process \d+ exited with status 3, twice"):
            pool._run([(0, os._exit, 3)])
        _replaced(pool, 2)
        assert torch.equal(pool.decode(data), codec.decode(data))
