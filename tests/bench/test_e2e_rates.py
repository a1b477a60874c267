"""What bench e2e tells the fetch of the model's prefill (recompute_tokens_per_s and
recompute_doubling_tokens), fitted to its prefill's steps."""
from __future__ import annotations

import pytest

from kvstreamd.bench.e2e import prefill_rate
from transport.policy import text_seconds


def test_the_rate_and_doubling_a_prefill_was_timed_at_come_back():
    steps = [(s, 1024, text_seconds(1024, s, 550.0, 5000.0)) for s in range(0, 8192, 1024)]
    tps, doubling = prefill_rate(steps)
    assert tps == pytest.approx(550.0) and doubling == pytest.approx(5000.0)


def test_a_prefill_that_does_not_slow_down_has_no_doubling():
    assert prefill_rate([(0, 1024, 2.0)]) == (512.0, None)
    assert prefill_rate([(0, 1024, 2.0), (1024, 1024, 1.9)]) == (pytest.approx(1024 / 1.95), None)
