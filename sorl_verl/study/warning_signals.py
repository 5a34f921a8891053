"""Which logged signals warn of a validation drop, how early, and how often they cry wolf.

The rule, fixed before the learning study's runs:

- **Drop.** A run *dropped* when it collapsed (:mod:`sorl_verl.study.collapse`) or gained and then
  lost the gain (:mod:`sorl_verl.study.measures`). Its drop step is the collapse onset, or else the
  first validation after the peak whose gain over step 0 is below ``LOST_FRACTION`` of the peak
  gain. A run that did neither *held*.
- **Alarm.** For a signal ``x_t`` (one value per training step), the baseline ``b`` is its median
  over steps ``1..BASELINE_STEPS`` and ``m_t`` the mean of the last ``WINDOW`` steps. The signal
  alarms at the first step ``t > BASELINE_STEPS`` with ``m_t > FACTOR * max(b, floor)`` (or, for the
  two-sided signals, also ``m_t < max(b, floor) / FACTOR``), where ``floor`` is ``FLOOR_SHARE`` of the
  median over the study's runs of the signal's largest value in each run (a scale of the signal
  itself, so that a baseline of 0, such as a clip fraction on-policy, does not alarm on any rise).
- **Scored.** An alarm warned of a drop when it came at or before the drop step (``lead = drop step
  - alarm step``); an alarm in a run that held is a false alarm.

A run that never gained (the no-learning stress study's runs) drops only by collapsing, so its drop
is its collapse onset. A signal that a run did not log leaves that run out of the signal's counts
(its ``n`` in ``k / n``), so a small ``n`` means "seldom logged", not "seldom warns".

A second analysis, **defined after seeing the learning study's runs** (the rule above stays the
primary one): runs that lost ground without first gaining ``MIN_GAIN`` count as held under the
rule above, though the guard's question is whether a signal rises before the score falls.

- **Fall below the best.** With ``best_j`` the highest validation score before validation ``j``
  (step 0 included) and ``n`` the run's number of validation questions, a run *fell* at the first
  ``j`` with ``best_j - v_j > FALL_K * sqrt(best_j (1 - best_j) / n + v_j (1 - v_j) / n)``: the
  difference exceeds ``FALL_K`` standard errors of a difference of two binomial means of ``n``
  questions each, taken as independent samples. That is an upper bound of the standard error here:
  both scores are on the same questions (positively correlated), and a mean over equal-sized data
  sources varies no more than the pooled binomial. A collapse onset, if earlier, is the drop step.
  Alarms are scored as above, with "fell" for "dropped" and "never fell" for "held".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from sorl_verl.study.measures import LOST_FRACTION, MIN_GAIN
from sorl_verl.study.metrics import Trace

BASELINE_STEPS = 5
WINDOW = 3
FACTOR = 2.0
FLOOR_SHARE = 0.1

#: signal name -> (metric key in verl's metrics file, two-sided)
SIGNALS: dict[str, tuple[str, bool]] = {
    "||C(theta)||": ("actor/sorl/clip_bias_grad_norm", False),
    "||C||": ("actor/sorl/clip_bias_norm", False),
    "rho": ("actor/sorl/clip_bias_rel", False),
    "ppo_kl": ("actor/ppo_kl", False),
    "turn clipfrac": ("actor/sorl/turn_clipfrac", False),
    "token clipfrac": ("actor/pg_clipfrac", False),
    "entropy": ("actor/entropy", True),
    "grad norm": ("actor/grad_norm", False),
    "response length": ("response_length/mean", True),
    "turns per episode": ("agent/turns_mean", True),
}

#: standard errors of the fall rule (see the module docstring)
FALL_K = 2.0
#: the cell override that sets a run's number of validation questions (``val_max_samples`` of a grid)
VAL_SIZE_KEY = "data.val_max_samples"

RULE = (
    f"Drop: collapse onset, or the first validation after the peak below {LOST_FRACTION:g} x the peak gain "
    f"(runs that gained >= {MIN_GAIN:g} and lost it). Alarm: the first step after {BASELINE_STEPS} where the "
    f"mean of the last {WINDOW} steps exceeds {FACTOR:g} x max(baseline, floor) (two-sided signals: or falls "
    f"below it / {FACTOR:g}); baseline = median over steps 1-{BASELINE_STEPS}; floor = {FLOOR_SHARE:g} x the "
    "median over runs of the signal's maximum. Warned: alarm at or before the drop; false alarm: alarm in a "
    "run that held."
)

FALL_RULE = (
    "Second analysis, defined after seeing the learning study's runs (the table above is the rule fixed "
    "before them). Fell: the first validation j whose score v_j is more than K standard errors below the best "
    "score before it, best_j - v_j > K sqrt(best_j (1 - best_j) / n + v_j (1 - v_j) / n), with step 0 a "
    f"candidate best, K = {FALL_K:g}, n the run's validation questions (independent-sample upper bound of the "
    "standard error of the difference), or the collapse onset if earlier. Alarm as above. Warned: alarm at or "
    "before the fall; false alarm: alarm in a run that never fell."
)

#: per rule, the table's words: (runs with a drop, runs without, the list of runs with a drop)
WORDS = {
    "drop": ("dropped runs", "runs that held", "Runs that dropped"),
    "fall": ("runs that fell", "runs that never fell", "Runs that fell"),
}


def drop_step(val_scores: Sequence[tuple[int, float]], collapse_onset: int | None) -> int | None:
    """The step of a run's drop (see the module docstring), or None when it held."""
    if collapse_onset is not None:
        return collapse_onset
    val_scores = [(s, v) for s, v in val_scores if math.isfinite(v)]
    if len(val_scores) < 2:
        return None
    v0 = val_scores[0][1]
    peak = max(v for _, v in val_scores)
    peak_gain = peak - v0
    final_gain = val_scores[-1][1] - v0
    if not (peak_gain >= MIN_GAIN - 1e-9 and final_gain < LOST_FRACTION * peak_gain):
        return None
    peak_step = next(s for s, v in val_scores if v == peak)
    return next(s for s, v in val_scores if s > peak_step and v - v0 < LOST_FRACTION * peak_gain)


def fall_step(
    val_scores: Sequence[tuple[int, float]], collapse_onset: int | None, n: int, k: float = FALL_K
) -> int | None:
    """The step of a run's fall below its best (second analysis of the module docstring), or None.

    ``val_scores``: (step, score in [0, 1]) in step order, non-finite scores skipped; ``n``: the
    number of validation questions behind each score; ``k``: standard errors (``FALL_K``).
    """
    if n < 1:
        raise ValueError(f"the number of validation questions must be >= 1, got {n}")
    finite = [(s, v) for s, v in val_scores if math.isfinite(v)]
    bad = [v for _, v in finite if not 0.0 <= v <= 1.0]
    if bad:
        raise ValueError(f"validation scores must lie in [0, 1] for the binomial error, got {bad[0]}")
    fell = None
    best = finite[0][1] if finite else 0.0
    for step, v in finite[1:]:
        if best - v > k * math.sqrt(best * (1 - best) / n + v * (1 - v) / n):
            fell = step
            break
        best = max(best, v)
    found = [s for s in (collapse_onset, fell) if s is not None]
    return min(found) if found else None


def validation_size(cell: Mapping[str, object]) -> int:
    """A run's number of validation questions, from its cell record's ``data.val_max_samples`` override
    (the number verl validates on when the validation set holds at least that many: the learning grid's
    300 is all of its questions); a record without it raises ``ValueError`` naming the cell."""
    overrides = cell.get("overrides")
    value = overrides.get(VAL_SIZE_KEY) if isinstance(overrides, Mapping) else None
    try:
        n = int(str(value))
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"{cell.get('key', 'a cell')}: its record has no {VAL_SIZE_KEY} override >= 1 (got {value!r}), "
            "so the fall rule cannot know how many validation questions a score averages"
        )
    return n


def alarm_step(series: Sequence[tuple[int, float]], floor: float, two_sided: bool) -> int | None:
    """The first step at which the signal alarms (see the module docstring), or None."""
    base_vals = [v for s, v in series if 1 <= s <= BASELINE_STEPS]
    if not base_vals:
        return None
    ref = max(statistics.median(base_vals), floor)
    if ref <= 0:
        return None
    values = [v for _, v in series]
    for i, (step, _) in enumerate(series):
        if step <= BASELINE_STEPS or i + 1 < WINDOW:
            continue
        m = sum(values[i + 1 - WINDOW : i + 1]) / WINDOW
        if m > FACTOR * ref or (two_sided and m < ref / FACTOR):
            return step
    return None


#: a drop rule: (validation scores, collapse onset or None) -> drop step or None
DropRule = Callable[[Sequence[tuple[int, float]], int | None], int | None]


@dataclass(frozen=True)
class RunSignals:
    """What the analysis needs of one run: its key, drop step (None: held) and signal series."""

    key: str
    drop: int | None
    series: Mapping[str, Sequence[tuple[int, float]]]


@dataclass(frozen=True)
class SignalScore:
    signal: str
    dropped_runs: int  # runs that dropped and log the signal
    warned: int  # of those, alarmed at or before the drop
    leads: tuple[int, ...]  # drop step - alarm step, per warned run
    held_runs: int  # runs that held and log the signal
    false_alarms: int

    def as_dict(self) -> dict[str, object]:
        lead = statistics.median(self.leads) if self.leads else None
        return {"signal": self.signal, "dropped_runs": self.dropped_runs, "warned": self.warned,
                "median_lead_steps": lead, "leads": list(self.leads), "held_runs": self.held_runs,
                "false_alarms": self.false_alarms}  # fmt: skip


def run_signals(run: Mapping[str, object], trace: Trace, drop: DropRule = drop_step) -> RunSignals:
    """A judged run of stability.json (:func:`sorl_verl.study.aggregate.run_record`) and its metrics;
    ``drop``: the rule giving the drop step from (validation scores, collapse onset or None)."""
    onset = run["onset_step"] if run["collapsed"] else None
    vals = [(int(s), float(v)) for s, v in run["val_scores"] if v is not None]  # type: ignore[union-attr]
    series = {name: trace.series(key) for name, (key, _) in SIGNALS.items()}
    key = f"{run['regime']}/{run['algorithm']}/seed{run['seed']}"
    return RunSignals(key, drop(vals, onset), {k: v for k, v in series.items() if v})  # type: ignore[arg-type]


def floors(runs: Iterable[RunSignals]) -> dict[str, float]:
    """Per signal, ``FLOOR_SHARE`` x the median over runs of the signal's largest value."""
    peaks: dict[str, list[float]] = {}
    for run in runs:
        for name, series in run.series.items():
            if series:
                peaks.setdefault(name, []).append(max(v for _, v in series))
    return {name: FLOOR_SHARE * statistics.median(vals) for name, vals in peaks.items()}


def score_signals(runs: Sequence[RunSignals]) -> list[SignalScore]:
    """One :class:`SignalScore` per signal of :data:`SIGNALS` that some run logs."""
    floor = floors(runs)
    out = []
    for name, (_, two_sided) in SIGNALS.items():
        logged = [r for r in runs if r.series.get(name)]
        if not logged:
            continue
        dropped = [r for r in logged if r.drop is not None]
        held = [r for r in logged if r.drop is None]
        leads = []
        for r in dropped:
            a = alarm_step(r.series[name], floor[name], two_sided)
            if a is not None and a <= r.drop:
                leads.append(r.drop - a)
        false_alarms = sum(alarm_step(r.series[name], floor[name], two_sided) is not None for r in held)
        out.append(SignalScore(name, len(dropped), len(leads), tuple(leads), len(held), false_alarms))
    return out


def markdown(scores: Sequence[SignalScore], runs: Sequence[RunSignals] = (), rule: str = "drop") -> str:
    """The warning table of docs/results.md (with the runs that dropped and where, when given), in the
    words of ``rule`` (a key of :data:`WORDS`)."""
    dropped_runs, held_runs, listed = WORDS[rule]
    lines = [f"| signal | warned / {dropped_runs} | median lead (steps) | false alarms / {held_runs} |",
             "| --- | ---: | ---: | ---: |"]  # fmt: skip
    for s in scores:
        d = s.as_dict()
        lead = "-" if d["median_lead_steps"] is None else f"{d['median_lead_steps']:g}"
        name = s.signal.replace("|", "\\|")  # a bare | in ||C|| would split the cell
        lines.append(f"| {name} | {s.warned} / {s.dropped_runs} | {lead} | {s.false_alarms} / {s.held_runs} |")
    dropped = [f"{r.key} (step {r.drop})" for r in runs if r.drop is not None]
    if runs:
        lines += ["", f"{listed}: {', '.join(dropped) if dropped else 'none'} of {len(runs)} judged."]
    return "\n".join(lines) + "\n"
