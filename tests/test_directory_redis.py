"""The directory in a real Redis server ([directory] backend = "redis"): daemons in this test's
event loop, not peered with each other, find each other's chunks through a redis-server the
test starts on a free port, dial a peer when a fetch needs it and hang up once idle, and ride
out the server going away."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis

from conftest import synthetic_kv
from kvstreamd.client import AsyncClient
from kvstreamd.lab import redisserver
from kvstreamd.lab.redisserver import RedisServer

ok, why = redisserver.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)  # make install puts it there

MODEL = "synthetic-test-model"
PREFIX = "kvs-test:"


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.stop()


def directory(server: RedisServer, **kw) -> dict:
    return {"directory": {"backend": "redis", "url": server.url, "prefix": PREFIX, "idle_s": 1.0, **kw}}


def client(d) -> AsyncClient:
    return AsyncClient(d.cfg.api.socket, timeout=60)


def held_in_redis(server: RedisServer, node: str, keys: list[str]) -> bool:
    r = redis.Redis(port=server.port)
    try:
        return all(node.encode() in r.smembers(f"{PREFIX}chunk:{k}") for k in keys)
    finally:
        r.close()


async def until(what: str, predicate, timeout: float = 10.0, interval: float = 0.05):
    t0 = time.monotonic()
    while not (value := await predicate()):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(what)
        await asyncio.sleep(interval)
    return value


def evalsha_calls(server: RedisServer) -> int:
    r = redis.Redis(port=server.port)
    try:
        return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    finally:
        r.close()


async def test_a_context_put_on_one_node_is_found_and_fetched_by_another_that_dials_it_only_to_fetch(
        inprocess, server):
    a, b = await inprocess(["a", "b"], peered=False, **directory(server))
    kv = synthetic_kv(600, seed=5).half()
    tokens = list(range(2000, 2600))
    async with client(a) as ca, client(b) as cb:
        put = await ca.put(MODEL, tokens, kv)
        t0 = time.monotonic()

        async def found():
            return (await cb.lookup(MODEL, tokens))["peers"] == {"a": 600}
        await until("b never found a's context in Redis", found, timeout=1.0)
        assert held_in_redis(server, "a", put["keys"]), "a's chunks are published under its node id"
        assert time.monotonic() - t0 < 1.0
        assert a.peers.connected() == [] and b.peers.connected() == []  # found without a connection

        calls = evalsha_calls(server)
        await cb.lookup(MODEL, tokens)
        assert evalsha_calls(server) == calls + 1, "a prompt's key chain is one round trip"

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
            return held_in_redis(server, "b", put["keys"]) and held_in_redis(server, "a", _keys(a, tokens_a))
        await until("the keys were not back in Redis within 5 s", republished, timeout=5.0)
        assert time.monotonic() - t0 < 5.0
        assert (await cb.health())["status"] == "ok"
        assert (await ca.lookup(MODEL, tokens_b))["peers"] == {"b": 512}  # b's outage put, published


async def _peers_are(c: AsyncClient, tokens, want) -> bool:
    return (await c.lookup(MODEL, tokens))["peers"] == want


def _keys(d, tokens) -> list[str]:
    from kvstreamd.keys import chunk_keys
    return [k.hex() for k in chunk_keys(MODEL, tokens, d.cfg.codec.chunk_tokens)]


def test_a_bad_directory_section_is_a_config_error(tmp_path):
    from kvstreamd import config

    bad = tmp_path / "c.toml"
    bad.write_text('[directory]\nbackend = "etcd"\n')
    with pytest.raises(config.ConfigError, match=r"\[directory\] backend"):
        config.load(bad)
    bad.write_text('[directory]\nbackend = "redis"\nurl = "localhost:6379"\n[peer]\nsecret = "0123456789abcdef0"\n')
    with pytest.raises(config.ConfigError, match="not a Redis URL"):
        config.load(bad)
    bad.write_text('[directory]\nbackend = "redis"\n')
    with pytest.raises(config.ConfigError, match="no secret"):
        config.load(bad)
