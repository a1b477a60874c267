"""transport.delivery.DeliveryClock: the sender's delivery clock without a socket or a loop,
times given, results exact."""
from __future__ import annotations

import pytest

from transport.delivery import DeliveryClock

MB = 1_000_000


def test_a_chunk_on_an_idle_link_crossed_in_its_send_to_ack_time_less_the_round_trip():
    clock = DeliveryClock(started=0.0)
    clock.on_sent(0, MB, now=0.0)
    assert clock.in_flight == 1
    d = clock.on_ack(0, now=0.11, rtt=0.01, window=2)
    assert d.nbytes == MB
    assert d.began == pytest.approx(0.01)
    assert d.rate == pytest.approx(MB / 0.10)
    assert clock.busy_s == pytest.approx(0.10)
    assert clock.in_flight == 0


def test_back_to_back_chunks_are_timed_over_their_run_however_their_acks_bunch():
    clock = DeliveryClock(started=0.0)
    for i in range(3):
        clock.on_sent(i, MB, now=0.0)  # a window of three written at once
    clock.on_ack(0, now=0.11, rtt=0.01, window=3)  # crossed 0.01 .. 0.11
    late = [clock.on_ack(i, now=0.31, rtt=0.01, window=3) for i in (1, 2)]  # both ACKs bunched at 0.31
    # 3 MB crossed from 0.01 to 0.31: 10 MB/s, not the 1 MB per 0 s the bunched pair alone says
    assert late[-1].rate == pytest.approx(3 * MB / 0.30)
    assert late[0].began == pytest.approx(0.11)  # the second started when the first had crossed
    assert clock.busy_s == pytest.approx(0.30)


def test_the_run_is_at_most_a_window_of_chunks():
    clock = DeliveryClock(started=0.0)
    for i in range(4):
        clock.on_sent(i, MB, now=0.0)
    rates = [clock.on_ack(i, now=0.1 * (i + 1), rtt=0.0, window=2).rate for i in range(4)]
    # each chunk took 0.1 s: over a run of at most 2 chunks, every rate is 1 MB per 0.1 s
    assert rates[1:] == pytest.approx([MB / 0.1] * 3)


def test_a_chunk_written_after_the_link_went_idle_starts_a_new_run():
    clock = DeliveryClock(started=0.0)
    clock.on_sent(0, MB, now=0.0)
    clock.on_ack(0, now=0.1, rtt=0.0, window=8)
    clock.on_sent(1, 2 * MB, now=5.0)  # long after: its crossing is its own, not the run's
    d = clock.on_ack(1, now=5.1, rtt=0.0, window=8)
    assert d.began == pytest.approx(5.0)
    assert d.rate == pytest.approx(2 * MB / 0.1)


def test_an_ack_for_a_chunk_not_in_flight_is_refused():
    clock = DeliveryClock(started=0.0)
    clock.on_sent(0, 10, now=0.0)
    clock.on_ack(0, now=0.1)
    with pytest.raises(KeyError):
        clock.on_ack(0, now=0.2)
    with pytest.raises(KeyError):
        clock.on_ack(7, now=0.2)
