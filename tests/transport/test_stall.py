"""transport.stall: a fetch's stall clock and a connection's write-stall rule without a socket or
a loop, times given, verdicts exact: progress (chunks, or bytes at a useful rate), reading
paused, the event loop's lag, the time limit, and which rule wins when several apply."""
from __future__ import annotations

import pytest

from transport.stall import (FINE, LOOP_LAG_S, MIN_PROGRESS_BYTES_PER_S, MIN_WAIT_S, STALLED, TIMED_OUT,
                             StallClock, WriteStall)

RATE = MIN_PROGRESS_BYTES_PER_S


def look(clock: StallClock, now: float, *, received: int | None = None, paused: bool = False) -> str:
    """What FetchCall does at each look: reading paused, the connection's bytes, the verdict."""
    if paused:
        clock.on_paused(now)
    if received is not None:
        clock.on_bytes(received, now)
    return clock.verdict(now).what


# -- the progress rule: chunks, or bytes at MIN_PROGRESS_BYTES_PER_S ----------------------------

def test_a_fetch_with_no_chunk_for_stall_s_has_stalled_and_says_for_how_long():
    clock = StallClock(10.0, stall_s=1.0)
    assert look(clock, 10.99) == FINE
    v = clock.verdict(11.0)
    assert v.what == STALLED
    assert "no whole chunk" in v.reason and "for 1.00 s" in v.reason and "stall_s 1" in v.reason


def test_each_chunk_starts_the_stall_over():
    clock = StallClock(0.0, stall_s=1.0)
    clock.on_chunk(0.8)
    assert look(clock, 1.5) == FINE
    assert clock.next_check() == pytest.approx(1.8)
    assert look(clock, 1.8) == STALLED


def test_bytes_at_the_useful_rate_over_stall_s_are_progress():
    clock = StallClock(0.0, stall_s=1.0, received=1000)
    assert look(clock, 1.0, received=1000 + RATE) == FINE  # a large chunk on its way
    assert clock.moved == 1.0
    assert look(clock, 2.0, received=1000 + RATE) == STALLED  # none since


def test_bytes_below_the_useful_rate_are_not_progress():
    clock = StallClock(0.0, stall_s=1.0, received=1000)
    assert look(clock, 1.0, received=1000 + RATE - 1) == STALLED  # a trickle, or PINGs


def test_bytes_count_only_over_a_whole_stall_s():
    clock = StallClock(0.0, stall_s=1.0)
    assert look(clock, 0.01, received=RATE) == FINE  # seen early: no progress yet, not a stall either
    assert clock.moved == 0.0
    assert look(clock, 1.0, received=RATE) == FINE  # over the whole stall_s they are progress
    assert clock.moved == 1.0


def test_a_chunk_counts_in_the_bytes_that_brought_it():
    clock = StallClock(0.0, stall_s=1.0)
    clock.on_bytes(RATE, 0.5)
    clock.on_chunk(0.5)  # its own bytes are not progress again after it
    assert look(clock, 1.5, received=RATE + 100) == STALLED


# -- reading paused --------------------------------------------------------------------------

def test_time_with_reading_paused_is_not_the_peers_silence():
    clock = StallClock(0.0, stall_s=1.0)
    for t in (0.9, 1.8, 2.7):  # this side's buffer full at each look: never a stall
        assert look(clock, t, paused=True) == FINE
    assert clock.next_check() == pytest.approx(3.7)
    assert look(clock, 3.7) == STALLED  # counted from the last look that found reading paused


# -- the event loop's lag -----------------------------------------------------------------------

def test_a_wake_later_than_planned_by_more_than_loop_lag_s_excuses_the_whole_sleep():
    clock = StallClock(0.0, stall_s=0.3)
    assert look(clock, 0.1) == FINE
    assert clock.next_check() == pytest.approx(0.3)
    woke = 0.3 + LOOP_LAG_S + 0.5  # the loop was held up (a GC pass, a starved host)
    assert clock.on_wake(woke)
    assert clock.moved == pytest.approx(woke - 0.1)
    assert look(clock, woke) == FINE  # past stall_s since the last chunk, yet not a stall


def test_a_wake_late_by_less_than_loop_lag_s_is_not_excused():
    clock = StallClock(0.0, stall_s=0.3)
    assert look(clock, 0.1) == FINE
    woke = 0.3 + LOOP_LAG_S / 2  # an ordinary late timer
    assert not clock.on_wake(woke)
    assert clock.moved == 0.0
    assert look(clock, woke) == STALLED


def test_with_a_long_stall_s_the_lag_allowed_is_a_quarter_of_it():
    clock = StallClock(0.0, stall_s=2.0)
    assert look(clock, 0.0) == FINE
    assert not clock.on_wake(2.0 + 0.5)  # 0.5 s late: within stall_s / 4
    assert look(clock, 2.5) == STALLED
    clock = StallClock(0.0, stall_s=2.0)
    assert look(clock, 0.0) == FINE
    assert clock.on_wake(2.0 + 0.51)


def test_the_lag_rule_holds_when_a_chunk_came_in_the_late_wake_too():
    clock = StallClock(0.0, stall_s=0.3)
    assert look(clock, 0.0) == FINE  # planned to look at 0.3
    clock.on_chunk(1.0)  # delivered as the held-up loop ran again
    assert clock.on_wake(1.0)
    assert clock.moved == pytest.approx(2.0)  # the chunk's time, and the sleep excused on top


def test_a_wake_is_judged_once_against_the_sleep_its_look_planned():
    clock = StallClock(0.0, stall_s=0.3)
    assert not clock.on_wake(5.0)  # no look planned a sleep
    assert look(clock, 0.0) == FINE
    assert clock.on_wake(1.0)
    assert not clock.on_wake(2.0)


# -- the time limit, when to look, and precedence ---------------------------------------------

def test_a_fetch_still_moving_times_out_at_its_limit():
    clock = StallClock(5.0, stall_s=1.0, limit_s=2.0)
    assert clock.until == 7.0
    for t in (5.5, 6.0, 6.5):
        clock.on_chunk(t)
        assert look(clock, t) == FINE
    assert clock.next_check() == pytest.approx(7.0)  # the limit comes before the stall
    v = clock.verdict(7.0)
    assert v.what == TIMED_OUT and v.reason == "no END within the fetch's time limit"


def test_a_stall_is_named_so_even_when_the_time_limit_is_up_too():
    clock = StallClock(0.0, stall_s=1.0, limit_s=1.0)
    assert clock.verdict(1.0).what == STALLED


def test_reading_paused_comes_before_the_stall_and_the_bytes_rule():
    clock = StallClock(0.0, stall_s=1.0)
    assert look(clock, 1.0, received=0, paused=True) == FINE  # would have stalled, reading on
    assert clock.moved == 1.0  # and the window for bytes starts over at the pause:
    assert look(clock, 1.5, received=RATE) == FINE  # half a stall_s is too soon to judge bytes
    assert clock.moved == 1.0
    assert look(clock, 2.0, received=RATE) == FINE  # over a whole one (from the chunk's) they count
    assert clock.moved == 2.0
    assert look(clock, 3.0, received=RATE) == STALLED


def test_a_late_wake_comes_before_the_stall():
    clock = StallClock(0.0, stall_s=0.3, limit_s=10.0)
    assert look(clock, 0.0) == FINE
    assert clock.on_wake(1.0)
    assert look(clock, 1.0) == FINE


def test_a_late_wake_does_not_excuse_the_time_limit():
    clock = StallClock(0.0, stall_s=0.3, limit_s=0.3)
    assert look(clock, 0.0) == FINE
    assert clock.on_wake(1.0)
    assert clock.verdict(1.0).what == TIMED_OUT


def test_without_limits_the_clock_never_ends_a_fetch_nor_plans_a_look():
    clock = StallClock(0.0)
    assert not clock.limited
    assert clock.verdict(1e9).what == FINE
    assert clock.next_check() is None


def test_a_look_due_now_still_sleeps_a_little():
    clock = StallClock(0.0, stall_s=1.0)
    assert look(clock, 1.0 - MIN_WAIT_S / 10) == FINE
    assert clock.next_check() == pytest.approx(1.0 - MIN_WAIT_S / 10 + MIN_WAIT_S)


# -- the write-stall rule -------------------------------------------------------------------------

def test_a_write_buffer_that_has_not_shrunk_for_stall_s_has_stalled():
    ws = WriteStall(1.0)
    ws.on_paused(5000, 0.0)
    assert ws.next_check() == pytest.approx(0.25)  # looked at every quarter of stall_s
    assert ws.verdict(5000, 0.25).what == FINE
    assert ws.verdict(6000, 0.5).what == FINE  # grew (a CANCEL, a PONG): not taken
    assert ws.next_check() == pytest.approx(0.75)
    v = ws.verdict(6000, 1.0)
    assert v.what == STALLED
    assert v.reason == "the peer took none of the 6000 bytes queued to it for 1.0 s (write_stall_s 1); dropped"


def test_a_write_buffer_that_shrinks_starts_the_write_stall_over():
    ws = WriteStall(1.0)
    ws.on_paused(5000, 0.0)
    assert ws.verdict(4000, 0.75).what == FINE  # a slow reader takes bytes
    assert ws.verdict(4000, 1.5).what == FINE
    assert ws.verdict(4000, 1.75).what == STALLED
