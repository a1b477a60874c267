"""The bandwidth estimator's arithmetic (transport/bandwidth.py): a window of deliveries, stale
history dropped, probes, and each peer's own history."""
from __future__ import annotations

import pytest

from tests.fixtures import MB, mbit
from transport.bandwidth import BandwidthEstimator, PeerBandwidth, Probe


# --- bandwidth estimation -------------------------------------------------------------------

def test_estimate_is_the_harmonic_mean_of_the_last_window_of_samples():
    est = BandwidthEstimator(window=3)
    for rate in (1 * MB, 10 * MB, 20 * MB, 40 * MB):  # one MB each, so the time is 1/rate
        est.add(1_000_000, 5.0, 5.0 + 1_000_000 / rate)
    assert est.samples == pytest.approx((10 * MB, 20 * MB, 40 * MB))
    assert est.estimate() == pytest.approx(3 / (1 / (10 * MB) + 1 / (20 * MB) + 1 / (40 * MB)))
    assert est.peak() == pytest.approx(40 * MB) and BandwidthEstimator().peak() is None


def test_a_delivery_after_a_pause_longer_than_stale_s_drops_the_samples_before_it():
    est = BandwidthEstimator(stale_s=10.0)
    for k in range(5):  # a fast link, one fetch
        est.add(1_000_000, k * 0.01, k * 0.01 + 1_000_000 / mbit(1000))
    est.add(1_000_000, 5.0, 5.0 + 1_000_000 / mbit(20))  # 5 s on: still the same link's history
    assert len(est.samples) == 5 and est.estimate() > mbit(80)
    est.add(1_000_000, 20.0, 20.0 + 1_000_000 / mbit(20))  # the next fetch, 15 s after the last ack
    assert est.samples == pytest.approx((mbit(20),)) and est.peak() == pytest.approx(mbit(20))


def test_a_slow_chunk_pulls_the_estimate_down_more_than_a_fast_one_pushes_it_up():
    slow, fast = BandwidthEstimator(), BandwidthEstimator()
    for est, odd in ((slow, 1 * MB), (fast, 100 * MB)):
        for rate in (10 * MB,) * 4 + (odd,):
            est.add(1_000_000, 0.0, 1_000_000 / rate)
    assert 10 * MB - slow.estimate() > fast.estimate() - 10 * MB


def test_a_peer_without_history_needs_a_probe_and_tiny_messages_do_not_count():
    est = BandwidthEstimator()
    assert est.needs_probe and est.estimate() is None
    assert not est.add(3 * 1024, 0.0, 0.001)  # a TEXT chunk measures latency, not bandwidth
    assert est.needs_probe
    assert est.add(1_000_000, 0.0, 0.1)
    assert not est.needs_probe and est.estimate() == pytest.approx(10 * MB)


def test_probe_timing_minus_the_round_trip_is_the_first_sample():
    est = BandwidthEstimator()
    rate = Probe(size=256 * 1024).record(est, sent_at=1.0, acked_at=1.1, rtt=0.02)
    assert rate == pytest.approx(256 * 1024 / 0.08)
    assert est.estimate() == pytest.approx(rate) and not est.needs_probe


def test_a_noisy_round_trip_at_most_halves_the_probe_time():
    est = BandwidthEstimator()
    assert Probe(size=256 * 1024).record(est, 0.0, 0.1, rtt=0.5) == pytest.approx(256 * 1024 / 0.05)


def test_an_ack_before_its_send_is_an_error():
    with pytest.raises(ValueError, match="before the send"):
        BandwidthEstimator().add(1_000_000, 2.0, 1.0)


def test_a_delivery_within_one_clock_tick_counts_as_one_tick():
    est = BandwidthEstimator()
    assert est.add(100_000, 5.0, 5.0)  # uvloop's clock: millisecond ticks
    assert est.estimate() == pytest.approx(100_000 / 1e-3)
    assert not est.add(3_000, 5.0, 5.0)  # a TEXT chunk: too small to say anything, not an error


def test_each_peer_keeps_its_own_history_and_the_oldest_peer_is_forgotten():
    peers = PeerBandwidth(max_peers=2)
    peers.get("a").add(1_000_000, 0.0, 0.1)
    assert peers.get("b").needs_probe and not peers.get("a").needs_probe
    peers.get("c")  # "b" is now the least recently used
    assert "b" not in peers and "a" in peers and len(peers) == 2
