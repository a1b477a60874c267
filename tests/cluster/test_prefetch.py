"""Predictive prefetch (kvstreamd/cluster/prefetch.py): the successor table, and two real daemon
processes replaying a recorded access pattern (user visits that read documents in a fixed
order), first with prefetch off, then on: the fetching node's local hit rate at least doubles.
Over a tbf-shaped link between network namespaces, a prefetch in flight yields the link to a
user fetch: none of its chunks is taken while the user's fetch runs, and it resumes after.
(What a user fetch pays while prefetches run, timed: `kvstreamd bench prefetch`.)"""
from __future__ import annotations

import array
import asyncio
import json
import re
import time

import pytest

from tests.fixtures import DATA, synthetic_daemon, synthetic_kv
from kvstreamd.client import AsyncClient
from kvstreamd.store.keys import chunk_keys
from kvstreamd.config import ConfigError, load
from kvstreamd.lab import netns
from kvstreamd.lab.daemons import wait_for
from kvstreamd.cluster.prefetch import CoAccess, Context

MODEL = "synthetic-test-model"
LEVEL = "fp16"  # one level, sized exactly: the store budgets below count whole documents
CHUNK_BYTES = 2 * 3 * 2 * 256 * 2 * 8  # fp16 KV of one 256-token chunk of the synthetic shape
PATTERN = DATA / "prefetch_visits.jsonl"


def ctx(name: int, chunks: int = 1) -> Context:
    keys = tuple(bytes([name, i]) * 16 for i in range(chunks))
    return Context(MODEL, keys, tuple((i * 256, (i + 1) * 256) for i in range(chunks)), array.array("I", range(chunks * 256)))


# -- the successor table --------------------------------------------------------------------

def test_a_context_fetched_within_the_window_after_another_is_its_successor():
    t = CoAccess(max_contexts=8, max_successors=2, window_s=10)
    t.fetched(ctx(1), 0.0)
    t.fetched(ctx(2), 5.0)
    t.fetched(ctx(3), 100.0)  # long after 2: not its successor
    assert [c.id for c in t.successors(ctx(1).id, 1, 2)] == [ctx(2).id]
    assert t.successors(ctx(2).id, 1, 2) == []


def test_successors_come_most_counted_first_and_below_min_count_not_at_all():
    t = CoAccess(max_contexts=8, max_successors=2, window_s=10)
    for now, nxt in enumerate([2, 3, 3]):
        t.fetched(ctx(1), 10.0 * now)
        t.fetched(ctx(nxt), 10.0 * now + 1)
    assert [c.id for c in t.successors(ctx(1).id, 1, 2)] == [ctx(3).id, ctx(2).id]
    assert [c.id for c in t.successors(ctx(1).id, 2, 2)] == [ctx(3).id]


def test_the_table_is_bounded_in_contexts_and_in_successors_each():
    t = CoAccess(max_contexts=3, max_successors=1, window_s=10)
    t.fetched(ctx(1), 0)
    t.fetched(ctx(2), 1)
    t.fetched(ctx(1), 20)
    t.fetched(ctx(3), 21)  # a new successor of 1 replaces the least counted (2)
    assert [c.id for c in t.successors(ctx(1).id, 1, 5)] == [ctx(3).id]
    t.fetched(ctx(4), 40)
    t.fetched(ctx(5), 60)  # past three contexts: the least recently fetched (2, then 1) are gone
    assert len(t.contexts) == 3 and ctx(1).id not in t.contexts and t.successors(ctx(1).id, 1, 5) == []


# -- configuration -------------------------------------------------------------------------

@pytest.mark.parametrize("text, fragment", [
    ("[prefetch]\nmemory_share = 1.5\n", "[prefetch] memory_share: 1.5 is a share of the budget: at most 1"),
    ("[prefetch]\nmemory_share = 0\n", "[prefetch] memory_share: 0 must be > 0"),
    ("[prefetch]\nmax_successors = 0\n", "[prefetch] max_successors: 0 is out of range (1..16)"),
    ("[prefetch]\nenabled = \"yes\"\n", "[prefetch] enabled:"),
    ("[prefetch]\nwindow = 3\n", "[prefetch] window: unknown key (did you mean window_s?)"),
])
def test_a_bad_prefetch_key_is_refused_naming_the_file_and_key(tmp_path, text, fragment):
    path = tmp_path / "kvstreamd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(path, {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert str(e.value).startswith(str(path)) and fragment in str(e.value)


# -- daemons in the test's event loop ---------------------------------------------------------

def idle(prefetch: dict) -> bool:
    """A node's /v1/status "prefetch": nothing queued or running, and no fetch of its own."""
    return prefetch["queued"] == 0 and prefetch["running"] is None and prefetch["user_fetches"] == 0


async def settle(d) -> None:
    """Until d's prefetches are done and no fetch of its own is running."""
    for _ in range(400):
        if idle(d.node.features["prefetch"].status()):
            return
        await asyncio.sleep(0.025)
    raise TimeoutError("prefetch did not settle")


async def fetch_on(d, tokens) -> int:
    """A user fetch on d; returns its local tokens."""
    async with AsyncClient(d.cfg.api.socket, timeout=60) as c:
        f = await c.fetch(MODEL, tokens, deadline_ms=30_000)
        async with f:
            assert [ev.kind async for ev in f] and f.end.kv_tokens == len(tokens)
            local = f.start.local_tokens
    await settle(d)
    return local


async def two_nodes(inprocess, budget: int | None = None, **prefetch):
    """a holds the contexts (put with `put`), b fetches them, keeping nothing it fetched, so
    that what b holds it prefetched."""
    store = {"keep_fetched": False, **({"memory_budget": budget, "disk_budget": 0} if budget else {})}
    return await inprocess(["a", "b"], codec={"levels": [LEVEL]}, per_node={"b": {"store": store}},
                           prefetch={"enabled": True, "min_count": 1, **prefetch})


async def put(a, b, n: int, chunks: int) -> list[list[int]]:
    contexts = [list(range(70_000 + 10_000 * i, 70_000 + 10_000 * i + 256 * chunks)) for i in range(n)]
    async with AsyncClient(a.cfg.api.socket, timeout=60) as c:
        for i, tokens in enumerate(contexts):
            await c.put(MODEL, tokens, synthetic_kv(len(tokens), seed=300 + i).half())
    for _ in range(200):
        if b.directory.counts().get("a", 0) == n * chunks:
            return contexts
        await asyncio.sleep(0.025)
    raise TimeoutError("b never learnt a's keys")


async def test_a_prefetched_context_is_fetched_locally_and_counted_a_hit(inprocess):
    a, b = await two_nodes(inprocess)
    x, y = await put(a, b, 2, chunks=2)
    for tokens in (x, y, x):  # y follows x; then x again prefetches y
        await fetch_on(b, tokens)
    sent = sum(len(a.store.get(k).levels[LEVEL]) for k in chunk_keys(MODEL, y, 256))
    assert b.metrics.prefetch_bytes._value.get() == sent
    assert b.metrics.prefetch_hits._value.get() == 0
    assert await fetch_on(b, y) == len(y)
    assert b.metrics.prefetch_hits._value.get() == 1


async def test_a_context_prefetched_and_not_fetched_is_not_prefetched_again(inprocess):
    a, b = await two_nodes(inprocess)
    x, y = await put(a, b, 2, chunks=2)
    for tokens in (x, y, x):
        await fetch_on(b, tokens)
    keys = chunk_keys(MODEL, y, 256)
    assert b.store.longest_prefix(keys) == 2
    b.store.delete_context(keys[-1])  # gone unused (as an eviction would take it)
    for _ in range(3):
        await fetch_on(b, x)
    assert b.store.longest_prefix(keys) == 0
    assert b.metrics.prefetches.labels("done")._value.get() == 1
    await fetch_on(b, y)  # a user fetched it: it may be prefetched again
    done = b.metrics.prefetches.labels("done")._value.get()
    await fetch_on(b, x)
    assert b.store.longest_prefix(keys) == 2 and b.metrics.prefetches.labels("done")._value.get() == done + 1


async def test_unused_prefetched_chunks_stay_within_their_share_of_the_memory_budget(inprocess):
    """Room for one 2-chunk context in the share: x's second successor takes the first's place."""
    budget = 10 * (CHUNK_BYTES + 64)
    a, b = await two_nodes(inprocess, budget=budget, memory_share=0.25, max_successors=2)
    x, y1, y2 = await put(a, b, 3, chunks=2)
    for tokens in (x, y1, x):  # y1 follows x: prefetched when x comes again
        await fetch_on(b, tokens)
    assert b.store.longest_prefix(chunk_keys(MODEL, y1, 256)) == 2
    for tokens in (y2, x):  # y2 follows x too: prefetched, and y1, still unused, makes room for it
        await fetch_on(b, tokens)
    held = [b.store.longest_prefix(chunk_keys(MODEL, t, 256)) for t in (y1, y2)]
    assert held == [0, 2]
    assert 0 < b.node.features["prefetch"].status()["unused_bytes"] <= 0.25 * budget


# -- two daemon processes ----------------------------------------------------------------------

def document(i: int) -> tuple[list[int], object]:
    """Document i: 512 tokens of its own, two 256-token chunks."""
    return list(range(20_000 + 1000 * i, 20_000 + 1000 * i + 512)), synthetic_kv(512, seed=100 + i).half()


def visits() -> list[list[int]]:
    """The recorded pattern: each line one user visit, the documents it read in order (a visit
    starting at document s reads s, s+1, s+2 of 12; seed 7)."""
    return [json.loads(line)["docs"] for line in PATTERN.read_text().splitlines() if line.strip()]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def settled(node) -> bool:
    return idle(node.client().status()["prefetch"])


@pytest.mark.system  # daemon processes
def test_replaying_a_recorded_access_pattern_prefetch_doubles_the_local_hit_rate(tmp_path, small_profile):
    """a holds 12 documents; b_off and b_on (each a store of 2.5 documents in memory, no disk,
    keeping what it fetches; prefetch off and on) each fetch the recorded visits from it."""
    codec = {"levels": [LEVEL]}
    store = {"memory_budget": int(2.5 * 2 * (CHUNK_BYTES + 64)), "disk_budget": 0}
    a = synthetic_daemon(tmp_path, "a", small_profile, codec=codec)
    fetchers = [synthetic_daemon(tmp_path, f"b_{mode}", small_profile, codec=codec, store=store,
                                 prefetch={"enabled": mode == "on", "min_count": 1, "max_successors": 1,
                                           "memory_share": 0.6})
                for mode in ("off", "on")]
    for b in fetchers:
        b.peers = [a.addr]
    a.peers = [b.addr for b in fetchers]
    docs = [document(i) for i in range(12)]
    try:
        for n in (a, *fetchers):
            n.start(wait=0)
        for n in (a, *fetchers):
            n.wait_healthy()
        for tokens, kv in docs:
            a.client().put(MODEL, tokens, kv)
        rate = []
        for b in fetchers:
            cb = b.client()
            wait_for(lambda: cb.lookup(MODEL, docs[-1][0])["peers"].get("a") == 512, what="b to learn a's keys")
            local = found = 0
            for visit in visits():
                for d in visit:
                    with cb.fetch(MODEL, docs[d][0], deadline_ms=30_000) as f:
                        list(f)
                        local, found = local + f.start.local_tokens, found + f.start.found_tokens
                        assert f.end.kv_tokens == 512
                    # a user reads between fetches: what b does after one is done before the next
                    wait_for(lambda: settled(b), timeout=10, interval=0.02, what="b to finish its prefetches")
            rate.append(local / found)
        off, on = rate
        print(f"local hit rate: prefetch off {off:.3f}, on {on:.3f}")
        assert on >= 2 * off and on > 0.3, (off, on)
        assert metric(fetchers[0].client().metrics(), "kvstreamd_prefetch_bytes_total") == 0  # off: none
        metrics = fetchers[1].client().metrics()
        assert metric(metrics, "kvstreamd_prefetch_hits_total") > 0
        assert metric(metrics, 'kvstreamd_prefetches_total{outcome="done"}') > 0
        assert metric(metrics, "kvstreamd_prefetch_bytes_total") > 0
    finally:
        for n in (*fetchers, a):
            n.stop()


ok, why = netns.available()


@pytest.mark.system  # daemon processes in network namespaces (root)
@pytest.mark.skipif(not ok, reason=f"cannot build network namespaces here: {why}")
def test_a_prefetch_in_flight_takes_no_chunk_while_a_user_fetch_runs_and_resumes_after(tmp_path, small_profile):
    """b learns that y follows x; fetching x again starts y's prefetch (12 chunks, ~2.4 s at
    2 Mbit/s); a user fetch of z (4 chunks) over the same link starts while it is in flight."""
    with netns.Link(rate_mbit=2) as link:
        codec = {"levels": [LEVEL]}
        a = synthetic_daemon(tmp_path, "a", small_profile, codec=codec)
        a.host, a.netns = link.addr["a"], link.command("a", [])
        b = synthetic_daemon(tmp_path, "b", small_profile, codec=codec, store={"keep_fetched": False},
                             prefetch={"enabled": True, "min_count": 1})
        b.host, b.netns = link.addr["b"], link.command("b", [])
        a.peers, b.peers = [b.addr], [a.addr]
        try:
            a.start(wait=0), b.start(wait=0)
            a.wait_healthy(), b.wait_healthy()
            ca, cb = a.client(), b.client()
            x, y, z = (list(range(50_000 * k, 50_000 * k + n)) for k, n in ((1, 256), (2, 12 * 256), (3, 4 * 256)))
            for seed, tokens in enumerate((x, y, z)):
                ca.put(MODEL, tokens, synthetic_kv(len(tokens), seed=seed).half())
            wait_for(lambda: cb.lookup(MODEL, z)["peers"].get("a") == len(z), what="b to learn a's keys")
            for tokens in (x, y):  # y follows x
                with cb.fetch(MODEL, tokens, deadline_ms=60_000) as f:
                    list(f)
            with cb.fetch(MODEL, x, deadline_ms=60_000) as f:
                list(f)
            wait_for(lambda: cb.status()["prefetch"]["received_at"], timeout=10, interval=0.01,
                     what="y's prefetch to take its first chunk")
            with cb.fetch(MODEL, z, deadline_ms=60_000) as f:
                user_start = time.time()  # the daemon has planned it: Start came
                events = list(f)
                user_end = time.time()
            assert {ev.source for ev in events} == {"a"}  # the user fetch crossed the link
            wait_for(lambda: settled(b) and cb.lookup(MODEL, y)["local_tokens"] == len(y), timeout=30,
                     what="y's prefetch to finish")
            taken = cb.status()["prefetch"]["received_at"]
            during = [t for t in taken if user_start <= t <= user_end]
            assert during == [], f"{len(during)} prefetched chunks taken during the user fetch"
            assert min(taken) < user_start and max(taken) > user_end, "the prefetch was not in flight across it"
            assert len(taken) >= 12
            m = cb.metrics()
            assert metric(m, "kvstreamd_prefetch_yields_total") >= 1
            assert metric(m, 'kvstreamd_prefetches_total{outcome="done"}') == 1
        finally:
            for n in (b, a):
                n.stop()
