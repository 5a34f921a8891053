"""verl's metrics file (``trainer.logger=[..., file]``, ``$VERL_FILE_LOGGER_PATH``): the project's one reader.

Each line is ``{"step": N, "data": {metric: value}}``; :func:`read_records` / :func:`records`
yield ``(step, data)`` per line and :func:`parse_val_key` splits a validation key
``val-<core|aux>/<data_source>/<var>/mean@<n>``. The study reads a file into a :class:`Trace`
(:func:`read_trace`); ``sorl-verl eval`` and ``sorl-verl plot`` read the same lines through
:func:`read_records`. Training steps carry
``training/global_step``; validations (before training and every ``trainer.test_freq`` steps)
carry ``val-core/<data_source>/<var>/mean@<n>`` (verl's core validation metric: ``<var>`` is
``acc`` when the reward function returns one, else ``reward``, the project's score: 1 for a
correct well-formed answer). The **validation score** of a validation is the unweighted mean
over data sources of that core metric (at the largest ``n``). The embedded defaults' validation
sources (:data:`TASK_SOURCES`): ``synthetic_{k}hop`` (k = 1, 2, 3) for ``search_qa``, so the
score is the mean over the hop counts; ``synthetic_med_<question type>`` (diagnosis, treatment,
..., treatment_contraindication) for ``medical_mcq``, the mean over the question types.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: task -> the data sources of its embedded default's validation rows
TASK_SOURCES = {
    "search_qa": re.compile(r"^synthetic_\d+hop$"),
    "medical_mcq": re.compile(r"^synthetic_med_[a-z][a-z_]*$"),
}
_VAL_KEY = re.compile(r"^val-(?P<kind>core|aux)/(?P<source>.+)/(?P<var>[^/]+)/mean@(?P<n>\d+)$")
#: training metrics whose non-finite value means the run diverged (see collapse.py)
_DIVERGENCE = re.compile(r"^(actor|critic)/(.*loss.*|grad_norm)$")


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


@dataclass(frozen=True)
class ValKey:
    """The parts of a validation key ``val-<kind>/<source>/<var>/mean@<n>``."""

    kind: str  #: ``core`` (verl's core metric) or ``aux``
    source: str  #: the data source (may itself contain ``/``)
    var: str  #: the reward function's variable: ``reward``, ``acc``, ``em``, ``f1``, ...
    n: int  #: samples per prompt the mean is over


def parse_val_key(key: str) -> ValKey | None:
    """:class:`ValKey` of a validation mean ``val-<core|aux>/<source>/<var>/mean@<n>``, else None."""
    m = _VAL_KEY.match(key)
    return None if m is None else ValKey(m["kind"], m["source"], m["var"], int(m["n"]))


def records(lines: Iterable[str], name: str = "<metrics>", strict: bool = False) -> Iterator[tuple[int, dict]]:
    """``(step, data)`` of each ``{"step": N, "data": {...}}`` line, in order.

    Blank lines, JSON that is not such an object, and a step that is not an integer are skipped.
    A line that is not JSON is skipped too (a run still writing leaves a partial last line), or,
    with ``strict``, raises ``ValueError("<name>:<line>: not JSON (...)")``.
    """
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if strict:
                raise ValueError(f"{name}:{line_no}: not JSON ({exc.msg})") from None
            continue
        if not isinstance(record, dict) or not isinstance(record.get("data"), dict):
            continue
        step = record.get("step", 0)
        if isinstance(step, int) and not isinstance(step, bool):
            yield step, record["data"]


def read_records(path: str | Path, strict: bool = False) -> Iterator[tuple[int, dict]]:
    """:func:`records` of a metrics file (undecodable bytes replaced)."""
    p = Path(path)
    with p.open(errors="replace") as fh:
        yield from records(fh, str(p), strict)


def validation_by_source(data: Mapping[str, object]) -> dict[str, float]:
    """data_source -> verl's core validation mean (largest ``@n`` when several) from one record."""
    best: dict[str, tuple[int, float]] = {}
    for key, value in data.items():
        k = parse_val_key(key)
        x = _number(value)
        if k is None or k.kind != "core" or x is None:
            continue
        if k.source not in best or k.n > best[k.source][0]:
            best[k.source] = (k.n, x)
    return {source: x for source, (_, x) in sorted(best.items())}


def source_task(source: str) -> str | None:
    """The task whose embedded default validates on ``source`` (None for any other data source)."""
    return next((task for task, pattern in TASK_SOURCES.items() if pattern.match(source)), None)


@dataclass
class Trace:
    """One run's metrics: training series and validations, in step order."""

    #: step -> metric -> value, for every training step logged
    train: dict[int, dict[str, float]] = field(default_factory=dict)
    #: (step, data_source -> score) for every validation logged
    validations: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    #: step -> every numeric ``val-*`` metric logged at that step (verl's means, the SORL trainers'
    #: question records): what the guard's rule reads, replayed by :mod:`sorl_verl.study.rule_replay`
    val_metrics: dict[int, dict[str, float]] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        """The last training step logged (0 when none)."""
        return max(self.train, default=0)

    @property
    def val_scores(self) -> list[tuple[int, float]]:
        """(step, mean over data sources) per validation; the validation score of the study."""
        return [(s, sum(v.values()) / len(v)) for s, v in self.validations if v]

    @property
    def task(self) -> str | None:
        """The task of every validation source logged, when they all belong to one embedded default (else None)."""
        tasks = {source_task(src) for _, v in self.validations for src in v}
        return tasks.pop() if len(tasks) == 1 else None

    def series(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of a training metric, steps ascending."""
        return [(s, m[key]) for s, m in sorted(self.train.items()) if key in m]

    def first_nonfinite(self) -> tuple[int, str] | None:
        """(step, key) of the first NaN/inf actor/critic loss or grad norm, or None."""
        for step in sorted(self.train):
            for key, value in sorted(self.train[step].items()):
                if _DIVERGENCE.match(key) and not math.isfinite(value):
                    return step, key
        return None


def parse_records(lines: list[str]) -> Trace:
    """A :class:`Trace` from metrics-file lines; a partly written or foreign line is skipped."""
    trace = Trace()
    for step, data in records(lines):
        by_source = validation_by_source(data)
        if by_source:
            trace.validations.append((step, by_source))
        val = {k: x for k, v in data.items() if k.startswith("val-") and (x := _number(v)) is not None}
        if val:
            trace.val_metrics.setdefault(step, {}).update(val)
        if "training/global_step" in data or "timing_s/step" in data:
            numbers = {k: x for k, v in data.items() if not k.startswith("val-") and (x := _number(v)) is not None}
            trace.train.setdefault(step, {}).update(numbers)
    trace.validations.sort(key=lambda sv: sv[0])
    return trace


def read_trace(path: str | Path) -> Trace:
    """:func:`parse_records` of a metrics file (an empty trace when the file does not exist)."""
    p = Path(path)
    if not p.exists():
        return Trace()
    return parse_records(p.read_text(errors="replace").splitlines())
