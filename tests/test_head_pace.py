"""The prefill rate a model process tells its senders, corrected by how its TEXT heads really
ran inside fetches (models.prefix.HeadPace): pure arithmetic, no model."""
import pytest

from kvstreamd.models.prefix import HeadPace
from transport.policy import text_seconds


def test_a_head_that_ran_slower_than_the_rate_predicts_lowers_the_rate_told_next_time():
    pace = HeadPace()
    assert pace.told("m", 550.0) == 550.0 and pace.told("m", None) is None  # nothing learned yet
    predicted = text_seconds(1536, 0, 550.0, 3000.0)
    pace.learn("m", [(0, 1536)], 1.4 * predicted, 550.0, 3000.0)
    assert pace.slowdown("m") == pytest.approx(1.4)
    assert pace.told("m", 550.0) == pytest.approx(550.0 / 1.4)
    assert pace.told("other", 550.0) == 550.0  # per model


def test_the_slowdown_moves_halfway_to_each_new_fetch_and_one_wild_fetch_is_bounded():
    pace = HeadPace()
    head = [(0, 512), (512, 1024)]
    predicted = sum(text_seconds(e - s, s, 500.0, None) for s, e in head)
    pace.learn("m", head, 1.2 * predicted, 500.0, None)
    pace.learn("m", head, 1.6 * predicted, 500.0, None)
    assert pace.slowdown("m") == pytest.approx(1.4)
    pace.learn("m", head, 100 * predicted, 500.0, None)  # a head held up by something else
    assert pace.slowdown("m") == pytest.approx((1.4 + HeadPace.BOUNDS[1]) / 2)


def test_a_fetch_without_text_or_without_a_rate_teaches_nothing():
    pace = HeadPace()
    pace.learn("m", [], 3.0, 500.0, None)
    pace.learn("m", [(0, 256)], 3.0, None, None)
    pace.learn("m", [(0, 256)], 0.0, 500.0, None)
    assert pace.slowdown("m") == 1.0
