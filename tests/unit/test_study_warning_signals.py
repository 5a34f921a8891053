"""The warning-signal analysis of the learning study (sorl_verl/study/warning_signals.py)."""

from __future__ import annotations

import math
import re
import statistics
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sorl_verl.study.metrics import Trace
from sorl_verl.study.warning_signals import (
    BASELINE_STEPS,
    BOTH,
    DOWN,
    FACTOR,
    FALL_K,
    SIGNALS,
    TRIGGER_MAX_FALSE,
    TRIGGER_MIN_WARNED,
    UP,
    WINDOW,
    RunSignals,
    SignalScore,
    alarm_step,
    baseline_floor,
    drop_step,
    fall_step,
    markdown,
    meets_trigger_rule,
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
    assert alarm_step(flat, BOTH) is None
    spike = [(s, 1.0 if s != 12 else 5.0) for s in range(1, 21)]
    assert alarm_step(spike, UP) == 12  # (1 + 1 + 5) / 3 > 2
    rise = [(s, 1.0 if s < 15 else 2.5) for s in range(1, 21)]
    assert alarm_step(rise, UP) == 17  # step 16: (1 + 2.5 + 2.5) / 3 = 2.0 is not > 2; step 17 is
    fall = [(s, 1.0 if s < 10 else 0.2) for s in range(1, 21)]
    assert alarm_step(fall, UP) is None and alarm_step(fall, BOTH) == 11 and alarm_step(fall, DOWN) == 11
    assert alarm_step(rise, DOWN) is None  # a signal that warns by falling ignores a rise
    with pytest.raises(ValueError, match="direction"):
        alarm_step(flat, "sideways")


def test_the_floor_is_the_spread_of_the_runs_own_baseline():
    # a baseline constant at 0 has no scale: never alarms on a rise (and cannot fall)
    zero = [(s, 0.0 if s < 10 else 0.01) for s in range(1, 21)]
    assert alarm_step(zero, BOTH) is None
    # median 0, standard deviation of (0, 0, 0, 0.03, 0.04) = 0.0195: a window mean above 0.039 alarms
    noisy = [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.03), (5, 0.04)]
    assert baseline_floor([v for _, v in noisy]) == pytest.approx(statistics.stdev([0, 0, 0, 0.03, 0.04]))
    below = noisy + [(s, 0.035) for s in range(6, 21)]
    above = noisy + [(s, 0.035 if s < 12 else 0.05) for s in range(6, 21)]
    assert alarm_step(below, UP) is None
    assert alarm_step(above, UP) == 12  # (0.035 + 0.035 + 0.05) / 3 = 0.040 > 2 x 0.0195; step 11's 0.035 is not
    # where the median exceeds the spread the threshold is FACTOR x median, as in the rule fixed before
    steady = [(s, 1.0 + 0.01 * (s % 2)) for s in range(1, 6)] + [(s, 2.1) for s in range(6, 12)]
    assert alarm_step(steady, UP) == 8
    # a fall is judged against the median alone: ESS from ~0.95 to below 0.475
    ess = [(s, 0.95) for s in range(1, 6)] + [(s, 0.95 if s < 30 else 0.3) for s in range(6, 41)]
    assert alarm_step(ess, DOWN) == 32  # (0.95 + 0.3 + 0.3) / 3 = 0.517 at 31 is not below 0.475; 32 is


@given(st.lists(st.floats(0.01, 100, allow_nan=False), min_size=BASELINE_STEPS + WINDOW, max_size=30))
def test_an_alarm_is_a_window_mean_past_the_threshold(values):
    series = [(i + 1, v) for i, v in enumerate(values)]
    a = alarm_step(series, UP)
    base = values[:BASELINE_STEPS]
    ref = max(statistics.median(base), statistics.stdev(base))
    means = {s: sum(values[i + 1 - WINDOW : i + 1]) / WINDOW for i, (s, _) in enumerate(series) if i + 1 >= WINDOW}
    expected = next((s for s, m in means.items() if s > BASELINE_STEPS and m > FACTOR * ref), None)
    assert a == expected
    low = statistics.median(base) / FACTOR
    expected_down = next((s for s, m in means.items() if s > BASELINE_STEPS and m < low), None)
    assert alarm_step(series, DOWN) == expected_down


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


def test_table_rows_keep_four_cells_and_name_the_signals_no_run_logged():
    flat = [(s, 1.0) for s in range(1, 11)]
    runs = [RunSignals("a", drop=None, series={"||C||": flat, "||C(theta)||": flat, "ppo_kl": flat})]
    rows = [line for line in markdown(score_signals(runs)).splitlines() if line.startswith("| ")]
    assert len(rows) == 2 + len(SIGNALS)  # header, separator and every signal, logged or not
    for row in rows:
        cells = re.split(r"(?<!\\)\|", row)[1:-1]  # split on bars that are not escaped
        assert len(cells) == 4, row
    assert "| \\|\\|C\\|\\| | 0 / 0 | - | 0 / 1 |" in rows
    # the old runs have no ESS: their rows say so instead of a count
    assert (
        "| ESS token | not logged | - | not logged |" in rows and "| ESS turn | not logged | - | not logged |" in rows
    )
    assert sum("not logged" in row for row in rows) == len(SIGNALS) - 3


# --- the per-run floor: a run's verdict does not depend on the other runs ----------------------------


def rising_run(key: str, drop: int | None) -> RunSignals:
    """A clip-fraction-like signal near 0 in its baseline (0.01 +- 0.001) that rises to 0.05 from step 20."""
    base = [0.01, 0.011, 0.009, 0.01, 0.011]
    series = [(s, base[s - 1] if s <= 5 else 0.01 if s < 20 else 0.05) for s in range(1, 51)]
    return RunSignals(key, drop=drop, series={"token clipfrac": series})


def test_a_runs_verdict_does_not_change_when_a_run_with_a_large_signal_is_added():
    """Fails on the pooled floor: 0.1 x the median over runs of each run's maximum (0.05 and 10) is 0.5,
    above the first run's rise, which then no longer warned; the per-run floor leaves it warned."""
    alone = rising_run("a", drop=30)
    loud = RunSignals("b", drop=None, series={"token clipfrac": [(s, 10.0) for s in range(1, 51)]})
    (before,) = score_signals([alone])
    (after,) = score_signals([alone, loud])
    assert (before.warned, before.leads) == (1, (10,))  # alarms at 20: (0.01 + 0.01 + 0.05) / 3 > 2 x 0.01
    assert (after.warned, after.leads, after.held_runs, after.false_alarms) == (1, (10,), 1, 0)


series_values = st.lists(st.floats(0.0, 50.0, allow_nan=False), min_size=BASELINE_STEPS + WINDOW, max_size=30)
other_runs = st.lists(st.tuples(series_values, st.one_of(st.none(), st.integers(6, 30))), max_size=6)


@given(other_runs)
def test_adding_runs_adds_their_counts_and_changes_no_other_runs_verdict(others):
    """Each run's contribution to a signal's counts is its own: the scores over the runs plus one are the
    scores over that run alone added to the scores over the others."""
    runs = [RunSignals(f"o{i}", drop, {"ppo_kl": [(k + 1, v) for k, v in enumerate(vals)]})
            for i, (vals, drop) in enumerate(others)]  # fmt: skip
    for target in (rising_run("a", drop=30), rising_run("b", drop=None)):
        target = RunSignals(target.key, target.drop, {"ppo_kl": target.series["token clipfrac"]})
        (own,) = score_signals([target])
        together = score_signals([*runs, target])[0]
        rest = score_signals(runs)[0] if runs else SignalScore("ppo_kl", 0, 0, (), 0, 0)
        assert together.warned == rest.warned + own.warned
        assert together.false_alarms == rest.false_alarms + own.false_alarms
        assert sorted(together.leads) == sorted(rest.leads + own.leads)


def test_the_early_trigger_rule_needs_80_percent_warned_and_at_most_20_percent_false_alarms():
    assert (TRIGGER_MIN_WARNED, TRIGGER_MAX_FALSE) == (0.8, 0.2)
    assert meets_trigger_rule(SignalScore("ppo_kl", 5, 4, (1, 2, 3, 4), 5, 1))  # 80 %, 20 %
    assert not meets_trigger_rule(SignalScore("ppo_kl", 5, 3, (1, 2, 3), 5, 1))  # 60 % warned
    assert not meets_trigger_rule(SignalScore("ppo_kl", 5, 5, (1,) * 5, 5, 2))  # 40 % false alarms
    assert not meets_trigger_rule(SignalScore("ppo_kl", 0, 0, (), 5, 0))  # no drop to warn of
    assert not meets_trigger_rule(SignalScore("ppo_kl", 5, 5, (1,) * 5, 0, 0))  # no held run to cry wolf in
    table = markdown([SignalScore("ppo_kl", 5, 4, (1, 2, 3, 4), 5, 1), SignalScore("grad norm", 5, 3, (), 5, 0)])
    assert (
        "Within the early-trigger rule (warned >= 80% of the dropped runs, false alarms <= 20% of the runs that "
        "held): ppo_kl." in table
    )
    assert markdown([SignalScore("grad norm", 5, 3, (), 5, 0)]).split("\n")[-2].endswith("held): none.")


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
