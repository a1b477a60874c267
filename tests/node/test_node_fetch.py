"""A fetch in-process: where its chunks come from (the plan), what happens when a holder fails
or sends a chunk that does not decode (fallback to another holder, or to TEXT), and how a node
serves a peer's FETCH. Daemons run in the test's event loop, are talked to through their API
socket with the AsyncClient, and peer over loopback TCP. Holders that must misbehave on cue
are scripted peers made from the transport alone (transport.aio with the cluster secret).
No subprocess, no root."""
from __future__ import annotations

import asyncio
import re

import pytest
import torch

import codec
from codec import baselines
from tests.fixtures import (MODEL, SECRET, TEXT, ScriptedPeer, bounds, client, connected, context, decoded,
                            encoded, events_of, keys_of, sees, serve_chunks, stored, until)
from kvstreamd.client import AsyncClient
from transport import aio
from transport.messages import Fetch, Chunk, Text

async def _found(c: AsyncClient, tokens: list[int], n: int) -> bool:
    return (await c.lookup(MODEL, tokens))["found_tokens"] == n


async def _idle(c: AsyncClient) -> bool:
    st = await c.status()
    return st["fetches_active"] == 0 and st["buffers_held"] == 0


# -- the plan: where each chunk comes from ---------------------------------------------------------

async def test_lookup_reports_local_tokens_tokens_per_peer_and_found_tokens(inprocess):
    a, b, c = await inprocess(["a", "b", "c"])
    await connected(a, b, c)
    tokens, kv = context(600)
    async with client(a) as ca, client(b) as cb, client(c) as cc:
        await ca.put(MODEL, tokens, kv)  # 600 tokens: chunks of 256, 256, 88
        await cc.put(MODEL, tokens[:512], kv[:, :, :512])
        await cb.put(MODEL, tokens[:256], kv[:, :, :256])
        prompt = tokens + list(range(50, 90))
        await sees(b, "a", prompt, 600)
        await sees(b, "c", prompt, 512)
        got = await cb.lookup(MODEL, prompt)
    assert got == {"prompt_tokens": 640, "chunks": 3, "local_tokens": 256, "peers": {"a": 600, "c": 512},
                   "found_tokens": 600}


async def test_local_chunks_come_from_the_store_and_the_rest_from_a_peer(inprocess, small_profile):
    a, b = await inprocess(["a", "b"])
    await connected(a, b)
    tokens, kv = context(600)
    async with client(a) as ca, client(b) as cb:
        await ca.put(MODEL, tokens, kv)
        await cb.put(MODEL, tokens[:256], kv[:, :, :256])
        await sees(b, "a", tokens, 600)
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
            assert f.start.local_tokens == 256
            assert [(ev.kind, ev.source) for ev in events] == [("kv", "local"), ("kv", "a"), ("kv", "a")]
            for ev in events:
                assert torch.equal(f.kv[:, :, ev.start:ev.end], decoded(kv, small_profile, ev.level, ev.start, ev.end))


async def test_a_stored_contexts_partial_last_chunk_matches_a_longer_prompt_locally(inprocess, small_profile):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    prompt = tokens + list(range(7, 47))  # the prompt's chunk 2 is tokens 512..768, the context's 512..600
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
        assert (await ca.lookup(MODEL, prompt))["local_tokens"] == 600
        async with await ca.fetch(MODEL, prompt, deadline_ms=30_000) as f:
            events = await events_of(f)
            assert [(ev.start, ev.end, ev.kind, ev.source) for ev in events] == [
                (0, 256, "kv", "local"), (256, 512, "kv", "local"), (512, 600, "kv", "local")]
            assert torch.equal(f.kv[:, :, 512:600], decoded(kv, small_profile, events[2].level, 512, 600))
    end = f.end
    assert end.prefill_from == 600 and end.prefill_tokens == 40


async def test_a_peers_partial_last_chunk_matches_a_longer_prompt(inprocess, small_profile):
    a, b = await inprocess(["a", "b"])
    await connected(a, b)
    tokens, kv = context(600)
    prompt = tokens + list(range(7, 47))
    async with client(a) as ca, client(b) as cb:
        await ca.put(MODEL, tokens, kv)
        await sees(b, "a", prompt, 600)
        async with await cb.fetch(MODEL, prompt, deadline_ms=30_000) as f:
            assert f.found_tokens == 600
            events = await events_of(f)
            assert [(ev.start, ev.end, ev.kind, ev.source) for ev in events] == [
                (0, 256, "kv", "a"), (256, 512, "kv", "a"), (512, 600, "kv", "a")]
            assert torch.equal(f.kv[:, :, 512:600], decoded(kv, small_profile, events[2].level, 512, 600))
    end = f.end
    assert end.kv_tokens == 600 and end.prefill_tokens == 40


async def test_a_prompt_with_no_cached_prefix_is_a_miss_with_no_buffer(inprocess):
    a, b = await inprocess(["a", "b"])
    await connected(a, b)
    tokens, kv = context(600)
    other = list(range(5000, 5400))
    async with client(a) as ca, client(b) as cb:
        await ca.put(MODEL, tokens, kv)
        await sees(b, "a", tokens, 600)
        assert await cb.lookup(MODEL, other) == {"prompt_tokens": 400, "chunks": 2, "local_tokens": 0, "peers": {},
                                                 "found_tokens": 0}
        async with await cb.fetch(MODEL, other, deadline_ms=30_000) as f:
            assert f.start.buffer is None and f.found_tokens == 0
            assert await events_of(f) == []
            assert f.kv is None
        end = f.end
        assert end.found_tokens == 0 and end.prefill_from == 0 and end.prefill_tokens == 400
        assert (await cb.status())["buffers_held"] == 0


async def test_a_prompt_that_diverges_inside_a_chunk_is_found_up_to_the_chunk_before(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    async with client(a) as ca:
        await ca.put(MODEL, tokens, kv)
        got = await ca.lookup(MODEL, tokens[:300] + [7] * 50)
    assert got["found_tokens"] == 256 and got["local_tokens"] == 256


async def test_a_prefix_shared_by_two_contexts_is_stored_once_and_found_for_either(inprocess):
    a, b = await inprocess(["a", "b"])
    await connected(a, b)
    shared, kv = context(512)
    x, kv_x = context(100, seed=1, first=3000)
    y, kv_y = context(100, seed=2, first=4000)
    async with client(a) as ca, client(b) as cb:
        first = await ca.put(MODEL, shared + x, torch.cat([kv, kv_x], dim=2))
        second = await ca.put(MODEL, shared + y, torch.cat([kv, kv_y], dim=2))
        assert (first["stored_chunks"], first["already_held"]) == (3, 0)
        assert (second["stored_chunks"], second["already_held"]) == (1, 2)  # only y's chunk is new
        assert sorted(c["tokens"] for c in await ca.contexts()) == [612, 612]
        await sees(b, "a", shared + y, 612)
        assert (await cb.lookup(MODEL, shared + x))["found_tokens"] == 612
        assert (await cb.lookup(MODEL, shared + [9] * 30))["found_tokens"] == 512
        async with await cb.fetch(MODEL, shared + [9] * 30, deadline_ms=30_000) as f:
            events = await events_of(f)
        assert [(ev.start, ev.end, ev.kind) for ev in events] == [(0, 256, "kv"), (256, 512, "kv")]


async def test_a_fetch_takes_each_chunk_from_a_peer_holding_it_sharing_those_several_hold(inprocess):
    a, b, c = await inprocess(["a", "b", "c"])
    await connected(a, b, c)
    tokens, kv = context(600)
    async with client(a) as ca, client(b) as cb, client(c) as cc:
        await ca.put(MODEL, tokens[:256], kv[:, :, :256])
        await cc.put(MODEL, tokens, kv)
        await sees(b, "a", tokens, 256)
        await sees(b, "c", tokens, 600)
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
    # chunk 0 is held by both (links unmeasured, alike: the split gives it to "a", the first by
    # name, while "c" sends the two only it holds), chunks 1-2 by c alone
    assert [ev.source for ev in events] == ["a", "c", "c"]
    assert f.end.errors == []



async def test_a_fetch_that_accepts_one_level_gets_every_chunk_at_it_from_the_peer(inprocess, small_profile):
    a, b = await inprocess(["a", "b"])
    await connected(a, b)
    tokens, kv = context(600)
    async with client(a) as ca, client(b) as cb:
        await ca.put(MODEL, tokens, kv)
        await sees(b, "a", tokens, 600)
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000, levels=["fast"]) as f:
            events = await events_of(f)
            assert [(ev.kind, ev.level) for ev in events] == [("kv", "fast")] * 3
            for ev in events:
                assert torch.equal(f.kv[:, :, ev.start:ev.end], decoded(kv, small_profile, "fast", ev.start, ev.end))


# -- fallback: a holder that fails, a chunk that does not decode -------------------------------------

async def test_when_the_only_holder_goes_away_mid_fetch_the_rest_comes_as_text_with_the_error(inprocess, small_profile):
    (b,) = await inprocess(["b"], store={"keep_fetched": False})  # so that what it forgot shows
    tokens, kv = context(600)
    payloads = encoded(kv, small_profile)
    holder = await ScriptedPeer("flaky", serve_chunks(payloads, after=1)).join(b, keys_of(tokens))
    await sees(b, "flaky", tokens, 600)
    async with client(b) as cb:
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = []
            async for ev in f:
                events.append(ev)
                if ev.i == 0:
                    holder.conn.abort()  # gone without a word, as a crash
            assert [(ev.kind, ev.source) for ev in events] == [("kv", "flaky"), ("text", "fallback"),
                                                                 ("text", "fallback")]
            assert torch.equal(f.kv[:, :, :256], codec.decode(payloads[0]))
        end = f.end
        assert end.kv_tokens == 256 and end.text_tokens == 344
        assert end.text_ranges == [[256, 512], [512, 600]]
        assert len(end.errors) == 1 and "flaky" in end.errors[0], end.errors
        # the node keeps serving: healthy, nothing left in flight, and it forgot the holder
        assert (await cb.health())["status"] == "ok"
        await until("a fetch or a buffer is still held", lambda: _idle(cb))
        await until("b still lists the holder", lambda: _found(cb, tokens, 0))


async def test_when_a_holders_daemon_stops_its_peers_forget_it_and_fetch_from_another_holder(inprocess):
    a, b, c = await inprocess(["a", "b", "c"])
    await connected(a, b, c)
    tokens, kv = context(600)
    async with client(a) as ca, client(b) as cb, client(c) as cc:
        await ca.put(MODEL, tokens, kv)
        await cc.put(MODEL, tokens, kv)
        await sees(b, "a", tokens, 600)
        await sees(b, "c", tokens, 600)
        await a.stop()

        async def only_c():
            return (await cb.lookup(MODEL, tokens))["peers"] == {"c": 600}

        await until("b still lists a's chunks", only_c)
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
        assert [(ev.kind, ev.source) for ev in events] == [("kv", "c")] * 3
        assert f.end.errors == []

async def test_a_holder_that_ends_the_stream_with_an_error_costs_only_its_remaining_chunks(inprocess, small_profile):
    (b,) = await inprocess(["b"])
    tokens, kv = context(600)
    payloads = encoded(kv, small_profile)

    async def fail(stream):
        await stream.fail("internal", "disk on fire")

    await ScriptedPeer("flaky", serve_chunks(payloads, after=2, then=fail)).join(b, keys_of(tokens))
    await sees(b, "flaky", tokens, 600)
    async with client(b) as cb:
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
        assert [(ev.kind, ev.source) for ev in events] == [("kv", "flaky"), ("kv", "flaky"), ("text", "fallback")]
        end = f.end
        assert end.text_ranges == [[512, 600]]
        assert any("flaky" in e and "disk on fire" in e for e in end.errors), end.errors
        assert (await cb.health())["status"] == "ok"


async def test_when_a_holder_goes_away_mid_fetch_a_second_holder_sends_the_rest_as_kv(inprocess, small_profile):
    """The second holder learns the chunks while the first is streaming, so which holder the
    plan picks first is not in question: only the failing one holds them at plan time."""
    a, b = await inprocess(["a", "b"])
    await connected(a, b)
    tokens, kv = context(600)
    payloads = encoded(kv, small_profile)
    holder = await ScriptedPeer("flaky", serve_chunks(payloads, after=1)).join(b, keys_of(tokens))
    await sees(b, "flaky", tokens, 600)
    async with client(a) as ca, client(b) as cb:
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = []
            async for ev in f:
                events.append(ev)
                if ev.i == 0:
                    await ca.put(MODEL, tokens, kv)
                    await sees(b, "a", tokens, 600)
                    holder.conn.close()
            assert [(ev.kind, ev.source) for ev in events] == [("kv", "flaky"), ("kv", "a"), ("kv", "a")]
            assert torch.equal(f.kv[:, :, :256], codec.decode(payloads[0]))
            for ev in events[1:]:
                assert torch.equal(f.kv[:, :, ev.start:ev.end], decoded(kv, small_profile, ev.level, ev.start, ev.end))
        end = f.end
        assert end.kv_tokens == 600 and end.text_tokens == 0
        assert len(end.errors) == 1 and "flaky" in end.errors[0], end.errors
        assert len(holder.fetches) == 1 and len(holder.fetches[0].keys) == 3


async def test_a_chunk_that_does_not_decode_becomes_text_and_the_others_still_land(inprocess, small_profile):
    (b,) = await inprocess(["b"])
    tokens, kv = context(600)
    payloads = encoded(kv, small_profile)
    bad = bytearray(payloads[1])
    bad[len(bad) // 2] ^= 0xFF  # damaged before it was sent: the wire crc covers the damage
    payloads[1] = bytes(bad)
    await ScriptedPeer("holder", serve_chunks(payloads)).join(b, keys_of(tokens))
    await sees(b, "holder", tokens, 600)
    async with client(b) as cb:
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
            assert [(ev.kind, ev.level) for ev in events] == [("kv", "balanced"), ("text", TEXT), ("kv", "balanced")]
            assert events[1].error
            assert torch.equal(f.kv[:, :, :256], codec.decode(payloads[0]))
            assert torch.equal(f.kv[:, :, 512:600], codec.decode(payloads[2]))
        end = f.end
        assert end.text_ranges == [[256, 512]] and end.kv_tokens == 344
        assert any("chunk 1" in e for e in end.errors), end.errors


async def test_a_chunk_of_the_wrong_shape_becomes_text_and_its_holder_is_not_asked_again(inprocess, small_profile):
    (b,) = await inprocess(["b"])
    tokens, kv = context(600)
    payloads = encoded(kv, small_profile)
    short = kv[:, :, 256:356].contiguous()  # 100 tokens where the chunk has 256
    payloads[1] = codec.encode(short, "balanced", small_profile, start=256)
    await ScriptedPeer("holder", serve_chunks(payloads)).join(b, keys_of(tokens))
    await sees(b, "holder", tokens, 600)
    async with client(b) as cb:
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
        # refused from its header, before decoding (kvstreamd/cluster/admission.py): that holder is not
        # trusted for the rest of the fetch, so chunk 2 comes as TEXT too
        assert [ev.kind for ev in events] == ["kv", "text", "text"]
        assert f.end.text_ranges == [[256, 512], [512, 600]]
        assert any("chunk 1" in e and "[256, 356)" in e for e in f.end.errors), f.end.errors


async def _acked_then_end(stream, chunks: int) -> None:
    """A scripted holder's close: every chunk it sent acknowledged, then END."""
    for _ in range(chunks):
        await stream.acks.get()
    await stream.end()


async def _holder(d, tokens: list[int], script) -> None:
    """A scripted holder "holder" of `tokens`' chunks, joined to d and seen by its lookups."""
    await ScriptedPeer("holder", script).join(d, keys_of(tokens))
    await sees(d, "holder", tokens, len(tokens))


async def test_a_chunk_the_holder_sends_as_text_is_a_text_event_from_that_holder(inprocess, small_profile):
    (b,) = await inprocess(["b"])
    tokens, kv = context(600)
    payloads = encoded(kv, small_profile)

    async def script(stream, fetch):
        await stream.send_chunk(0, "balanced", payloads[0])
        await stream.send_text(1, tokens[256:512])
        await stream.send_chunk(2, "balanced", payloads[2])
        await _acked_then_end(stream, 3)

    await _holder(b, tokens, script)
    async with client(b) as cb:
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
    assert [(ev.kind, ev.source) for ev in events] == [("kv", "holder"), ("text", "holder"), ("kv", "holder")]
    end = f.end
    assert end.text_ranges == [[256, 512]] and end.errors == []


async def test_a_fetch_in_landed_order_tells_each_kv_chunk_as_it_lands_and_text_after_every_chunk_before(
        inprocess, small_profile):
    """Chunks 1 and 2 (int8) land while chunk 0 (coded) has not come: asked with order "landed",
    their events come first; the TEXT chunk 3, sent before any of them, comes after chunk 0."""
    (b,) = await inprocess(["b"])
    tokens, kv = context(1000)  # chunks of 256, 256, 256, 232
    coded = encoded(kv, small_profile)
    int8 = [baselines.SCHEMES["int8"].encode(kv[:, :, s:e].contiguous()) for s, e in bounds(1000)]
    told = asyncio.Event()  # the client has the events of chunks 1 and 2

    async def script(stream, fetch):
        await stream.send_text(3, tokens[768:])
        await stream.send_chunk(1, "int8", int8[1])
        await stream.send_chunk(2, "int8", int8[2])
        await told.wait()
        await stream.send_chunk(0, "balanced", coded[0])
        await _acked_then_end(stream, 4)

    await _holder(b, tokens, script)
    async with client(b) as cb:
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000, levels=["balanced", "int8"],
                                  order="landed") as f:
            events = []
            async for ev in f:
                events.append(ev)
                if {e.i for e in events} == {1, 2}:
                    told.set()
            for ev in events[:3]:
                want = decoded(kv, small_profile, "balanced", ev.start, ev.end) if ev.level == "balanced" else \
                    baselines.SCHEMES["int8"].decode(int8[ev.i])
                assert torch.equal(f.kv[:, :, ev.start:ev.end], want)
    assert sorted((ev.i, ev.kind, ev.level) for ev in events[:2]) == [(1, "kv", "int8"), (2, "kv", "int8")]
    assert [(ev.i, ev.kind, ev.level) for ev in events[2:]] == [(0, "kv", "balanced"), (3, "text", "text")]
    assert f.end.levels == ["balanced", "int8", "int8", "text"] and f.end.text_ranges == [[768, 1000]]


def damage(d, key: bytes) -> None:
    """Flip one byte in the middle of the file d's store keeps chunk `key` in (whatever the
    layout under [store] dir: the file is named by the key's hex)."""
    [path] = [p for p in d.cfg.store.dir.rglob(f"*{key.hex()}*") if p.is_file()]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


async def test_a_chunk_damaged_on_its_holders_disk_is_never_served_as_kv(inprocess, small_profile):
    """memory_budget 0 keeps every chunk on disk only, so the holder reads (and checks) the file;
    b keeps nothing it fetched, so its lookups show what it hears from a."""
    a, b = await inprocess(["a", "b"], store={"memory_budget": 0, "keep_fetched": False})
    await connected(a, b)
    tokens, kv = context(600)
    async with client(a) as ca, client(b) as cb:
        keys = [bytes.fromhex(k) for k in (await ca.put(MODEL, tokens, kv))["keys"]]
        await sees(b, "a", tokens, 600)
        damage(a, keys[1])
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
            assert events[1].kind == "text"
            for ev in events:
                if ev.kind == "kv":
                    want = decoded(kv, small_profile, ev.level, ev.start, ev.end)
                    assert torch.equal(f.kv[:, :, ev.start:ev.end], want)
        end = f.end
        assert end.kv_tokens + end.text_tokens == 600
        assert any(re.search(r"\ba\b", e) for e in end.errors), end.errors  # names the holder
        # the holder drops the damaged chunk, and its peers hear of it
        assert (await ca.lookup(MODEL, tokens))["local_tokens"] == 256
        await sees(b, "a", tokens, 256)
        assert (await cb.health())["status"] == "ok"


async def test_a_chunk_damaged_on_its_holder_costs_only_it_and_the_chunks_after(inprocess, small_profile):
    """README: "A peer that fails mid-stream costs only the rest of its chunks". The chunk
    before the damaged one is intact on the holder and must still arrive as KV."""
    a, b = await inprocess(["a", "b"], store={"memory_budget": 0})
    await connected(a, b)
    tokens, kv = context(600)
    async with client(a) as ca, client(b) as cb:
        keys = [bytes.fromhex(k) for k in (await ca.put(MODEL, tokens, kv))["keys"]]
        await sees(b, "a", tokens, 600)
        damage(a, keys[1])
        async with await cb.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
            assert [(ev.kind, ev.source) for ev in events[:2]] == [("kv", "a"), ("text", "fallback")], events
            assert torch.equal(f.kv[:, :, :256], decoded(kv, small_profile, events[0].level, 0, 256))


async def test_a_local_chunk_damaged_on_disk_becomes_text(inprocess, small_profile):
    (a,) = await inprocess(["a"], store={"memory_budget": 0})
    tokens, kv = context(600)
    async with client(a) as ca:
        keys = [bytes.fromhex(k) for k in (await ca.put(MODEL, tokens, kv))["keys"]]
        damage(a, keys[1])
        async with await ca.fetch(MODEL, tokens, deadline_ms=30_000) as f:
            events = await events_of(f)
            assert [ev.kind for ev in events] == ["kv", "text", "kv"]
            for ev in (events[0], events[2]):
                assert torch.equal(f.kv[:, :, ev.start:ev.end], decoded(kv, small_profile, ev.level, ev.start, ev.end))
        assert f.end.text_ranges == [[256, 512]]


# -- serving a peer's FETCH ---------------------------------------------------------------------

async def raw_peer(d, node_id: str = "probe") -> aio.PeerConnection:
    async with client(d) as c:
        port = (await c.status())["peer_port"]
    return await aio.connect("127.0.0.1", port, node_id, SECRET)


async def test_a_node_serves_a_fetch_of_keys_it_holds_with_chunks_at_offered_levels_then_end(inprocess, small_profile):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    keys = await stored(a, tokens, kv)
    conn = await raw_peer(a)
    try:
        offered = ["high", "balanced", "fast"]
        stream = conn.fetch(Fetch.ask(keys, 30_000, offered + [TEXT]))
        got = [msg async for msg in stream]
    finally:
        conn.close()
    assert [m.i for m in got] == [0, 1, 2]
    assert all(isinstance(m, Chunk) and m.level in offered for m in got), got
    for m, (s, e) in zip(got, bounds(600)):
        assert torch.equal(codec.decode(m.payload), decoded(kv, small_profile, m.level, s, e))
    assert stream.end is not None and stream.end.status == "ok"


async def test_a_fetch_for_keys_not_held_is_answered_not_found(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    keys = await stored(a, tokens, kv)
    conn = await raw_peer(a)
    try:
        with pytest.raises(aio.FetchFailed) as e:
            [m async for m in conn.fetch(Fetch.ask(keys[:1] + keys_of(list(range(9000, 9300)))[1:], 30_000, ["balanced", TEXT]))]
        assert e.value.code == "not_found"
        # only that request ends: the connection still serves the next one
        again = [m async for m in conn.fetch(Fetch.ask(keys[:1], 30_000, ["balanced", TEXT]))]
        assert [m.i for m in again] == [0]
    finally:
        conn.close()


async def test_a_fetch_asking_exactly_one_level_gets_that_level_for_every_chunk(inprocess, small_profile):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    keys = await stored(a, tokens, kv)
    conn = await raw_peer(a)
    try:
        for level in ("high", "fast"):
            got = [m async for m in conn.fetch(Fetch.ask(keys, 30_000, [level, TEXT]))]
            assert [(m.i, getattr(m, "level", TEXT)) for m in got] == [(0, level), (1, level), (2, level)]
            for m, (s, e) in zip(got, bounds(600)):
                assert torch.equal(codec.decode(m.payload), decoded(kv, small_profile, level, s, e))
    finally:
        conn.close()


async def test_a_fetch_offering_only_text_gets_every_chunks_token_ids(inprocess):
    (a,) = await inprocess(["a"])
    tokens, kv = context(600)
    keys = await stored(a, tokens, kv)
    conn = await raw_peer(a)
    try:
        got = [m async for m in conn.fetch(Fetch.ask(keys, 30_000, [TEXT]))]
    finally:
        conn.close()
    assert all(isinstance(m, Text) for m in got), got
    assert [list(m.tokens) for m in got] == [tokens[s:e] for s, e in bounds(600)]


async def test_a_fetch_for_a_level_the_node_does_not_store_is_answered_not_found(inprocess):
    """A holder offers only the levels it holds: the fetcher then takes the chunk from a holder
    that has one asked for (or recomputes it), rather than text from this one."""
    (a,) = await inprocess(["a"])  # stores high, balanced, fast
    tokens, kv = context(600)
    keys = await stored(a, tokens, kv)
    conn = await raw_peer(a)
    try:
        with pytest.raises(aio.FetchFailed, match="chunk 0 .* is held here only at high, balanced, fast, "
                                                  "not at a level asked") as e:
            [m async for m in conn.fetch(Fetch.ask(keys, 30_000, ["int8", TEXT]))]
        assert e.value.code == "not_found"
    finally:
        conn.close()


def test_overlapping_decodes_share_the_clock_they_ran_in(monkeypatch):
    """The decode rate a host tells senders counts each decode's share of the time (dt over
    the decodes running), so two chunks decoding at once do not each claim the whole span:
    their shares add up to the span, and a decode alone gets its wall time."""
    from kvstreamd import coder

    clock = [0.0]
    monkeypatch.setattr(coder.time, "perf_counter", lambda: clock[0])
    shares = coder._Shares()
    a = shares.timed()
    sa = a.__enter__()
    clock[0] = 1.0
    b = shares.timed()
    sb = b.__enter__()
    clock[0] = 3.0
    a.__exit__(None, None, None)
    clock[0] = 4.0
    b.__exit__(None, None, None)
    assert (sa[0], sb[0]) == (2.0, 2.0)  # a: 1 alone + 2 shared; b: 2 shared + 1 alone
    with shares.timed() as alone:
        clock[0] = 6.5
    assert alone[0] == 2.5


def test_a_fetchs_coded_decodes_are_one_sample_of_the_rate_it_tells(codec_pool):
    """Decodes with a tally (a fetch's) leave the told rate alone until the fetch observes
    their sum as one sample (kvstreamd/coder.py DecodeTally)."""
    from codec.tuning import registry
    from codec.profile import Profile
    from kvstreamd.coder import Coder, DecodeTally
    from tests.fixtures import synthetic_kv

    shipped = Profile.load(registry.SHIPPED_DIR / "smollm2-135m-instruct.kvprofile")
    kv = synthetic_kv(256, seed=3, layers=shipped.layers, heads=shipped.heads, head_dim=shipped.head_dim).half()
    payload = codec.encode(kv, "high", shipped, start=0)  # 5.9 MB of fp16: big enough to be timed
    c = Coder(1, pool=codec_pool)
    prior, tally = c.decode_mbps, DecodeTally()
    for _ in range(3):
        assert torch.equal(c.decode("high", payload, tally), codec.decode(payload, shipped))
    assert (c.decode_samples, c.decode_mbps) == (0, prior)
    assert tally.mb == pytest.approx(3 * kv.numel() * 2 / 1e6) and tally.seconds > 0
    c.observe(tally.mb, tally.seconds, alpha=0.5)
    assert c.decode_samples == 1
    assert c.decode_mbps == pytest.approx(0.5 * prior + 0.5 * tally.mb / tally.seconds)
