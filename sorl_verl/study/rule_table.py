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

Last, question 5's verdict (:func:`default_rule_verdict`, natural.yaml's DEFAULT RULE, its text
:func:`default_rule_text` generated from the constants below): the protocols are the grid's own
``test_freq`` / ``val_max_samples`` (every regime without ``protocol_of``: P10 in natural.yaml) and each
distinct one of a protocol twin (P5); the units are the seeds of :data:`RULE_UNGUARDED` in a control or
admitted regime, each replayed from the unguarded run where the rule can be, else from its guarded twin
:data:`RULE_GUARDED` (censored at its first restore: no fire by then), else missing (:data:`UNITS_TEXT`).
Per (rule, protocol) the admitted-regime and control units that fired; per protocol whether
:data:`CANDIDATE_RULE` under it beats :data:`DEFAULT_RULE` under the grid's own protocol
(:func:`protocol_part`: holds / fails / undecided naming the missing units); the decision
(:func:`default_decision`): the candidate where some protocol holds, the default where all fail.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sorl_verl.study.grid import TEST_FREQ_KEY
from sorl_verl.study.guard_table import (
    FAILS,
    HOLDS,
    RULE_GUARDED,
    RULE_UNGUARDED,
    UNDECIDED,
    Part,
    admission,
    run_timing,
    share,
)
from sorl_verl.study.measures import GUARD_RESTORES
from sorl_verl.study.metrics import Trace, parse_val_key
from sorl_verl.study.rule_replay import Replay, first_restore, guard_config, replay_run, validation_questions
from sorl_verl.study.warning_signals import validation_size
from sorl_verl.trainer.guard_rule import GUARD_PREFIX, GuardConfig, validation_score

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


def planned_freq(grid: Any, key: tuple[str, str, int]) -> int:
    """The validation interval the grid gives the cell ``(regime, algorithm, seed)`` (:meth:`Grid.test_freq_of`),
    for a record that lacks its ``trainer.test_freq``; a cell the grid no longer plans: its regime's, else the
    grid's."""
    for c in grid.cells:
        if (c.regime, c.algorithm, c.seed) == key:
            return grid.test_freq_of(c)
    entry = grid.regimes.get(key[0])
    return entry.test_freq if entry is not None and entry.test_freq else grid.test_freq


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
                test_freq=str(rec.get("overrides", {}).get(TEST_FREQ_KEY, planned_freq(grid, key))),
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


# --- question 5: the default rule -------------------------------------------------------------

#: the rule the recipes run (presets.yaml grpo_guard), the default unless question 5's rule holds
DEFAULT_RULE = "drop"
#: the rule question 5 may make the default
CANDIDATE_RULE = "stderr"
#: the control-unit fires the candidate may have ("no control-run fire at all")
CONTROL_FIRES_ALLOWED = 0
#: the setting the verdict decides, and where a new default's protocol is stated
RULE_KEY = f"{GUARD_PREFIX}.rule"
PROTOCOL_DOC = "docs/guard.md"
#: where the rule was written
DEFAULT_RULE_SOURCE = "recipe/sorl/study/natural.yaml, question 5, written 2026-11-28 before any P5 cell ran"
ADMITTED = "admitted"
UNITS_TEXT = (
    f"a unit is one seed of {RULE_UNGUARDED} in a control or admitted regime (a protocol twin in its base's "
    f"role): the unguarded {RULE_UNGUARDED} run's replay where the rule can be replayed on it, else its guarded "
    f"twin {RULE_GUARDED}'s, censored at its first restore (no fire by then: not a fire, left out of the mean "
    "step); a unit with neither is missing, as is one whose run has not been made"
)


def default_rule_text(protocols: Sequence[str], base: str) -> str:
    """Question 5's DEFAULT RULE in the grid comment's words, from the module's constants: ``protocols`` the
    candidate's protocol names, ``base`` the grid's own protocol (the incumbent's)."""
    allowed = ("no control-run fire at all" if CONTROL_FIRES_ALLOWED == 0
               else f"at most {CONTROL_FIRES_ALLOWED} control-run fires")  # fmt: skip
    return (
        f"DEFAULT RULE: {RULE_KEY} becomes {CANDIDATE_RULE} (with its protocol stated in {PROTOCOL_DOC}) only if, "
        f"under {' or '.join(protocols)}, {CANDIDATE_RULE} fires in at least as many admitted-regime runs as "
        f"{DEFAULT_RULE} does under {base}, at a mean first-fire step no later, with no more control-run fires "
        f"than {DEFAULT_RULE} under {base} and {allowed}; otherwise the default stays {DEFAULT_RULE} and the "
        "table is reported."
    )


@dataclass(frozen=True, order=True)
class Protocol:
    """A validation protocol: every ``test_freq`` steps on ``questions`` questions; ``name`` ``P<test_freq>``."""

    test_freq: int
    questions: int
    name: str

    def text(self) -> str:
        return f"validation every {self.test_freq} steps on {self.questions} questions"


def protocols(grid: Any) -> dict[str, Protocol]:
    """regime -> its protocol: the grid's ``test_freq`` / ``val_max_samples`` for a regime without
    ``protocol_of``, a twin's own (its regime's keys, else the grid's). Named ``P<test_freq>``, with
    ``q<questions>`` added where two protocols share a ``test_freq``; the key ``""`` is the grid's own."""
    own = (grid.test_freq, grid.val_max_samples)
    keys = {r: (e.test_freq or own[0], e.val_max_samples or own[1]) if r in grid.protocol_twins else own
            for r, e in grid.regimes.items()}  # fmt: skip
    freqs = Counter(tf for tf, _ in set(keys.values()) | {own})
    name = {k: f"P{k[0]}" if freqs[k[0]] == 1 else f"P{k[0]}q{k[1]}" for k in set(keys.values()) | {own}}
    return {"": Protocol(*own, name[own])} | {r: Protocol(*k, name[k]) for r, k in keys.items()}


@dataclass(frozen=True)
class Unit:
    """One seed of a regime under one rule: the replay used (None: missing) and its source (the algorithm
    replayed, or why the unit is missing)."""

    regime: str
    seed: int
    control: bool
    replay: Replay | None
    source: str

    @property
    def name(self) -> str:
        return f"{self.regime}/{RULE_UNGUARDED}/seed{self.seed}"


def _unit(regime: str, seed: int, role: str, rule: str, rows: Mapping, planned: set) -> Unit:
    """The unit's replay under ``rule`` (:data:`UNITS_TEXT`); ``rows`` (regime, algorithm, seed) -> RuleRow,
    ``planned`` the grid's cells as such keys."""
    control = role == CONTROL
    if role != ADMITTED and not control:
        return Unit(regime, seed, control, None, f"admission {role}")
    why = []
    for alg in (RULE_UNGUARDED, RULE_GUARDED):
        row = rows.get((regime, alg, seed))
        if row is None:
            if alg == RULE_UNGUARDED and (regime, alg, seed) in planned:  # its own run is still to come
                return Unit(regime, seed, control, None, "not run")
            why.append(f"no {alg} run")
        elif row.replays[rule].cannot is None:
            return Unit(regime, seed, control, row.replays[rule], alg)
        else:
            why.append(f"{alg}: {row.replays[rule].cannot}")
    return Unit(regime, seed, control, None, "; ".join(why))


@dataclass(frozen=True)
class Tally:
    """One rule under one protocol, over its units."""

    rule: str
    protocol: Protocol
    units: tuple[Unit, ...]

    def present(self, control: bool) -> list[Unit]:
        return [u for u in self.units if u.control == control and u.replay is not None]

    def steps(self, control: bool) -> list[int]:
        return [u.replay.step for u in self.present(control) if u.replay is not None and u.replay.step is not None]

    def missing(self, control: bool | None = None) -> list[str]:
        return [f"{u.name} ({u.source})" for u in self.units
                if u.replay is None and (control is None or u.control == control)]  # fmt: skip

    def mean_step(self) -> float | None:
        steps = self.steps(False)
        return statistics.mean(steps) if steps else None

    def text(self, control: bool) -> str:
        """``k of n`` fired (admitted: with the mean first-fire step), censored units counted apart."""
        present, steps = self.present(control), self.steps(control)
        text = f"{len(steps)} of {len(present)}"
        if not control and steps:
            text += f" (mean step {statistics.mean(steps):.1f})"
        censored = sum(u.replay is not None and u.replay.censored_at is not None for u in present)
        return text + (f", {censored} censored" if censored else "")

    def sources(self) -> str:
        used = Counter(u.source for u in self.units if u.replay is not None)
        return ", ".join(f"{alg} {n}" for alg, n in sorted(used.items())) or "-"


def tallies(grid: Any, rows: Sequence[RuleRow], role: Mapping[str, str]) -> dict[tuple[str, Protocol], Tally]:
    """(rule, protocol) -> :class:`Tally`, for every rule of :data:`RULES` and every protocol with a unit:
    the seeds of :data:`RULE_UNGUARDED` and :data:`RULE_GUARDED` the grid plans or the archive has, in the
    regimes whose (base's) role is control, admitted or undecided (an undecided regime's units are missing)."""
    proto = protocols(grid)
    by_key = {(r.regime, r.algorithm, r.seed): r for r in rows}
    planned = {(c.regime, c.algorithm, c.seed) for c in grid.cells}
    units: dict[tuple[str, Protocol], list[Unit]] = {}
    for regime in sorted(set(grid.regimes) | {r.regime for r in rows}):
        base_role = role.get(grid.base_regime(regime), "-")
        if base_role not in (CONTROL, ADMITTED, UNDECIDED):
            continue
        pair = (RULE_UNGUARDED, RULE_GUARDED)
        seeds = sorted({s for g, a, s in planned | set(by_key) if g == regime and a in pair})
        for rule in RULES:
            key = (rule, proto.get(regime, proto[""]))
            units.setdefault(key, []).extend(_unit(regime, s, base_role, rule, by_key, planned) for s in seeds)
    return {k: Tally(k[0], k[1], tuple(v)) for k, v in sorted(units.items(), key=lambda kv: (kv[0][1], kv[0][0]))}


def protocol_part(c: Tally, b: Tally) -> Part:
    """The rule under one protocol: candidate ``c`` (:data:`CANDIDATE_RULE` under it) against ``b``
    (:data:`DEFAULT_RULE` under the grid's own protocol). Fails as soon as the evidence in hand decides it (a
    control-unit fire beyond :data:`CONTROL_FIRES_ALLOWED`; too few admitted-unit fires even if every missing
    admitted unit fired); else undecided while a unit of either is missing; else holds or fails. With no
    admitted-unit fire on either side the mean-step condition has nothing to compare and is not failed."""
    fired, base_fired = c.steps(False), b.steps(False)
    control, base_control = len(c.steps(True)), len(b.steps(True))
    evidence = (
        f"{c.rule}: admitted-regime units {c.text(False)}, control units {c.text(True)}; "
        f"{b.rule} under {b.protocol.name}: admitted-regime units {b.text(False)}, control units {b.text(True)}"
    )
    missing = "; missing " + ", ".join(b.missing() + c.missing())
    if control > CONTROL_FIRES_ALLOWED:
        return Part(c.protocol.name, FAILS, evidence + " (a control-unit fire)")
    if b.missing():
        return Part(c.protocol.name, UNDECIDED, evidence + missing)
    if c.missing(False) and len(fired) + len(c.missing(False)) < len(base_fired):
        return Part(c.protocol.name, FAILS, evidence + " (fewer admitted-unit fires, whatever the missing units give)")
    if c.missing():
        return Part(c.protocol.name, UNDECIDED, evidence + missing)
    why = []
    if len(fired) < len(base_fired):
        why.append("fewer admitted-unit fires")
    if fired and base_fired and statistics.mean(fired) > statistics.mean(base_fired):
        why.append("a later mean first-fire step")
    if control > base_control:
        why.append("more control-unit fires")
    return Part(c.protocol.name, FAILS if why else HOLDS, evidence + (f" ({', '.join(why)})" if why else ""))


def default_decision(parts: Sequence[Part]) -> str:
    """:data:`CANDIDATE_RULE` where the rule holds under some protocol; :data:`DEFAULT_RULE` when it fails
    under every one; else :data:`DEFAULT_RULE` for now, undecided."""
    held = [p.name for p in parts if p.status == HOLDS]
    open_ = [p.name for p in parts if p.status == UNDECIDED]
    if held:
        later = f"; units of {', '.join(open_)} still missing cannot change this" if open_ else ""
        return (f"{RULE_KEY} becomes {CANDIDATE_RULE} (the rule holds under {' and '.join(held)}, the protocol "
                f"{PROTOCOL_DOC} states{later})")  # fmt: skip
    if all(p.status == FAILS for p in parts):
        return f"{RULE_KEY} stays {DEFAULT_RULE} (the rule fails under every protocol)"
    return f"{RULE_KEY} stays {DEFAULT_RULE} for now (undecided: units missing under {' and '.join(open_)})"


def tally_table(ts: Mapping[tuple[str, Protocol], Tally]) -> str:
    """Markdown: per rule and protocol, admitted-regime and control units fired, the replays used, the
    missing units."""
    lines = [
        "| rule | protocol | admitted-regime units fired (mean first-fire step) | control units fired "
        "| replays used | missing units |",
        "|---|---|---|---|---|---|",
    ]
    for (rule, p), t in ts.items():
        lines.append(f"| {rule} | {p.name} | {t.text(False)} | {t.text(True)} | {t.sources()} "
                     f"| {', '.join(t.missing()) or '-'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def default_rule_verdict(grid: Any, rows: Sequence[RuleRow], role: Mapping[str, str]) -> str:
    """Markdown: question 5's rule (:func:`default_rule_text`), the protocols, the per (rule, protocol)
    table, the rule under each protocol (:func:`protocol_part`) and the decision."""
    ts = tallies(grid, rows, role)
    proto = protocols(grid)
    base = proto[""]
    candidates = sorted({p for r, p in ts if r == CANDIDATE_RULE})
    parts = [protocol_part(ts[(CANDIDATE_RULE, p)], ts[(DEFAULT_RULE, base)]) for p in candidates]
    where = {p: sorted({u.regime for (_, q), t in ts.items() if q == p for u in t.units}) for p in candidates}
    lines = [
        f"### Question 5: the default rule (rule: {DEFAULT_RULE_SOURCE})",
        "",
        default_rule_text([p.name for p in candidates], base.name),
        "",
        "Protocols: "
        + "; ".join(f"{p.name} = {p.text()} ({', '.join(where[p])})" for p in candidates)
        + f". Units: {UNITS_TEXT}.",
        "",
        tally_table(ts),
        *[f"- ({p.name}) **{p.status}**: {p.detail}" for p in parts],
        "",
        f"Decision: **{default_decision(parts)}**.",
    ]
    return "\n".join(lines) + "\n"


def rule_report(grid: Any, found: Iterable[tuple[Mapping[str, Any], Trace]], runs: Sequence[Mapping[str, Any]]) -> str:
    """The whole ``<name>_rules.md``."""
    configs = rule_configs(grid.algorithms)
    rows = rule_rows(grid, found, runs)
    return (
        "## The guard's rules replayed: first fire per run\n\n"
        f"{runs_table(rows, configs)}\n{summary_table(rows, configs)}\n{consistency(rows)}\n\n{notes(configs)}\n\n"
        f"{default_rule_verdict(grid, rows, roles(grid, runs))}"
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
