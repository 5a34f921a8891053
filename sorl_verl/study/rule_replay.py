"""Replay the collapse guard's validation rule on a finished run: the step at which it would first act.

Contract. :func:`replay` takes a run's validations, ``step -> metrics`` (every numeric ``val-*``
metric logged at that step, :attr:`~sorl_verl.study.metrics.Trace.val_metrics`), and a
:class:`~sorl_verl.trainer.guard_rule.GuardConfig`, and applies the guard's own rule functions to
them as the trainer does (``_guard_observe`` in sorl_verl/trainer/guard.py): from a fresh
``GuardState``, in step order, each validation of a step >= 1 (the one before training, step 0, is
not used by the guard) is scored by ``validation_score(metrics, config.val_metric)`` and, with
``rule: stderr``, given its standard error ``validation_se(metrics, config.val_metric)``, and fed to
``observe_validation``. The outcome, a :class:`Replay`, is one of

- **fired** at step ``s`` (``step``): the first validation at which the rule declares a collapse it
  acts on (``Action.RESTORE``; ``Action.STOP`` where ``max_restores`` is 0);
- **no fire** (``step`` None): none over the whole series;
- **censored at step N** (``censored_at``): with ``cut=N`` only the validations up to and including
  step N are replayed, and none of them fired;
- **cannot replay** (``cannot``, the reason; never a plain None): a validation the rule cannot read:
  no finite metric matches ``val_metric`` (the guard would stop there), or, with ``rule: stderr``, the
  run logged no question records (``val-aux/<source>/<var>/questions``, ``.../question_var``:
  :data:`NO_RECORDS`; the SORL trainers log them with every validation, before 2026-11-28 only with
  the guard on).

:func:`replay_run` replays a run's :class:`~sorl_verl.study.metrics.Trace` cut at the guard's first
restore when the run logged one (the first step at which ``sorl/guard/restores`` rose,
:func:`~sorl_verl.study.measures.restore_steps`): after it a guarded run's trajectory is no longer
its unguarded twin's. Up to its first restore a guarded run is that twin bit for bit, so the replay of
an unguarded run is the step at which a guarded run with the replayed rule would first restore (its
detection step), and a fire in a healthy run is a false restore. Only the validation half of the
rule is replayed: a config with a ``warning_metric`` is refused (``ValueError``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from sorl_verl.study.measures import GUARD_RESTORES, restore_steps
from sorl_verl.study.metrics import Trace, parse_val_key
from sorl_verl.trainer.guard_rule import (
    GUARD_PREFIX,
    QUESTIONS_METRIC,
    Action,
    GuardConfig,
    GuardState,
    guard_settings,
    observe_validation,
    validation_score,
    validation_se,
)

#: why rule ``stderr`` cannot be replayed on a run without the trainer's question records
NO_RECORDS = "no question records"


@dataclass(frozen=True)
class Replay:
    """A replay's outcome (module docstring): at most one of the three fields is set; none: no fire."""

    #: the step of the first fire
    step: int | None = None
    #: no fire up to and including this cut (a guarded run's first restore)
    censored_at: int | None = None
    #: why the rule cannot be replayed on the run
    cannot: str | None = None

    @property
    def fired(self) -> bool:
        return self.step is not None

    def text(self) -> str:
        if self.cannot is not None:
            return f"n/a ({self.cannot})"
        if self.step is not None:
            return f"step {self.step}"
        if self.censored_at is not None:
            return f"censored at step {self.censored_at}"
        return "no fire"


def replay(validations: Mapping[int, Mapping[str, Any]], config: GuardConfig, cut: int | None = None) -> Replay:
    """The first step at which the guard's rule under ``config`` acts on ``validations`` (step ->
    metrics), replayed up to and including step ``cut`` when given (module docstring)."""
    if config.warning_metric is not None:
        raise ValueError(
            f"{GUARD_PREFIX}.warning_metric={config.warning_metric!r}: only the validation rule can be replayed"
        )
    state = GuardState()
    for step in sorted(validations):
        if step < 1 or (cut is not None and step > cut):
            continue
        metrics = validations[step]
        score = validation_score(metrics, config.val_metric)
        if score is None:
            return Replay(cannot=f"no finite metric matches {config.val_metric} at step {step}")
        se = None
        if config.rule == "stderr":
            try:
                se = validation_se(metrics, config.val_metric)
            except ValueError:
                return Replay(cannot=NO_RECORDS)
        decision = observe_validation(config, state, step, score, se)
        if decision.action in (Action.RESTORE, Action.STOP):
            return Replay(step=step)
        state = decision.state
    return Replay(censored_at=cut)


def first_restore(trace: Trace) -> int | None:
    """The step of the guard's first restore in a run (None: the guard was off or never restored)."""
    steps = restore_steps(trace.series(GUARD_RESTORES))
    return steps[0] if steps else None


def replay_run(trace: Trace, config: GuardConfig) -> Replay:
    """:func:`replay` of a run's validations, cut at the guard's first restore when it logged one."""
    return replay(trace.val_metrics, config, cut=first_restore(trace))


def guard_config(overrides: Mapping[str, Any], **changes: Any) -> GuardConfig:
    """The ``GuardConfig`` of a grid algorithm's ``sorl.guard.*`` overrides (the guard's defaults for the
    rest), with ``changes`` applied; validated as the trainer validates it."""
    prefix = f"{GUARD_PREFIX}."
    section = {k.removeprefix(prefix): v for k, v in overrides.items() if k.startswith(prefix)}
    config, _ = guard_settings({"guard": section})
    return replace(config, **changes)


def validation_questions(metrics: Mapping[str, Any], pattern: str) -> int | None:
    """The questions a validation score averages: the sum over the validation means matching
    ``pattern`` of their source's ``QUESTIONS_METRIC``; None without the records."""
    total = 0
    for name in metrics:
        key = parse_val_key(name)
        if key is None or validation_score({name: metrics[name]}, pattern) is None:  # the rule's own match
            continue
        count = metrics.get(QUESTIONS_METRIC.format(source=key.source, var=key.var))
        if count is None:
            return None
        total += int(count)
    return total or None
