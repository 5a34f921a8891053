"""The collapse guard's settings and its detection rule (pure Python, no verl, no torch).

With ``v_j`` the validation score at the ``j``-th validation (the mean of the validation metrics
that match ``val_metric``, by default verl's ``val-core/<source>/reward/mean@N`` over the data
sources) and ``b_j = max(v_i : i <= j)`` the best score so far (a validation that sets a new best
gets a checkpoint), validation ``i`` is **low** when ``v_i < b_i - m_i`` with the margin

    rule ``drop``:               m = max(drop * |b|, min_drop)
    rule ``stderr`` (default):   m = max(stderr_k * sqrt(se(b)^2 + se(v)^2), min_drop)

``se(v)`` is the standard error of the score, ``sqrt(sum_s var_s / n_s) / S`` over its ``S``
matched sources, ``n_s`` the source's validation questions and ``var_s`` the variance of their
per-question scores (``p (1 - p)`` for 0/1 scores: the binomial of results.md's second analysis);
the trainer logs both per source (:func:`validation_se`). Both margins work for any sign of the
score; for a positive best and ``min_drop = 0`` the ``drop`` line is ``(1 - drop) * b`` computed
as before, bit for bit (:func:`collapse_line`). A **collapse** is declared at validation ``j`` when
each of the last ``patience`` validations is low (consecutive; a validation on or above the line,
or a new best, resets the count), or, when a ``warning_metric`` ``w`` is named, at training step
``t`` when

    not (w_s <= warning_threshold)   for each of the last ``patience_steps`` steps s = t - patience_steps + 1 .. t

(a non-finite ``w_s`` counts as above the threshold). A collapse before any best exists, or at the
step whose validation set the best (it would restore the checkpoint just taken), is not acted on.
On a collapse the guard restores the best checkpoint and multiplies the learning rate (or
``clip_norm_tau``) scale by ``backoff``; after ``max_restores`` restores the next collapse stops the
run. Non-finite validation scores are skipped.

:func:`observe_validation` and :func:`observe_step` are the rule; :class:`GuardState` is all it
remembers (saved with every checkpoint, so it survives a kill and a resume).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

#: where the knobs live in the trainer config
GUARD_PREFIX = "sorl.guard"
FAULT_PREFIX = "sorl.fault_injection"
BACKOFF_TARGETS = ("lr", "clip_norm_tau")
#: the validation rule's margins (module docstring)
RULES = ("drop", "stderr")
#: per-source validation records the trainer adds beside verl's ``val-core/<source>/<var>/...``
QUESTIONS_METRIC = "val-aux/{source}/{var}/questions"
QUESTION_VAR_METRIC = "val-aux/{source}/{var}/question_var"


def _number(prefix: str, name: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = ("(" if low_open else "[") + f"{low:g}", f"{high:g}" + (")" if high_open else "]")
        raise ValueError(f"{prefix}.{name}={value!r} is invalid: it must be a finite number in {lo}, {hi}")
    return float(value)


def _integer(prefix: str, name: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{prefix}.{name}={value!r} is invalid: it must be an integer >= {low}")
    return value


def _boolean(prefix: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{prefix}.{name}={value!r} is invalid: it must be true or false")
    return value


@dataclass(frozen=True)
class GuardConfig:
    """``sorl.guard``: every knob with its default (docs/guard.md). Validated on construction."""

    enable: bool = False
    val_metric: str = "val-core/*/reward/mean@*"
    drop: float = 0.3
    patience: int = 2
    warning_metric: str | None = None
    warning_threshold: float | None = None
    patience_steps: int = 3
    backoff: float = 0.5
    backoff_target: str = "lr"
    max_restores: int = 3
    #: ``drop`` until natural.yaml's question 5 (docs/results/natural_rules.md) decided for ``stderr``;
    #: what was fixed before that (presets.yaml's guarded arms, the recipes' GUARD=1) says ``drop``
    rule: str = "stderr"
    stderr_k: float = 2.0
    min_drop: float = 0.0
    shared_storage: bool = False

    def __post_init__(self) -> None:
        p = GUARD_PREFIX
        _boolean(p, "enable", self.enable)
        if not isinstance(self.val_metric, str) or not self.val_metric:
            raise ValueError(f"{p}.val_metric={self.val_metric!r} is invalid: it must be a metric name or pattern")
        _number(p, "drop", self.drop, 0.0, 1.0, low_open=True, high_open=True)
        _integer(p, "patience", self.patience, 1)
        _integer(p, "patience_steps", self.patience_steps, 1)
        _number(p, "backoff", self.backoff, 0.0, 1.0, low_open=True, high_open=False)
        _integer(p, "max_restores", self.max_restores, 0)
        if self.rule not in RULES:
            raise ValueError(f"{p}.rule={self.rule!r} is invalid: it must be one of {RULES}")
        _number(p, "stderr_k", self.stderr_k, 0.0, math.inf, low_open=True, high_open=True)
        _number(p, "min_drop", self.min_drop, 0.0, math.inf, low_open=False, high_open=True)
        _boolean(p, "shared_storage", self.shared_storage)
        if self.backoff_target not in BACKOFF_TARGETS:
            raise ValueError(
                f"{p}.backoff_target={self.backoff_target!r} is invalid: it must be one of {BACKOFF_TARGETS}"
            )
        if self.warning_metric is not None:
            if not isinstance(self.warning_metric, str) or not self.warning_metric:
                raise ValueError(f"{p}.warning_metric={self.warning_metric!r} is invalid: a metric name or null")
            if self.warning_threshold is None:
                raise ValueError(f"{p}.warning_threshold is required when {p}.warning_metric is set")
            _number(p, "warning_threshold", self.warning_threshold, -math.inf, math.inf, low_open=True, high_open=True)
        elif self.warning_threshold is not None:
            raise ValueError(f"{p}.warning_threshold={self.warning_threshold!r} is set but {p}.warning_metric is null")


@dataclass(frozen=True)
class FaultInjection:
    """``sorl.fault_injection``: the learning rate times ``lr_factor`` on steps ``from_step <= t < until_step``.

    A test hook that forces a collapse (``until_step`` null: to the end of the run); inert with
    ``lr_factor = 1``. It works with the guard on or off.
    """

    lr_factor: float = 1.0
    from_step: int = 1
    until_step: int | None = None

    def __post_init__(self) -> None:
        p = FAULT_PREFIX
        _number(p, "lr_factor", self.lr_factor, 0.0, math.inf, low_open=True, high_open=True)
        _integer(p, "from_step", self.from_step, 1)
        if self.until_step is not None:
            _integer(p, "until_step", self.until_step, self.from_step + 1)

    @property
    def active(self) -> bool:
        return self.lr_factor != 1.0

    def factor(self, step: int) -> float:
        """The learning-rate factor of training step ``step``."""
        inside = step >= self.from_step and (self.until_step is None or step < self.until_step)
        return self.lr_factor if inside else 1.0


def _from_section(cls: type, prefix: str, section: Mapping[str, Any] | None) -> Any:
    section = dict(section or {})
    unknown = sorted(set(section) - set(cls.__dataclass_fields__))
    if unknown:
        known = ", ".join(cls.__dataclass_fields__)
        raise ValueError(f"{prefix} has unknown key(s) {unknown}; known: {known}")
    return cls(**section)


def guard_settings(sorl_section: Mapping[str, Any] | None) -> tuple[GuardConfig, FaultInjection]:
    """``(GuardConfig, FaultInjection)`` from the config's ``sorl`` section (plain dicts); defaults where absent."""
    sorl_section = sorl_section or {}
    return (
        _from_section(GuardConfig, GUARD_PREFIX, sorl_section.get("guard")),
        _from_section(FaultInjection, FAULT_PREFIX, sorl_section.get("fault_injection")),
    )


def validation_score(metrics: Mapping[str, Any], pattern: str) -> float | None:
    """Mean of the finite metrics whose name matches ``pattern`` (fnmatch; an exact name matches
    itself); ``None`` when no metric matches or none of the matches is finite."""
    values = [float(v) for k, v in metrics.items() if fnmatch.fnmatchcase(k, pattern) and _is_number(v)]
    values = [v for v in values if math.isfinite(v)]
    return math.fsum(values) / len(values) if values else None


def validation_se(metrics: Mapping[str, Any], pattern: str) -> float | None:
    """Standard error of :func:`validation_score`: ``sqrt(sum_s var_s / n_s) / S`` over the ``S`` finite
    matched metrics ``val-<sec>/<source>/<var>/<stat>``, from the trainer's ``QUESTIONS_METRIC`` and
    ``QUESTION_VAR_METRIC`` of that source and variable; ``None`` when nothing matches. A matched
    metric without its records raises ``ValueError`` naming the rule."""
    total, count = 0.0, 0
    for name, value in metrics.items():
        if not (fnmatch.fnmatchcase(name, pattern) and _is_number(value) and math.isfinite(float(value))):
            continue
        keys = _record_keys(metrics, name)
        if not all(k in metrics for k in keys):
            raise ValueError(
                f"{GUARD_PREFIX}.rule=stderr needs the number of validation questions and their variance for "
                f"{name!r} ({keys[0]}, logged by the SORL trainers), but they are missing; "
                f"use {GUARD_PREFIX}.rule=drop or a val_metric of the form val-core/<source>/<var>/<stat>"
            )
        n, var = float(metrics[keys[0]]), float(metrics[keys[1]])
        total += var / n if n > 0 else math.inf
        count += 1
    return math.sqrt(total) / count if count else None


def can_have_records(val_metric: str) -> bool:
    """Whether ``val_metric`` can match a metric with question records (rule ``stderr``): a pattern with a
    wildcard can; an exact name must be ``val-core/<source>/<var>/<stat>`` (or ``val-aux/...``)."""
    if any(c in val_metric for c in "*?["):
        return True
    parts = val_metric.split("/")
    return len(parts) >= 4 and parts[0] in ("val-core", "val-aux") and all(parts)


def _record_keys(metrics: Mapping[str, Any], name: str) -> list[str]:
    """The question records of validation metric ``name`` = ``val-<sec>/<source>/<var>/<stat>``. verl
    writes the data source as it is, so it may hold slashes (``openai/gsm8k``): every split of ``name``
    into a source, a variable and a statistic is tried and the first with both records in ``metrics``
    wins; without one, the split at the first slashes (the keys a missing-records error names)."""
    parts = name.split("/")
    splits = [("/".join(parts[1:i]), parts[i]) for i in range(2, len(parts) - 1)] or [("?", "?")]
    candidates = [
        [QUESTIONS_METRIC.format(source=source, var=var), QUESTION_VAR_METRIC.format(source=source, var=var)]
        for source, var in splits
    ]
    return next((keys for keys in candidates if all(k in metrics for k in keys)), candidates[0])


def question_records(
    data_sources: Sequence[Any], sample_uids: Sequence[Any], variables: Mapping[str, Sequence[Any]]
) -> dict[str, float]:
    """``QUESTIONS_METRIC`` (``n_s``: distinct questions of source ``s``) and ``QUESTION_VAR_METRIC``
    (``var_s = (1/n_s) sum_q (x_q - mean_s)^2``, ``x_q`` the mean of question ``q``'s samples) for
    every variable of verl's validation whose values are all finite numbers (one value per sample)."""
    out: dict[str, float] = {}
    for var, values in variables.items():
        values = list(values)
        if len(values) != len(data_sources) or not all(_is_finite_number(v) for v in values):
            continue
        groups: dict[tuple[str, str], list[float]] = {}
        for source, uid, value in zip(data_sources, sample_uids, values, strict=True):
            groups.setdefault((str(source), str(uid)), []).append(float(value))
        per_source: dict[str, list[float]] = {}
        for (source, _uid), samples in groups.items():
            per_source.setdefault(source, []).append(math.fsum(samples) / len(samples))
        for source, means in per_source.items():
            mean = math.fsum(means) / len(means)
            out[QUESTIONS_METRIC.format(source=source, var=var)] = float(len(means))
            spread = math.fsum((x - mean) ** 2 for x in means)
            out[QUESTION_VAR_METRIC.format(source=source, var=var)] = spread / len(means)
    return out


def _is_finite_number(value: Any) -> bool:
    """A finite real (Python, numpy or 0-d tensor scalar, bools included); never a string."""
    if isinstance(value, str | bytes):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, bool | str)


class Action(str, Enum):
    """What the trainer must do after an observation."""

    NONE = "none"
    NEW_BEST = "new_best"  # keep a checkpoint of the current weights as the best
    RESTORE = "restore"  # collapse: restore the best checkpoint and back off
    STOP = "stop"  # collapse after max_restores restores: stop the run


#: numeric code of the reason of a collapse, logged as sorl/guard/reason
REASON_CODES = {"": 0, "validation": 1, "warning": 2}
#: the step metrics the study reads (sorl_verl/study/measures.py keeps torch-free copies, tied by a test)
RESTORES_METRIC = "sorl/guard/restores"
SECONDS_METRIC = "timing_s/sorl_guard"


@dataclass(frozen=True)
class GuardState:
    """All the rule remembers; plain data (JSON round trip with :meth:`to_dict` / :meth:`from_dict`)."""

    best_score: float | None = None
    best_step: int | None = None
    low_validations: int = 0
    warning_steps: int = 0
    restores: int = 0
    best_se: float | None = None
    lr_scale: float = 1.0
    tau_scale: float = 1.0
    last_reason: str = ""
    history: tuple[dict[str, Any], ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["history"] = list(self.history)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GuardState:
        data = dict(data)
        data["history"] = tuple(data.get("history", ()))
        return cls(**data)


@dataclass(frozen=True)
class Decision:
    action: Action
    state: GuardState
    reason: str = ""


def _collapse(config: GuardConfig, state: GuardState, step: int, kind: str, detail: str) -> Decision:
    """A declared collapse: restore (and back off) unless max_restores is spent; no best, no action."""
    if state.best_step is None:
        return Decision(
            Action.NONE, state, f"{kind} collapse at step {step} ignored: no best checkpoint yet ({detail})"
        )
    if state.best_step == step:  # the checkpoint just taken is this step's: restoring it undoes nothing
        return Decision(
            Action.NONE,
            replace(state, low_validations=0, warning_steps=0),
            f"{kind} collapse at step {step} ignored: this step's validation set the new best ({detail})",
        )
    reason = f"{kind}: {detail}"
    if state.restores >= config.max_restores:
        return Decision(Action.STOP, replace(state, last_reason=reason), reason)
    lr_scale, tau_scale = state.lr_scale, state.tau_scale
    if config.backoff_target == "lr":
        lr_scale *= config.backoff
    else:
        tau_scale *= config.backoff
    event = {"step": step, "kind": kind, "reason": reason, "restored_step": state.best_step}
    restored = replace(
        state,
        low_validations=0,
        warning_steps=0,
        restores=state.restores + 1,
        lr_scale=lr_scale,
        tau_scale=tau_scale,
        last_reason=reason,
        history=(*state.history, event),
    )
    return Decision(Action.RESTORE, restored, reason)


def collapse_line(config: GuardConfig, best: float, best_se: float | None = None, se: float | None = None) -> float:
    """``b - m`` with the rule's margin ``m`` (module docstring). Rule ``drop`` with a positive best and
    a margin of ``drop * b`` returns ``(1 - drop) * b`` itself, the line of the study's guarded runs."""
    if config.rule == "stderr":
        if best_se is None or se is None:
            raise ValueError(
                f"{GUARD_PREFIX}.rule=stderr needs the validation score's standard error (best {best_se}, score {se})"
            )
        return best - max(config.stderr_k * math.sqrt(best_se**2 + se**2), config.min_drop)
    margin = config.drop * abs(best)
    if best > 0 and margin >= config.min_drop:
        return (1.0 - config.drop) * best
    return best - max(margin, config.min_drop)


def observe_validation(
    config: GuardConfig, state: GuardState, step: int, score: float, se: float | None = None
) -> Decision:
    """Apply the validation half of the rule (module docstring) to the score ``score`` of step ``step``;
    ``se``: its standard error (rule ``stderr``)."""
    if not math.isfinite(score):
        return Decision(Action.NONE, state, f"non-finite validation score {score} skipped")
    if state.best_score is None or score > state.best_score:
        best = replace(state, best_score=score, best_step=step, best_se=se, low_validations=0)
        return Decision(Action.NEW_BEST, best)
    line = collapse_line(config, state.best_score, state.best_se, se)
    if not score < line:
        return Decision(Action.NONE, replace(state, low_validations=0))
    low = state.low_validations + 1
    state = replace(state, low_validations=low)
    if low < config.patience:
        return Decision(Action.NONE, state)
    how = (
        f"best - {config.stderr_k:g} standard errors (min_drop {config.min_drop:g})"
        if config.rule == "stderr"
        else f"best - max(drop * |best|, min_drop {config.min_drop:g})"
    )
    detail = (
        f"validation score {score:.4g} < {how} = {line:.4g} (best {state.best_score:.4g} at step "
        f"{state.best_step}) for {low} validation(s), patience {config.patience}"
    )
    return _collapse(config, state, step, "validation", detail)


def observe_step(config: GuardConfig, state: GuardState, step: int, value: float) -> Decision:
    """Apply the warning half of the rule to ``warning_metric``'s value ``value`` at step ``step``."""
    if config.warning_metric is None:
        return Decision(Action.NONE, state)
    above = not (value <= config.warning_threshold)  # NaN counts as above
    count = state.warning_steps + 1 if above else 0
    state = replace(state, warning_steps=count)
    if count < config.patience_steps:
        return Decision(Action.NONE, state)
    detail = (
        f"{config.warning_metric} = {value:.4g} > {config.warning_threshold:.4g} for {count} step(s), "
        f"patience_steps {config.patience_steps}"
    )
    return _collapse(config, state, step, "warning", detail)


def guard_metrics(config: GuardConfig, state: GuardState, collapsed: bool, reason_kind: str = "") -> dict[str, float]:
    """The ``sorl/guard/*`` metrics of a step (docs/guard.md)."""
    metrics = {
        RESTORES_METRIC: float(state.restores),
        "sorl/guard/lr_scale": float(state.lr_scale),
        "sorl/guard/low_validations": float(state.low_validations),
        "sorl/guard/collapse": 1.0 if collapsed else 0.0,
        "sorl/guard/reason": float(REASON_CODES[reason_kind]),
    }
    if config.backoff_target == "clip_norm_tau":
        metrics["sorl/guard/clip_norm_tau_scale"] = float(state.tau_scale)
    if state.best_score is not None:
        metrics["sorl/guard/best_score"] = float(state.best_score)
        metrics["sorl/guard/best_step"] = float(state.best_step)
    if config.warning_metric is not None:
        metrics["sorl/guard/warning_steps"] = float(state.warning_steps)
    return metrics
