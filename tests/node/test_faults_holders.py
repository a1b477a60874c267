"""Issue 26: a fetch survives dishonest or broken holders. A holder the directory names whose
address accepts TCP and never speaks (a ghost), a peer that advertises a context and only PINGs,
one that answers TEXT for the KV it advertised, and one that trickles a CHUNK frame a few bytes
at a time: each costs the fetch little of its time, the chunks an honest holder has come from it
as KV, the culprit is named and cools down (GET /v1/peers says why), and the daemon goes on
answering /healthz at once. Daemons under test run in the test's event loop (the `inprocess`
fixture); the holders are real peers on loopback TCP, the directory of the ghost test a real
redis-server."""
from __future__ import annotations

import asyncio
import json
import re
import time
import zlib
from pathlib import Path

import pytest
import redis
import torch

from kvstreamd.client import AsyncClient
from tests.fixtures import (MODEL, SECRET, ScriptedPeer, client, context, decoded, encoded, keys_of, sees,
                             stored, until)
from transport.events import FetchReceived
from transport.messages import Advertise, Chunk
from transport.protocol import Connection, State

HANG_S = 30  # a fetch not ended by then fails the test rather than hanging it
# /healthz answers within HEALTHZ_S, whatever a fetch's peers do: 95% of the polls, the
# slowest within HEALTHZ_MAX_S (the daemons share this test's event loop, on a loaded machine)
HEALTHZ_S = 0.1
HEALTHZ_MAX_S = 0.5


async def timed_fetch(c: AsyncClient, tokens: list[int], deadline_ms: int):
    """(events, End, seconds from the request to each event, to the End, and each KV event with
    a copy of what the buffer held for it as it came) of one fetch."""
    t0 = time.monotonic()
    at, events, checked = [], [], []
    async with asyncio.timeout(HANG_S):
        async with await c.fetch(MODEL, tokens, deadline_ms=deadline_ms) as f:
            async for ev in f:
                events.append(ev)
                at.append(time.monotonic() - t0)
                if ev.kind == "kv":
                    checked.append((ev, f.kv[:, :, ev.start:ev.end].clone()))
    return events, f.end, at, time.monotonic() - t0, checked


def right_kv(checked, kv: torch.Tensor, profile) -> None:
    """No wrong KV reached the client: each KV chunk is what its level decodes the context to."""
    for ev, got in checked:
        assert torch.equal(got, decoded(kv, profile, ev.level, ev.start, ev.end)), f"chunk {ev.i} is not the context's"


class Healthz:
    """Polls /healthz every 20 ms while the block runs, timing each answer."""

    def __init__(self, d) -> None:
        self.d, self.took = d, []

    async def _poll(self) -> None:
        async with client(self.d) as c:
            while True:
                t = time.monotonic()
                assert (await c.health())["status"] in ("ok", "degraded")
                self.took.append(time.monotonic() - t)
                await asyncio.sleep(0.02)

    async def __aenter__(self) -> "Healthz":
        self._task = asyncio.ensure_future(self._poll())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        took = sorted(self.took)
        assert took, "/healthz never answered"
        p95 = took[int(0.95 * (len(took) - 1))]
        print(f"/healthz: {len(took)} polls, 95% within {p95 * 1000:.1f} ms, slowest {took[-1] * 1000:.1f} ms")
        assert p95 < HEALTHZ_S and took[-1] < HEALTHZ_MAX_S, f"/healthz: 95% {p95 * 1000:.0f} ms, slowest {took[-1] * 1000:.0f} ms"


def no_traceback(caplog) -> None:
    bad = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not bad, [r.getMessage() for r in bad]


async def peer_info(c: AsyncClient, peer: str) -> dict:
    return {p["node_id"]: p for p in await c.peers()}.get(peer) or {}


async def metric(c: AsyncClient, kind: str) -> float:
    m = re.search(rf'^kvstreamd_errors_total{{kind="{kind}"}} (\S+)$', await c.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


def rss() -> int:
    """This process's resident memory (the in-process daemons live in it), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024


def never_answers(stream, fetch):
    return asyncio.Event().wait()


def serves(tokens: list[int], payloads: list[bytes], delay_s: float = 0.0, level: str = "balanced"):
    """A script that sends, for each key asked, that chunk's payload (delay_s before each)."""
    keys = keys_of(tokens)

    async def script(stream, fetch) -> None:
        for pos, key in enumerate(fetch.keys):
            await asyncio.sleep(delay_s)
            await stream.send_chunk(pos, level, payloads[keys.index(key)], key=key)
            await stream.acks.get()
        await stream.end()
    return script


# -- a ghost in the directory ------------------------------------------------------------------------

PREFIX = "kvs-test:"  # (redis_server: conftest.py's)


async def test_a_ghost_holder_that_accepts_tcp_and_never_speaks_costs_a_2_s_fetch_no_time_and_cools_down(
        inprocess, redis_server, caplog):
    """Another client of the Redis directory names "ghost", at an address that accepts TCP and
    never says a word, as a holder of every chunk a real holder "a" has. stall_s 1: a dial with no
    handshake within it names a ghost."""
    a, b = await inprocess(["a", "b"], peered=False, fetch={"stall_s": 1.0},
                           per_node={"b": {"store": {"keep_fetched": False}}},
                           directory={"backend": "redis", "url": redis_server.url, "prefix": PREFIX, "idle_s": 5.0})
    accepted: list = []

    async def accept(reader, writer):
        accepted.append(writer)  # held open, never written to

    ghost = await asyncio.start_server(accept, "127.0.0.1", 0)
    tokens, kv = context(1000)
    try:
        keys = await stored(a, tokens, kv)
        r = redis.Redis(port=redis_server.port)
        try:
            r.set(f"{PREFIX}host:ghost", json.dumps({"address": "127.0.0.1:%d" % ghost.sockets[0].getsockname()[1],
                                                      "zone": ""}))
            for k in keys:
                r.sadd(f"{PREFIX}chunk:{k.hex()}", "ghost")
        finally:
            r.close()
        async with client(b) as cb, Healthz(b):
            assert (await cb.lookup(MODEL, tokens))["peers"] == {"a": 1000, "ghost": 1000}
            events, end, at, took, _ = await timed_fetch(cb, tokens, 2000)
            print(f"ghost beside a real holder, 2000 ms deadline: ended after {took:.3f} s, "
                  f"sources {[ev.source for ev in events]}")
            assert took <= 2.2
            assert [(ev.kind, ev.source) for ev in events] == [("kv", "a")] * 4
            assert len(accepted) == 1  # it was dialled

            async def cooling():
                return (await peer_info(cb, "ghost")).get("cooldown_why") == "ghost"
            await until("the ghost never cooled down", cooling, timeout=5)
            assert await metric(cb, "peer_ghost") == 1
            assert (await cb.lookup(MODEL, tokens))["peers"] == {"a": 1000}

            events, end, at, took, _ = await timed_fetch(cb, tokens, 2000)  # the next fetch: not dialled
            print(f"next fetch while the ghost cools down: {took:.3f} s")
            assert [(ev.kind, ev.source) for ev in events] == [("kv", "a")] * 4 and end.errors == []
            assert len(accepted) == 1 and took < 1.0
        no_traceback(caplog)
    finally:
        ghost.close()
        for w in accepted:
            w.close()


# -- a peer that advertises and only PINGs -------------------------------------------------------------

async def test_a_peer_that_advertises_everything_and_only_pings_holds_up_no_chunk_an_honest_holder_has(
        inprocess, small_profile, caplog):
    """16 chunks held by two honest daemons; "chatty" advertises them all, takes the FETCH, never
    sends a chunk and PINGs every 0.5 s (bytes on the wire, no progress). The chunks reach the
    client within 2x the time they take with the honest holders alone, measured side by side
(+0.3 s for a pause of the test process), well before chatty's stall verdict;
    the fetch ends within its deadline plus grace, chatty named as stalled."""
    deadline_ms = 5000
    b, h1, h2 = await inprocess(["b", "h1", "h2"], fetch={"stall_s": 1.0},
                                per_node={"b": {"store": {"keep_fetched": False}}})
    tokens, kv = context(16 * 256, seed=4)
    await stored(h1, tokens, kv)
    await stored(h2, tokens, kv)
    await sees(b, "h1", tokens, len(tokens))
    await sees(b, "h2", tokens, len(tokens))
    async with client(b) as cb:
        plain = []
        for _ in range(2):  # the honest holders alone (the second, warm, is the one compared)
            events, end, at, took, checked = await timed_fetch(cb, tokens, deadline_ms)
            assert {ev.source for ev in events} <= {"h1", "h2"} and {ev.kind for ev in events} == {"kv"}
            plain.append(at[-1])
        before = rss()

        chatty = await ScriptedPeer("chatty", never_answers).join(b, keys_of(tokens))

        async def chatter():
            while True:
                await chatty.conn.ping()
                await asyncio.sleep(0.5)
        pinging = asyncio.ensure_future(chatter())
        try:
            await sees(b, "chatty", tokens, len(tokens))
            async with Healthz(b):
                events, end, at, took, checked = await timed_fetch(cb, tokens, deadline_ms)
            assert len(chatty.fetches) == 1  # it was asked for its share
        finally:
            pinging.cancel()
            await asyncio.gather(pinging, return_exceptions=True)
        async def cooled() -> bool:  # its request ran on to its stall verdict (stall_s) after the fetch
            return (await peer_info(cb, "chatty"))["cooldown_why"] == "stalled"

        await until("chatty to stall and cool down", cooled, timeout=5)
        events2, _, at2, _, _ = await timed_fetch(cb, tokens, deadline_ms)  # chatty cools down: alone again
        assert len(chatty.fetches) == 1
        plain.append(at2[-1])
        no_fault = (plain[1] + plain[2]) / 2
        print(f"16 chunks, honest holders alone: last chunk at {plain[1]:.3f} / {plain[2]:.3f} s; beside a "
              f"chatty peer: last chunk at {at[-1]:.3f} s, fetch ended at {took:.3f} s; "
              f"RSS {before / 2**20:.0f} -> {rss() / 2**20:.0f} MiB")
        assert [ev.kind for ev in events] == ["kv"] * 16 and {ev.source for ev in events} <= {"h1", "h2"}
        right_kv(checked, kv, small_profile)
        # Waiting for chatty's stall verdict would put the last chunk past stall_s (1 s); the 0.3 s
        # over 2x leaves room for one pause of the test process that runs all three daemons (a
        # full GC pass, after a thousand tests, measured 350 ms in CI).
        assert at[-1] <= 2 * no_fault + 0.3, f"last chunk at {at[-1]:.3f} s, no-fault {no_fault:.3f} s"
        assert took - at[-1] < 0.5, "the fetch waited for the silent holder (stall_s 1) though it had every chunk"
        assert rss() <= before * 1.1, "memory did not come back after the fault"
    no_traceback(caplog)


# -- a peer that answers TEXT for what it advertised ---------------------------------------------------

async def test_a_peer_answering_text_for_the_kv_it_advertised_is_asked_no_more_and_the_chunks_come_as_kv(
        inprocess, small_profile, caplog):
    b, h1 = await inprocess(["b", "h1"], per_node={"b": {"store": {"keep_fetched": False}}})
    tokens, kv = context(8 * 256, seed=5)
    await stored(h1, tokens, kv)

    async def texts(stream, fetch):
        for pos in range(len(fetch.keys)):
            s = 256 * keys_of(tokens).index(fetch.keys[pos])
            await stream.send_text(pos, tokens[s:s + 256])
            await stream.acks.get()
        await stream.end()

    liar = await ScriptedPeer("a-liar", texts).join(b, keys_of(tokens))
    await sees(b, "h1", tokens, len(tokens))
    await sees(b, "a-liar", tokens, len(tokens))
    async with client(b) as cb, Healthz(b):
        events, end, at, took, checked = await timed_fetch(cb, tokens, 30_000)
        print(f"a TEXT liar beside an honest holder: {took:.3f} s, {[ev.source for ev in events]}")
        assert len(liar.fetches) == 1
        assert [(ev.kind, ev.source) for ev in events] == [("kv", "h1")] * 8  # re-asked of h1
        right_kv(checked, kv, small_profile)
        assert any("a-liar" in e and "as TEXT" in e for e in end.errors), end.errors
        info = await peer_info(cb, "a-liar")
        assert info["cooldown_why"] == "text_for_kv" and info["cooldown_s"] > 0
        assert await metric(cb, "peer_text_for_kv") == 1

        events, end, at, took, _ = await timed_fetch(cb, tokens, 30_000)  # it cools down: not asked
        assert len(liar.fetches) == 1 and [ev.source for ev in events] == ["h1"] * 8 and end.errors == []
    no_traceback(caplog)


# -- a peer that trickles a CHUNK frame ---------------------------------------------------------------

class TricklePeer:
    """A peer on a bare socket past the handshake: it advertises keys and answers a FETCH with
    a real CHUNK frame, written 4 bytes every 100 ms (never a whole chunk within stall_s)."""

    def __init__(self, node_id: str, payload: bytes) -> None:
        self.node_id, self.payload = node_id, payload
        self.fetches = 0
        self.written = 0

    async def join(self, d, keys: list[bytes]) -> "TricklePeer":
        async with client(d) as c:
            port = (await c.status())["peer_port"]
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.conn = Connection("client", self.node_id, SECRET)
        self.writer.write(self.conn.data_to_send())
        while self.conn.state is not State.READY:
            self.conn.receive_data(await self.reader.read(65536), 0.0)
            self.writer.write(self.conn.data_to_send())
        self.conn.send(Advertise(keys), 0.0)
        self.writer.write(self.conn.data_to_send())
        self.task = asyncio.ensure_future(self._run())
        return self

    async def _run(self) -> None:
        trickle = None
        while data := await self.reader.read(65536):
            self.conn.receive_data(data, 0.0)
            while (ev := self.conn.next_event()) is not None:
                if isinstance(ev, FetchReceived) and trickle is None:
                    self.fetches += 1
                    fetch = ev.msg
                    self.conn.send(Chunk(fetch.req, 0, "balanced", self.payload, zlib.crc32(self.payload),
                                         fetch.keys[0]), 0.0)
                    trickle = asyncio.ensure_future(self._trickle(self.conn.data_to_send()))

    async def _trickle(self, frame: bytes) -> None:
        for k in range(0, len(frame), 4):
            self.writer.write(frame[k:k + 4])
            self.written += 4
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        self.task.cancel()
        self.writer.close()
        await asyncio.gather(self.task, return_exceptions=True)


async def test_a_peer_trickling_a_chunk_frame_is_marked_stalled_after_stall_s_and_another_holder_sends_its_chunks(
        inprocess, small_profile, caplog):
    """"a-trickle" (first in the split) trickles its CHUNK; "z-slow" sends a chunk every 0.3 s,
    so it takes nothing from a-trickle before a-trickle's stall_s (0.4 s) is up."""
    (b,) = await inprocess(["b"], fetch={"stall_s": 0.4}, store={"keep_fetched": False})
    tokens, kv = context(600, seed=6)
    payloads = encoded(kv, small_profile)
    trickler = await TricklePeer("a-trickle", payloads[0]).join(b, keys_of(tokens))
    await ScriptedPeer("z-slow", serves(tokens, payloads, delay_s=0.3)).join(b, keys_of(tokens))
    try:
        await sees(b, "a-trickle", tokens, 600)
        await sees(b, "z-slow", tokens, 600)
        async with client(b) as cb, Healthz(b):
            events, end, at, took, checked = await timed_fetch(cb, tokens, 5000)
            print(f"a trickling peer ({trickler.written} bytes in) beside a slow honest holder: {took:.3f} s")
            assert trickler.fetches == 1 and trickler.written > 0
            assert [(ev.kind, ev.source) for ev in events] == [("kv", "z-slow")] * 3
            right_kv(checked, kv, small_profile)
            assert any("a-trickle" in e and "stalled" in e for e in end.errors), end.errors
            assert (await peer_info(cb, "a-trickle"))["cooldown_why"] == "stalled"
            assert took < 5.0
        no_traceback(caplog)
    finally:
        await trickler.close()
