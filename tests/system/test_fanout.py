"""One context from several holders at once, over real shaped links: a hub namespace (the
fetcher) joined to three holder namespaces, each by a 4 Mbit/s tbf-shaped link of its own
(netns.Star), every host a daemon process. The fetch takes its chunks from all three; a holder
SIGKILLed mid-fetch costs no chunk: its share comes from the others. (How much sooner than
from one holder: `kvstreamd bench fanout`, docs/benchmarks.md.)"""
from __future__ import annotations

import threading

import pytest

from tests.fixtures import synthetic_daemon, synthetic_kv
from kvstreamd.lab import netns
from kvstreamd.lab.daemons import wait_for

ok, why = netns.available()
pytestmark = [pytest.mark.system,  # daemon processes in network namespaces (root)
              pytest.mark.skipif(not ok, reason=f"cannot build network namespaces here: {why}")]

MODEL = "synthetic-test-model"
TOKENS = 8192  # 32 chunks of 256 tokens, ~49 kB each at fp16: ~3.2 s from one holder at 4 Mbit/s
CHUNKS = TOKENS // 256
LEVEL = "fp16"


def fetch(node, tokens, kill=None, after_chunks: int = 0):
    """Fetch at exactly LEVEL; SIGKILL `kill` once `after_chunks` chunks have landed."""
    with node.client().fetch(MODEL, tokens, deadline_ms=120_000, levels=[LEVEL]) as f:
        events = []
        for ev in f:
            events.append(ev)
            if kill is not None and len(events) == after_chunks:
                threading.Thread(target=kill.kill).start()
        return events, f.end


def test_one_context_comes_from_three_holders_at_once_and_a_killed_holder_costs_no_chunk(tmp_path, small_profile):
    spokes = ("b", "c", "d")
    with netns.Star(spokes=spokes, rate_mbit=4) as star:
        codec = {"levels": [LEVEL]}
        holders = []
        for s in spokes:
            h = synthetic_daemon(tmp_path, f"holder-{s}", small_profile, codec=codec)
            h.host, h.netns = star.addr[s], star.command(s, [])
            holders.append(h)
        fetcher = synthetic_daemon(tmp_path, "fetcher", small_profile, codec=codec, store={"keep_fetched": False})
        fetcher.host, fetcher.netns = "0.0.0.0", star.command("a", [])
        fetcher.peers = [h.addr for h in holders]
        nodes = [*holders, fetcher]
        try:
            for n in nodes:
                n.start(wait=0)
            for n in nodes:
                n.wait_healthy(120)
            tokens, kv = list(range(10_000, 10_000 + TOKENS)), synthetic_kv(TOKENS, seed=12).half()
            for h in holders:
                h.client().put(MODEL, tokens, kv)
            wait_for(lambda: fetcher.client().lookup(MODEL, tokens)["peers"] == {h.name: TOKENS for h in holders},
                     timeout=30, what="the fetcher to learn every holder's keys")

            events, end = fetch(fetcher, tokens)
            assert [ev.kind for ev in events] == ["kv"] * CHUNKS and end.errors == []
            assert [ev.i for ev in events] == list(range(CHUNKS))  # handed over in order
            by = {h.name: sum(ev.source == h.name for ev in events) for h in holders}
            assert all(n >= 3 for n in by.values()), by  # every link carried a share

            victim = holders[1]
            events, end = fetch(fetcher, tokens, kill=victim, after_chunks=2)
            assert [ev.kind for ev in events] == ["kv"] * CHUNKS, [(ev.i, ev.kind, ev.source, ev.error) for ev in events]
            assert {ev.level for ev in events} == {LEVEL}
            assert any(victim.name in e for e in end.errors), end.errors
            # The rest of its share came from the others. What it had written before it died still
            # lands (its kernel send buffer and the link's 200 ms tbf queue, ~300 kB, ~6 chunks), so
            # it is killed early in a fetch whose fair share per holder (~11) is larger than that.
            assert sum(ev.source == victim.name for ev in events) < CHUNKS // 3, by
        finally:
            for n in nodes:
                n.kill()
