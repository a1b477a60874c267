"""A PONG carries the answerer's wall clock (docs/protocol.md, PONG `wall`), so a pinger learns
how far a peer's clock is from its own: on the wire (sans-IO), from peers that do not send it,
and over real loopback sockets against a peer whose clock runs 5 s ahead."""
from __future__ import annotations

import asyncio
import time

from transport import aio, frames
from transport.messages import Ping, Pong, from_wire, to_wire
from transport.protocol import Connection, State

SECRET = b"cluster-secret-for-clocks"
NOW = 1.0


def ready_pair(server_wall=None) -> tuple[Connection, Connection]:
    c = Connection("client", "node-a", SECRET)
    s = Connection("server", "node-b", SECRET, wall_clock=server_wall)
    for _ in range(10):
        s.receive_data(c.data_to_send(), NOW)
        c.receive_data(s.data_to_send(), NOW)
    assert (c.state, s.state) == (State.READY, State.READY)
    while c.next_event() or s.next_event():
        pass
    return c, s


def sent_frames(conn: Connection) -> list[dict]:
    dec = frames.FrameDecoder(2**20)
    dec.feed(conn.data_to_send())
    return [f for f, _ in dec]


def test_a_pong_carries_the_answerers_wall_clock():
    c, s = ready_pair(server_wall=lambda: 1_700_000_000.25)
    c.send(Ping(NOW), NOW)
    s.receive_data(c.data_to_send(), NOW)
    [pong] = sent_frames(s)
    assert pong == {"t": "PONG", "time": NOW, "wall": 1_700_000_000.25}


def test_a_connection_without_a_wall_clock_answers_a_pong_as_before():
    c, s = ready_pair(server_wall=None)
    c.send(Ping(NOW), NOW)
    s.receive_data(c.data_to_send(), NOW)
    assert sent_frames(s) == [{"t": "PONG", "time": NOW}]


def test_a_pong_without_wall_from_an_older_peer_still_parses():
    assert from_wire({"t": "PONG", "time": 2.5}) == Pong(2.5, None)
    assert to_wire(Pong(2.5)) == {"t": "PONG", "time": 2.5}


async def test_a_pinger_learns_that_a_peers_clock_runs_5_s_ahead_over_real_sockets():
    loop = asyncio.get_running_loop()
    ahead = lambda: time.time() + 5.0  # noqa: E731  (the peer's clock)
    server = await loop.create_server(lambda: aio.PeerConnection("server", "skewed", SECRET, wall_clock=ahead),
                                      "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    conn = await aio.connect("127.0.0.1", port, "pinger", SECRET)
    try:
        assert conn.clock_offset is None  # nothing measured before a PING
        rtt = await conn.ping()
        assert abs(conn.clock_offset - 5.0) <= rtt + 0.05, (conn.clock_offset, rtt)
    finally:
        conn.close()
        server.close()
        await server.wait_closed()
