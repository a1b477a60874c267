"""Hybrid attention end to end on a synthetic profile shaped like Gemma-3's: sliding layers (a
short window, their own rotary base) between full-attention ones. A fetch moves the sliding
layers only for the chunks inside the prefix's last window, the buffer holds them as their
layers do, and what arrives is bit for bit the decoded stored chunk's rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import codec
from codec import bitstream as bs, layout, profile as profiles, rope
from codec.tuning import registry
from codec.errors import CodecError
from codec.layout import Layout, PrefixKV

from tests.fixtures import synthetic_kv

LAYERS, HEADS, HEAD_DIM = 4, 2, 8
WINDOWS = [300, None, 300, None]  # layers 0, 2 slide over 300 tokens; 1, 3 see everything
CHUNK = 256


def hybrid_kv(tokens: int, seed: int = 0) -> torch.Tensor:
    return synthetic_kv(tokens, seed, layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM)


@pytest.fixture(scope="module")
def hybrid_profile(tmp_path_factory) -> profiles.Profile:
    freqs = np.stack([rope.default_inv_freq(10_000.0 if w else 1_000_000.0, HEAD_DIM).numpy() for w in WINDOWS])
    samples = [(hybrid_kv(400, 1), 0), (hybrid_kv(300, 2), 400)]
    sens = np.linspace(0.5, 2.0, LAYERS * 2).reshape(LAYERS, 2)
    prof = profiles.fit(samples, model_id="synthetic-hybrid-model", inv_freq=freqs, layer_windows=WINDOWS,
                        sensitivity=sens, kl_budget=1e-2, rope_info=[{"layer_type": "test"}])
    path = tmp_path_factory.mktemp("hybrid") / "hybrid.kvprofile"
    prof.save(path)
    prof = profiles.Profile.load(path)
    registry.register(prof)
    return prof


def test_layout_says_which_layers_each_chunk_of_a_prefix_needs():
    lay = Layout(tuple(WINDOWS))
    assert [g.layers for g in lay.groups()] == [(1, 3), (0, 2)]
    n = 1000  # chunks [0,256) [256,512) [512,768) [768,1000); a sliding layer reads tokens 701..999
    assert lay.first_token(300, n) == 701 and lay.first_token(300, n, CHUNK) == 512
    assert [lay.chunk_layers(s, min(s + CHUNK, n), n) for s in range(0, n, CHUNK)] == \
        [(1, 3), (1, 3), (0, 1, 2, 3), (0, 1, 2, 3)]
    assert lay.token_layers(n, CHUNK) == 2 * 1000 + 2 * 488
    assert Layout.dense(3).chunk_layers(0, 10, 5000) == (0, 1, 2)


def test_profile_records_windows_and_rope_kinds(hybrid_profile):
    assert hybrid_profile.layer_windows == tuple(WINDOWS)
    assert [hybrid_profile.rope_kind(i) for i in range(LAYERS)] == [0, 1, 0, 1]
    assert not torch.equal(hybrid_profile.inv_freq(0), hybrid_profile.inv_freq(1))


@pytest.mark.parametrize("level", ["high", "fast", "cachegen-paper"])
def test_two_rope_kinds_round_trip_like_one(hybrid_profile, level):
    kv = hybrid_kv(CHUNK, 5)
    for start in (0, 4096):
        data = codec.encode(kv, level, hybrid_profile, start=start)
        out = codec.decode(data)
        assert out.shape == kv.shape
        # every layer decodes to what the same layer coded alone (the subset) decodes to
        for layer in range(LAYERS):
            sub = codec.decode(codec.select_layers(data, (layer,)))
            assert torch.equal(sub[0], out[layer])


def test_select_is_the_decoded_rows_and_names_its_layers(hybrid_profile):
    kv = hybrid_kv(CHUNK, 7)
    whole = codec.encode(kv, "balanced", hybrid_profile, start=0)  # sink rows at start 0 travel too
    cut = codec.select_layers(whole, (1, 3))
    assert len(cut) < len(whole) * 0.6
    h = bs.unpack(cut)
    assert h.held_layers() == (1, 3) and h.layers == 2
    assert torch.equal(codec.decode(cut), codec.decode(whole)[[1, 3]])
    assert codec.select_layers(whole, (0, 1, 2, 3)) == whole
    with pytest.raises(CodecError):
        codec.select_layers(cut, (0,))  # not held
    with pytest.raises(CodecError):
        codec.select_layers(whole, (3, 1))  # not increasing
    # a decoder of the whole profile refuses a cut chunk rather than mislabel its layers
    with pytest.raises(CodecError, match="holds layers"):
        codec.Decoder(hybrid_profile).decode(cut)


def test_a_layer_subset_codes_with_its_whole_profiles_tables(hybrid_profile):
    """A cut chunk's profile (Profile.subset) keeps no tables of its own: its entropy models and
    bases are the whole profile's, at the whole's layer index, built once for both."""
    step = float(codec.tuning.levels.get("fast").steps(hybrid_profile)[3, 1])
    sub = hybrid_profile.subset((1, 3))
    assert sub.rans_models(1, 1, step) is hybrid_profile.rans_models(3, 1, step)
    assert sub.basis(0, 0) is hybrid_profile.basis(1, 0)
    assert sub.models("pca", 1, 0, step) is hybrid_profile.models("pca", 3, 0, step)
    assert not sub._models and not sub._basis


def test_pool_workers_come_warm_for_chunks_before_the_window(hybrid_profile):
    """A hybrid profile's workers warm the full-attention subset's share too: the first chunk
    cut to those layers builds no entropy model in any worker, and decodes as codec.decode does."""
    from codec.pool.parallel import CodecPool

    cut = codec.select_layers(codec.encode(hybrid_kv(CHUNK, 3), "fast", hybrid_profile, start=4096), (1, 3))
    with CodecPool(3, profile_paths=(hybrid_profile.path,), warm_levels=("fast",)) as pool:
        # streams of the whole (2 x layer + K/V): the whole's 8 split 3/3/2, and the cut's 4 (layers
        # 1 and 3) split 2/1/1, which gives workers 0 and 1 a stream beyond their share of the whole
        warm = pool.streams_with_tables(hybrid_profile)
        assert warm == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7]]
        assert torch.equal(pool.decode(cut), codec.decode(cut))
        assert pool.streams_with_tables(hybrid_profile) == warm


@pytest.mark.parametrize("layers", [None, (1, 3)])
def test_the_pool_codes_a_chunk_to_the_very_bytes_codec_encode_does(hybrid_profile, layers):
    """Both build the header with cachegen.header_of: the pool's chunk of some layers (coded with
    Profile.subset) names its layers as codec.encode's does, and its streams use their tables."""
    from codec.pool.parallel import CodecPool

    prof = hybrid_profile if layers is None else hybrid_profile.subset(layers)
    kv = hybrid_kv(CHUNK, 9) if layers is None else hybrid_kv(CHUNK, 9)[list(layers)].contiguous()
    with CodecPool(2, profile_paths=(hybrid_profile.path,), warm_levels=()) as pool:
        for level, start in (("high", 0), ("fast", 4096)):  # sink rows travel at 0
            data = codec.encode(kv, level, prof, start=start)
            got = pool.encode(kv, level, prof, start=start)
            assert bs.unpack(got).layer_ids == bs.unpack(data).layer_ids == layers
            assert got == data
            assert torch.equal(pool.decode(got), codec.decode(data))


def test_a_damaged_layer_list_is_refused(hybrid_profile):
    cut = bytearray(codec.select_layers(codec.encode(hybrid_kv(64, 1), "high", hybrid_profile, start=0), (0, 2)))
    pos = bs._FIXED.size
    cut[pos:pos + 4] = np.array([2, 0], "<u2").tobytes()  # reversed: CRC catches it first
    with pytest.raises(CodecError):
        codec.decode(bytes(cut))


@pytest.mark.parametrize("scheme", ["fp16", "int8"])
def test_baselines_cut_to_layers_too(hybrid_profile, scheme):
    from codec import baselines

    kv = hybrid_kv(CHUNK, 3).half()
    whole = baselines.SCHEMES[scheme].encode(kv)
    cut = codec.select_layers(whole, (1, 3))
    assert torch.equal(baselines.SCHEMES[scheme].decode(cut), baselines.SCHEMES[scheme].decode(whole)[[1, 3]])


def test_prefix_kv_views_and_their_limits():
    kv = hybrid_kv(1000, 2)
    lay = Layout(tuple(WINDOWS))
    p = PrefixKV.from_dense(kv, lay, CHUNK)
    assert [(part.layers, part.start) for part in p.parts] == [((1, 3), 0), ((0, 2), 512)]
    start, l0 = p.layer(0)
    assert start == 512 and torch.equal(l0, kv[0, :, 512:])
    with pytest.raises(ValueError, match="window"):
        p.dense()
    assert p.prefix(999).tokens == 999  # still inside: a sliding layer reads 700.. of it
    with pytest.raises(ValueError, match="needs them from"):
        p.prefix(700)  # its window would start at 401, before what the part holds
    parts = layout.fetch_parts(lay, 1000, CHUNK)
    flat = torch.zeros(layout.parts_numel(parts, 1000, HEADS, HEAD_DIM))
    over = layout.over(flat, parts, 1000, HEADS, HEAD_DIM)
    over.parts[1].kv.fill_(1.0)
    assert flat.sum() == over.parts[1].kv.numel()
    assert PrefixKV.from_dense(kv[:, :, :5]).dense().data_ptr() == kv.data_ptr()


@pytest.mark.parametrize("shape", [(4, 2, 40, 2, 8), (2, 2, 300, 4, 64), (3, 1, 5000, 8)])
def test_a_serial_copy_is_the_copy_whatever_the_shape_and_dtypes(shape):
    src = torch.randn(shape).to(torch.float16)
    want = src.to(torch.float32)
    dst = torch.full(shape, float("nan"))
    layout.copy_serial_(dst, src)
    assert torch.equal(dst, want)
    # into a strided view (a heads-first buffer seen token-major), only the rows named
    hf = torch.zeros(shape[:2] + (shape[3], shape[2]) + shape[4:]) if len(shape) == 5 else None
    if hf is not None:
        view = hf.transpose(2, 3)
        layout.copy_serial_(view[:, :, 3:17], src[:, :, 3:17])
        assert torch.equal(view[:, :, 3:17], want[:, :, 3:17]) and view[:, :, :3].abs().sum() == 0
    # copy_tokens_(serial=True) takes the same tokens as the pooled copy
    if len(shape) == 5:
        p = PrefixKV.from_dense(src)
        a, b = p.empty_heads_first(dtype=torch.float32, room=3), p.empty_heads_first(dtype=torch.float32, room=3)
        a.copy_tokens_(p, 0, shape[2])
        b.copy_tokens_(p, 0, shape[2], serial=True)
        assert torch.equal(a.dense(), b.dense())


async def test_fetch_moves_sliding_layers_only_inside_the_window(inprocess, hybrid_profile):
    """Put a 1000-token context on a, fetch it on b through the API: the chunks before the
    window carry only the full-attention layers, on the wire and in the buffer."""
    from kvstreamd.client import AsyncClient

    a, b = await inprocess(["a", "b"], profile=hybrid_profile, codec={"levels": ["high", "fp16"]})
    tokens = list(range(1000, 2000))
    kv = hybrid_kv(1000, 11)
    async with AsyncClient(a.cfg.api.socket) as ca:
        await ca.put("synthetic-hybrid-model", tokens, kv)
    want = {s: codec.decode(codec.encode(kv[:, :, s:s + CHUNK], "high", hybrid_profile, start=s))
            for s in range(0, 1000, CHUNK)}
    import asyncio
    async with AsyncClient(b.cfg.api.socket) as cb:
        for _ in range(100):
            if (await cb.lookup("synthetic-hybrid-model", tokens))["found_tokens"] == 1000:
                break
            await asyncio.sleep(0.05)
        for levels, expect_bytes in ((["high"], None), (["fp16"], 2 * 2 * HEADS * HEAD_DIM * Layout(tuple(WINDOWS)).token_layers(1000, CHUNK))):
            f = await cb.fetch("synthetic-hybrid-model", tokens, deadline_ms=30_000, levels=levels)
            async with f:
                events = [ev async for ev in f]
                assert [e.kind for e in events] == ["kv"] * 4 and all(e.source != "local" for e in events)
                assert f.start.parts == [{"layers": [1, 3], "start": 0, "window": None},
                                         {"layers": [0, 2], "start": 512, "window": 300}]
                prefix = f.prefix
                part = None
                if levels == ["high"]:
                    for part in prefix.parts:
                        for s in range(part.start, 1000, CHUNK):
                            e = min(s + CHUNK, 1000)
                            assert torch.equal(part.kv[:, :, s - part.start:e - part.start],
                                               want[s][list(part.layers)].half())
                    whole = sum(len(codec.encode(kv[:, :, s:s + CHUNK], "high", hybrid_profile, start=s))
                                for s in range(0, 1000, CHUNK))
                    assert f.end.bytes < 0.8 * whole  # chunks 0, 1 went with 2 of 4 layers
                else:
                    assert torch.equal(prefix.layer(1)[1], kv[1].half())
                    assert torch.equal(prefix.layer(0)[1], kv[0, :, 512:].half())
                    assert expect_bytes <= f.end.bytes <= expect_bytes + 4 * 200  # + frame headers
                del prefix, part  # views of the buffer, which the block's end releases


async def test_a_local_fetch_cuts_stored_chunks_to_the_window(inprocess, hybrid_profile):
    from kvstreamd.client import AsyncClient

    (a,) = await inprocess(["a"], profile=hybrid_profile, codec={"levels": ["fast"]})
    tokens = list(range(700))  # chunks [0,256) [256,512) [512,700); sliding layers read 401..699
    kv = hybrid_kv(700, 4)
    async with AsyncClient(a.cfg.api.socket) as c:
        await c.put("synthetic-hybrid-model", tokens, kv)
        f = await c.fetch("synthetic-hybrid-model", tokens + [5, 6])
        async with f:
            events = [ev async for ev in f]
            assert [e.source for e in events] == ["local"] * 3
            whole = len(codec.encode(kv[:, :, :256], "fast", hybrid_profile, start=0))
            assert events[0].bytes < 0.7 * whole  # 2 of its 4 layers
            got = f.prefix
            assert [(p.layers, p.start) for p in got.parts] == [((1, 3), 0), ((0, 2), 256)]
            for s in (256, 512):
                want = codec.decode(codec.encode(kv[:, :, s:s + 256], "fast", hybrid_profile, start=s))
                assert torch.equal(got.layer(2)[1][:, s - 256:s], want[2].half())
            with pytest.raises(ValueError, match="window"):
                got.dense()
            del got


async def test_a_chunk_that_does_not_cut_costs_only_itself(inprocess, hybrid_profile):
    """A stored chunk damaged in memory (its CRC no longer matches) cannot be cut to the window's
    layers: the holder sends the chunks before it, then NOT_FOUND for it alone, and the fetcher
    takes it as TEXT and goes back to the same holder for the rest."""
    import asyncio
    import dataclasses

    from kvstreamd.client import AsyncClient

    a, b = await inprocess(["a", "b"], profile=hybrid_profile, codec={"levels": ["high"]})
    tokens = list(range(3000, 4000))
    kv = hybrid_kv(1000, 12)
    async with AsyncClient(a.cfg.api.socket) as ca:
        keys = [bytes.fromhex(k) for k in (await ca.put("synthetic-hybrid-model", tokens, kv))["keys"]]
    rec = a.store.get(keys[1])  # outside the window: it is cut to layers 1, 3
    bad = bytearray(rec.levels["high"])
    bad[len(bad) // 2] ^= 0xFF
    assert a.store.delete(keys[1])  # (a put of a key already held keeps the old record)
    assert a.store.put(dataclasses.replace(rec, levels={"high": bytes(bad)}))
    async with AsyncClient(b.cfg.api.socket) as cb:
        for _ in range(100):
            if (await cb.lookup("synthetic-hybrid-model", tokens))["found_tokens"] == 1000:
                break
            await asyncio.sleep(0.05)
        f = await cb.fetch("synthetic-hybrid-model", tokens, deadline_ms=30_000)
        async with f:
            events = [ev async for ev in f]
        assert [(e.kind, e.start) for e in events] == [("kv", 0), ("text", 256), ("kv", 512), ("kv", 768)], events
        assert all(e.source == "a" for e in events if e.kind == "kv")
        assert f.end.text_ranges == [[256, 512]]
        assert (await cb.health())["status"] == "ok"


@pytest.mark.parametrize("level", ["high", "cachegen-paper", "fp16", "int8"])
def test_the_size_of_a_cut_is_known_before_it_is_made(hybrid_profile, level):
    from codec import baselines
    from codec.tuning import catalog
    from codec.select import selected_size

    kv = hybrid_kv(CHUNK, 9).half()
    whole = (codec.encode(kv, level, hybrid_profile, start=0) if catalog.get(level).kind == "level"
             else baselines.SCHEMES[level].encode(kv))
    for layers in ((1, 3), (0,), (0, 1, 2, 3)):
        size = selected_size(whole, layers)
        got = len(codec.select_layers(whole, layers))
        assert size == got if catalog.get(level).kind == "level" else abs(size - got) <= 64
