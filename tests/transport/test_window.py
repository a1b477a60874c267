"""The window of chunks in flight (transport.send.window_chunks), the delaying relay
(kvstreamd/lab/relay.py), and the real send loop over a shaped link behind the relay: with a
long round trip far more than two chunks go out at once, and a fetch takes a few round trips,
not one per two chunks."""
from __future__ import annotations

import hashlib
import os
import socket
import threading
import time

import pytest

from kvstreamd.lab import netns
from kvstreamd.lab.relay import Relay
from transport.bandwidth import BandwidthEstimator, Probe, crossing_s
from transport.send import MAX_WINDOW, MAX_WINDOW_BYTES, MIN_WINDOW, window_chunks

MB = 1_000_000


# -- the rule ---------------------------------------------------------------------------------

def test_the_window_covers_the_bandwidth_delay_product_plus_one_chunk():
    # 1 Gbit/s x 100 ms = 12.5 MB: three 4 MiB chunks cover it, and one more is being written
    assert window_chunks(125 * MB, 0.1, 4 * 2**20) == 4
    assert window_chunks(125 * MB, 0.1, 1 * MB) == 14
    # a LAN: the round trip holds a fraction of a chunk; today's two stay the floor
    assert window_chunks(125 * MB, 0.0002, 4 * 2**20) == MIN_WINDOW == 2


def test_the_window_is_capped_in_chunks_and_in_bytes():
    assert window_chunks(1250 * MB, 0.2, 64 * 1024) == MAX_WINDOW == 64  # small chunks, long fat link
    # 10 Gbit/s x 100 ms of 4 MiB chunks would be 31: bytes in flight stay within half the
    # fetcher's receive buffer, so the window alone never makes it pause reading
    assert window_chunks(1250 * MB, 0.1, 4 * 2**20) == MAX_WINDOW_BYTES // (4 * 2**20) == 8
    assert window_chunks(1250 * MB, 0.1, 4 * 2**20, max_bytes=64 * 2**20) == 16
    # chunks bigger than the byte cap: still two, as before
    assert window_chunks(125 * MB, 0.1, 40 * 2**20) == MIN_WINDOW


def test_without_a_bandwidth_or_a_round_trip_the_window_is_the_floor():
    assert window_chunks(None, 0.1, MB) == MIN_WINDOW
    assert window_chunks(125 * MB, None, MB) == MIN_WINDOW
    assert window_chunks(125 * MB, 0.1, 0) == MIN_WINDOW


def test_a_long_round_trip_comes_off_a_small_delivery_but_a_noisy_one_cannot_blow_it_up():
    # 512 KiB at 1 Gbit/s over 100 ms: 104.2 ms from write to PONG, 4.2 ms of them crossing
    est = BandwidthEstimator()
    rate = Probe().record(est, 0.0, 0.1042, rtt=0.1)
    assert rate == pytest.approx(512 * 1024 / 0.0042, rel=0.01)
    # an RTT a little over what is left: at most RTT_JITTER of it (plus a tick) is trusted away
    assert crossing_s(0.1005, 0.1) == pytest.approx(0.02 * 0.1 + 0.001)
    assert crossing_s(0.1, 0.5) == pytest.approx(0.05)  # longer than the whole time: noise


# -- the relay ---------------------------------------------------------------------------------

def _sink(server: socket.socket, out: dict) -> None:
    conn, _ = server.accept()
    with conn:
        h, n, first = hashlib.sha256(), 0, None
        while b := conn.recv(1 << 20):
            first = first or time.monotonic()
            n += len(b)
            h.update(b)
        conn.sendall(b"done")  # the other direction, delayed as well
        out.update(n=n, digest=h.hexdigest(), first=first)


def test_the_relay_delivers_every_byte_in_order_and_each_direction_at_least_the_delay_late():
    delay = 0.08
    data = os.urandom(24 << 20)
    out: dict = {}
    with socket.create_server(("127.0.0.1", 0)) as server, \
            Relay(("127.0.0.1", 0), server.getsockname()[:2], delay) as relay:
        t = threading.Thread(target=_sink, args=(server, out), daemon=True)
        t.start()
        with socket.create_connection(relay.address) as s:
            t0 = time.monotonic()
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(30)
            reply = s.recv(16, socket.MSG_WAITALL)
            back = time.monotonic()
        t.join(30)
    assert out["n"] == len(data) and out["digest"] == hashlib.sha256(data).hexdigest()
    assert out["first"] - t0 >= delay
    assert reply == b"done" and back - t0 >= 2 * delay  # there and back, each way delayed


# -- the send loop through the relay over a shaped link -------------------------------------------

ok, why = netns.available()


@pytest.mark.system  # daemon processes in network namespaces (root)
@pytest.mark.skipif(not ok, reason=f"cannot build network namespaces here: {why}")
def test_a_long_round_trip_puts_many_chunks_in_flight_and_costs_a_few_round_trips_per_fetch():
    from kvstreamd.bench import window as bench

    chunks, chunk_bytes, delay_ms = 16, 256 * 1024, 50  # 4 MiB at 500 Mbit/s: 67 ms of link time
    rtt = 2 * delay_ms / 1000
    with netns.Link(rate_mbit=500) as link:
        relay = bench.start_relay(link, delay_ms)
        try:
            bdp = bench.one_run(link, 0, chunks, chunk_bytes)
            fixed = bench.one_run(link, MIN_WINDOW, chunks, chunk_bytes)
        finally:
            relay.kill()
            relay.wait()
    for r in (bdp, fixed):
        assert r["cold"]["bytes"] == r["warm"]["bytes"] == chunks * chunk_bytes
    # the sender learnt the round trip through the relay, and the window followed it
    assert bdp["warm"]["sender"]["rtt_ms"] >= 2 * delay_ms
    # 500 Mbit/s x 100 ms is 24 chunks of 256 KiB: every chunk goes before the first ACK is back
    assert bdp["warm"]["sender"]["max_inflight"] >= 12, bdp
    assert fixed["warm"]["sender"]["max_inflight"] == MIN_WINDOW
    # two at a time is at least a round trip per two chunks; the window's fetch is the FETCH's
    # and the first chunk's round trip plus the link time, far fewer (bounds, not a time budget)
    assert fixed["warm"]["seconds"] >= chunks / MIN_WINDOW * rtt
    assert bdp["warm"]["seconds"] / rtt < chunks / MIN_WINDOW / 2, (bdp, fixed)
