"""Lasting pins (kvstreamd.store.pins, Store.pin_context): eviction passes a pinned context over in
both tiers until it is unpinned or deleted, the pin budget bounds pinned bytes and a pin over it
is refused saying so; and the API's pin field and /v1/pins on a real daemon in this loop."""
from __future__ import annotations

import pytest

from kvstreamd.client import AsyncClient, ClientError
from kvstreamd.store.pins import PinRefused
from kvstreamd.store.store import Store
from tests.fixtures import KIB, Events, chunk_file, make_context, open_store

from tests.fixtures import synthetic_kv


def keys(recs) -> list[bytes]:
    return [r.key for r in recs]


def pinned_store(dir, mem: int, disk: int, pin_budget: int, n_chunks: int):
    """An open store (with a disk tier when dir is given) holding one pinned context of n_chunks
    1 KiB chunks: (store, its Events, the context)."""
    ev = Events()
    s = Store(dir, mem, disk, on_add=ev.on_add, on_remove=ev.on_remove, pin_budget=pin_budget)
    s.open()
    pinned = make_context(n_chunks=n_chunks, seed=1)
    for r in pinned:
        s.put(r)
    assert s.pin_context(keys(pinned)) == n_chunks * KIB
    return s, ev, pinned


def test_a_pinned_context_outlives_eviction_from_both_tiers(tmp_path):
    s, ev, pinned = pinned_store(tmp_path, 2 * KIB, 4 * KIB, 3 * KIB, 3)
    others = make_context(n_chunks=8, seed=2)
    for r in others:
        s.put(r)
    assert all(k in s for k in keys(pinned)) and not set(keys(pinned)) & set(ev.removed)
    assert set(ev.removed) & set(keys(others)), "the others were not evicted: the test filled nothing"
    assert s.usage().memory_bytes <= 2 * KIB  # memory copies of pinned chunks with a file may go


def test_a_pinned_context_stays_in_memory_without_a_disk_tier():
    s, ev, pinned = pinned_store(None, 3 * KIB, 0, 2 * KIB, 2)
    others = make_context(n_chunks=4, seed=2)
    for r in others:
        s.put(r)
    assert all(k in s for k in keys(pinned))
    assert ev.removed == keys(others)[:3]


def test_a_pin_over_the_budget_is_refused_saying_pinned_bytes_and_budget(tmp_path):
    s, _ = open_store(tmp_path)
    s.set_pin_budget(4 * KIB)
    a, b = make_context(n_chunks=3, seed=1), make_context(n_chunks=2, seed=2)
    for r in a + b:
        s.put(r)
    s.pin_context(keys(a))
    with pytest.raises(PinRefused, match=r"3072 bytes are pinned and \[store\] pin_budget is 4096 bytes"):
        s.pin_context(keys(b))
    assert not s.is_pinned(b[-1].key) and s.usage().pinned_bytes == 3 * KIB


def test_a_context_not_held_whole_cannot_be_pinned(tmp_path):
    s, _ = open_store(tmp_path)
    s.set_pin_budget(10 * KIB)
    ctx = make_context(n_chunks=3)
    s.put(ctx[0])
    with pytest.raises(PinRefused, match="chunk 1 of the 3 is not held"):
        s.pin_context(keys(ctx))


def stored_context(dir, pin_budget: int):
    """An open store under dir holding one unpinned context of four 1 KiB chunks."""
    s, _ = open_store(dir)
    s.set_pin_budget(pin_budget)
    long = make_context(n_chunks=4, seed=3)
    for r in long:
        s.put(r)
    return s, long


def test_shared_prefix_counts_once_against_the_budget(tmp_path):
    s, long = stored_context(tmp_path, 4 * KIB)
    assert s.pin_context(keys(long[:2])) == 2 * KIB
    assert s.pin_context(keys(long)) == 2 * KIB  # its first two chunks are pinned already
    assert s.pin_context(keys(long)) == 0  # pinned again: nothing changes
    assert s.usage().pinned_bytes == 4 * KIB
    s.unpin_context(long[-1].key)
    assert s.usage().pinned_bytes == 2 * KIB  # the shorter pin still holds the prefix


def test_unpinned_context_is_evictable_again():
    s, ev, pinned = pinned_store(None, 2 * KIB, 0, 2 * KIB, 2)
    assert s.unpin_context(pinned[-1].key) is True
    assert s.unpin_context(pinned[-1].key) is False
    for r in make_context(n_chunks=2, seed=2):
        s.put(r)
    assert set(keys(pinned)) <= set(ev.removed) and s.usage().pinned_bytes == 0


def test_deleting_a_pinned_context_ends_its_pin_but_not_another_pins_prefix(tmp_path):
    s, long = stored_context(tmp_path, 10 * KIB)
    s.pin_context(keys(long[:2]))
    s.pin_context(keys(long))
    assert s.delete_context(long[-1].key) == 2  # stops at the prefix another pin holds
    assert [k in s for k in keys(long)] == [True, True, False, False]
    assert not s.is_pinned(long[-1].key) and s.usage().pinned_bytes == 2 * KIB


def test_a_pin_outlasts_a_reopen_and_the_eviction_at_open_passes_it_over(tmp_path):
    s, _, pinned = pinned_store(tmp_path, 2 * KIB, 8 * KIB, 3 * KIB, 3)
    for r in make_context(n_chunks=4, seed=2):
        s.put(r)
    s.close()
    s = Store(tmp_path, 2 * KIB, 4 * KIB, pin_budget=3 * KIB)  # a smaller disk budget: open evicts
    s.open()
    assert s.is_pinned(pinned[-1].key) and all(k in s for k in keys(pinned))
    assert s.usage().disk_bytes <= 4 * KIB and s.usage().pinned_bytes == 3 * KIB


def test_a_pin_whose_chunks_are_gone_is_dropped_at_open(tmp_path):
    s, _, pinned = pinned_store(tmp_path, 2 * KIB, 8 * KIB, 3 * KIB, 3)
    s.close()
    chunk_file(tmp_path, pinned[1].key).unlink()
    s = Store(tmp_path, 2 * KIB, 8 * KIB, pin_budget=3 * KIB)
    s.open()
    assert s.pins() == [] and s.usage().pinned_bytes == 0
    assert '"pins": []' in (tmp_path / "pins.json").read_text()  # rewritten without it


def test_a_pins_file_that_is_not_one_is_logged_and_the_store_opens(tmp_path, caplog):
    (tmp_path / "pins.json").write_text('{"version": 1, "pins": [["zz"]]}')
    s = Store(tmp_path, 2 * KIB, 8 * KIB, pin_budget=3 * KIB)
    s.open()
    assert s.pins() == [] and "a pin is not a list of hex chunk keys" in caplog.text


# -- the API ------------------------------------------------------------------------------------

async def test_put_with_a_pin_that_is_not_a_boolean_is_refused_naming_the_field(inprocess, small_profile):
    (d,) = await inprocess(["a"], store={"pin_budget": "1MiB"})
    async with AsyncClient(d.cfg.api.socket) as c:
        resp = await c._send("POST", "/v1/contexts", {"model_id": small_profile.model_id, "tokens": [1, 2],
                                                      "buffer": "x", "shape": [3, 2, 2, 2, 8], "pin": "yes"})
        body = await resp.json()
    assert resp.status == 400 and body["error"]["message"] == "field 'pin' must be bool"


async def test_put_with_pin_pins_the_context_and_status_and_metrics_show_the_bytes(inprocess, small_profile):
    (d,) = await inprocess(["a"], store={"pin_budget": "1MiB"})
    tokens = list(range(1, 601))
    async with AsyncClient(d.cfg.api.socket) as c:
        reply = await c.put(small_profile.model_id, tokens, synthetic_kv(600), pin=True)
        store = (await c.status())["store"]
        ctxs = await c.contexts()
        metrics = await c.metrics()
    assert reply["pinned"] > 0 and store["pinned_bytes"] == reply["pinned"] and store["pin_budget"] == 2**20
    assert [c["pinned"] for c in ctxs] == [True]
    assert f"kvstreamd_store_pinned_bytes {float(reply['pinned'])}" in metrics
    assert 'kvstreamd_store_budget_bytes{tier="pin"} 1.048576e+06' in metrics


async def test_a_pin_over_the_budget_is_refused_by_the_api_with_the_message(inprocess, small_profile):
    (d,) = await inprocess(["a"], store={"pin_budget": "1kB"})
    tokens = list(range(1, 601))
    async with AsyncClient(d.cfg.api.socket) as c:
        await c.put(small_profile.model_id, tokens, synthetic_kv(600))
        with pytest.raises(ClientError) as e:
            await c.pin(small_profile.model_id, tokens)
        pins = await c.pins()
    assert e.value.status == 409 and e.value.code == "pin_refused"
    assert "0 bytes are pinned and [store] pin_budget is 1000 bytes" in e.value.message
    assert pins == []


async def test_unpin_through_the_api_ends_the_pin(inprocess, small_profile):
    (d,) = await inprocess(["a"], store={"pin_budget": "1MiB"})
    tokens = list(range(1, 601))
    async with AsyncClient(d.cfg.api.socket) as c:
        reply = await c.put(small_profile.model_id, tokens, synthetic_kv(600), pin=True)
        await c.unpin(reply["keys"][-1])
        assert await c.pins() == []
        with pytest.raises(ClientError) as e:
            await c.unpin(reply["keys"][-1])
    assert e.value.status == 404


def test_giving_back_an_unused_prefetch_spares_a_pinned_context_and_a_prefix_another_chunk_extends(tmp_path):
    """Store.drop_unshared, what a prefetch nobody used gives back: it must not take a context
    someone pinned since, nor the first chunks of a longer context that extends it."""
    s, ev, pinned = pinned_store(tmp_path, 64 * KIB, 64 * KIB, 8 * KIB, 2)
    assert s.drop_unshared(keys(pinned)) == 0 and all(k in s for k in keys(pinned))
    longer = make_context(n_chunks=3, seed=3)
    for r in longer:
        s.put(r)
    assert s.drop_unshared(keys(longer)[:2]) == 0  # chunk 1 is extended by chunk 2: a prefix in use
    assert s.drop_unshared(keys(longer)) == 3 and not any(k in s for k in keys(longer))
