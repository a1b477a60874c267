"""transport/aio.py over real TCP on 127.0.0.1: handshake, refusals, faults confined to one
connection, CANCEL, and many concurrent streams with their bytes checked."""
from __future__ import annotations

import asyncio
import time
import random

import pytest
import uvloop

from transport import aio, frames
from transport.messages import Fetch, Advertise, Chunk, Text
from transport.protocol import (AUTH_FAILED, BAD_FRAME, CONNECTION_LOST, FRAME_TOO_LARGE,
                                HANDSHAKE_TIMEOUT, INTERNAL, NOT_FOUND, Connection, State)

SECRET = b"test-cluster-secret"
HOST = "127.0.0.1"
LIMIT = 10  # seconds; a bound on every test, never a timing assertion

_rng = random.Random(7)
PAYLOADS = {f"key-{n}".encode().ljust(32, b"."): _rng.randbytes(_rng.randrange(20_000, 200_000)) for n in range(40)}
KEYS = list(PAYLOADS)


def streaming_handler(pace: bool = False, cancelled: asyncio.Event | None = None, acks: list | None = None):
    """Streams PAYLOADS[key] for each key as CHUNKs; with pace, waits for each ACK first."""
    async def handler(served: aio.ServedFetch, fetch) -> None:
        try:
            for i, key in enumerate(fetch.keys):
                size = await served.send_chunk(i, "high", PAYLOADS[key])
                if pace or acks is not None:
                    ack, _ = await served.acks.get()
                    if acks is not None:
                        acks.append((ack, size))
            await served.end()
        except asyncio.CancelledError:
            if cancelled is not None:
                cancelled.set()
            raise
    return handler


@pytest.fixture
async def server():
    srv = await aio.serve(HOST, 0, "srv", SECRET, streaming_handler())
    async with srv:
        yield srv


async def fetch_all(peer: aio.PeerConnection, keys: list[bytes], **kw) -> list:
    return [m async for m in peer.fetch(Fetch.ask(keys, kw.get("deadline_ms", 5000), ["high"]))]


def assert_complete(got: list, keys: list[bytes]) -> None:
    assert [m.i for m in got] == list(range(len(keys)))
    assert all(isinstance(m, Chunk) and m.payload == PAYLOADS[k] for m, k in zip(got, keys))


async def raw_client(port: int, handshake: bool = True):
    """A bare socket, driven through the handshake by the sans-IO Connection (or silent),
    so a test can write any bytes."""
    reader, writer = await asyncio.open_connection(HOST, port)
    conn = Connection("client", "raw", SECRET)
    if handshake:
        writer.write(conn.data_to_send())
    while handshake and conn.state is not State.READY:
        data = await reader.read(65536)
        assert data, "server closed during the handshake"
        conn.receive_data(data, 0.0)
        writer.write(conn.data_to_send())
    return reader, writer, conn


async def frames_until_eof(reader: asyncio.StreamReader) -> list[dict]:
    dec = frames.FrameDecoder(2**30)
    dec.feed(await reader.read())  # read() without a size reads to EOF
    return [f for f, _ in dec]


# -- handshake ---------------------------------------------------------------------------------


async def test_handshake_makes_both_sides_ready(server):
    async with asyncio.timeout(LIMIT):
        peer = await aio.connect(HOST, server.port, "cli", SECRET, caps={"levels": ["high"]})
        assert peer.state is State.READY and peer.peer_node_id == "srv"
        (srv_side,) = server.connections
        await srv_side.wait_ready()
        assert srv_side.peer_node_id == "cli" and srv_side.peer_caps == {"levels": ["high"]}
        assert await peer.ping() > 0
        sent_at, acked_at = await peer.probe(256 * 1024)
        assert acked_at > sent_at
        await peer.send(Advertise([b"k1" * 16]))
        assert await srv_side.recv() == Advertise([b"k1" * 16])
        peer.close()
        assert (await srv_side.wait_closed()).by_peer


async def test_wrong_secret_is_refused_and_the_server_keeps_serving(server):
    async with asyncio.timeout(LIMIT):
        with pytest.raises(aio.HandshakeError) as e:
            await aio.connect(HOST, server.port, "intruder", b"not-the-secret")
        assert e.value.code == AUTH_FAILED
        peer = await aio.connect(HOST, server.port, "cli", SECRET)
        assert_complete(await fetch_all(peer, KEYS[:3]), KEYS[:3])
        peer.close()


async def test_silent_peer_is_closed_after_the_handshake_timeout():
    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET, None, handshake_timeout=0.2) as srv:
            reader, writer, _ = await raw_client(srv.port, handshake=False)
            got = await frames_until_eof(reader)
            assert [f["t"] for f in got] == ["HELLO", "ERROR"] and got[1]["code"] == HANDSHAKE_TIMEOUT
            writer.close()


# -- one connection's faults stay with it -------------------------------------------------------


@pytest.mark.parametrize("after_handshake", [False, True])
async def test_oversize_frame_closes_only_that_connection(after_handshake):
    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET, streaming_handler(),
                                   max_frame_bytes=2**20) as srv:
            good = await aio.connect(HOST, srv.port, "good", SECRET)
            reader, writer, _ = await raw_client(srv.port, handshake=after_handshake)
            writer.write((2**20 + 1).to_bytes(4, "big"))  # the length alone is enough
            got = await frames_until_eof(reader)
            assert got[-1]["t"] == "ERROR" and got[-1]["code"] == FRAME_TOO_LARGE
            writer.close()
            assert_complete(await fetch_all(good, KEYS[:4]), KEYS[:4])
            good.close()


@pytest.mark.parametrize("after_handshake", [False, True])
async def test_garbage_bytes_close_only_that_connection(server, after_handshake):
    async with asyncio.timeout(LIMIT):
        good = await aio.connect(HOST, server.port, "good", SECRET)
        call = good.fetch(Fetch.ask(KEYS[:5], 5000, ["high"]))
        first = await anext(call)  # mid-call when the garbage arrives
        reader, writer, _ = await raw_client(server.port, handshake=after_handshake)
        writer.write(b"\x00\x00\x00\x08GARBAGE!")
        got = await frames_until_eof(reader)
        assert got[-1]["t"] == "ERROR" and got[-1]["code"] == BAD_FRAME
        writer.close()
        assert_complete([first] + [m async for m in call], KEYS[:5])
        good.close()


async def test_server_dropping_a_connection_mid_stream_fails_only_that_fetch():
    victim_cut = asyncio.Event()

    async def handler(served: aio.ServedFetch, fetch) -> None:
        if served.peer.peer_node_id == "bystander":
            await served.send_chunk(0, "high", PAYLOADS[fetch.keys[0]])
            await victim_cut.wait()  # the bystander is mid-stream when the victim is cut
            for i, key in enumerate(fetch.keys[1:], 1):
                await served.send_chunk(i, "high", PAYLOADS[key])
            await served.end()
            return
        for i in range(2):
            await served.send_chunk(i, "high", PAYLOADS[fetch.keys[i]])
            await served.acks.get()
        served.peer.abort()  # as if the serving process died
        victim_cut.set()
        await asyncio.Event().wait()  # cancelled: the connection is gone

    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET, handler) as srv:
            victim = await aio.connect(HOST, srv.port, "victim", SECRET)
            bystander = await aio.connect(HOST, srv.port, "bystander", SECRET)
            got: list = []

            async def victim_fetch() -> aio.FetchError:
                with pytest.raises(aio.FetchInterrupted) as e:
                    async for m in victim.fetch(Fetch.ask(KEYS[:6], 5000, ["high"])):
                        got.append(m)
                return e.value

            err, complete = await asyncio.gather(victim_fetch(), fetch_all(bystander, KEYS[6:12]))
            assert err.code == CONNECTION_LOST and err.req == 0 and "before END" in str(err)
            assert [m.i for m in got] == [0, 1]  # what arrived is never reported as complete
            assert_complete(complete, KEYS[6:12])
            bystander.close()


async def test_client_vanishing_mid_stream_cancels_its_handler_and_others_continue():
    cancelled = asyncio.Event()
    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET,
                                   streaming_handler(pace=True, cancelled=cancelled)) as srv:
            leaver = await aio.connect(HOST, srv.port, "leaver", SECRET)
            stayer = await aio.connect(HOST, srv.port, "stayer", SECRET)
            staying = asyncio.ensure_future(fetch_all(stayer, KEYS[:8]))
            async for _ in leaver.fetch(Fetch.ask(KEYS[8:16], 5000, ["high"])):
                leaver.abort()
                break
            await cancelled.wait()
            assert_complete(await staying, KEYS[:8])
            assert {p.peer_node_id for p in srv.connections} == {"stayer"}
            stayer.close()


# -- requests ------------------------------------------------------------------------------------


async def test_cancel_stops_the_stream_at_once_and_the_connection_stays_usable():
    cancelled = asyncio.Event()
    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET,
                                   streaming_handler(pace=True, cancelled=cancelled)) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)
            call = peer.fetch(Fetch.ask(KEYS[:20], 5000, ["high"]))
            first = await anext(call)
            await call.cancel()
            with pytest.raises(aio.FetchCancelled):
                await anext(call)
            await cancelled.wait()  # the server's handler saw it
            assert first.i == 0
            assert_complete(await fetch_all(peer, KEYS[20:23]), KEYS[20:23])
            peer.close()


async def test_a_fetch_from_a_peer_that_sends_nothing_stalls_after_stall_s_and_is_cancelled_on_the_wire():
    cancelled = asyncio.Event()

    async def silent(served, fetch):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET, silent) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)
            t0 = asyncio.get_running_loop().time()
            call = peer.fetch(Fetch.ask(KEYS[:3], 30_000, ["high"]), stall_s=0.3)
            with pytest.raises(aio.FetchStalled, match="sent no whole chunk"):
                await anext(call)
            assert 0.3 <= asyncio.get_running_loop().time() - t0 < 1.3
            await cancelled.wait()  # the server's handler saw the CANCEL
            peer.close()


async def test_time_this_sides_loop_is_held_up_is_not_the_peers_silence():
    """The receiver's event loop held up past stall_s (a GC pass, a starved host) reads nothing
    meanwhile: that time is not the peer's silence. Here the sender, starved as well, sends its
    next chunk 0.1 s after the loop runs again (within stall_s of this side's waking)."""
    go = asyncio.Event()

    async def held(served, fetch):
        for i, key in enumerate(fetch.keys):
            if i == 2:
                await go.wait()
            await served.send_chunk(i, "high", PAYLOADS[key])
        await served.end()

    def hold_up(loop) -> None:
        time.sleep(0.8)
        loop.call_later(0.1, go.set)

    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET, held) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)
            got = []
            async for m in peer.fetch(Fetch.ask(KEYS[:6], 30_000, ["high"]), stall_s=0.3):
                got.append(m)
                if len(got) == 2:
                    loop = asyncio.get_running_loop()
                    loop.call_soon(hold_up, loop)
            assert [m.i for m in got] == list(range(6))
            peer.close()


async def test_a_fetch_still_moving_at_its_time_limit_times_out_and_is_cancelled_on_the_wire():
    cancelled = asyncio.Event()

    async def slow(served, fetch):  # a chunk every 0.1 s: never silent for stall_s, never done in time
        try:
            for i, key in enumerate(fetch.keys):
                await served.send_chunk(i, "high", PAYLOADS[key])
                await asyncio.sleep(0.1)
            await served.end()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET, slow) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)
            t0 = asyncio.get_running_loop().time()
            got = []
            with pytest.raises(aio.FetchTimedOut):
                async for m in peer.fetch(Fetch.ask(KEYS[:30], 30_000, ["high"]), stall_s=0.3, limit_s=0.6):
                    got.append(m)
            assert 0.6 <= asyncio.get_running_loop().time() - t0 < 1.6
            assert 2 <= len(got) < 30 and [m.i for m in got] == list(range(len(got)))
            await cancelled.wait()
            assert_complete(await fetch_all(peer, KEYS[:2]), KEYS[:2])  # the connection still serves
            peer.close()


async def test_every_chunk_is_acked_with_its_wire_size():
    acks: list = []
    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET, streaming_handler(acks=acks)) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)
            assert_complete(await fetch_all(peer, KEYS[:5]), KEYS[:5])
            assert [a.i for a, _ in acks] == list(range(5))
            assert all(a.recv_bytes == size for a, size in acks)
            peer.close()


async def test_handler_failure_ends_only_that_request():
    async def handler(served: aio.ServedFetch, fetch) -> None:
        if fetch.keys[0] == b"bad".ljust(32, b"."):
            raise RuntimeError("disk on fire")
        await served.send_text(0, [1, 2, 3])
        await served.end()

    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET, handler) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)
            with pytest.raises(aio.FetchFailed) as e:
                await fetch_all(peer, [b"bad".ljust(32, b".")])
            assert e.value.code == INTERNAL and "disk on fire" in e.value.msg
            assert await fetch_all(peer, [b"good" * 8]) == [Text(1, 0, [1, 2, 3])]
            peer.close()


async def test_chunks_that_arrived_before_a_not_found_are_still_yielded():
    """A peer sends chunks 0 and 1, then ERROR NOT_FOUND (it lost chunk 2) before the fetcher
    has read any of them: the fetcher gets both chunks, then the error, so it knows which chunk
    was lost. Its own cancel still stops the iterator at once."""
    sent = asyncio.Event()

    async def handler(served: aio.ServedFetch, fetch) -> None:
        await served.send_chunk(0, "high", PAYLOADS[fetch.keys[0]])
        await served.send_chunk(1, "high", PAYLOADS[fetch.keys[1]])
        await served.fail(NOT_FOUND, "chunk 2 is gone")
        sent.set()

    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET, handler) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)
            call = peer.fetch(Fetch.ask(KEYS[:4], 5000, ["high"]))
            await sent.wait()
            while call.end is None and call._final is None:  # the ERROR is in: both chunks wait unread
                await asyncio.sleep(0.01)
            got = []
            with pytest.raises(aio.FetchFailed) as e:
                async for m in call:
                    got.append(m)
            assert e.value.code == NOT_FOUND and "chunk 2" in e.value.msg
            assert_complete(got, KEYS[:2])
            call = peer.fetch(Fetch.ask(KEYS[:4], 5000, ["high"]))
            first = await call.__anext__()
            await call.cancel()
            with pytest.raises(aio.FetchCancelled):
                await call.__anext__()  # chunk 1 may already be in: it is not yielded
            assert first.i == 0
            peer.close()


async def test_fetch_from_a_node_without_handler_is_not_found():
    async with asyncio.timeout(LIMIT):
        async with await aio.serve(HOST, 0, "srv", SECRET, None) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)
            with pytest.raises(aio.FetchFailed) as e:
                await fetch_all(peer, KEYS[:1])
            assert e.value.code == NOT_FOUND
            peer.close()


async def test_a_passed_deadline_is_reported(server):
    async with asyncio.timeout(LIMIT):
        peer = await aio.connect(HOST, server.port, "cli", SECRET)
        call = peer.fetch(Fetch.ask(KEYS[:2], 0, ["high"]))
        assert_complete([m async for m in call], KEYS[:2])
        assert call.end is not None and call.end.deadline_missed
        peer.close()


async def test_twenty_concurrent_streams_on_four_connections_deliver_every_byte(server):
    rng = random.Random(3)
    async with asyncio.timeout(LIMIT):
        peers = [await aio.connect(HOST, server.port, f"cli-{n}", SECRET) for n in range(4)]
        plans = [(peers[n % 4], rng.sample(KEYS, 6)) for n in range(20)]
        results = await asyncio.gather(*(fetch_all(p, keys) for p, keys in plans))
        for got, (_, keys) in zip(results, plans):
            assert_complete(got, keys)
        for p in peers:
            p.close()


async def test_a_fetcher_that_does_not_read_pushes_back_on_the_sender(server):
    async with asyncio.timeout(LIMIT):
        peer = await aio.connect(HOST, server.port, "cli", SECRET, max_buffered_bytes=300_000)
        call = peer.fetch(Fetch.ask(KEYS[:20], 5000, ["high"]))
        while not peer.reading_paused:  # nobody reads: reading stops, TCP fills up
            await asyncio.sleep(0.005)
        assert_complete([m async for m in call], KEYS[:20])
        assert not peer.reading_paused
        peer.close()


async def test_either_side_can_serve_fetches(server):
    async def client_handler(served: aio.ServedFetch, fetch) -> None:
        await served.send_text(0, [42])
        await served.end()

    async with asyncio.timeout(LIMIT):
        peer = await aio.connect(HOST, server.port, "cli", SECRET, handler=client_handler)
        (srv_side,) = server.connections
        await srv_side.wait_ready()
        assert await fetch_all(srv_side, [b"k" * 32]) == [Text(0, 0, [42])]
        assert_complete(await fetch_all(peer, KEYS[:2]), KEYS[:2])
        peer.close()


def test_streams_over_uvloop():
    async def main() -> list:
        async with await aio.serve(HOST, 0, "srv", SECRET, streaming_handler()) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)
            got = await asyncio.gather(*(fetch_all(peer, KEYS[n:n + 5]) for n in (0, 5, 10)))
            peer.close()
            return got

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert isinstance(runner.get_loop(), uvloop.Loop)
        for got, n in zip(runner.run(asyncio.wait_for(main(), LIMIT)), (0, 5, 10)):
            assert_complete(got, KEYS[n:n + 5])


def test_a_ping_and_a_probe_sent_in_one_tick_of_uvloops_clock_time_from_that_tick():
    """The sender pings and probes a new link at once: the second PING of a tick gets a time of
    its own (the PONG names its PING by time), but both are timed from the clock's tick, so a
    PONG that comes back in that same millisecond never looks as if it came before its PING."""
    async def main() -> list:
        async with await aio.serve(HOST, 0, "srv", SECRET, streaming_handler()) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)
            got = [await asyncio.gather(peer.ping(), peer.probe(1024)) for _ in range(50)]
            peer.close()
            return got

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for rtt, (sent, acked) in runner.run(asyncio.wait_for(main(), LIMIT)):
            assert rtt >= 0 and acked >= sent


def test_a_ping_sent_in_the_tick_of_one_just_answered_is_answered_too():
    """Fetches to a new peer start a few milliseconds apart, each pinging and probing it. A
    PING sent in uvloop's clock tick (a millisecond) of one whose PONG had just come, its
    waiter not yet resumed, took that one's time; the answered one's cleanup then dropped the
    new one's waiter, and that probe waited for ever (its fetch stalled: tests/system's fifty
    fetches, now and then). Before the fix this hung in every run."""
    rng = random.Random(0)

    async def main() -> list:
        async with await aio.serve(HOST, 0, "srv", SECRET, streaming_handler()) as srv:
            peer = await aio.connect(HOST, srv.port, "cli", SECRET)

            async def fetch_starts(delay: float):
                await asyncio.sleep(delay)
                return await asyncio.gather(peer.ping(), peer.probe(128 * 1024))

            got = []
            for _ in range(30):
                got += await asyncio.gather(*(fetch_starts(rng.random() * 0.005) for _ in range(8)))
            peer.close()
            return got

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        got = runner.run(asyncio.wait_for(main(), LIMIT))
    assert len(got) == 240 and all(rtt >= 0 and acked >= sent for rtt, (sent, acked) in got)
