"""The guard's validation rules replayed on a study's runs: ``<name>_rules.md`` (issue 46, deliverable 4).

Written by ``aggregate`` for a grid with ``guard_controls`` (:func:`write_rule_table`). Two rules are
replayed on every run (:mod:`~sorl_verl.study.rule_replay`), both with the settings of the grid's
:data:`~sorl_verl.study.guard_table.RULE_GUARDED` algorithm (its ``sorl.guard.*`` overrides,
presets.yaml; the guard's defaults for the rest):

- ``drop``: that algorithm's rule as it ran (natural.yaml: drop 0.3, patience 1);
- ``stderr``: the same with ``rule: stderr`` and the guard's default ``stderr_k``.

The validation score is the study's (:attr:`~sorl_verl.study.metrics.Trace.val_scores`: verl's
``val-core/<source>/<var>/mean@N``): the algorithm's ``val_metric`` where it matches the run's
validations, else ``val-core/*/<var>/mean@*`` with the run's core variable (``acc`` where the reward
function returns one, e.g. ``partial_credit``), the ``val_metric`` a guarded run there would need.

One row per run (every arm, guarded or not): the regime's role (a control of ``guard_controls``, or its
admission by :func:`~sorl_verl.study.guard_table.admission`; a protocol twin, a regime with
``protocol_of``, takes its base regime's role (:meth:`~sorl_verl.study.grid.Grid.base_regime`), shown
as ``admitted (protocol_of <base>)``: question 5 counts fires per role and protocol), the validation
protocol (``test_freq`` from the run's overrides, and the questions a validation averages: from the
run's question records, else the ``data.val_max_samples`` override), the guard's own first restore
(guarded runs), each rule's :class:`~sorl_verl.study.rule_replay.Replay`, and the share of the wall
time spent validating (:func:`~sorl_verl.study.guard_table.run_timing`, the guard table's measure).
Under it, per regime and algorithm and rule: the runs that fired and their mean step (false restores in
a control regime, detections elsewhere), with censored and unreplayable runs counted apart.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sorl_verl.study.guard_table import RULE_GUARDED, admission, run_timing, share
from sorl_verl.study.measures import GUARD_RESTORES
from sorl_verl.study.metrics import Trace, parse_val_key
from sorl_verl.study.rule_replay import Replay, first_restore, guard_config, replay_run, validation_questions
from sorl_verl.study.warning_signals import validation_size
from sorl_verl.trainer.guard_rule import GuardConfig, validation_score

#: the replayed rules, in column order
RULES = ("drop", "stderr")
CONTROL = "control"


def rule_configs(algorithms: Mapping[str, Any]) -> dict[str, GuardConfig]:
    """``drop`` and ``stderr`` (module docstring) from the grid's :data:`RULE_GUARDED` entry."""
    if RULE_GUARDED not in algorithms:
        raise ValueError(f"the grid has no {RULE_GUARDED} algorithm, whose guard settings the rule table replays")
    base = guard_config(algorithms[RULE_GUARDED].overrides)
    return {"drop": replace(base, rule="drop"), "stderr": replace(base, rule="stderr", stderr_k=GuardConfig.stderr_k)}


def rule_name(config: GuardConfig) -> str:
    """The rule and its settings in a few words."""
    what = f"stderr k {config.stderr_k:g}" if config.rule == "stderr" else f"drop {config.drop:g}"
    floor = f", min_drop {config.min_drop:g}" if config.min_drop else ""
    return f"{what}, patience {config.patience}{floor}"


def score_pattern(trace: Trace, pattern: str) -> str:
    """``pattern`` where it scores the run's validations, else ``val-core/*/<var>/mean@*`` with the run's
    core variable (module docstring)."""
    validations = [m for s, m in sorted(trace.val_metrics.items()) if s >= 1]
    if not validations or validation_score(validations[0], pattern) is not None:
        return pattern
    core = sorted({k.var for name in validations[0] if (k := parse_val_key(name)) is not None and k.kind == "core"})
    return f"val-core/*/{core[0]}/mean@*" if len(core) == 1 else pattern


@dataclass(frozen=True)
class RuleRow:
    """One run of the table."""

    regime: str
    algorithm: str
    seed: int
    role: str
    test_freq: str
    questions: str
    restored: str
    replays: Mapping[str, Replay]
    validation_share: float | None


def _questions(rec: Mapping[str, Any], trace: Trace, pattern: str) -> str:
    for step, metrics in sorted(trace.val_metrics.items()):
        if step >= 1 and (n := validation_questions(metrics, pattern)) is not None:
            return str(n)
    try:
        return f"{validation_size(rec)} (val_max_samples)"
    except ValueError:
        return "?"


def roles(grid: Any, runs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """regime -> ``control`` or its admission status (the grid's planned cells decide what is missing);
    a protocol twin -> its base regime's role, ``<role> (protocol_of <base>)``."""
    planned: dict[tuple[str, str], set[int]] = {}
    for c in grid.cells:
        planned.setdefault((c.regime, c.algorithm), set()).add(c.seed)
    twins = grid.protocol_twins
    out = {a.regime: a.status for a in admission(runs, grid.guard_controls, planned, twins)}
    out |= {c: CONTROL for c in grid.guard_controls}
    return out | {t: f"{out.get(grid.base_regime(t), '-')} (protocol_of {grid.base_regime(t)})" for t in twins}


def rule_rows(
    grid: Any, found: Iterable[tuple[Mapping[str, Any], Trace]], runs: Sequence[Mapping[str, Any]]
) -> list[RuleRow]:
    """One :class:`RuleRow` per run: ``found`` the (cell record, trace) pairs ``aggregate`` reads,
    ``runs`` their stability.json records."""
    configs = rule_configs(grid.algorithms)
    role = roles(grid, runs)
    records = {(r["regime"], r["algorithm"], r["seed"]): r for r in runs}
    rows = []
    for rec, trace in found:
        key = (rec["regime"], rec["algorithm"], rec["seed"])
        pattern = score_pattern(trace, configs["drop"].val_metric)
        replays = {name: replay_run(trace, replace(c, val_metric=pattern)) for name, c in configs.items()}
        restore = first_restore(trace)
        guarded = bool(trace.series(GUARD_RESTORES))  # the guard was on
        run = records.get(key, {})
        rows.append(
            RuleRow(
                regime=key[0],
                algorithm=key[1],
                seed=key[2],
                role=role.get(key[0], "-"),
                test_freq=str(rec.get("overrides", {}).get("trainer.test_freq", grid.test_freq)),
                questions=_questions(rec, trace, pattern),
                restored=("-" if not guarded else "none" if restore is None else f"step {restore}"),
                replays=replays,
                validation_share=share(
                    {"wall_s": run.get("wall_s", rec.get("wall_s")), **run_timing(trace)}, "validation_s"
                ),
            )
        )
    return sorted(rows, key=lambda r: (r.regime, r.algorithm, r.seed))


def runs_table(rows: Sequence[RuleRow], configs: Mapping[str, GuardConfig]) -> str:
    """Markdown: one row per run."""
    heads = " | ".join(f"first fire, {rule_name(configs[r])}" for r in RULES)
    lines = [
        f"| regime | role | algorithm | seed | validation every | questions | guard's first restore | {heads} "
        "| validation share of wall |",
        "|---|---|---|---|---|---|---|" + "---|" * len(RULES) + "---|",
    ]
    for r in rows:
        fires = " | ".join(r.replays[name].text() for name in RULES)
        val = "-" if r.validation_share is None else f"{100 * r.validation_share:.1f}%"
        lines.append(
            f"| {r.regime} | {r.role} | {r.algorithm} | {r.seed} | {r.test_freq} steps | {r.questions} "
            f"| {r.restored} | {fires} | {val} |"
        )
    return "\n".join(lines) + "\n"


def fires_text(replays: Sequence[Replay]) -> str:
    """``k of n fired (mean step s)``, then the censored and unreplayable runs apart."""
    cannot = [r for r in replays if r.cannot is not None]
    censored = [r for r in replays if r.censored_at is not None]
    fired = [r.step for r in replays if r.step is not None]
    n = len(replays) - len(cannot)
    if not n:
        reasons = sorted({str(r.cannot) for r in cannot})
        return f"n/a ({'; '.join(reasons)})"
    text = f"{len(fired)} of {n}"
    if fired:
        text += f" (step {fired[0]})" if len(fired) == 1 else f" (mean step {statistics.mean(fired):.1f})"
    if censored:
        text += f", {len(censored)} censored"
    if cannot:
        text += f"; {len(cannot)} n/a"
    return text


def summary_table(rows: Sequence[RuleRow], configs: Mapping[str, GuardConfig]) -> str:
    """Markdown: per regime and algorithm, each rule's fires over the runs."""
    heads = " | ".join(f"fired, {rule_name(configs[r])}" for r in RULES)
    lines = [f"| regime | role | algorithm | runs | {heads} |", "|---|---|---|---|" + "---|" * len(RULES)]
    groups: dict[tuple[str, str], list[RuleRow]] = {}
    for r in rows:
        groups.setdefault((r.regime, r.algorithm), []).append(r)
    for (regime, alg), group in sorted(groups.items()):
        cells = " | ".join(fires_text([r.replays[name] for r in group]) for name in RULES)
        lines.append(f"| {regime} | {group[0].role} | {alg} | {len(group)} | {cells} |")
    return "\n".join(lines) + "\n"


def consistency(rows: Sequence[RuleRow]) -> str:
    """The check the replay allows: on a guarded run that restored, ``drop`` (the rule it ran with)
    must fire at its first restore."""
    restored = [r for r in rows if r.restored.startswith("step ")]
    if not restored:
        return "No guarded run restored, so no replay can be checked against a restore."
    same = [r for r in restored if r.replays["drop"].text() == r.restored]
    names = [f"{r.regime}/{r.algorithm}/seed{r.seed}" for r in restored if r not in same]
    text = f"The drop replay fires at the guard's own first restore in {len(same)} of {len(restored)} guarded runs"
    return text + (f"; not in {', '.join(names)}." if names else ".")


def notes(configs: Mapping[str, GuardConfig]) -> str:
    drop, stderr = configs["drop"], configs["stderr"]
    return (
        f"Rules (sorl_verl/trainer/guard_rule.py, replayed by sorl_verl/study/rule_replay.py): drop: a validation "
        f"is low below best - max({drop.drop:g} x |best|, min_drop {drop.min_drop:g}); stderr: below best - "
        f"max({stderr.stderr_k:g} x sqrt(se(best)^2 + se(score)^2), min_drop {stderr.min_drop:g}), se from the "
        f"trainer's question records; a collapse after {drop.patience} low validation(s) in a row. Settings: "
        f"{RULE_GUARDED}'s (presets.yaml) with the guard's default stderr_k. Each replay starts from a fresh "
        "state at step 1 (the validation before training is not used). A guarded run is its unguarded twin "
        "bit for bit until its first restore, so a fire is the step at which a guarded run with that rule "
        "would first restore: a detection in an admitted regime, a false restore in a control. Guarded runs "
        "are replayed up to and including their first restore ('censored at step N': no fire by then). "
        "'n/a (no question records)': the run was made before the SORL trainers logged the question records "
        "with the guard off. Role: a control (guard_controls) or the regime's admission (the guard table's "
        "rule); a regime marked protocol_of another (the same training, validated otherwise) has its base's "
        "role. Questions: from the run's question records, else its data.val_max_samples. "
        "Validation share: verl's timing_s/testing summed over the run / the cell's wall time (the validation "
        "before training is not timed by verl 0.9.1)."
    )


def rule_report(grid: Any, found: Iterable[tuple[Mapping[str, Any], Trace]], runs: Sequence[Mapping[str, Any]]) -> str:
    """The whole ``<name>_rules.md``."""
    configs = rule_configs(grid.algorithms)
    rows = rule_rows(grid, found, runs)
    return (
        "## The guard's rules replayed: first fire per run\n\n"
        f"{runs_table(rows, configs)}\n{summary_table(rows, configs)}\n{consistency(rows)}\n\n{notes(configs)}\n"
    )


def write_rule_table(
    grid: Any,
    found: Iterable[tuple[Mapping[str, Any], Trace]],
    runs: Sequence[Mapping[str, Any]],
    results: Path,
    name: str,
) -> Path | None:
    """Write ``<results>/<name>_rules.md`` for a grid with ``guard_controls`` (None, nothing written,
    for another grid)."""
    if not grid.guard_controls:
        return None
    path = results / f"{name}_rules.md"
    path.write_text(rule_report(grid, found, runs))
    return path
