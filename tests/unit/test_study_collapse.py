"""The study's collapse rule (sorl_verl/study/collapse.py) on synthetic scores and metric files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sorl_verl.study.collapse import CRITERION, FRACTION, judge, killed, score_collapse_onset
from sorl_verl.study.metrics import read_trace


def vals(*scores: float, every: int = 5) -> list[tuple[int, float]]:
    return [(i * every, s) for i, s in enumerate(scores)]


def test_criterion_is_fixed_text_naming_each_clause():
    assert FRACTION == 0.5
    for part in ("half of its running peak", "NaN or infinite", "non-zero code after", "not a result"):
        assert part in CRITERION


@pytest.mark.parametrize(
    ("scores", "onset"),
    [
        ((0.6, 0.62, 0.65), None),  # learning
        ((0.6, 0.7, 0.2, 0.1), 10),  # collapse from step 10 on (peak 0.7, half 0.35)
        ((0.6, 0.1, 0.5), None),  # recovery: 0.5 >= 0.3 at the last validation
        ((0.6, 0.1, 0.5, 0.2), 15),  # recovered, then down again: the final stretch starts at 15
        ((0.6, 0.3), None),  # exactly half is not below half
        ((0.6, 0.2999), 5),
        ((0.6,), None),  # a single validation cannot collapse
        ((0.0, 0.0, 0.0), None),  # nothing to lose
        ((0.0, 0.4, 0.1), 10),  # the peak can come after step 0
        ((0.6, math.nan, 0.1), 10),  # a NaN validation is skipped
        ((0.6, 0.1, math.nan), 5),
    ],
)
def test_score_collapse_onset(scores, onset):
    assert score_collapse_onset(vals(*scores)) == onset


def brute_force_onset(scores: list[float], f: float) -> int | None:
    """The rule as worded: the first i such that every j >= i is below f x running peak at j."""
    peaks = [max(scores[: j + 1]) for j in range(len(scores))]
    for i in range(len(scores)):
        if all(scores[j] < f * peaks[j] for j in range(i, len(scores))):
            return i
    return None


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12), st.sampled_from([0.25, 0.5, 0.75]))
def test_onset_equals_the_worded_rule_and_the_last_validation_test(scores, f):
    onset = score_collapse_onset(vals(*scores, every=1), f)
    assert onset == brute_force_onset(scores, f)
    assert (onset is not None) == (scores[-1] < f * max(scores))


def test_judge_clauses_and_their_priority():
    stable = vals(0.6, 0.62)
    assert judge(stable, None, 0, 10) == judge(stable, None, 0, 10)
    v = judge(stable, None, 0, 10)
    assert (v.collapsed, v.judged, v.reason) == (False, True, "")
    v = judge(vals(0.6, 0.1), None, 0, 10)
    assert (v.collapsed, v.judged, v.onset_step) == (True, True, 5)
    # (b) non-finite loss wins, with its step
    v = judge(stable, (3, "actor/pg_loss"), 0, 10)
    assert (v.collapsed, v.onset_step) == (True, 3) and "actor/pg_loss" in v.reason
    # (c) died after step 1
    v = judge(stable, None, 1, 4)
    assert (v.collapsed, v.judged, v.onset_step) == (True, True, 4)
    # died before step 1: a failed run, not a result
    v = judge(vals(0.6), None, 1, 0)
    assert (v.collapsed, v.judged) == (False, False)
    # killed by a signal: interrupted, not a result, even with NaN or a low score
    for code in (-9, -15, 137, 143, 130):
        assert killed(code)
        v = judge(vals(0.6, 0.0), (2, "actor/grad_norm"), code, 8)
        assert (v.collapsed, v.judged) == (False, False)
    assert not killed(0) and not killed(1) and not killed(None)


def write_metrics(path: Path, records: list[dict], tail: str = "") -> Path:
    """A metrics file in verl's file-logger format (json.dumps writes NaN as NaN, as verl's does)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def val_record(step: int, one: float, two: float, three: float) -> dict:
    return {
        "step": step,
        "data": {
            "val-core/synthetic_1hop/reward/mean@1": one,
            "val-core/synthetic_2hop/reward/mean@1": two,
            "val-core/synthetic_3hop/reward/mean@1": three,
            "val-aux/synthetic_1hop/em/mean@1": one,
            "val-aux/num_turns/mean": 3.0,
        },
    }


def train_record(step: int, **metrics: float) -> dict:
    return {"step": step, "data": {"training/global_step": step, "timing_s/step": 6.0, **metrics}}


def test_metrics_file_to_verdict(tmp_path):
    records = [val_record(0, 0.6, 0.9, 0.0)]
    records += [train_record(s, **{"actor/pg_loss": 0.1, "actor/grad_norm": 0.5}) for s in (1, 2)]
    records += [val_record(2, 0.1, 0.2, 0.0)]
    path = write_metrics(tmp_path / "metrics.jsonl", records, tail='{"step": 3, "data": {"trai')
    trace = read_trace(path)
    assert trace.last_step == 2
    assert trace.val_scores == [(0, pytest.approx(0.5)), (2, pytest.approx(0.1))]
    assert trace.validations[0][1] == {"synthetic_1hop": 0.6, "synthetic_2hop": 0.9, "synthetic_3hop": 0.0}
    v = judge(trace.val_scores, trace.first_nonfinite(), 0, trace.last_step)
    assert (v.collapsed, v.onset_step) == (True, 2)


def test_nan_grad_norm_in_the_file_is_divergence(tmp_path):
    records = [val_record(0, 0.6, 0.6, 0.6), train_record(1, **{"actor/grad_norm": 1.0})]
    records += [train_record(2, **{"actor/grad_norm": math.nan, "actor/entropy": math.nan})]
    records += [train_record(3, **{"critic/vf_loss": math.inf})]
    path = write_metrics(tmp_path / "m.jsonl", records)
    assert "NaN" in path.read_text()
    trace = read_trace(path)
    assert trace.first_nonfinite() == (2, "actor/grad_norm")  # entropy NaN alone is not the rule's
    v = judge(trace.val_scores, trace.first_nonfinite(), 0, trace.last_step)
    assert v.collapsed and v.onset_step == 2


def test_validation_uses_the_largest_n_per_source(tmp_path):
    rec = {
        "step": 0,
        "data": {"val-core/a/reward/mean@1": 0.0, "val-core/a/reward/mean@4": 1.0, "val-core/b/acc/mean@1": 0.5},
    }
    trace = read_trace(write_metrics(tmp_path / "m.jsonl", [rec]))
    assert trace.validations == [(0, {"a": 1.0, "b": 0.5})]
    assert trace.val_scores == [(0, 0.75)]


def test_missing_file_is_an_empty_trace(tmp_path):
    trace = read_trace(tmp_path / "absent.jsonl")
    assert (trace.last_step, trace.val_scores, trace.first_nonfinite()) == (0, [], None)
    v = judge(trace.val_scores, trace.first_nonfinite(), 1, trace.last_step)
    assert (v.collapsed, v.judged) == (False, False)
