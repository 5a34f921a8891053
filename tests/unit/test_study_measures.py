"""The learning measures of one run (sorl_verl/study/measures.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sorl_verl.study.measures import LOST_FRACTION, MIN_GAIN, auc_gain, guard_measures, measures


def test_a_run_that_learns_and_keeps_it():
    vals = [(0, 0.20), (10, 0.30), (20, 0.30), (30, 0.28)]
    m = measures(vals, episodes_per_step=32)
    assert m.gain == pytest.approx(0.08) and m.peak_gain == pytest.approx(0.10) and m.peak_step == 10
    # trapezoids over (v - 0.2): 10*(0+0.1)/2 + 10*(0.1+0.1)/2 + 10*(0.1+0.08)/2 = 0.5 + 1.0 + 0.9
    assert m.auc_gain == pytest.approx(2.4 / 30)
    assert m.episodes == 960 and m.gain_per_1k_episodes == pytest.approx(1000 * 0.08 / 960)
    assert m.peak_gain_per_1k_episodes == pytest.approx(1000 * 0.10 / 320)
    assert m.lost_gain is False


def test_a_run_that_gains_and_then_loses_it():
    m = measures([(0, 0.2), (10, 0.3), (20, 0.22)], episodes_per_step=32)
    assert m.lost_gain is True and m.gain == pytest.approx(0.02)


def test_a_gain_of_exactly_the_minimum_counts_despite_rounding():
    # 0.25 - 0.2 is 0.04999999999999999 in binary floating point
    assert MIN_GAIN > 0.25 - 0.2
    assert measures([(0, 0.2), (10, 0.25), (20, 0.2)], 32).lost_gain is True


def test_too_small_a_peak_is_never_a_lost_gain_and_nonfinite_scores_are_skipped():
    m = measures([(0, 0.2), (10, 0.24), (20, float("nan")), (30, 0.1)], 32)
    assert m.lost_gain is False and m.gain == pytest.approx(-0.1) and m.peak_step == 10
    assert measures([(0, 0.2)], 32).gain is None and measures([], None).lost_gain is None


def test_without_an_episode_count_the_rates_are_none():
    m = measures([(0, 0.2), (10, 0.3)], None)
    assert m.episodes is None and m.gain_per_1k_episodes is None and m.gain == pytest.approx(0.1)


scores = st.lists(st.floats(0, 1, allow_nan=False), min_size=2, max_size=8)


@given(scores)
def test_properties(vals):
    pts = [(10 * i, v) for i, v in enumerate(vals)]
    m = measures(pts, 32)
    v0 = vals[0]
    assert m.peak_gain >= m.gain and m.peak_gain >= 0
    # the mean gain lies between the smallest and the largest gain the curve takes
    assert min(v - v0 for v in vals) - 1e-12 <= m.auc_gain <= m.peak_gain + 1e-12
    assert m.lost_gain == (m.peak_gain >= MIN_GAIN - 1e-9 and m.gain < LOST_FRACTION * m.peak_gain)
    # a constant shift of every score changes no gain
    shifted = measures([(s, v + 0.5) for s, v in pts], 32)
    assert math.isclose(shifted.auc_gain, m.auc_gain, abs_tol=1e-9)
    assert auc_gain(pts[:1]) is None


def test_guard_measures_of_a_run_with_restores():
    # restores logged at every step, the step order of the series not assumed
    restores = [(3, 1.0), (1, 0.0), (2, 0.0), (5, 2.0), (4, 1.0)]
    seconds = [(1, 0.5), (2, 0.25), (3, float("nan")), (4, 1.5), (5, 0.125)]
    g = guard_measures(restores, seconds)
    assert (g.guard_restores, g.guard_s, g.logged) == (2, 2.375, True)
    assert g.as_dict() == {"guard_restores": 2, "guard_s": 2.375}


def test_guard_measures_of_a_run_without_the_guard():
    g = guard_measures([], [])
    assert (g.guard_restores, g.guard_s, g.logged) == (None, None, False)


@given(st.lists(st.integers(0, 1), min_size=1, max_size=50), st.lists(st.floats(0, 100), min_size=1, max_size=50))
def test_guard_measures_properties(increments, seconds):
    # restores never decrease: the count at the last step is the number of restores of the run
    counts = [sum(increments[: i + 1]) for i in range(len(increments))]
    g = guard_measures(list(enumerate(map(float, counts), 1)), list(enumerate(seconds, 1)))
    assert g.guard_restores == sum(increments)
    assert g.guard_s == math.fsum(seconds) and g.guard_s >= max(seconds)


def test_the_guard_metric_names_are_the_ones_the_guard_logs():
    from sorl_verl.study.measures import GUARD_RESTORES, GUARD_SECONDS
    from sorl_verl.trainer.guard_rule import RESTORES_METRIC, SECONDS_METRIC, GuardConfig, GuardState, guard_metrics

    assert (GUARD_RESTORES, GUARD_SECONDS) == (RESTORES_METRIC, SECONDS_METRIC)
    assert guard_metrics(GuardConfig(enable=True), GuardState(restores=2), False)[GUARD_RESTORES] == 2.0
