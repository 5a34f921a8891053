"""The collapse guard's detection rule (sorl_verl/trainer/guard_rule.py) on synthetic metric streams,
and its knobs' start-up validation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from sorl_verl.trainer.guard_rule import (
    Action,
    FaultInjection,
    GuardConfig,
    GuardState,
    guard_metrics,
    guard_settings,
    observe_step,
    observe_validation,
    validation_score,
)

REPO = Path(__file__).resolve().parents[2]

scores = st.one_of(st.floats(0.0, 1.0), st.just(math.nan))
rule_configs = st.builds(
    GuardConfig,
    enable=st.just(True),
    rule=st.just("drop"),  # the formula below is drop's; stderr's has its own tests
    drop=st.floats(0.01, 0.99),
    patience=st.integers(1, 4),
    backoff=st.floats(0.05, 1.0),
    max_restores=st.integers(0, 3),
)


def run_validations(config: GuardConfig, stream: list[float]) -> tuple[list[Action], GuardState]:
    """Feed ``stream`` (validation j at step j + 1) to the rule until it says stop."""
    state, actions = GuardState(), []
    for step, score in enumerate(stream, start=1):
        decision = observe_validation(config, state, step, score)
        state = decision.state
        actions.append(decision.action)
        if decision.action == Action.STOP:
            break
    return actions, state


@settings(max_examples=300, deadline=None)
@given(config=rule_configs, stream=st.lists(scores, max_size=30))
def test_validation_rule_is_the_formula(config, stream):
    actions, state = run_validations(config, stream)
    line = 1.0 - config.drop
    peak = -math.inf  # b_j: the running best over finite scores
    low_run = 0  # validations in a row below (1 - drop) * b since the last collapse or reset
    collapses = 0
    for j, action in enumerate(actions):
        v = stream[j]
        if not math.isfinite(v):
            assert action == Action.NONE
            continue
        if v > peak:
            peak = v
            assert action == Action.NEW_BEST, (j, v)
            low_run = 0
            continue
        low_run = low_run + 1 if v < line * peak else 0
        if low_run == config.patience:
            collapses += 1
            low_run = 0
            assert action == (Action.STOP if collapses > config.max_restores else Action.RESTORE), (j, v, peak)
        else:
            assert action == Action.NONE, (j, v, peak, low_run)
    restores = actions.count(Action.RESTORE)
    assert restores <= config.max_restores
    assert actions.count(Action.STOP) <= 1 and (Action.STOP not in actions or actions[-1] == Action.STOP)
    assert state.restores == restores
    assert state.lr_scale == pytest.approx(config.backoff**restores, rel=1e-12)
    assert state.tau_scale == 1.0
    finite = [v for v in stream[: len(actions)] if math.isfinite(v)]
    assert state.best_score == (max(finite) if finite else None)


@given(config=rule_configs, stream=st.lists(st.floats(0.0, 1.0), max_size=30))
def test_scores_that_never_drop_below_the_line_never_collapse(config, stream):
    floor = [max(stream[: i + 1]) * (1.0 - config.drop) for i in range(len(stream))]
    kept = [max(v, f) for v, f in zip(stream, floor, strict=True)]
    actions, state = run_validations(config, kept)
    assert Action.RESTORE not in actions and Action.STOP not in actions
    assert state.lr_scale == 1.0


@given(best=st.floats(0.1, 1.0), drop=st.floats(0.05, 0.95), patience=st.integers(1, 5))
def test_collapse_is_declared_at_the_patience_th_low_validation(best, drop, patience):
    config = GuardConfig(enable=True, rule="drop", drop=drop, patience=patience)
    low = (1.0 - drop) * best * 0.5
    actions, state = run_validations(config, [best] + [low] * patience)
    assert actions == [Action.NEW_BEST] + [Action.NONE] * (patience - 1) + [Action.RESTORE]
    assert state.restores == 1 and state.low_validations == 0 and state.best_step == 1
    assert state.history[-1]["restored_step"] == 1 and state.history[-1]["kind"] == "validation"
    # exactly on the line is not below it
    actions, _ = run_validations(config, [best] + [(1.0 - drop) * best] * patience)
    assert Action.RESTORE not in actions


def test_max_restores_then_stop_and_backoff_compounds():
    config = GuardConfig(enable=True, rule="drop", drop=0.5, patience=1, backoff=0.1, max_restores=2)
    actions, state = run_validations(config, [0.8, 0.1, 0.1, 0.1, 0.1])
    assert actions == [Action.NEW_BEST, Action.RESTORE, Action.RESTORE, Action.STOP]
    assert state.restores == 2 and state.lr_scale == pytest.approx(0.01)
    assert state.last_reason.startswith("validation:")
    tau = GuardConfig(enable=True, rule="drop", drop=0.5, patience=1, backoff=0.1, backoff_target="clip_norm_tau")
    _, state = run_validations(tau, [0.8, 0.1])
    assert (state.lr_scale, state.tau_scale) == (1.0, pytest.approx(0.1))


def test_no_best_no_restore():
    config = GuardConfig(enable=True, warning_metric="actor/ppo_kl", warning_threshold=0.1, patience_steps=1)
    decision = observe_step(config, GuardState(), 1, 5.0)
    assert decision.action == Action.NONE and "no best checkpoint" in decision.reason


values = st.one_of(st.floats(-1.0, 2.0), st.just(math.nan))


@settings(max_examples=300, deadline=None)
@given(
    stream=st.lists(values, max_size=40),
    threshold=st.floats(0.0, 1.0),
    patience_steps=st.integers(1, 5),
    max_restores=st.integers(0, 3),
)
def test_warning_rule_counts_steps_in_a_row_above_the_threshold(stream, threshold, patience_steps, max_restores):
    config = GuardConfig(
        enable=True,
        warning_metric="actor/ppo_kl",
        warning_threshold=threshold,
        patience_steps=patience_steps,
        max_restores=max_restores,
    )
    state = GuardState(best_score=0.5, best_step=1)
    run, collapses = 0, 0
    for step, w in enumerate(stream, start=2):
        decision = observe_step(config, state, step, w)
        state = decision.state
        above = math.isnan(w) or w > threshold
        run = run + 1 if above else 0
        if run == patience_steps:
            collapses += 1
            run = 0
            expected = Action.STOP if collapses > max_restores else Action.RESTORE
            assert decision.action == expected and decision.reason.startswith("warning:")
            if expected == Action.STOP:
                break
        else:
            assert decision.action == Action.NONE
    assert state.restores == min(collapses, max_restores)


def test_warning_off_without_metric():
    decision = observe_step(GuardConfig(enable=True), GuardState(best_score=1.0, best_step=1), 2, math.inf)
    assert decision.action == Action.NONE and decision.state == GuardState(best_score=1.0, best_step=1)


def test_validation_score_is_the_mean_over_matching_sources():
    metrics = {
        "val-core/a/reward/mean@1": 0.5,
        "val-core/b/reward/mean@1": 0.25,
        "val-core/c/reward/mean@1": math.nan,
        "val-aux/a/reward/std@1": 9.0,
        "actor/pg_loss": 3.0,
    }
    assert validation_score(metrics, GuardConfig().val_metric) == pytest.approx(0.375)
    assert validation_score(metrics, "val-core/b/reward/mean@1") == 0.25
    assert validation_score(metrics, "val-core/zzz/*") is None


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("enable", "yes"),
        ("drop", 0.0),
        ("drop", 1.0),
        ("drop", math.nan),
        ("patience", 0),
        ("patience", 1.5),
        ("patience_steps", 0),
        ("backoff", 0.0),
        ("backoff", 1.5),
        ("backoff_target", "lr_and_tau"),
        ("max_restores", -1),
        ("val_metric", ""),
        ("warning_threshold", 0.1),
    ],
)
def test_bad_knob_fails_naming_it(knob, value):
    with pytest.raises(ValueError, match=rf"sorl\.guard\.{knob}"):
        guard_settings({"guard": {knob: value}})


def test_warning_metric_needs_a_threshold_and_unknown_keys_fail():
    with pytest.raises(ValueError, match=r"sorl\.guard\.warning_threshold is required"):
        guard_settings({"guard": {"warning_metric": "actor/ppo_kl"}})
    with pytest.raises(ValueError, match=r"sorl\.guard has unknown key\(s\) \['pateince'\]"):
        guard_settings({"guard": {"pateince": 2}})
    with pytest.raises(ValueError, match=r"sorl\.fault_injection\.until_step"):
        guard_settings({"fault_injection": {"lr_factor": 10.0, "from_step": 3, "until_step": 3}})
    with pytest.raises(ValueError, match=r"sorl\.fault_injection\.lr_factor"):
        guard_settings({"fault_injection": {"lr_factor": 0}})


def test_off_without_a_sorl_section_and_yaml_defaults_are_the_dataclass_defaults():
    guard, fault = guard_settings(None)
    assert not guard.enable and not fault.active
    yaml = OmegaConf.load(REPO / "recipe" / "sorl" / "config" / "sorl_trainer.yaml")
    sections = OmegaConf.to_container(yaml.sorl)
    assert guard_settings(sections) == (GuardConfig(), FaultInjection())
    assert set(sections["guard"]) == set(GuardConfig.__dataclass_fields__)
    assert set(sections["fault_injection"]) == set(FaultInjection.__dataclass_fields__)


@given(lr_factor=st.floats(0.01, 1e4), start=st.integers(1, 20), length=st.one_of(st.none(), st.integers(1, 20)))
def test_fault_window(lr_factor, start, length):
    fault = FaultInjection(lr_factor=lr_factor, from_step=start, until_step=None if length is None else start + length)
    for step in range(1, 50):
        inside = step >= start and (length is None or step < start + length)
        assert fault.factor(step) == (lr_factor if inside else 1.0)


def test_state_round_trips_through_json_and_metrics():
    config = GuardConfig(
        enable=True, rule="drop", drop=0.5, patience=1, warning_metric="actor/ppo_kl", warning_threshold=1.0
    )
    _, state = run_validations(config, [0.6, 0.1])
    again = GuardState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert again == state
    metrics = guard_metrics(config, state, collapsed=True, reason_kind="validation")
    assert metrics["sorl/guard/restores"] == 1.0 and metrics["sorl/guard/lr_scale"] == 0.5
    assert metrics["sorl/guard/collapse"] == 1.0 and metrics["sorl/guard/reason"] == 1.0
    assert metrics["sorl/guard/best_score"] == 0.6 and metrics["sorl/guard/warning_steps"] == 0.0


# ---------------------------------------------------------------- issue 46: the line for any sign, stderr rule


@pytest.mark.parametrize(("best", "score", "collapsed"), [
    (-0.5, -0.6, False),  # 0.1 below a best of -0.5 is less than 0.3 * |best| = 0.15
    (-0.5, -0.66, True),  # 0.16 below it is more
    (-0.5, -0.55, False),  # the old line (1 - drop) * best = -0.35 lay above the best and called this one
    (0.0, -0.2, True),  # best 0: the line is 0 itself (min_drop 0), so a negative score falls
    (0.0, 0.0, False),
])  # fmt: skip
def test_line_works_for_any_sign_of_the_best(best, score, collapsed):
    config = GuardConfig(enable=True, rule="drop", drop=0.3, patience=1)
    actions, _ = run_validations(config, [best, score])
    assert actions[1] == (Action.RESTORE if collapsed else Action.NONE)


@given(best=st.floats(1e-6, 1e6), drop=st.floats(0.01, 0.99))
def test_positive_bests_keep_the_studys_line_bit_for_bit(best, drop):
    from sorl_verl.trainer.guard_rule import collapse_line

    assert collapse_line(GuardConfig(enable=True, rule="drop", drop=drop), best) == (1.0 - drop) * best


def test_min_drop_floors_the_margin():
    config = GuardConfig(enable=True, rule="drop", drop=0.3, patience=1, min_drop=0.05)
    assert run_validations(config, [0.0, -0.04])[0][1] == Action.NONE
    assert run_validations(config, [0.0, -0.06])[0][1] == Action.RESTORE
    # a small positive best: 0.3 * 0.1 = 0.03 < 0.05, the floor sets the line at 0.05 below
    assert run_validations(config, [0.1, 0.06])[0][1] == Action.NONE
    assert run_validations(config, [0.1, 0.04])[0][1] == Action.RESTORE


def test_no_collapse_on_the_step_that_set_a_new_best():
    config = GuardConfig(enable=True, warning_metric="actor/ppo_kl", warning_threshold=0.1, patience_steps=1)
    state = observe_validation(config, GuardState(), 5, 0.6).state
    decision = observe_step(config, state, 5, 9.0)
    assert decision.action == Action.NONE and "new best" in decision.reason
    assert decision.state.warning_steps == 0 and decision.state.restores == 0
    assert observe_step(config, decision.state, 6, 9.0).action == Action.RESTORE


def se_metrics(source_stats: dict[str, tuple[float, int, float]]) -> dict[str, float]:
    """verl's per-source validation means plus the guard's per-source question counts and variances."""
    out = {}
    for src, (mean, n, var) in source_stats.items():
        out[f"val-core/{src}/reward/mean@1"] = mean
        out[f"val-aux/{src}/reward/questions"] = n
        out[f"val-aux/{src}/reward/question_var"] = var
    return out


def test_validation_standard_error_is_that_of_a_mean_over_sources():
    from sorl_verl.trainer.guard_rule import validation_se

    # one source, 0/1 scores: var p(1-p), SE sqrt(p(1-p)/n) = sqrt(0.25 * 0.75 / 300) = 0.025
    metrics = se_metrics({"nq": (0.25, 300, 0.25 * 0.75)})
    assert validation_se(metrics, GuardConfig().val_metric) == pytest.approx(0.025, rel=1e-12)
    # two sources averaged: SE = sqrt(var_a/n_a + var_b/n_b) / 2
    metrics = se_metrics({"a": (0.5, 100, 0.25), "b": (0.1, 25, 0.09)})
    assert validation_se(metrics, GuardConfig().val_metric) == pytest.approx(math.sqrt(0.0025 + 0.0036) / 2)
    with pytest.raises(ValueError, match=r"sorl\.guard\.rule=stderr.*val-aux/a/reward/questions"):
        validation_se({"val-core/a/reward/mean@1": 0.5}, GuardConfig().val_metric)


def test_stderr_rule_declares_a_drop_of_more_than_k_standard_errors():
    config = GuardConfig(enable=True, rule="stderr", stderr_k=2.0, patience=1)
    n = 300
    se = lambda p: math.sqrt(p * (1 - p) / n)  # noqa: E731
    state = observe_validation(config, GuardState(), 10, 0.30, se(0.30)).state
    assert state.best_se == se(0.30)
    # 0.25: best - v = 0.05 < 2 * sqrt(0.3*0.7/300 + 0.25*0.75/300) = 0.0729: noise
    assert observe_validation(config, state, 20, 0.25, se(0.25)).action == Action.NONE
    # 0.22: 0.08 > 2 * sqrt(0.21/300 + 0.1716/300) = 0.0714: a drop
    decision = observe_validation(config, state, 20, 0.22, se(0.22))
    assert decision.action == Action.RESTORE and "standard error" in decision.reason
    # the same scores on 30 questions are noise (2 SE = 0.226)
    small = observe_validation(config, GuardState(), 10, 0.30, math.sqrt(0.21 / 30)).state
    assert observe_validation(config, small, 20, 0.22, math.sqrt(0.1716 / 30)).action == Action.NONE
    # any sign: rewards in [-1, 0], best -0.2 (SE 0.02), score -0.3 (SE 0.03): 0.1 > 2 * 0.036
    neg = observe_validation(config, GuardState(), 10, -0.2, 0.02).state
    assert observe_validation(config, neg, 20, -0.3, 0.03).action == Action.RESTORE
    assert observe_validation(config, neg, 20, -0.25, 0.03).action == Action.NONE
    with pytest.raises(ValueError, match="needs the validation score's standard error"):
        observe_validation(config, neg, 20, -0.3)


def test_rule_knobs_fail_naming_them():
    for knob, value in (("rule", "sigma"), ("stderr_k", 0.0), ("min_drop", -0.1), ("shared_storage", "yes")):
        with pytest.raises(ValueError, match=rf"sorl\.guard\.{knob}"):
            guard_settings({"guard": {knob: value}})
