"""The warning-signal analysis of the learning study (sorl_verl/study/warning_signals.py)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from sorl_verl.study.metrics import Trace
from sorl_verl.study.warning_signals import (
    BASELINE_STEPS,
    FACTOR,
    WINDOW,
    RunSignals,
    alarm_step,
    drop_step,
    markdown,
    run_signals,
    score_signals,
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
