"""verl's metrics file (``trainer.logger=[..., file]``, ``$VERL_FILE_LOGGER_PATH``) as per-step series.

Each line is ``{"step": N, "data": {metric: value}}``. Training steps carry
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: task -> the data sources of its embedded default's validation rows
TASK_SOURCES = {
    "search_qa": re.compile(r"^synthetic_\d+hop$"),
    "medical_mcq": re.compile(r"^synthetic_med_[a-z][a-z_]*$"),
}
_VAL_CORE = re.compile(r"^val-core/(?P<source>.+)/(?P<var>[^/]+)/mean@(?P<n>\d+)$")
#: training metrics whose non-finite value means the run diverged (see collapse.py)
_DIVERGENCE = re.compile(r"^(actor|critic)/(.*loss.*|grad_norm)$")


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def validation_by_source(data: Mapping[str, object]) -> dict[str, float]:
    """data_source -> verl's core validation mean (largest ``@n`` when several) from one record."""
    best: dict[str, tuple[int, float]] = {}
    for key, value in data.items():
        m = _VAL_CORE.match(key)
        x = _number(value)
        if m is None or x is None:
            continue
        n = int(m.group("n"))
        if m.group("source") not in best or n > best[m.group("source")][0]:
            best[m.group("source")] = (n, x)
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
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("data"), dict):
            continue
        data, step = record["data"], record.get("step", 0)
        if not isinstance(step, int):
            continue
        by_source = validation_by_source(data)
        if by_source:
            trace.validations.append((step, by_source))
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
