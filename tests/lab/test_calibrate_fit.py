"""The tuners' answer from every point they tried (calibrate.crossing): pure arithmetic, no model."""
from __future__ import annotations

import math

import pytest

from kvstreamd.lab.calibrate import FIT_REACH, crossing


def kl(x: float, c: float = 1e-3, power: float = 2.0) -> float:
    return c * x ** power


def test_the_answer_is_where_the_fitted_curve_crosses_the_goal_not_the_first_point_under_it():
    tried = [(1.0, kl(1.0)), (1.3, kl(1.3)), (2.0, kl(2.0))]  # 1.3 met 2e-3 first; the curve crosses at sqrt(2)
    assert crossing(tried, 2e-3) == pytest.approx(math.sqrt(2), rel=1e-6)


def test_the_answer_is_never_finer_than_a_point_that_met_the_goal_nor_as_coarse_as_one_that_missed():
    noisy = [(1.0, kl(1.0)), (1.5, 1.05 * 2e-3), (1.6, 3e-3)]  # 1.5 met (within 10%), 1.6 missed
    got = crossing(noisy, 2e-3)
    assert 1.5 <= got <= 1.6


def test_a_fit_reaches_only_a_little_past_the_coarsest_point_tried():
    far = [(1.0, kl(1.0)), (1.2, kl(1.2))]  # crossing at sqrt(20) = 4.5, far past both points
    assert crossing(far, 2e-2) == pytest.approx(FIT_REACH * 1.2)


def test_a_curve_that_barely_grows_gives_the_ceiling_not_an_overflow():
    flat = [(1.0, 1e-3), (2.0, 1.0000001e-3)]  # a tiny random model's KL: it crosses 2e-2 at ~10**(10**7)
    assert crossing(flat, 2e-2) == pytest.approx(FIT_REACH * 2.0)


@pytest.mark.parametrize("tried,want", [
    ([(1.7, 1e-3)], 1.7),  # one point that met the goal
    ([(1.7, 5e-3)], 1.7),  # one point that missed it: the finest tried
    ([(1.0, 3e-3), (2.0, 1e-3)], 2.0),  # KL that falls as steps grow: no fit, the coarsest that met it
])
def test_without_a_curve_to_fit_the_answer_is_the_coarsest_point_that_met_the_goal(tried, want):
    assert crossing(tried, 2e-3) == want
