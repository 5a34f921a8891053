"""What a user cares about in one run: how much the agent learned, kept, and at what cost in episodes.

From the validation scores ``v_0, ..., v_m`` at steps ``s_0 = 0 < s_1 < ... < s_m`` (mean over data
sources; non-finite scores skipped), with ``E`` training episodes per step:

- ``gain = v_m - v_0`` (final) and ``peak_gain = max_j v_j - v_0``, reached first at ``peak_step``;
- ``auc_gain``: the area between the validation curve and ``v_0`` by the trapezoid rule, divided by
  ``s_m`` - the run's mean gain over its steps (a run that learns early and keeps it scores high, one
  that peaks late or loses its gain low);
- ``gain_per_1k_episodes = 1000 * gain / (E * s_m)`` and ``peak_gain_per_1k_episodes = 1000 *
  peak_gain / (E * peak_step)`` (sample efficiency; ``E = train_batch_size * rollout.n``);
- ``lost_gain``: the run *gained and then lost the gain*, fixed before the learning study's runs:
  ``peak_gain >= MIN_GAIN`` and ``gain < LOST_FRACTION * peak_gain``. This is the failure the regime
  search looks for (weaker than the collapse rule of :mod:`sorl_verl.study.collapse`, which asks for
  the score to fall below half of its peak itself).

With the collapse guard on (``sorl.guard.enable=true``, docs/guard.md), :func:`guard_measures` adds
``guard_restores`` (the last logged ``sorl/guard/restores``: the restores of the run, a resume
included) and ``guard_s`` (the sum of ``timing_s/sorl_guard`` over the steps: the guard's own
checkpoints of new bests and its restores); both are None for a run that logged neither (guard off),
and such a run's record carries neither key (:attr:`GuardMeasures.logged`). :func:`restore_steps` gives
the steps at which ``sorl/guard/restores`` rose (the plots mark them; the rule replay cuts a guarded
run at the first).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

#: a gain counts as one when the validation score rose at least this much over step 0 (one question
#: in 20 of the 300 the learning study validates on)
MIN_GAIN = 0.05
#: a run lost its gain when its final gain is below this fraction of its peak gain
LOST_FRACTION = 0.5

LOST_GAIN_RULE = (
    f"A run gained and then lost the gain if its peak validation gain over step 0 is at least {MIN_GAIN:g} "
    f"and its final gain is below {LOST_FRACTION:g} x that peak gain."
)


@dataclass(frozen=True)
class Measures:
    """The learning measures of one run (None where a run has fewer than two finite validations)."""

    gain: float | None
    peak_gain: float | None
    peak_step: int | None
    auc_gain: float | None
    episodes: int | None
    gain_per_1k_episodes: float | None
    peak_gain_per_1k_episodes: float | None
    lost_gain: bool | None

    def as_dict(self) -> dict[str, float | int | bool | None]:
        return asdict(self)


NONE = Measures(None, None, None, None, None, None, None, None)


def auc_gain(val_scores: Sequence[tuple[int, float]]) -> float | None:
    """Trapezoid area between the (finite) validation curve and its first score, over its step span."""
    pts = [(s, v) for s, v in val_scores if math.isfinite(v)]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    v0 = pts[0][1]
    area = sum((s1 - s0) * ((a - v0) + (b - v0)) / 2 for (s0, a), (s1, b) in zip(pts, pts[1:], strict=False))
    return area / (pts[-1][0] - pts[0][0])


def measures(val_scores: Sequence[tuple[int, float]], episodes_per_step: int | None) -> Measures:
    """The measures of one run from its ``(step, validation score)`` pairs, step 0 first."""
    pts = [(s, v) for s, v in val_scores if math.isfinite(v)]
    if len(pts) < 2:
        return NONE
    (s0, v0), (s_m, v_m) = pts[0], pts[-1]
    peak = max(v for _, v in pts)
    peak_step = next(s for s, v in pts if v == peak)
    gain, peak_gain = v_m - v0, peak - v0
    per_k = peak_per_k = episodes = None
    if episodes_per_step:
        episodes = episodes_per_step * (s_m - s0)
        per_k = 1000.0 * gain / episodes if episodes else None
        peak_per_k = 1000.0 * peak_gain / (episodes_per_step * (peak_step - s0)) if peak_step > s0 else 0.0
    # scores are means of fractions: a rise of exactly MIN_GAIN may come out a rounding error below it
    lost = peak_gain >= MIN_GAIN - 1e-9 and gain < LOST_FRACTION * peak_gain
    return Measures(gain, peak_gain, peak_step, auc_gain(pts), episodes, per_k, peak_per_k, lost)


#: the guard's metrics as verl's file logger writes them: copies of sorl_verl.trainer.guard_rule's
#: RESTORES_METRIC and SECONDS_METRIC, so that the study does not import torch (tied by a unit test)
GUARD_RESTORES = "sorl/guard/restores"
GUARD_SECONDS = "timing_s/sorl_guard"


@dataclass(frozen=True)
class GuardMeasures:
    """What the collapse guard did in one run (None where the run logged no guard metric)."""

    guard_restores: int | None
    guard_s: float | None

    @property
    def logged(self) -> bool:
        """True when the run logged a guard metric (the guard was on)."""
        return self.guard_restores is not None or self.guard_s is not None

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def restore_steps(restores: Iterable[tuple[int, float]]) -> list[int]:
    """The steps at which the ``(step, value)`` series of ``sorl/guard/restores`` rose (counted from 0
    before the first logged step; non-finite values skipped): the guard's restores, in step order."""
    steps, before = [], 0.0
    for step, count in sorted(restores):
        if math.isfinite(count) and count > before:
            steps.append(step)
        if math.isfinite(count):
            before = count
    return steps


def guard_measures(restores: Sequence[tuple[int, float]], seconds: Sequence[tuple[int, float]]) -> GuardMeasures:
    """From the ``(step, value)`` series of ``sorl/guard/restores`` and ``timing_s/sorl_guard``:
    the restores at the last step that logged them and the sum of the finite guard seconds."""
    finite_restores = [(s, v) for s, v in restores if math.isfinite(v)]
    finite_seconds = [v for _, v in seconds if math.isfinite(v)]
    return GuardMeasures(
        int(max(finite_restores, key=lambda sv: sv[0])[1]) if finite_restores else None,
        math.fsum(finite_seconds) if finite_seconds else None,
    )
