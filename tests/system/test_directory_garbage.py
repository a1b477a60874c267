"""What another Redis client writes at the directory's keys is input, not trusted: keys of the
wrong type, members, host entries and levels that do not parse, and a chunk set of 300,000
members, each planted by a plain Redis client beside the daemons' own entries on a real
redis-server. Lookups answer from the valid entries, publishing completes, the node is not
degraded, and each bad entry is counted as kvstreamd_errors{kind="directory_<fault>"}."""
from __future__ import annotations

import asyncio
import inspect
import logging
import re
import time

import pytest
import redis

from tests.fixtures import synthetic_kv
from kvstreamd.client import AsyncClient
from kvstreamd.cluster import redis_directory
from kvstreamd.store.keys import chunk_keys

MODEL = "synthetic-test-model"
PREFIX = "kvs-garbage:"
LEASE_S = 1.5  # renewed every 0.5 s: a host key or lease lost is published anew within it


@pytest.fixture
def r(redis_server):
    c = redis.Redis(port=redis_server.port)
    yield c
    c.close()


def directory(server) -> dict:
    return {"directory": {"backend": "redis", "url": server.url, "prefix": PREFIX, "lease_s": LEASE_S,
                          "idle_s": 1.0}}


def client(d) -> AsyncClient:
    return AsyncClient(d.cfg.api.socket, timeout=60)


def key(kind: str, name: bytes | str) -> bytes:
    return PREFIX.encode() + kind.encode() + b":" + (name.encode() if isinstance(name, str) else name)


def hex_keys(tokens: list[int]) -> list[str]:
    return [k.hex() for k in chunk_keys(MODEL, tokens, 256)]


async def errors(c: AsyncClient) -> dict[str, float]:
    text = await c.metrics()
    return {m[1]: float(m[2]) for m in re.finditer(r'kvstreamd_errors_total\{kind="(directory_\w+)"\} (\S+)', text)}


async def until(what: str, check, timeout: float = 5.0):
    """Wait for check() (a coroutine function, or a plain one) to be true."""
    t0 = time.monotonic()
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


async def healthy_and_quick(*clients: AsyncClient) -> None:
    """Each node answers /healthz "ok" (not degraded) within 100 ms."""
    for c in clients:
        t0 = time.monotonic()
        health = await c.health()
        assert time.monotonic() - t0 < 0.1
        assert health["status"] == "ok", health


async def fetched_from(c: AsyncClient, tokens: list[int]) -> list[tuple[str, str]]:
    f = await c.fetch(MODEL, tokens, deadline_ms=30_000)
    async with f:
        return [(ev.kind, ev.source) async for ev in f]


def no_traceback(caplog) -> None:
    bad = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not bad, [r.getMessage() for r in bad]


async def test_keys_of_the_wrong_type_fail_no_lookup_and_no_republish_and_are_replaced_by_the_holder(
        inprocess, redis_server, r, caplog):
    a, b = await inprocess(["a", "b"], peered=False, **directory(redis_server))
    tokens = list(range(2000, 2512))
    k0, k1 = hex_keys(tokens)
    async with client(a) as ca, client(b) as cb:
        await ca.put(MODEL, tokens, synthetic_kv(512, seed=3).half())
        await until("b never found a's context", lambda: _peers_are(cb, tokens, {"a": 512}))

        # another client: a string where the set of holders belongs, a list for the levels hash,
        # a list at a's own host key (its lease is gone: it publishes everything anew), a string
        # for a's held: set, and a hash at the host key of a member of k0's holders
        r.delete(key("chunk", k1), key("levels", k1), key("held", "a"))
        r.set(key("held", "a"), b"not a set")
        r.set(key("chunk", k1), b"not a set")
        r.rpush(key("levels", k1), b"not a hash")
        r.delete(key("host", "a"))
        r.rpush(key("host", "a"), b"not a host entry")
        r.sadd(key("chunk", k0), b"w")
        r.hset(key("host", "w"), b"address", b"127.0.0.1:1")

        await cb.lookup(MODEL, tokens)  # answered (a is found again once it renews its host entry)
        await healthy_and_quick(cb)
        for _ in range(15):  # a republishes over it: not degraded once, through three renewals
            await healthy_and_quick(ca)
            await asyncio.sleep(0.1)
        await until("a never published k1 again over the garbage", lambda: _peers_are(cb, tokens, {"a": 512}))
        assert r.type(key("chunk", k1)) == b"set" and r.type(key("levels", k1)) == b"hash"
        assert r.type(key("host", "a")) == b"string" and r.type(key("held", "a")) == b"set"
        assert redis_server.holds(PREFIX, "a", [k0, k1])

        assert await fetched_from(cb, tokens) == [("kv", "a")] * 2
        await healthy_and_quick(ca, cb)
        assert (await ca.status())["directory"]["up"] and (await cb.status())["directory"]["up"]
        assert (await errors(ca)).get("directory_wrong_type", 0) >= 4  # host:a, held:a, chunk:k1, levels:k1
        assert (await errors(cb)).get("directory_wrong_type", 0) >= 1  # host:w (and chunk:k1 if seen)
        assert "directory_unreachable" not in await errors(ca) and "directory_unreachable" not in await errors(cb)
    no_traceback(caplog)


async def test_members_host_entries_and_levels_that_do_not_parse_are_skipped_and_counted_not_a_500(
        inprocess, redis_server, r, caplog):
    a, b = await inprocess(["a", "b"], peered=False, **directory(redis_server))
    tokens = list(range(3000, 3512))
    k0, k1 = hex_keys(tokens)
    async with client(a) as ca, client(b) as cb:
        put = await ca.put(MODEL, tokens, synthetic_kv(512, seed=4).half())
        await until("b never found a's context", lambda: _peers_are(cb, tokens, {"a": 512}))

        for k in (k0, k1):
            # members that are no node id (not UTF-8; 300 bytes), each with a host entry
            for member in (b"\xff\xfe", b"n" * 300):
                r.sadd(key("chunk", k), member)
                r.set(key("host", member), b'{"address": "127.0.0.1:1", "zone": ""}')
            # holders whose host entry is not a record: not UTF-8, not host:port, a zone that is
            # not a string, longer than the bound
            for node, record in ((b"x1", b"\xff\xfe{"), (b"x2", b'{"address": "no port"}'),
                                 (b"x3", b'{"address": "127.0.0.1:1", "zone": [1]}'),
                                 (b"x4", b"{" + b" " * 5000 + b"}")):
                r.sadd(key("chunk", k), node)
                r.set(key("host", node), record)
            # a live holder whose levels field is not UTF-8, and one whose field is too long
            for node, levels in ((b"y1", b"\xff\xfebalanced"), (b"y2", b"balanced," * 1000)):
                r.sadd(key("chunk", k), node)
                r.set(key("host", node), b'{"address": "127.0.0.1:1", "zone": ""}')
                r.hset(key("levels", k), node, levels)
        r.sadd(key("held", "a"), b"not a chunk key", b"\xff" * 40)

        got = await cb.lookup(MODEL, tokens)  # no 500
        assert got["peers"] == {"a": 512, "y1": 512, "y2": 512}
        held = await b.directory.lookup([bytes.fromhex(k0), bytes.fromhex(k1)])
        assert held.holders(0) == ["a", "y1", "y2"]
        assert held.levels_of("a", 0) == {"balanced", "fast", "high"}
        assert held.levels_of("y1", 0) is None and held.levels_of("y2", 0) is None  # the field skipped
        seen = await errors(cb)
        for fault in ("bad_holder", "bad_host", "bad_levels"):
            assert seen.get(f"directory_{fault}", 0) >= 2, (fault, seen)

        # y1 and y2 do not answer (port 1): the chunks come from a, as KV, and b stays well
        assert await fetched_from(cb, tokens) == [("kv", "a")] * 2

        r.delete(key("host", "a"))  # a publishes everything anew, reading its held: set
        await until("a never counted the held: members that are no chunk key",
                    lambda: _counted(ca, "directory_bad_held", 2))
        await until("a never took them out of its held: set",
                    lambda: set(r.smembers(key("held", "a"))) == {bytes.fromhex(k) for k in put["keys"]})
        await healthy_and_quick(ca, cb)
        assert "directory_unreachable" not in await errors(ca) and "directory_unreachable" not in await errors(cb)
    no_traceback(caplog)


async def test_a_chunk_set_of_300000_members_costs_a_lookup_milliseconds_and_its_valid_holder_is_still_found(
        inprocess, redis_server, r, caplog):
    a, b = await inprocess(["a", "b"], peered=False, **directory(redis_server))
    tokens = list(range(4000, 4256))
    (k0,) = hex_keys(tokens)
    async with client(a) as ca, client(b) as cb:
        await ca.put(MODEL, tokens, synthetic_kv(256, seed=5).half())
        await until("b never found a's context", lambda: _peers_are(cb, tokens, {"a": 256}))
        pipe = r.pipeline(transaction=False)
        for i in range(0, 300_000, 10_000):
            pipe.sadd(key("chunk", k0), *(f"junk{j}" for j in range(i, i + 10_000)))
        pipe.execute()
        assert r.scard(key("chunk", k0)) == 300_001

        r.config_set("slowlog-log-slower-than", 0)  # every command, with how long Redis spent on it
        r.config_set("slowlog-max-len", 100_000)
        r.slowlog_reset()
        for _ in range(3):
            assert (await cb.lookup(MODEL, tokens))["peers"] == {"a": 256}
        scripts = [e["duration"] for e in r.slowlog_get(100_000) if e["command"].startswith(b"EVALSHA")]
        assert len(scripts) == 3
        assert max(scripts) < 50_000, scripts  # microseconds: Redis is not blocked for long
        # a lookup reads a bounded part of the set (the rest is left for other lookups to prune)
        assert r.scard(key("chunk", k0)) >= 300_001 - 3 * 2 * redis_directory.HOLDERS_READ

        assert await fetched_from(cb, tokens) == [("kv", "a")]
        await healthy_and_quick(ca, cb)
        assert (await errors(cb)).get("directory_oversized_set", 0) >= 3
        assert "directory_unreachable" not in await errors(cb)
    no_traceback(caplog)


async def _peers_are(c: AsyncClient, tokens, want) -> bool:
    return (await c.lookup(MODEL, tokens))["peers"] == want


async def _counted(c: AsyncClient, kind: str, n: int) -> bool:
    return (await errors(c)).get(kind, 0) >= n
