"""Onward serving: a node keeps the chunks a fetch received, as the bitstreams that arrived
(never coded again from the decoded KV), tells the directory, and serves them to the next
fetcher at the levels it holds. Daemons in the test's event loop, over loopback TCP."""
from __future__ import annotations

import asyncio
import time

import torch

from tests.fixtures import synthetic_kv
from kvstreamd.client import AsyncClient
from kvstreamd.store.keys import chunk_keys

MODEL = "synthetic-test-model"


def client(d) -> AsyncClient:
    return AsyncClient(d.cfg.api.socket, timeout=60)


async def until(what: str, predicate, timeout: float = 10.0):
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


async def fetch(c: AsyncClient, tokens, **kw):
    f = await c.fetch(MODEL, tokens, deadline_ms=30_000, **kw)
    async with f:
        events = [ev async for ev in f]
        return events, f.kv.clone()


async def test_a_fetched_context_is_served_onward_bit_identical_after_its_first_holder_stops(inprocess):
    a, b, c = await inprocess(["a", "b", "c"])
    tokens, kv = list(range(8000, 8700)), synthetic_kv(700, seed=11).half()
    keys = chunk_keys(MODEL, tokens, 256)
    async with client(a) as ca, client(b) as cb, client(c) as cc:
        await ca.put(MODEL, tokens, kv)
        await until("b never learnt a's keys", lambda: b.directory.counts().get("a", 0) == 3)
        got_b, kv_b = await fetch(cb, tokens, levels=["balanced"])  # one level: every chunk at it
        assert [(ev.kind, ev.source, ev.level) for ev in got_b] == [("kv", "a", "balanced")] * 3
        await until("b did not keep the fetched chunks", lambda: all(b.store.has(k) for k in keys))
        for k in keys:  # the very bytes a sent, at the level they came as, and no other
            kept, sent = b.store.get(k), a.store.get(k)
            assert dict(kept.levels) == {"balanced": sent.levels["balanced"]}
        await until("c never learnt that b holds them", lambda: c.directory.counts().get("b", 0) == 3)

        await a.stop()
        got_c, kv_c = await fetch(cc, tokens)  # asks for every level: b offers the one it holds
        assert [(ev.kind, ev.source, ev.level) for ev in got_c] == [("kv", "b", "balanced")] * 3
        assert torch.equal(kv_c, kv_b)
        assert 'kvstreamd_put_chunks_total{outcome="fetched"} 3.0' in await cb.metrics()


async def test_a_fetch_takes_chunks_from_holders_in_its_own_zone_and_from_others_only_for_the_rest(inprocess):
    """[node] zone: the edge fetcher pulls from the edge holder alone while it holds the chunks,
    and from the core holder only for the chunk the edge one lacks."""
    zones = {"core": {"node": {"zone": "core"}}, "edge-b": {"node": {"zone": "edge"}},
             "fetcher": {"node": {"zone": "edge"}}}
    core, edge, f = await inprocess(["core", "edge-b", "fetcher"], per_node=zones, store={"keep_fetched": False})
    tokens, kv = list(range(9000, 9768)), synthetic_kv(768, seed=13).half()
    async with client(core) as cc, client(edge) as ce, client(f) as cf:
        await cc.put(MODEL, tokens, kv)
        await ce.put(MODEL, tokens[:512], kv[:, :, :512])
        await until("the fetcher never learnt both holders' keys",
                    lambda: f.directory.counts() == {"core": 3, "edge-b": 2})
        assert f.peers.zone_of("core") == "core" and f.peers.zone_of("edge-b") == "edge"
        got, _ = await fetch(cf, tokens)
        assert [ev.source for ev in got] == ["edge-b", "edge-b", "core"]


async def test_holders_advertise_their_levels_and_a_fetch_takes_chunks_from_one_holding_the_level_it_needs(inprocess):
    """b keeps a's chunks at `fast` only; c's fetch, with a deadline loose enough for `high`,
    takes every chunk from a, which holds it, though b holds the chunks too."""
    a, b, c = await inprocess(["a", "b", "c"], per_node={"c": {"store": {"keep_fetched": False}}})
    tokens, kv = list(range(7000, 7700)), synthetic_kv(700, seed=17).half()
    keys = chunk_keys(MODEL, tokens, 256)
    async with client(a) as ca, client(b) as cb, client(c) as cc:
        await ca.put(MODEL, tokens, kv)
        await until("b never learnt a's keys", lambda: b.directory.counts().get("a", 0) == 3)
        await fetch(cb, tokens, levels=["fast"])
        held = lambda: c.directory.lookup_now(keys)  # noqa: E731
        await until("c never learnt b's keys", lambda: c.directory.counts().get("b", 0) == 3)
        assert [held().levels_of("b", i) for i in range(3)] == [frozenset({"fast"})] * 3
        assert held().levels_of("a", 0) == frozenset({"high", "balanced", "fast"})

        got, _ = await fetch(cc, tokens)
        assert [(ev.kind, ev.source, ev.level) for ev in got] == [("kv", "a", "high")] * 3
        # both hold what it needs: either may send each chunk (the split gives each a share, and an
        # idle holder takes what the other has not sent within PATIENCE x its own time per chunk)
        got, _ = await fetch(cc, tokens, levels=["fast"])
        assert {ev.level for ev in got} == {"fast"} and {ev.source for ev in got} <= {"a", "b"}


async def test_a_peer_holding_chunks_only_at_levels_the_fetch_does_not_take_is_not_asked(inprocess):
    a, b, c = await inprocess(["a", "b", "c"], per_node={"c": {"store": {"keep_fetched": False}}})
    tokens, kv = list(range(6000, 6512)), synthetic_kv(512, seed=19).half()
    async with client(a) as ca, client(b) as cb, client(c) as cc:
        await ca.put(MODEL, tokens, kv)
        await until("b never learnt a's keys", lambda: b.directory.counts().get("a", 0) == 2)
        await fetch(cb, tokens, levels=["fast"])
        await until("c never learnt b's keys", lambda: c.directory.counts().get("b", 0) == 2)
        await a.stop()
        await until("c still sees a", lambda: "a" not in c.directory.counts())

        f = await cc.fetch(MODEL, tokens, deadline_ms=30_000, levels=["high"])
        async with f:
            assert f.found_tokens == 0 and [ev async for ev in f] == []  # not asked, no NOT_FOUND
        assert 'direction="sent"' not in await cb.metrics()
        assert (await cc.lookup(MODEL, tokens))["peers"] == {"b": 512}  # (held, at another level)
