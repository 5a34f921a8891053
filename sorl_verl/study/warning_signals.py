"""Which logged signals warn of a validation drop, how early, and how often they cry wolf.

The rule, fixed before the learning study's runs:

- **Drop.** A run *dropped* when it collapsed (:mod:`sorl_verl.study.collapse`) or gained and then
  lost the gain (:mod:`sorl_verl.study.measures`). Its drop step is the collapse onset, or else the
  first validation after the peak whose gain over step 0 is below ``LOST_FRACTION`` of the peak
  gain. A run that did neither *held*.
- **Alarm.** For a signal ``x_t`` (one value per training step), the baseline ``b`` is its median
  over steps ``1..BASELINE_STEPS`` and ``m_t`` the mean of the last ``WINDOW`` steps. A signal that
  warns by rising (``up``) alarms at the first step ``t > BASELINE_STEPS`` with
  ``m_t > FACTOR * max(b, floor)``; one that warns by falling (``down``, the effective sample sizes)
  at the first with ``m_t < b / FACTOR``; a ``both`` signal at the first step with either.
- **Per-run floor.** ``floor`` is the sample standard deviation of the same run's values at steps
  ``1..BASELINE_STEPS`` (0 with fewer than two of them). It uses nothing but that run's own baseline,
  so a run's alarm does not depend on which other runs are analysed. (Until issue 46 the floor was
  ``0.1 x`` the median over the study's runs of each run's largest value: adding runs moved it and
  changed verdicts, ``||C(theta)||`` warned 5/12 -> 12/14 -> 7/17 as runs came in.) Why the spread:
  the floor exists so that a baseline near 0 (a clip fraction or KL on-policy) does not alarm on any
  rise; a share of the baseline median cannot do that (it is 0 too), while the spread is the run's
  own step-to-step noise, so a rise must bring the window mean past ``FACTOR`` baseline standard
  deviations above 0 before it counts; where the median exceeds the spread (most signals) the rule is
  ``FACTOR x median``, as before. A baseline that is exactly constant at 0 has no scale to judge a
  rise by and never alarms upward. A fall is judged against the median alone: a baseline of 0 cannot
  fall, and a noisy baseline should not make a fall easier to call.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

# VAL_SIZE_KEY: the cell override that sets a run's number of validation questions (the cell's
# ``val_max_samples``: its regime's, else the grid's)
from sorl_verl.study.grid import VAL_SIZE_KEY
from sorl_verl.study.measures import LOST_FRACTION, MIN_GAIN
from sorl_verl.study.metrics import Trace

BASELINE_STEPS = 5
WINDOW = 3
FACTOR = 2.0

#: the directions a signal warns in: by rising, by falling, or either
UP, DOWN, BOTH = "up", "down", "both"

#: signal name -> (metric key in verl's metrics file, direction)
SIGNALS: dict[str, tuple[str, str]] = {
    "||C(theta)||": ("actor/sorl/clip_bias_grad_norm", UP),
    "||C||": ("actor/sorl/clip_bias_norm", UP),
    "rho": ("actor/sorl/clip_bias_rel", UP),
    "ppo_kl": ("actor/ppo_kl", UP),
    "turn clipfrac": ("actor/sorl/turn_clipfrac", UP),
    "token clipfrac": ("actor/pg_clipfrac", UP),
    "ESS token": ("actor/sorl/ess_token", DOWN),
    "ESS turn": ("actor/sorl/ess_turn", DOWN),
    "entropy": ("actor/entropy", BOTH),
    "grad norm": ("actor/grad_norm", UP),
    "response length": ("response_length/mean", BOTH),
    "turns per episode": ("agent/turns_mean", BOTH),
}

#: the issue's rule for a signal to become an early trigger of the collapse guard: it warned before at
#: least this share of the drops ...
TRIGGER_MIN_WARNED = 0.8
#: ... with false alarms in at most this share of the runs that held
TRIGGER_MAX_FALSE = 0.2

#: standard errors of the fall rule (see the module docstring)
FALL_K = 2.0

RULE = (
    f"Drop: collapse onset, or the first validation after the peak below {LOST_FRACTION:g} x the peak gain "
    f"(runs that gained >= {MIN_GAIN:g} and lost it). Alarm: the first step after {BASELINE_STEPS} where the "
    f"mean of the last {WINDOW} steps exceeds {FACTOR:g} x max(baseline, floor) (signals that warn by falling, "
    f"the ESS: falls below baseline / {FACTOR:g}; entropy, response length, turns: either); baseline = median "
    f"over the run's steps 1-{BASELINE_STEPS}; floor = the standard deviation of the run's own steps "
    f"1-{BASELINE_STEPS} (per run: no run's alarm depends on the other runs). Warned: alarm at or before the "
    'drop; false alarm: alarm in a run that held. A signal no run logged is "not logged"; the counts of a '
    "signal are over the runs that log it."
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


def baseline_floor(base_values: Sequence[float]) -> float:
    """The per-run floor (module docstring): the sample standard deviation of the run's own baseline
    values, 0 with fewer than two."""
    return statistics.stdev(base_values) if len(base_values) >= 2 else 0.0


def alarm_step(series: Sequence[tuple[int, float]], direction: str = UP) -> int | None:
    """The first step at which the signal alarms in ``direction`` (:data:`UP`, :data:`DOWN` or
    :data:`BOTH`; module docstring), judged against this series' own baseline only; None if never."""
    if direction not in (UP, DOWN, BOTH):
        raise ValueError(f"direction must be {UP!r}, {DOWN!r} or {BOTH!r}, got {direction!r}")
    base_vals = [v for s, v in series if 1 <= s <= BASELINE_STEPS]
    if not base_vals:
        return None
    median = statistics.median(base_vals)
    high = FACTOR * max(median, baseline_floor(base_vals)) if direction != DOWN else math.inf
    low = median / FACTOR if direction != UP else -math.inf
    if not high > 0:  # a baseline constant at 0 (or below): no scale to judge a rise by
        high = math.inf
    values = [v for _, v in series]
    for i, (step, _) in enumerate(series):
        if step <= BASELINE_STEPS or i + 1 < WINDOW:
            continue
        m = sum(values[i + 1 - WINDOW : i + 1]) / WINDOW
        if m > high or m < low:
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


def score_signals(runs: Sequence[RunSignals]) -> list[SignalScore]:
    """One :class:`SignalScore` per signal of :data:`SIGNALS` that some run logs; each run's alarm is its
    own (:func:`alarm_step`), so a run's contribution does not change when other runs are added."""
    out = []
    for name, (_, direction) in SIGNALS.items():
        logged = [r for r in runs if r.series.get(name)]
        if not logged:
            continue
        dropped = [r for r in logged if r.drop is not None]
        held = [r for r in logged if r.drop is None]
        leads = []
        for r in dropped:
            a = alarm_step(r.series[name], direction)
            if a is not None and a <= r.drop:
                leads.append(r.drop - a)
        false_alarms = sum(alarm_step(r.series[name], direction) is not None for r in held)
        out.append(SignalScore(name, len(dropped), len(leads), tuple(leads), len(held), false_alarms))
    return out


def meets_trigger_rule(score: SignalScore) -> bool:
    """The issue's rule for an early trigger of the guard: warned before at least
    :data:`TRIGGER_MIN_WARNED` of the drops and false alarms in at most :data:`TRIGGER_MAX_FALSE` of the
    runs that held; False where either count is over no runs (nothing to judge by)."""
    if score.dropped_runs == 0 or score.held_runs == 0:
        return False
    warned = score.warned / score.dropped_runs
    false = score.false_alarms / score.held_runs
    return warned >= TRIGGER_MIN_WARNED - 1e-12 and false <= TRIGGER_MAX_FALSE + 1e-12


def markdown(scores: Sequence[SignalScore], runs: Sequence[RunSignals] = (), rule: str = "drop") -> str:
    """The warning table of docs/results.md (with the runs that dropped and where, when given), in the
    words of ``rule`` (a key of :data:`WORDS`). Every signal of :data:`SIGNALS` has a row, in that order:
    one that no run logged says "not logged" instead of a count. Below the table, the signals that meet
    the early-trigger rule (:func:`meets_trigger_rule`), or "none": a fact about this table, not the
    guard's setting (docs/results.md says which study decides it and what the guard uses)."""
    dropped_runs, held_runs, listed = WORDS[rule]
    lines = [f"| signal | warned / {dropped_runs} | median lead (steps) | false alarms / {held_runs} |",
             "| --- | ---: | ---: | ---: |"]  # fmt: skip
    by_name = {s.signal: s for s in scores}
    for name in [*SIGNALS, *(n for n in by_name if n not in SIGNALS)]:
        cell = name.replace("|", "\\|")  # a bare | in ||C|| would split the cell
        s = by_name.get(name)
        if s is None:
            lines.append(f"| {cell} | not logged | - | not logged |")
            continue
        d = s.as_dict()
        lead = "-" if d["median_lead_steps"] is None else f"{d['median_lead_steps']:g}"
        lines.append(f"| {cell} | {s.warned} / {s.dropped_runs} | {lead} | {s.false_alarms} / {s.held_runs} |")
    triggers = [s.signal for s in scores if meets_trigger_rule(s)]
    lines += ["", f"Within the early-trigger rule (warned >= {TRIGGER_MIN_WARNED:.0%} of the {dropped_runs}, false "
              f"alarms <= {TRIGGER_MAX_FALSE:.0%} of the {held_runs}): {', '.join(triggers) if triggers else 'none'}."]  # fmt: skip
    dropped = [f"{r.key} (step {r.drop})" for r in runs if r.drop is not None]
    if runs:
        lines += ["", f"{listed}: {', '.join(dropped) if dropped else 'none'} of {len(runs)} judged."]
    return "\n".join(lines) + "\n"
