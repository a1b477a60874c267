"""Per-token steps (codec/tuning/token_steps.py, bitstream transform TOKEN_STEPS): the rule that
classes tokens, chunks that carry classes (each token coded at its class's step, decoded by
the one decoder on every path: single process, the pool's workers, the batched lanes), and
what a decoder refuses."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

import codec
from codec import bitstream as bs, gpu, steps
from codec.errors import CodecError
from codec.pool.parallel import CodecPool
from codec.tuning import named, registry, token_steps
from tests.fixtures import synthetic_kv


@pytest.fixture(scope="module")
def stepped(small_profile, tmp_path_factory):
    """The small profile taking per-token steps (a profile of its own, saved and registered)."""
    prof = codec.Profile(dict(small_profile.meta, token_steps={"power": 0.25}), dict(small_profile.tensors))
    prof = codec.Profile.load(prof.save(tmp_path_factory.mktemp("stepped") / "stepped.kvprofile"))
    registry.register(prof)
    return prof


def _classes(layers: int, tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, bs.TOP_CLASS + 1, (layers, tokens)).astype(np.uint8)


def test_the_rule_keeps_read_tokens_fine_and_coarsens_the_rest_by_the_power(stepped):
    L = stepped.layers
    w = np.ones((L, 64))
    w[:, 1] = 1 / 16  # read 16x less than the mean (near enough: the mean moves a little)
    w[:, 2] = 1e-9  # not read at all: the rule's top class (a multiplier of 4)
    w[:, 3] = 4.0  # read more than the mean: never finer than the stream's step
    got = token_steps.classes(w, stepped)
    assert got.dtype == np.uint8 and got.shape == (L, 64)
    mean = w.mean(1)[0]
    assert got[0, 1] == 2 * round(np.log2((1 / 16 / mean) ** -0.25)) == 2  # whole octaves: a step twice as coarse
    assert set(np.unique(token_steps.classes(np.random.default_rng(1).lognormal(0, 3, (L, 500)), stepped))) == {0, 2, 4}
    assert got[0, 2] == 2 * np.log2(token_steps.DEFAULT_TOP) == 4 and got[0, 3] == 0
    assert np.array_equal(steps.multipliers(np.array([0, 2, 6], np.uint8)), [1.0, 2.0, 8.0])
    with pytest.raises(CodecError):
        token_steps.classes(np.ones((L + 1, 6)), stepped)  # not the profile's layers
    with pytest.raises(CodecError):
        token_steps.classes(np.ones((L, 6)), codec.Profile(dict(stepped.meta, token_steps=None),
                                                           dict(stepped.tensors)))  # a profile without token steps


def test_a_chunk_with_classes_decodes_as_its_roundtrip_and_each_class_as_coarser_steps(stepped):
    kv = synthetic_kv(96, seed=5).half()
    L = stepped.layers
    cls = _classes(L, 96)
    data = codec.encode(kv, "balanced", stepped, start=0, token_classes=cls)
    h = bs.unpack(data)
    assert h.transforms & bs.TOKEN_STEPS and np.array_equal(h.token_classes, cls[:, h.sink_tokens:])
    out = codec.decode(data, stepped)
    assert torch.equal(out, named.roundtrip(kv, "balanced", stepped, 0, token_classes=cls))
    assert torch.equal(out[:, :, :h.sink_tokens], kv[:, :, :h.sink_tokens])  # the sink stays exact
    # Every token of class 2 is coded as the chunk at twice the level's scale codes it.
    two = np.full((L, 96), 2, np.uint8)
    coarse = codec.encode(kv, "balanced", stepped, start=0, token_classes=two)
    scale = codec.LEVELS["balanced"].scale_in(stepped)
    plain = codec.encode(kv, "balanced", stepped, start=0, scale=2 * scale)
    assert torch.allclose(codec.decode(coarse, stepped).float(), codec.decode(plain, stepped).float(), atol=2e-3)
    section = len(bs.unpack(coarse).token_classes.tobytes())
    assert len(coarse) - len(plain) <= 4 + section + 8 * L  # the class section and a length per stream
    # coarser classes make a smaller chunk with a larger error
    fine = codec.encode(kv, "balanced", stepped, start=0)
    assert len(data) < len(fine)
    err = lambda c: float((codec.decode(c, stepped).float() - kv.float()).pow(2).mean())  # noqa: E731
    assert err(fine) < err(data)


def test_classes_are_dropped_where_the_profile_or_the_level_takes_none(small_profile, stepped):
    kv = synthetic_kv(64, seed=6).half()
    cls = _classes(small_profile.layers, 64)
    plain = codec.encode(kv, "high", small_profile, token_classes=cls)
    assert plain == codec.encode(kv, "high", small_profile)  # a profile without token steps: as before
    assert not bs.unpack(codec.encode(kv, "max", stepped, token_classes=cls)).transforms & bs.TOKEN_STEPS
    with pytest.raises(CodecError):
        codec.encode(kv, "high", stepped, token_classes=cls[:, :10])  # not the chunk's tokens
    with pytest.raises(CodecError):
        codec.encode(kv, "high", stepped, token_classes=np.full_like(cls, bs.TOP_CLASS + 1))


def test_the_pool_and_the_batched_lanes_code_and_decode_such_chunks_alike(stepped):
    kv = synthetic_kv(160, seed=7).half()
    cls = _classes(stepped.layers, 160, seed=1)
    single = [codec.encode(kv[:, :, a:a + 80].contiguous(), "fast", stepped, start=a, token_classes=cls[:, a:a + 80])
              for a in (0, 80)]
    with CodecPool(workers=2) as pool:
        pool.add_profile(stepped.path)
        pooled = [pool.encode(kv[:, :, a:a + 80].contiguous(), "fast", stepped, start=a,
                              token_classes=cls[:, a:a + 80]) for a in (0, 80)]
        assert pooled == single
        decoded = pool.decode_many(pooled, stepped)
    ref = torch.cat([codec.decode(c, stepped) for c in single], dim=2)
    assert torch.equal(torch.cat(decoded, dim=2), ref)
    # a lane decoder leaves them to the CPU (one block per class), mixed with lane-coded chunks
    mixed = single + [codec.encode(kv[:, :, :40].contiguous(), "high", stepped, start=160)]
    dec = gpu.device_decoder(stepped, "cpu")
    out = dec.decode_many(mixed)
    assert torch.equal(out[:, :, :160], ref)
    assert [s is None for s in dec.symbols(dec.prepare(mixed))] == [True, True, False]


def test_select_keeps_each_layers_classes(stepped):
    kv = synthetic_kv(48, seed=8).half()
    cls = _classes(stepped.layers, 48, seed=2)
    whole = codec.encode(kv, "high", stepped, start=64, token_classes=cls)
    cut = bs.unpack(bs.select(whole, (0, 2)))
    assert np.array_equal(cut.token_classes, cls[[0, 2]])
    part = codec.decode(bs.select(whole, (0, 2)), stepped)
    assert torch.equal(part, codec.decode(whole, stepped)[[0, 2]])


def _with_classes_section(data: bytes, section: bytes) -> bytes:
    """`data` (a TOKEN_STEPS chunk) with its class section replaced, the CRC made good."""
    h = bs.unpack(data)
    L = h.layers
    pos = bs._FIXED.size + 8 * L
    (n,) = struct.unpack_from("<I", data, pos)
    body = data[:pos] + struct.pack("<I", len(section)) + section + data[pos + 4 + n:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def test_a_damaged_class_section_or_block_is_refused_by_name(stepped):
    kv = synthetic_kv(40, seed=9).half()
    L = stepped.layers
    data = codec.encode(kv, "high", stepped, start=64, token_classes=_classes(L, 40, seed=3))
    with pytest.raises(CodecError, match="token classes are damaged"):
        bs.unpack(_with_classes_section(data, b"not zlib"))
    with pytest.raises(CodecError, match="hold"):
        bs.unpack(_with_classes_section(data, zlib.compress(bytes(L * 39))))  # a token short
    with pytest.raises(CodecError, match="token class 7"):
        bs.unpack(_with_classes_section(data, zlib.compress(bytes([7]) * (L * 40))))
    # classes that do not say the blocks the streams hold (one class for every token)
    with pytest.raises(CodecError, match="class blocks"):
        codec.decode(_with_classes_section(data, zlib.compress(bytes(L * 40))), stepped)


def test_warming_a_level_builds_each_token_classs_tables(stepped):
    from codec import decoder
    prof = codec.Profile(dict(stepped.meta), dict(stepped.tensors))  # nothing built yet
    named.warm(decoder.Decoder(prof), "fast")
    steps = codec.LEVELS["fast"].steps(prof)
    built = {(k[1], k[2], k[3]) for k in prof._models if k[0] == "rans"}
    want = {(l, kv, codec.steps.class_step(float(steps[l, kv]), c))
            for l in range(prof.layers) for kv in range(2) for c in (0, 2, 4)}
    assert want <= built
    assert token_steps.rule_classes("max", prof) == [0] and token_steps.rule_classes("fast", prof) == [0, 2, 4]
