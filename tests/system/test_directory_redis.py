"""The directory in a real Redis server ([directory] backend = "redis"): daemons in this test's
event loop, not peered with each other, find each other's chunks through a redis-server the
test starts on a free port, dial a peer when a fetch needs it and hang up once idle, and ride
out the server going away."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis

from tests.fixtures import synthetic_kv
from kvstreamd.client import AsyncClient
from kvstreamd.lab import redisserver
from kvstreamd.lab.daemons import seconds_until
from kvstreamd.lab.redisserver import RedisServer

ok, why = redisserver.available()
assert ok, why  # a real server, which `make install` puts there: not having one is a broken install, not a skip

MODEL = "synthetic-test-model"
PREFIX = "kvs-test:"


@pytest.fixture
def server(redis_server):
    return redis_server


def directory(server: RedisServer, **kw) -> dict:
    return {"directory": {"backend": "redis", "url": server.url, "prefix": PREFIX, "idle_s": 1.0, **kw}}


def client(d) -> AsyncClient:
    return AsyncClient(d.cfg.api.socket, timeout=60)


async def until(what: str, predicate, timeout: float = 10.0, interval: float = 0.05):
    t0 = time.monotonic()
    while not (value := await predicate()):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(what)
        await asyncio.sleep(interval)
    return value


async def test_a_context_put_on_one_node_is_found_and_fetched_by_another_that_dials_it_only_to_fetch(
        inprocess, server):
    a, b = await inprocess(["a", "b"], peered=False, per_node={"a": {"node": {"zone": "core"}}}, **directory(server))
    kv = synthetic_kv(600, seed=5).half()
    tokens = list(range(2000, 2600))
    async with client(a) as ca, client(b) as cb:
        put = await ca.put(MODEL, tokens, kv)
        t0 = time.monotonic()

        async def found():
            return (await cb.lookup(MODEL, tokens))["peers"] == {"a": 600}
        await until("b never found a's context in Redis", found, timeout=1.0)
        assert server.holds(PREFIX, "a", put["keys"]), "a's chunks are published under its node id"
        assert time.monotonic() - t0 < 1.0
        assert a.peers.connected() == [] and b.peers.connected() == []  # found without a connection

        calls = server.calls("evalsha")
        await cb.lookup(MODEL, tokens)
        assert server.calls("evalsha") == calls + 1, "a prompt's key chain is one round trip"
        held = await b.directory.lookup([bytes.fromhex(k) for k in put["keys"]])
        assert held.addresses == {"a": f"127.0.0.1:{a.peers.port}"} and held.zones == {"a": "core"}

        f = await cb.fetch(MODEL, tokens, deadline_ms=30_000)
        async with f:
            events = [ev async for ev in f]
        assert [ev.kind for ev in events] == ["kv"] * 3 and {ev.source for ev in events} == {"a"}
        assert b.peers.connected() == ["a"]
        peers = {p["node_id"]: p for p in await cb.peers()}
        assert peers["a"]["address"] == f"127.0.0.1:{a.peers.port}" and peers["a"]["configured"] is False

        async def hung_up():
            return a.peers.connected() == [] and b.peers.connected() == []
        await until("the dialled connection was not closed once idle", hung_up, timeout=5)
        status = await cb.status()
        assert status["directory"]["backend"] == "redis" and status["directory"]["up"] is True


async def test_each_holder_publishes_the_levels_it_holds_and_a_lookup_carries_them(inprocess, server):
    a, b, c = await inprocess(["a", "b", "c"], peered=False, per_node={"c": {"store": {"keep_fetched": False}}},
                              **directory(server))
    tokens, kv = list(range(3000, 3512)), synthetic_kv(512, seed=7).half()
    async with client(a) as ca, client(b) as cb:
        keys = [bytes.fromhex(k) for k in (await ca.put(MODEL, tokens, kv))["keys"]]
        f = await cb.fetch(MODEL, tokens, deadline_ms=30_000, levels=["balanced"])
        async with f:
            assert [ev.level async for ev in f] == ["balanced"] * 2

        async def b_published():
            return all(b.store.has(k) for k in keys) and len((await c.directory.lookup(keys)).of(1)) == 2
        await until("b's kept chunks never reached Redis", b_published)
        r = redis.Redis(port=server.port)
        try:
            assert r.hgetall(f"{PREFIX}levels:{keys[0].hex()}") == {b"a": b"balanced,fast,high", b"b": b"balanced"}
        finally:
            r.close()
        held = await c.directory.lookup(keys)
        assert held.levels_of("a", 0) == {"high", "balanced", "fast"} and held.levels_of("b", 1) == {"balanced"}
        assert held.want(["fast"]).holders(0) == ["a"]  # b would answer NOT_FOUND: not its holder for this fetch
        await b.stop()  # b's lease ends: it leaves both the holders and their levels
        r = redis.Redis(port=server.port)
        try:
            await c.directory.lookup(keys)
            assert r.hgetall(f"{PREFIX}levels:{keys[0].hex()}") == {b"a": b"balanced,fast,high"}
        finally:
            r.close()


async def test_redis_going_away_fails_no_fetch_the_local_store_or_a_known_peer_can_serve(inprocess, server):
    a, b = await inprocess(["a", "b"], peered=False, **directory(server))
    tokens_a, tokens_b = list(range(3000, 3512)), list(range(4000, 4512))
    async with client(a) as ca, client(b) as cb:
        await ca.put(MODEL, tokens_a, synthetic_kv(512, seed=6).half())
        await until("b never found a's context",
                    lambda: _peers_are(cb, tokens_a, {"a": 512}))  # b now knows a holds it
        server.stop()

        f = await cb.fetch(MODEL, tokens_a, deadline_ms=30_000)  # from the peer b knows of
        async with f:
            events = [ev async for ev in f]
        assert [(ev.kind, ev.source) for ev in events] == [("kv", "a")] * 2
        put = await cb.put(MODEL, tokens_b, synthetic_kv(512, seed=7).half())  # stored locally all the same
        assert put["stored_chunks"] == 2
        f = await cb.fetch(MODEL, tokens_b, deadline_ms=30_000)
        async with f:
            assert [ev.source async for ev in f] == ["local"] * 2

        health = await cb.health()
        assert health["status"] == "degraded" and health["degraded"][0]["reason"] == "directory"
        assert "unreachable" in health["degraded"][0]["message"]
        text = await cb.metrics()
        assert 'kvstreamd_errors_total{kind="directory_unreachable"} 1.0' in text  # once per outage
        assert 'kvstreamd_degraded{reason="directory"} 1.0' in text

        await asyncio.sleep(1.0)
        server.start()  # empty, as a restarted server without persistence is
        t0 = time.monotonic()

        async def republished():
            return server.holds(PREFIX, "b", put["keys"]) and server.holds(PREFIX, "a", _keys(a, tokens_a))
        await until("the keys were not back in Redis within 5 s", republished, timeout=5.0)
        assert time.monotonic() - t0 < 5.0
        assert (await cb.health())["status"] == "ok"
        assert (await ca.lookup(MODEL, tokens_b))["peers"] == {"b": 512}  # b's outage put, published


async def _peers_are(c: AsyncClient, tokens, want) -> bool:
    return (await c.lookup(MODEL, tokens))["peers"] == want


def _keys(d, tokens) -> list[str]:
    from kvstreamd.store.keys import chunk_keys
    return [k.hex() for k in chunk_keys(MODEL, tokens, d.cfg.codec.chunk_tokens)]


# -- the fleet floor: 16 daemon processes, one redis-server ----------------------------------------

LEASE_S = 10.0


def _fetch_sources(d, tokens) -> list[tuple[str, str]]:
    with d.client().fetch(MODEL, tokens, deadline_ms=30_000) as f:
        return [(ev.kind, ev.source) for ev in f]


def test_sixteen_daemons_on_one_redis_find_each_other_connect_only_to_fetch_and_ride_out_a_redis_restart(
        tmp_path, small_profile, server):
    from tests.fixtures import synthetic_daemon

    cfg = {"directory": {"backend": "redis", "url": server.url, "prefix": PREFIX, "lease_s": LEASE_S, "idle_s": 60.0}}
    nodes = [synthetic_daemon(tmp_path, f"n{i:02d}", small_profile, **cfg) for i in range(16)]
    try:
        for n in nodes:
            n.start(wait=0)
        for n in nodes:
            n.wait_healthy(240)
        holder, fetcher, other = nodes[3], nodes[7], nodes[5]
        ctx = list(range(5000, 5600))
        holder.client().put(MODEL, ctx, synthetic_kv(600, seed=8).half())
        t0 = time.monotonic()
        for n in nodes:  # every other one finds it, within 1 s of the put's reply
            if n is not holder:
                seconds_until(lambda: n.client().lookup(MODEL, ctx)["peers"] == {"n03": 600}, timeout=1.0,
                              what=f"{n.name} finding the context")
        assert time.monotonic() - t0 < 1.0
        assert all(n.client().status()["peers_connected"] == [] for n in nodes), "lookups need no peer connection"

        assert _fetch_sources(fetcher, ctx) == [("kv", "n03")] * 3
        connected = {n.name: n.client().status()["peers_connected"] for n in nodes}
        assert connected == {n.name: (["n03"] if n is fetcher else ["n07"] if n is holder else []) for n in nodes}

        ctx2 = list(range(6000, 6512))
        other.client().put(MODEL, ctx2, synthetic_kv(512, seed=9).half())
        seconds_until(lambda: nodes[9].client().lookup(MODEL, ctx2)["peers"] == {"n05": 512}, timeout=1.0,
                      what="n09 finding n05's context")

        seconds_until(lambda: nodes[0].client().lookup(MODEL, ctx)["peers"] == {"n03": 600, "n07": 600}, timeout=2.0,
                      what="the fetcher publishing the chunks it kept to serve onward")
        holder.kill()  # SIGKILL: its lease is not given back; it runs out
        gone = seconds_until(lambda: nodes[0].client().lookup(MODEL, ctx)["peers"] == {"n07": 600},
                             timeout=LEASE_S + 1, what="the killed host leaving lookups")
        assert gone <= LEASE_S

        server.stop()
        outage_t0 = time.monotonic()
        assert _fetch_sources(nodes[9], ctx2) == [("kv", "n05")] * 2  # a peer known from its lookup
        assert _fetch_sources(other, ctx2) == [("kv", "local")] * 2
        ctx3 = list(range(7000, 7256))
        put3 = nodes[12].client().put(MODEL, ctx3, synthetic_kv(256, seed=10).half())
        assert put3["stored_chunks"] == 1
        time.sleep(max(0.0, 10.0 - (time.monotonic() - outage_t0)))  # Redis is away for 10 s
        server.start()
        back = seconds_until(lambda: server.holds(PREFIX, "n05", _chunk_keys(ctx2)) and server.holds(PREFIX, "n12", put3["keys"]),
                             timeout=5.0, what="the keys being back in Redis")
        found = seconds_until(lambda: nodes[0].client().lookup(MODEL, ctx3)["peers"] == {"n12": 256},
                              timeout=5.0 - back, what="n00 finding the outage's put")
        assert back + found < 5.0
        assert not server.holds(PREFIX, "n03", _chunk_keys(ctx)), "the killed host's lease did not come back"
    finally:
        for n in nodes:
            n.kill()


def _chunk_keys(tokens) -> list[str]:
    from kvstreamd.store.keys import chunk_keys
    return [k.hex() for k in chunk_keys(MODEL, tokens, 256)]
