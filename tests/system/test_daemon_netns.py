"""A peer that dies mid-stream, over a real shaped link: daemon a in one network namespace, b and
c in another, joined by an 8 Mbit/s veth pair so a 4-chunk transfer takes seconds and a can be
killed (SIGKILL) while it streams. The fetch on b finishes anyway -- the rest of the chunks come
from c when c holds them, else as TEXT for the model to recompute -- and b and c keep serving."""
from __future__ import annotations

import pytest
import torch

from kvstreamd.lab import netns
from kvstreamd.lab.daemons import DaemonProcess, wait_for

from tests.fixtures import CHUNK, expected_chunk, real_context

ok, why = netns.available()
pytestmark = [pytest.mark.system,  # daemon processes in network namespaces (root), the real model
              pytest.mark.skipif(not ok, reason=f"cannot build network namespaces here: {why}")]


@pytest.fixture(scope="module")
def long_context(lm):
    """1024 real tokens: four 256-token chunks, ~1.1 MB each at `high` (about a second each at 8 Mbit/s)."""
    return real_context(lm, 100_000, 1024)


@pytest.fixture(scope="module")
def short_context(lm):
    return real_context(lm, 140_000, 300)


def fetch_killing(node: DaemonProcess, victim: DaemonProcess, model_id: str, tokens: list[int]):
    """Fetch on `node`; SIGKILL `victim` as soon as the first chunk has landed."""
    with node.client().fetch(model_id, tokens, deadline_ms=120_000) as f:
        events = []
        for ev in f:
            events.append(ev)
            if len(events) == 1:
                victim.kill()
        kv = f.kv.clone()
        return events, f.end, kv


def test_peer_killed_mid_stream(tmp_path, long_context, short_context):
    model_id, tokens, kv = long_context
    with netns.Link(rate_mbit=8) as link:
        extra = {"codec": {"chunk_tokens": CHUNK, "workers": 1}}
        a = DaemonProcess("a", tmp_path / "a", host=link.addr["a"], netns=link.command("a", []), extra=extra)
        # b keeps nothing it fetched: each step's fetch is of chunks held by a (and c), not by b
        b = DaemonProcess("b", tmp_path / "b", host=link.addr["b"], netns=link.command("b", []),
                          extra={**extra, "store": {"keep_fetched": False}})
        c = DaemonProcess("c", tmp_path / "c", host=link.addr["b"], netns=link.command("b", []), extra=extra)
        nodes = [a, b, c]
        for n in nodes:
            n.peers = [m.addr for m in nodes if m is not n]
        try:
            for n in nodes:
                n.start(wait=0)
            for n in nodes:
                n.wait_healthy()
            # 1. only a holds the context: a dies after the first chunk -> the rest is TEXT
            a.client().put(model_id, tokens, kv)
            wait_for(lambda: b.client().lookup(model_id, tokens)["peers"].get("a") == 1024, what="b sees a's chunks")
            events, end, got = fetch_killing(b, a, model_id, tokens)
            assert not a.alive()
            assert len(events) == 4 and events[0].kind == "kv" and events[0].source == "a"
            assert events[-1].kind == "text" and events[-1].source == "fallback"
            assert end.kv_tokens + end.text_tokens == 1024 and end.text_tokens >= CHUNK
            assert any("peer a failed" in e for e in end.errors), end.errors
            for ev in events:
                if ev.kind == "kv":
                    assert torch.equal(got[:, :, ev.start:ev.end], expected_chunk(kv, ev.i, ev.level, model_id))

            # 2. b and c keep serving: a context on c reaches b
            m2, t2, kv2 = short_context
            c.client().put(m2, t2, kv2)
            wait_for(lambda: b.client().lookup(m2, t2)["peers"].get("c") == 300, what="b sees c's chunks")
            with b.client().fetch(m2, t2) as f:
                list(f)
                assert f.end.kv_tokens == 300 and {e.source for e in f.events} == {"c"}
            assert b.client().health()["status"] == "ok" and c.client().health()["status"] == "ok"

            # 3. a restarts (its store is rebuilt from disk) and c holds the context too: a dies again
            #    mid-fetch -> the rest comes from c, every chunk as KV
            c.client().put(model_id, tokens, kv)
            a.start()
            wait_for(lambda: b.client().lookup(model_id, tokens)["peers"].get("a") == 1024, timeout=60,
                     what="b sees a again")
            events, end, got = fetch_killing(b, a, model_id, tokens)
            assert [e.kind for e in events] == ["kv"] * 4, events
            # (c, on b's own host, takes what a has not sent once it has sent its share: a slow
            # link, a peer that died mid-stream or a silent one hold up no chunk c has)
            assert events[-1].source == "c", [(e.i, e.source, e.arrived_ms) for e in events]
            assert end.kv_tokens == 1024 and end.text_tokens == 0
            for ev in events:
                assert torch.equal(got[:, :, ev.start:ev.end], expected_chunk(kv, ev.i, ev.level, model_id))
            assert b.stop() == 0 and c.stop() == 0
        finally:
            for n in nodes:
                n.kill()
