"""The warning-signal analysis of the learning study (sorl_verl/study/warning_signals.py)."""

from __future__ import annotations

import math
import re
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sorl_verl.study.metrics import Trace
from sorl_verl.study.warning_signals import (
    BASELINE_STEPS,
    FACTOR,
    FALL_K,
    WINDOW,
    RunSignals,
    alarm_step,
    drop_step,
    fall_step,
    markdown,
    run_signals,
    score_signals,
    validation_size,
)


def test_drop_step_is_the_collapse_onset_or_the_first_validation_that_lost_half_the_gain():
    assert drop_step([(0, 0.2), (10, 0.1)], collapse_onset=10) == 10
    vals = [(0, 0.2), (10, 0.3), (20, 0.27), (30, 0.22), (40, 0.21)]
    assert drop_step(vals, None) == 30  # gain 0.1 at the peak; 0.07 keeps it, 0.02 is below 0.05
    assert drop_step([(0, 0.2), (10, 0.3), (20, 0.26)], None) is None  # kept 0.06 of 0.1
    assert drop_step([(0, 0.2), (10, 0.23), (20, 0.1)], None) is None  # never gained 0.05
    assert drop_step([(0, 0.2), (10, float("nan")), (20, 0.3), (30, 0.2)], None) == 30


def test_alarm_needs_the_window_mean_past_the_factor_after_the_baseline():
    flat = [(s, 1.0) for s in range(1, 21)]
    assert alarm_step(flat, floor=0.0, two_sided=True) is None
    spike = [(s, 1.0 if s != 12 else 5.0) for s in range(1, 21)]
    assert alarm_step(spike, 0.0, False) == 12  # (1 + 1 + 5) / 3 > 2
    rise = [(s, 1.0 if s < 15 else 2.5) for s in range(1, 21)]
    assert alarm_step(rise, 0.0, False) == 17  # step 16: (1 + 2.5 + 2.5) / 3 = 2.0 is not > 2; step 17 is
    fall = [(s, 1.0 if s < 10 else 0.2) for s in range(1, 21)]
    assert alarm_step(fall, 0.0, False) is None and alarm_step(fall, 0.0, True) == 11
    # a baseline of 0 alarms only past FACTOR x the floor
    zero = [(s, 0.0 if s < 10 else 0.01) for s in range(1, 21)]
    assert alarm_step(zero, floor=0.01, two_sided=False) is None
    assert alarm_step(zero, floor=0.001, two_sided=False) == 10  # (0 + 0 + 0.01) / 3 > 2 x 0.001


@given(st.lists(st.floats(0.01, 100, allow_nan=False), min_size=BASELINE_STEPS + WINDOW, max_size=30))
def test_an_alarm_is_a_window_mean_past_the_threshold(values):
    series = [(i + 1, v) for i, v in enumerate(values)]
    a = alarm_step(series, 0.0, False)
    base = sorted(values[:BASELINE_STEPS])[BASELINE_STEPS // 2] if BASELINE_STEPS % 2 else None
    means = {s: sum(values[i + 1 - WINDOW : i + 1]) / WINDOW for i, (s, _) in enumerate(series) if i + 1 >= WINDOW}
    if base is not None:
        expected = next((s for s, m in means.items() if s > BASELINE_STEPS and m > FACTOR * base), None)
        assert a == expected


def test_scores_count_warned_drops_leads_and_false_alarms():
    rising = [(s, 1.0 if s < 20 else 9.0) for s in range(1, 51)]
    flat = [(s, 1.0) for s in range(1, 51)]
    late = [(s, 1.0 if s < 45 else 9.0) for s in range(1, 51)]
    runs = [
        RunSignals("a", drop=30, series={"ppo_kl": rising}),  # alarms at 20: (1 + 1 + 9) / 3 > 2, 10 steps ahead
        RunSignals("b", drop=30, series={"ppo_kl": late}),  # alarms after the drop: not warned
        RunSignals("c", drop=None, series={"ppo_kl": flat}),
        RunSignals("d", drop=None, series={"ppo_kl": rising}),  # a false alarm
    ]
    (kl,) = score_signals(runs)
    assert (kl.signal, kl.dropped_runs, kl.warned, kl.leads, kl.held_runs, kl.false_alarms) == (
        "ppo_kl",
        2,
        1,
        (10,),
        2,
        1,
    )
    assert "| ppo_kl | 1 / 2 | 10 | 1 / 2 |" in markdown([kl])


def test_run_signals_takes_the_collapse_onset_or_the_lost_gain_and_only_logged_signals():
    trace = Trace(train={s: {"actor/ppo_kl": 0.01 * s} for s in range(1, 11)})
    run = {"regime": "r", "algorithm": "a", "seed": 1, "collapsed": False, "onset_step": None,
           "val_scores": [[0, 0.2], [5, 0.3], [10, 0.21]]}  # fmt: skip
    rs = run_signals(run, trace)
    assert rs.key == "r/a/seed1" and rs.drop == 10 and set(rs.series) == {"ppo_kl"}
    assert run_signals({**run, "collapsed": True, "onset_step": 5}, trace).drop == 5
    assert run_signals({**run, "val_scores": [[0, 0.2], [5, 0.3], [10, 0.29]]}, trace).drop is None


def test_table_rows_keep_four_cells_when_a_signal_name_has_bars():
    flat = [(s, 1.0) for s in range(1, 11)]
    runs = [RunSignals("a", drop=None, series={"||C||": flat, "||C(theta)||": flat, "ppo_kl": flat})]
    rows = [line for line in markdown(score_signals(runs)).splitlines() if line.startswith("| ")]
    assert len(rows) == 5  # header, separator and 3 signals
    for row in rows:
        cells = re.split(r"(?<!\\)\|", row)[1:-1]  # split on bars that are not escaped
        assert len(cells) == 4, row
    assert "| \\|\\|C\\|\\| | 0 / 0 | - | 0 / 1 |" in rows


# --- the second analysis: fall below the best (defined after the learning study's runs) ---------


def test_fall_is_the_first_validation_more_than_k_standard_errors_below_the_best_before_it():
    # gains, then falls: best 0.3, v 0.2: 2 sqrt((0.3 x 0.7 + 0.2 x 0.8) / 300) = 2 x 0.0351 = 0.070 < 0.1
    assert fall_step([(0, 0.2), (10, 0.3), (20, 0.2)], None, n=300) == 20
    # the same drop with 30 questions: 2 sqrt(0.37 / 30) = 0.222 > 0.1, a wobble
    assert fall_step([(0, 0.2), (10, 0.3), (20, 0.2)], None, n=30) is None
    # falls from step 0 (updates16_lr6e-4 grpo seed 1): 0.197 -> 0.113 is 0.084 > 2 x 0.0294 = 0.059
    assert fall_step([(0, 0.197), (10, 0.113), (20, 0.107), (30, 0.14)], None, n=300) == 10
    # updates16_const_jump21 grpo seed 1: 0.223 -> 0.123 at step 30 is 0.100 > 2 x 0.0306 = 0.061;
    # step 10 (0.197 -> 0.187) is 0.010, far inside
    jump21 = [(0, 0.197), (10, 0.187), (20, 0.223), (30, 0.123), (40, 0.11), (50, 0.13)]
    assert fall_step(jump21, None, n=300) == 30
    assert drop_step(jump21, None) is None  # the fixed rule: a gain of 0.026 < 0.05 before it, "held"
    # wobbles within 2 standard errors (largest drop 0.22 -> 0.19: 0.03 < 2 x 0.033 = 0.066)
    wobble = [(0, 0.2), (10, 0.17), (20, 0.22), (30, 0.19), (40, 0.2)]
    assert fall_step(wobble, None, n=300) is None
    # the same scores on 30,000 questions: 0.2 -> 0.17 is 0.03 > 2 sqrt((0.16 + 0.1411) / 30000) = 0.0063
    assert fall_step(wobble, None, n=30_000) == 10
    # a collapse onset earlier than the fall is the drop; a later one is not
    assert fall_step([(0, 0.2), (10, 0.3), (20, 0.2)], collapse_onset=10, n=300) == 10
    assert fall_step([(0, 0.2), (10, 0.3), (20, 0.2), (30, 0.05)], collapse_onset=30, n=300) == 20
    assert fall_step(wobble, collapse_onset=40, n=300) == 40
    # non-finite scores are skipped, as by the fixed rule
    assert fall_step([(0, 0.2), (10, float("nan")), (20, 0.3), (30, 0.2)], None, n=300) == 30


def test_fall_rule_rejects_what_a_binomial_error_cannot_describe():
    with pytest.raises(ValueError, match="validation questions"):
        fall_step([(0, 0.2), (10, 0.1)], None, n=0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        fall_step([(0, 0.2), (10, 1.5)], None, n=300)


def test_validation_size_comes_from_the_cell_record_or_fails_naming_the_cell():
    assert validation_size({"key": "r/a/seed1", "overrides": {"data.val_max_samples": "300"}}) == 300
    for overrides in ({}, {"data.val_max_samples": "all"}, {"data.val_max_samples": "0"}, None):
        with pytest.raises(ValueError, match=r"r/a/seed1: .*data\.val_max_samples"):
            validation_size({"key": "r/a/seed1", "overrides": overrides})


scores_in_01 = st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=12)


@given(scores_in_01, st.integers(1, 10_000))
def test_a_score_that_never_decreases_never_falls(values, n):
    vals = [(10 * i, v) for i, v in enumerate(sorted(values))]
    assert fall_step(vals, None, n) is None


@given(scores_in_01, st.integers(1, 10_000), st.floats(0.0, 5.0), st.floats(0.0, 5.0))
def test_more_standard_errors_never_make_a_fall_earlier(values, n, k, extra):
    vals = [(10 * i, v) for i, v in enumerate(values)]
    looser, stricter = fall_step(vals, None, n, k), fall_step(vals, None, n, k + extra)
    assert stricter is None or (looser is not None and looser <= stricter)


@given(scores_in_01, st.integers(1, 10_000), st.one_of(st.none(), st.integers(0, 120)))
def test_the_fall_step_is_the_earlier_of_the_collapse_and_a_score_k_errors_below_the_best(values, n, onset):
    vals = [(10 * i, v) for i, v in enumerate(values)]
    got = fall_step(vals, onset, n)
    fell = fall_step(vals, None, n)
    assert got == min((s for s in (onset, fell) if s is not None), default=None)
    if fell is not None:
        j = fell // 10
        best, v = max(values[:j]), values[j]
        assert best - v > FALL_K * math.sqrt(best * (1 - best) / n + v * (1 - v) / n)
        assert all(  # no earlier validation was that far below its best
            max(values[:i]) - values[i]
            <= FALL_K * math.sqrt(max(values[:i]) * (1 - max(values[:i])) / n + values[i] * (1 - values[i]) / n)
            for i in range(1, j)
        )


def test_the_fall_analysis_is_scored_and_written_as_the_fixed_one_in_its_own_words():
    trace = Trace(train={s: {"actor/ppo_kl": 0.01 if s < 20 else 0.1} for s in range(1, 51)})
    run = {"regime": "r", "algorithm": "a", "seed": 1, "collapsed": False, "onset_step": None,
           "val_scores": [[0, 0.197], [10, 0.187], [20, 0.223], [30, 0.123], [40, 0.11], [50, 0.13]]}  # fmt: skip
    held, fell = run_signals(run, trace), run_signals(run, trace, partial(fall_step, n=300))
    assert (held.drop, fell.drop) == (None, 30)
    (kl_held,) = score_signals([held])
    (kl_fell,) = score_signals([fell])
    assert (kl_held.false_alarms, kl_held.warned) == (1, 0)  # ppo_kl alarms at 20: false under the fixed rule
    assert (kl_fell.false_alarms, kl_fell.warned, kl_fell.leads) == (0, 1, (10,))  # 10 steps before the fall
    table = markdown([kl_fell], [fell], rule="fall")
    assert "| signal | warned / runs that fell | median lead (steps) | false alarms / runs that never fell |" in table
    assert "| ppo_kl | 1 / 1 | 10 | 0 / 0 |" in table
    assert table.endswith("Runs that fell: r/a/seed1 (step 30) of 1 judged.\n")
    assert markdown([kl_held], [held]) == markdown([kl_held], [held], rule="drop")
    assert "Runs that dropped: none of 1 judged." in markdown([kl_held], [held])
