"""The sans-IO sender of one FETCH (transport/sender.py), driven by hand: chunks in order, the
deadline, cancelling, what the rule is told, and where text may go."""
from __future__ import annotations

import pytest

from tests.fixtures import DPPL, fixed, mbit
from transport import traces
from transport.bandwidth import BandwidthEstimator
from transport.policy import TEXT, Choice, adaptive_rule, cachegen_rule
from transport.sender import FetchSender


# --- the sender of one FETCH -------------------------------------------------------------------

def sender(deadline_ms: float, chunks: int = 4, rule=adaptive_rule, probed_at: float | None = 100.0, beside=()):
    est = BandwidthEstimator()
    if probed_at is not None:
        est.add(1_000_000, 0.0, 1_000_000 / mbit(probed_at))
    sizes, work = traces.smollm2_chunks(chunks)
    return FetchSender(7, chunks, sizes, deadline_ms, 0.0, rule, est, work, DPPL, beside=beside)


def run(s: FetchSender, now: float, bandwidth: float) -> float:
    """Send and acknowledge chunk after chunk at `bandwidth` bytes/s; returns the time."""
    while (nxt := s.next_chunk(now)) is not None:
        i, level = nxt
        nbytes = s.sizes[level][i]
        s.on_ack(i, nbytes, now, now + nbytes / bandwidth)
        now += nbytes / bandwidth
    return now


def test_sender_streams_every_chunk_in_order_within_its_deadline():
    s = sender(deadline_ms=5000)
    handed = []
    now = 0.0
    while (nxt := s.next_chunk(now)) is not None:
        handed.append(nxt[0])
        now += 0.1
        s.on_ack(nxt[0], s.sizes[nxt[1]][nxt[0]], now - 0.1, now)
    assert handed == [0, 1, 2, 3] and s.finished and s.finished_at == pytest.approx(0.4)
    assert not s.deadline_missed(now) and len(s.choices) == 4


def test_sender_reports_a_passed_deadline_and_keeps_sending():
    s = sender(deadline_ms=1000, rule=cachegen_rule)
    end = run(s, 0.0, mbit(10))  # 4 `high` chunks would take 14 s at 10 Mbit/s
    assert end > 1.0 and s.finished and s.deadline_missed(end)
    assert len(s.levels) == 4 and s.levels[-1] == TEXT  # CacheGen's rule: TEXT once nothing fits
    assert s.deadline_missed(end + 100)  # stays reported


def test_sender_marks_the_deadline_missed_as_soon_as_it_passes():
    s = sender(deadline_ms=200)
    i, level = s.next_chunk(0.0)
    assert not s.deadline_missed(0.1) and s.deadline_missed(0.3)
    s.on_ack(i, s.sizes[level][i], 0.0, 0.3)
    assert s.next_chunk(0.3) is not None and s.deadline_missed(0.3)


def test_sender_late_last_ack_misses_the_deadline():
    s = sender(deadline_ms=500, chunks=1)
    i, level = s.next_chunk(0.0)
    s.on_ack(i, s.sizes[level][i], 0.0, 0.6)
    assert s.finished and s.deadline_missed(0.6)


def test_cancel_stops_the_stream_at_once():
    s = sender(deadline_ms=1000)
    i, level = s.next_chunk(0.0)
    s.cancel()
    assert s.next_chunk(0.01) is None and s.finished
    s.on_ack(i, 2_000_000, 0.0, 0.02)  # the chunk already on the wire still measures the link
    assert s.estimator.samples[-1] == pytest.approx(1e8)
    assert not s.deadline_missed(50.0)  # a cancelled stream has no deadline left to miss


def test_sender_tells_the_rule_what_is_still_in_flight():
    seen = []

    def rule(sit):
        seen.append(sit)
        return Choice("high", 0.0, "")

    s = sender(deadline_ms=5000, rule=rule)
    s.next_chunk(0.0)
    s.next_chunk(0.0)  # pipelined: chunk 0 not yet acknowledged
    assert seen[1].inflight_bytes == s.sizes["high"][0]
    assert seen[1].backlog_s == pytest.approx(s.work_s["high"]) and seen[1].chunks == 3


def test_an_ack_for_a_chunk_not_in_flight_is_an_error():
    s = sender(deadline_ms=1000)
    i, level = s.next_chunk(0.0)
    s.on_ack(i, s.sizes[level][i], 0.0, 0.1)
    with pytest.raises(ValueError, match="not in flight"):
        s.on_ack(i, s.sizes[level][i], 0.0, 0.2)
    with pytest.raises(ValueError, match="not in flight"):
        s.on_ack(3, 1000, 0.0, 0.2)


def test_text_is_a_head_or_a_tail_never_between_kv_chunks():
    # TEXT before any KV chunk is a head (the receiver prefills it while the rest streams);
    # after a KV chunk, TEXT is a tail: every later chunk goes as TEXT too. With text_last
    # (a receiver that holds a KV prefix, then computes) there is no head.
    wanted = [TEXT, TEXT, "high", TEXT, "high"]  # what a rule asks for, chunk by chunk
    est = BandwidthEstimator()
    est.add(1_000_000, 0.0, 1_000_000 / mbit(100))
    sizes, work = traces.smollm2_chunks(5)
    seen = []

    def rule(sit):
        seen.append(sit.text_last)
        return fixed(wanted)(sit)

    loose = FetchSender(7, 5, sizes, 5000, 0.0, rule, est, work, DPPL)
    strict = FetchSender(8, 5, sizes, 5000, 0.0, fixed(wanted), est, work, DPPL, text_last=True)
    run(loose, 0.0, mbit(100))
    run(strict, 0.0, mbit(100))
    assert loose.levels == [TEXT, TEXT, "high", TEXT, TEXT]
    assert seen == [False, False, False, True]  # the rule plans TEXT as a tail once KV has gone
    assert strict.levels == [TEXT] * 5


def test_sender_will_not_guess_the_link_before_a_probe():
    s = sender(deadline_ms=1000, probed_at=None)
    assert s.needs_probe
    with pytest.raises(RuntimeError, match="probe"):
        s.next_chunk(0.0)


def test_the_sender_keeps_levels_decoded_beside_out_of_the_receivers_backlog():
    seen = []

    def rule(sit):
        seen.append(sit)
        return Choice("int8" if len(seen) == 1 else "high", 0.0, "")

    s = sender(deadline_ms=5000, rule=rule, beside=("int8",))
    s.next_chunk(0.0)  # int8, still in flight
    s.next_chunk(0.0)
    assert seen[1].backlog_s == 0.0 and seen[1].beside == frozenset({"int8"})
    s.on_ack(0, s.sizes["int8"][0], 0.0, 0.01)
    s.next_chunk(0.01)
    assert seen[2].backlog_s == pytest.approx(s.work_s["high"])  # only chunk 1's decode is ahead
