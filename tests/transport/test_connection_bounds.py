"""What one peer connection may make this side hold, over real TCP on 127.0.0.1: probes against
a peer that reads nothing queue one padding, not one each; a connection whose writes do not
drain for write_stall_s is ended and its buffer dropped; a peer flooding messages that land in
the inbox (ADVERTISE) is paused, not buffered without end."""
from __future__ import annotations

import asyncio

import pytest

from transport import aio
from transport.messages import WRITE_STALLED, Advertise
from transport.protocol import Connection, State

from tests.transport.test_transport_tcp import HOST, SECRET, raw_client

PROBE = 4 * 2**20
LIMIT = 10  # seconds; a bound on every wait, never a timing assertion


async def deaf_server():
    """A listening socket whose peer completes the handshake, then never reads another byte
    (a SIGSTOPped node, as its socket sees it). Returns (server, port)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection("server", "deaf", SECRET)
        while conn.state is not State.READY:
            data = await reader.read(65536)
            if not data:
                return
            conn.receive_data(data, 0.0)
            writer.write(conn.data_to_send())
        writer.transport.pause_reading()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:  # the server closing: end quietly
            writer.close()

    server = await asyncio.start_server(handle, HOST, 0)
    return server, server.sockets[0].getsockname()[1]


async def test_probes_timing_out_against_a_peer_that_reads_nothing_queue_one_padding_not_one_each():
    server, port = await deaf_server()
    async with server:
        peer = await aio.connect(HOST, port, "prober", SECRET, write_stall_s=60)
        try:
            for _ in range(8):
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await peer.probe(PROBE)
                assert peer.write_buffer_bytes <= PROBE + 64 * 1024, peer.write_buffer_bytes
            assert peer.state is State.READY
        finally:
            peer.abort()


async def test_a_connection_whose_writes_do_not_drain_for_write_stall_s_is_ended_and_its_buffer_dropped():
    server, port = await deaf_server()
    async with server:
        peer = await aio.connect(HOST, port, "prober", SECRET, write_stall_s=0.5)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await peer.probe(PROBE)
        async with asyncio.timeout(LIMIT):
            closed = await peer.wait_closed()
        assert closed.code == WRITE_STALLED and not closed.by_peer
        assert "took none of the" in closed.msg and "write_stall_s 0.5" in closed.msg, closed.msg
        assert peer.write_buffer_bytes == 0
        with pytest.raises(aio.ConnectionClosedError):
            await peer.probe(PROBE)


async def test_a_slow_reader_that_takes_bytes_is_not_a_stall():
    """The bound is on no progress at all: a peer that reads, however slowly, keeps its link."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection("server", "slow", SECRET)
        while True:
            data = await reader.read(65536)
            if not data:
                return
            conn.receive_data(data, 0.0)
            writer.write(conn.data_to_send())
            if conn.state is State.READY:
                await asyncio.sleep(0.05)  # ~1.3 MB/s: a 4 MiB probe takes ~3 s, past write_stall_s

    server = await asyncio.start_server(handle, HOST, 0)
    async with server:
        peer = await aio.connect(HOST, server.sockets[0].getsockname()[1], "prober", SECRET, write_stall_s=0.5)
        try:
            async with asyncio.timeout(LIMIT):
                await peer.probe(PROBE)  # answered: its PONG comes once the slow side read it all
            assert peer.closed is None
        finally:
            peer.abort()


async def test_a_peer_flooding_advertise_at_a_reader_that_lags_is_paused_and_loses_nothing():
    """The server's owner reads nothing from the inbox until the flood is in: reading pauses
    once the inbox holds MAX_INBOX_BYTES, so the flooder's writes block (TCP pushes back),
    and once the owner reads, every message arrives in order."""
    accepted: asyncio.Future[aio.PeerConnection] = asyncio.get_running_loop().create_future()
    srv = await aio.serve(HOST, 0, "srv", SECRET, None, on_connect=accepted.set_result)
    async with srv:
        reader, writer, conn = await raw_client(srv.port)
        keys = 4000  # ~140 KB a frame
        frames = 4 * aio.MAX_INBOX_BYTES // (keys * 35)  # four inboxes' worth
        for n in range(frames):
            conn.send(Advertise([n.to_bytes(4, "big") * 8] * keys), 0.0)
        writer.write(conn.data_to_send())
        peer = await accepted
        with pytest.raises(TimeoutError):  # blocked: the server stopped reading
            async with asyncio.timeout(1.0):
                await writer.drain()
        assert peer.reading_paused
        assert peer.inbox_bytes <= aio.MAX_INBOX_BYTES + 1024 * 1024, peer.inbox_bytes
        async with asyncio.timeout(LIMIT):
            got = [await peer.recv() for _ in range(frames)]
            await writer.drain()
        assert [m.keys[0][:4] for m in got] == [n.to_bytes(4, "big") for n in range(frames)]
        assert not peer.reading_paused and peer.inbox_bytes == 0
        writer.close()
