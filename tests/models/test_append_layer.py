"""A cache made on a prefix with room (PrefixKV.empty_heads_first(room=), models.cache_from_kv)
writes the tokens run after the prefix into that room, in place (models/append_layer.py), and
continues to the logits a cache of transformers' own gives, bit for bit: on tiny random models of
both shipped architectures (Llama's grouped queries; Gemma-3's sliding and global layers)."""
from __future__ import annotations

import pytest
import torch

from codec.layout import Layout, PrefixKV
from kvstreamd.models.adapter import cache_from_kv, cache_kwarg, empty_cache, generate_cache_kwarg, layer_windows, run
from kvstreamd.models.append_layer import AppendLayer
from tests.models.test_attention import _gemma, _llama

PREFIX = 100


def _prefix(model, ids: torch.Tensor) -> PrefixKV:
    """The KV of ids[:PREFIX], as a fetch would hand it over: every layer's tokens it needs."""
    _, kv = run(model, ids[:PREFIX], empty_cache(model.config), all_logits=False, keep_kv=True)
    return PrefixKV.from_dense(kv, Layout(tuple(layer_windows(model.config))))


def _steps(model, cache, rest: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """The logits of `rest` run on `cache` in blocks of these sizes (a question, then tokens one by one)."""
    out, at = [], 0
    with torch.no_grad():
        for n in blocks:
            out.append(model(input_ids=rest[at:at + n][None], use_cache=True, **{cache_kwarg(model): cache}).logits[0])
            at += n
    return torch.cat(out)


@pytest.mark.parametrize("make", [_llama, _gemma], ids=["llama", "gemma3"])
@pytest.mark.parametrize("room,blocks", [(27, [19, 1, 1, 1]), (20, [19, 1, 1, 1, 1, 1])],
                         ids=["inside", "past-the-room"])
def test_a_cache_with_room_appends_in_place_and_gives_the_same_logits(make, room, blocks):
    model = make()
    ids = torch.randint(2, 300, (PREFIX + sum(blocks),), generator=torch.Generator().manual_seed(7))
    prefix = _prefix(model, ids)
    own = prefix.copy_heads_first(dtype=torch.float32, room=room)
    assert all(p.room == room for p in own.parts) and torch.equal(own.parts[0].kv, prefix.parts[0].kv)
    before = [p.kv.clone() for p in own.parts]
    held = cache_from_kv(own, torch.float32, model.config, copy=False)
    full = next(p for p in own.parts if p.window is None)  # full-attention layers: every token, from 0
    layer = held.layers[full.layers[0]]
    assert isinstance(layer, AppendLayer) and layer.keys.data_ptr() == full.kv[0, 0].data_ptr()

    rest = ids[PREFIX:]
    got = _steps(model, held, rest, blocks)
    want = _steps(model, cache_from_kv(prefix, torch.float32, model.config), rest, blocks)
    assert torch.equal(got, want)
    assert all(torch.equal(p.kv, b) for p, b in zip(own.parts, before))  # the prefix's tokens: never written
    inside = sum(blocks) <= room
    # inside the room the layer still holds the prefix's own memory; past it, a concatenated copy
    assert (layer.keys.data_ptr() == full.kv[0, 0].data_ptr()) == inside
    assert layer.keys.shape[2] == PREFIX + sum(blocks)


def test_a_shorter_prefix_has_no_room_so_its_tokens_after_are_never_written():
    """prefix(n) of fewer tokens than the KV holds views rows that hold tokens: no room, and a
    cache made on it without a copy copies after all (as before there was room)."""
    model = _llama()
    ids = torch.randint(2, 300, (PREFIX + 5,), generator=torch.Generator().manual_seed(3))
    own = _prefix(model, ids).copy_heads_first(dtype=torch.float32, room=8)
    assert own.prefix(PREFIX).parts[0].room == 8
    short = own.prefix(PREFIX - 10)
    assert short.parts[0].room == 0
    kept = own.parts[0].kv.clone()
    cache = cache_from_kv(short, torch.float32, model.config, copy=False)
    assert not isinstance(cache.layers[0], AppendLayer)
    _steps(model, cache, ids[PREFIX - 10:], [12])
    assert torch.equal(own.parts[0].kv, kept)


def test_generate_on_a_cache_with_room_gives_the_same_tokens():
    model = _llama()
    ids = torch.randint(2, 300, (PREFIX + 19,), generator=torch.Generator().manual_seed(5))
    prefix = _prefix(model, ids)
    name = generate_cache_kwarg()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids[None], **{name: cache_from_kv(prefix, torch.float32, model.config)}, **kwargs)
        own = prefix.copy_heads_first(dtype=torch.float32, room=19 + 8)
        got = model.generate(ids[None], **{name: cache_from_kv(own, torch.float32, model.config, copy=False)}, **kwargs)
    assert torch.equal(got, want)


def test_append_layer_refuses_keys_that_are_not_the_start_of_their_room():
    room = torch.zeros(1, 2, 10, 4)
    with pytest.raises(ValueError):
        AppendLayer(room[:, :, 1:5], room[:, :, :4], room, room)
