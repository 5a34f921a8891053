"""Issue 49's dose-response: SO-GRPO's normalizer at several taus against GRPO and matched-step GRPO.

Written by ``aggregate`` as ``<name>_dose.md`` and ``<name>_dose.png`` (:func:`write_dose_table`) for a
grid whose cells (or runs) put :data:`CONTROL` and at least :data:`MIN_DOSES` variants of :data:`FAMILY`
(``so_grpo_grad``, ``so_grpo_grad_tau<x>``: their tau is the algorithm's ``clip_norm_tau`` override) in
the same regime R (a dose-response needs two doses; a regime with one is the headline table's). The
arms of R: :data:`CONTROL`; *matched-step* :data:`CONTROL`, its runs in the regime ``R`` +
:data:`MATCHED_SUFFIX` (the control learning.yaml's rule defines: the same regime at a smaller base lr);
every variant, largest tau (weakest normalizer) first.

Per run, from its validation scores ``v_0, ..., v_m`` (mean over the sources) at steps ``0 = s_0 < ... <
s_m`` (:mod:`~sorl_verl.study.measures`): final gain ``v_m - v_0``, peak gain ``max_j v_j - v_0``, mean
gain (AUC: the trapezoid area over ``v_0`` divided by ``s_m``); the 2-hop score (:data:`TWO_HOP`) at its
best ``max_j h_j`` (step 0 included) and at the end ``h_m``; the mean step scale ``u_t`` (the factor the
normalizer applied to step t's update: ``actor/sorl/update_scale``, else ``1/Z``,
:func:`~sorl_verl.study.aggregate.update_scale_series`) over the steps ``t < J`` and ``t >= J``, J the
regime's lr jump (``sorl.fault_injection.from_step``; without one, all steps); the share of micro-batches
the normalizer scaled (``actor/sorl/triggered``, the fraction with ``Z > 1``), averaged over all steps:
``u_t`` is the loss-share-weighted mean of ``1/Z`` over the step's micro-batches, so a step scale near
``1 - triggered`` says the scaled micro-batches were scaled nearly to nothing (``Z >> 1``), a step
scale set by how often clipping fires rather than by tau. An arm's value is
``mean ± sd`` (sd with n - 1) over its judged runs (:func:`~sorl_verl.study.report.judged`).

The difference of arm a to control b is ``d = mean_a - mean_b`` ± ``SE = sqrt(sd_a^2/n_a + sd_b^2/n_b)``
(:func:`~sorl_verl.study.guard_table.diff_se`, the SE of two independent means). The reading rule
(:data:`RULE_SOURCE`): a tau *dominates* a control when both arms have judged runs of every seed of
:data:`SEEDS` and ``d_final > K x SE_final`` and ``d_peak > -K x SE_peak`` (K = :data:`K`); it *does not*
when both are complete and either fails; *undecided* otherwise, the missing cells named. The answer:
"yes" when some tau dominates matched-step GRPO, "no" when every tau is decided against it and none
does. The defaults change only for a tau that dominates both controls.

Matched-step lr (:func:`matched_lr`): the tau with the highest mean final gain over its runs (final once
every tau has all of :data:`SEEDS`, provisional before) gives ``m`` = the mean of ``u_t`` over every step
of its runs, rounded to 2 significant digits, and the lr ``lr_R x m`` (``lr_R``: the lr its runs ran
with, the regime's base lr).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sorl_verl.study.aggregate import LR_KEY, finite_mean, update_scale_series
from sorl_verl.study.grid import Cell, Grid
from sorl_verl.study.guard_table import UNDECIDED, Diff, by_cell, missing_cells
from sorl_verl.study.metrics import Trace
from sorl_verl.study.report import judged, spread

#: the control arm's algorithm
CONTROL = "grpo"
#: the normalizer's variants: this name (tau 0.05) and ``<FAMILY>_tau<x>``
FAMILY = "so_grpo_grad"
FAMILY_RE = re.compile(rf"^{FAMILY}(_tau[0-9][0-9.e-]*)?$")
TAU_KEY = "actor_rollout_ref.actor.policy_loss.clip_norm_tau"
#: the variants a regime needs to be a dose regime
MIN_DOSES = 2
#: the regime of matched-step GRPO: the dose regime's name + this
MATCHED_SUFFIX = "_matched"
#: the key of the regime's lr jump (fault injection from this step on)
JUMP_KEY = "sorl.fault_injection.from_step"
#: the share of a step's micro-batches the normalizer scaled (Z > 1)
TRIGGERED = "actor/sorl/triggered"
#: the validation source of the 2-hop questions (search_qa's embedded default)
TWO_HOP = "synthetic_2hop"
#: the reading rule's standard-error multiple and seeds
K = 2.0
SEEDS = (1, 2, 3)
RULE_SOURCE = "recipe/sorl/study/learning.yaml, issue 49, written 2026-11-28 before any of its runs, ee95365"
DOMINATES, DOES_NOT = "dominates", "does not dominate"


def rule_text(k: float = K, n: int = len(SEEDS)) -> str:
    """The reading rule in words, from the module's constants."""
    return (
        f"a tau DOMINATES a control when its mean final gain exceeds the control's by more than {k:g} standard "
        f"errors of the difference (two {n}-seed means) and its mean peak gain is not lower by more than {k:g} "
        f'standard errors. The answer to issue 49 is "yes" if some tau dominates matched-step GRPO, "no" if none '
        f"does. The defaults (clip_norm_tau, clip_norm_reference) change only if one tau dominates both grpo and "
        f"matched-step GRPO, and then to that tau with the gradient reference."
    )


def significant(x: float, digits: int = 2) -> float:
    """``x`` rounded to ``digits`` significant digits (0 stays 0)."""
    return 0.0 if x == 0 else round(x, digits - 1 - math.floor(math.log10(abs(x))))


# --- runs and arms ----------------------------------------------------------------------------


def is_variant(algorithm: str) -> bool:
    """True for ``so_grpo_grad`` and ``so_grpo_grad_tau<x>``."""
    return bool(FAMILY_RE.match(algorithm))


@dataclass(frozen=True)
class DoseRun:
    """One judged run's measures (None where the run logged nothing of the kind)."""

    seed: int
    gain: float
    peak_gain: float
    auc_gain: float | None
    two_hop_best: float | None
    two_hop_end: float | None
    #: mean step scale before / from the jump (all steps before when the regime has none)
    scale_before: float | None
    scale_after: float | None
    #: every logged step scale of the run
    scales: tuple[float, ...]
    lr: float | None
    #: mean over steps of the share of micro-batches with Z > 1
    triggered: float | None = None


def dose_run(run: Mapping[str, Any], trace: Trace, jump: int | None) -> DoseRun:
    """A :class:`DoseRun` from a stability.json run record (judged, with a gain) and its trace."""
    two_hop = [v[TWO_HOP] for _, v in trace.validations if math.isfinite(v.get(TWO_HOP, math.nan))]
    series = update_scale_series(trace)
    cut = jump if jump is not None else math.inf
    return DoseRun(
        seed=run["seed"],
        gain=run["gain"],
        peak_gain=run["peak_gain"],
        auc_gain=run.get("auc_gain"),
        two_hop_best=max(two_hop) if two_hop else None,
        two_hop_end=two_hop[-1] if two_hop else None,
        scale_before=finite_mean(u for s, u in series if s < cut),
        scale_after=finite_mean(u for s, u in series if s >= cut) if jump is not None else None,
        scales=tuple(u for _, u in series if math.isfinite(u)),
        lr=run.get("lr"),
        triggered=finite_mean(v for _, v in trace.series(TRIGGERED)),
    )


@dataclass(frozen=True)
class Arm:
    """One arm of a dose regime: an algorithm in a regime (the matched control's regime is ``R_matched``)."""

    label: str
    regime: str
    algorithm: str
    tau: float | None
    #: its judged runs, by seed
    runs: tuple[DoseRun, ...]
    #: the cells of :data:`SEEDS` without a judged run
    missing: tuple[str, ...] = ()

    @property
    def tau_text(self) -> str:
        return "-" if self.tau is None else f"{self.tau:g}"

    def values(self, key: str, rule: bool = False) -> list[float]:
        """The runs' values of a :class:`DoseRun` field (None left out); ``rule``: of :data:`SEEDS` only."""
        return [v for r in self.runs if (v := getattr(r, key)) is not None and (not rule or r.seed in SEEDS)]


@dataclass(frozen=True)
class DoseRegime:
    """A regime with :data:`CONTROL` and variants: its arms and lr jump."""

    regime: str
    jump: int | None
    steps: int
    control: Arm
    matched: Arm
    variants: tuple[Arm, ...]

    @property
    def arms(self) -> tuple[Arm, ...]:
        return (self.control, self.matched, *self.variants)


def dose_regimes(
    grid: Grid, cells: Sequence[Cell], runs: Sequence[Mapping[str, Any]], traces: Mapping[tuple[str, str, int], Trace]
) -> list[DoseRegime]:
    """Every regime of ``cells`` (or ``runs``) with :data:`CONTROL` and :data:`MIN_DOSES` :data:`FAMILY`
    variants, sorted by name."""
    planned = {(c.regime, c.algorithm) for c in cells} | {(r["regime"], r["algorithm"]) for r in runs}
    by_seed = by_cell(runs)
    out = []
    for regime in sorted({r for r, a in planned if a == CONTROL}):
        variants = [a for r, a in planned if r == regime and is_variant(a)]
        if len(variants) < MIN_DOSES:
            continue
        overrides = grid.regimes[regime].overrides if regime in grid.regimes else {}
        jump = int(overrides[JUMP_KEY]) if JUMP_KEY in overrides else None
        steps = grid.regimes[regime].steps if regime in grid.regimes and grid.regimes[regime].steps else grid.steps

        def arm(label: str, reg: str, alg: str, tau: float | None, jump: int | None = jump) -> Arm:
            rs = sorted((r for r in runs if (r["regime"], r["algorithm"]) == (reg, alg) and judged(r)),
                        key=lambda r: r["seed"])  # fmt: skip
            done = tuple(dose_run(r, traces[(reg, alg, r["seed"])], jump) for r in rs)
            return Arm(label, reg, alg, tau, done, tuple(missing_cells(by_seed, reg, [alg], SEEDS)))

        def tau_of(alg: str) -> float | None:
            value = grid.algorithms[alg].overrides.get(TAU_KEY) if alg in grid.algorithms else None
            return float(value) if value is not None else None

        doses = sorted(variants, key=lambda a: (-(tau_of(a) or 0.0), a))
        out.append(
            DoseRegime(
                regime=regime,
                jump=jump,
                steps=steps,
                control=arm(CONTROL, regime, CONTROL, None),
                matched=arm(f"matched-step {CONTROL}", regime + MATCHED_SUFFIX, CONTROL, None),
                variants=tuple(arm(a, regime, a, tau_of(a)) for a in doses),
            )
        )
    return out


# --- the rule ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """A tau against a control: ``status`` dominates / does not dominate / undecided, and the evidence."""

    tau: Arm
    control: Arm
    status: str
    final: Diff | None = None
    peak: Diff | None = None
    missing: tuple[str, ...] = ()

    def text(self) -> str:
        head = f"{self.tau.label} (tau {self.tau.tau_text}) against {self.control.label}: **{self.status}**"
        if self.status == UNDECIDED:
            return f"{head}: missing {', '.join(self.missing)}"
        assert self.final is not None and self.peak is not None
        f_line, p_line = K * (self.final.se or 0.0), -K * (self.peak.se or 0.0)
        return (
            f"{head}: final d = {self.final.d:+.4f}, SE {self.final.se or 0.0:.4f}, line {f_line:+.4f}; "
            f"peak d = {self.peak.d:+.4f}, SE {self.peak.se or 0.0:.4f}, line {p_line:+.4f}"
        )


def reading(tau: Arm, control: Arm) -> Reading:
    """The reading rule for one tau against one control (module docstring)."""
    if tau.missing or control.missing:
        return Reading(tau, control, UNDECIDED, missing=tau.missing + control.missing)
    final = Diff.of(tau.values("gain", rule=True), control.values("gain", rule=True))
    peak = Diff.of(tau.values("peak_gain", rule=True), control.values("peak_gain", rule=True))
    holds = final.d > K * (final.se or 0.0) and peak.d > -K * (peak.se or 0.0)
    return Reading(tau, control, DOMINATES if holds else DOES_NOT, final, peak)


def answer(readings: Sequence[Reading]) -> str:
    """Issue 49's answer from the readings against matched-step GRPO: yes / no / undecided."""
    won = [r.tau.label for r in readings if r.status == DOMINATES]
    if won:
        return f"yes ({', '.join(won)} dominates matched-step {CONTROL})"
    open_ = [r.tau.label for r in readings if r.status == UNDECIDED]
    if open_:
        return f"undecided ({', '.join(open_)} not yet decided against matched-step {CONTROL}; none dominates so far)"
    return f"no (no tau dominates matched-step {CONTROL})"


def defaults(against_control: Sequence[Reading], against_matched: Sequence[Reading]) -> str:
    """The defaults' fate: changed to a tau that dominates both controls, else unchanged (or undecided)."""
    both = [a.tau for a, m in zip(against_control, against_matched, strict=True)
            if a.status == DOMINATES and m.status == DOMINATES]  # fmt: skip
    if both:
        taus = " or ".join(f"clip_norm_tau {a.tau_text} ({a.label})" for a in both)
        return f"change to {taus}, clip_norm_reference gradient"
    if any(UNDECIDED in (a.status, m.status) for a, m in zip(against_control, against_matched, strict=True)):
        return "unchanged for now (undecided: no tau has dominated both controls, some lack cells)"
    return "unchanged (no tau dominates both controls)"


@dataclass(frozen=True)
class MatchedLr:
    """The matched-step lr the rule defines, from the best tau so far."""

    regime: str
    best: Arm
    #: the seeds of the best tau's runs the lr is from
    seeds: tuple[int, ...]
    mean_final: float
    m: float
    m_rounded: float
    lr: float
    base_lr: float
    steps: int
    provisional: tuple[str, ...]

    def text(self) -> str:
        state = (f"provisional, {len(self.provisional)} cells of the taus missing: {', '.join(self.provisional)}"
                 if self.provisional else "final: every tau has its seeds")  # fmt: skip
        return (
            f"Matched-step lr for {self.regime} ({state}): best tau {self.best.label} (tau {self.best.tau_text}, "
            f"mean final gain {self.mean_final:+.3f} over seeds {','.join(map(str, self.seeds))}); "
            f"m = mean step scale over its {self.steps} logged steps = {self.m:.4f} -> {self.m_rounded:g} "
            f"(2 significant digits); lr = {self.base_lr:g} x {self.m_rounded:g} = {self.lr:.6g}. "
            f"Regime to add: {self.regime}{MATCHED_SUFFIX} = {self.regime} with {LR_KEY}: {self.lr:.6g}"
        )


def matched_lr(dose: DoseRegime) -> MatchedLr | None:
    """The matched-step lr of a dose regime from the runs of :data:`SEEDS` (None while no tau has one, or
    the best tau's runs logged no step scale or ran with several lrs)."""
    ranked = [a for a in dose.variants if a.values("gain", rule=True)]
    if not ranked:
        return None
    best = max(ranked, key=lambda a: statistics.fmean(a.values("gain", rule=True)))
    runs = [r for r in best.runs if r.seed in SEEDS]
    scales = [u for r in runs for u in r.scales]
    lrs = {r.lr for r in runs if r.lr is not None}
    if not scales or len(lrs) != 1:
        return None
    base_lr, m = lrs.pop(), statistics.fmean(scales)
    m_rounded = significant(m)
    return MatchedLr(
        regime=dose.regime,
        best=best,
        seeds=tuple(r.seed for r in runs),
        mean_final=statistics.fmean(best.values("gain", rule=True)),
        m=m,
        m_rounded=m_rounded,
        lr=float(f"{base_lr * m_rounded:.6g}"),
        base_lr=base_lr,
        steps=len(scales),
        provisional=tuple(c for a in dose.variants for c in a.missing),
    )


# --- the table --------------------------------------------------------------------------------


def _diff_text(arm: Arm, control: Arm, key: str) -> str:
    a, b = arm.values(key), control.values(key)
    if arm is control or not a or not b:
        return "-"
    return Diff.of(a, b).text()


def _steps(dose: DoseRegime) -> tuple[str, str]:
    if dose.jump is None:
        return "step scale, all steps", "step scale after a jump (none)"
    return f"step scale, steps 1-{dose.jump - 1}", f"step scale, steps {dose.jump}-{dose.steps}"


def table(dose: DoseRegime) -> str:
    """Markdown: one row per arm (module docstring); differences ± SE to grpo and to matched-step grpo."""
    before, after = _steps(dose)
    lines = [
        f"| arm | tau | seeds | final gain | peak gain | mean gain (AUC) | 2-hop at its best | 2-hop at the end "
        f"| {before} | {after} | share of micro-batches scaled (Z > 1) | final gain - {CONTROL} | peak gain - {CONTROL} "
        f"| final gain - matched-step {CONTROL} | peak gain - matched-step {CONTROL} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in dose.arms:
        name = arm.label if arm.regime == dose.regime else f"{arm.label} ({arm.regime})"
        seeds = ",".join(str(r.seed) for r in arm.runs) or "not run"
        scale = [spread(arm.values(k)) for k in ("scale_before", "scale_after")]
        lines.append(
            f"| {name} | {arm.tau_text} | {seeds} "
            f"| {spread(arm.values('gain'), sign='+')} | {spread(arm.values('peak_gain'), sign='+')} "
            f"| {spread(arm.values('auc_gain'), sign='+')} | {spread(arm.values('two_hop_best'))} "
            f"| {spread(arm.values('two_hop_end'))} | {scale[0]} | {scale[1] if dose.jump is not None else '-'} "
            f"| {spread(arm.values('triggered'))} "
            f"| {_diff_text(arm, dose.control, 'gain')} | {_diff_text(arm, dose.control, 'peak_gain')} "
            f"| {_diff_text(arm, dose.matched, 'gain')} | {_diff_text(arm, dose.matched, 'peak_gain')} |"
        )
    return "\n".join(lines) + "\n"


NOTE = (
    "Gains are validation-score gains over step 0 (mean over the sources), mean ± sd over the judged runs (sd "
    "with n - 1); the 2-hop columns are each run's best 2-hop score (step 0 included) and its last. Step scale: "
    "the factor the normalizer applied to the update (actor/sorl/update_scale), averaged over the run's steps "
    "before and from the lr jump, then over runs; grpo logs none (its step is the lr's). Share scaled: the "
    "fraction of the step's micro-batches with Z > 1 (actor/sorl/triggered), averaged over all steps, then over "
    "runs; a step scale near 1 - that share means the scaled micro-batches were scaled nearly to nothing. "
    "Differences: arm minus control ± SE = sqrt(sd_a^2/n_a + sd_b^2/n_b) (two independent means), in brackets in SE units."
)


def report(doses: Sequence[DoseRegime]) -> str:
    """The whole ``<name>_dose.md``."""
    parts = ["## Dose-response: the normalizer at several taus against GRPO and matched-step GRPO (issue 49)\n"]
    for dose in doses:
        jump = f"lr jump at step {dose.jump}" if dose.jump is not None else "no lr jump"
        parts.append(f"### {dose.regime} ({jump})\n\n{table(dose)}\n{NOTE}\n")
        vs_control = [reading(a, dose.control) for a in dose.variants]
        vs_matched = [reading(a, dose.matched) for a in dose.variants]
        lr = matched_lr(dose)
        lr_text = (
            lr.text() if lr else f"Matched-step lr for {dose.regime}: no tau has a run with logged step scales yet."
        )
        parts.append(
            "\n".join(
                [
                    f"Reading rule ({RULE_SOURCE}): {rule_text()}",
                    "",
                    *[f"- {r.text()}" for r in (*vs_control, *vs_matched)],
                    "",
                    f"Answer in {dose.regime}: **{answer(vs_matched)}**. Defaults: **{defaults(vs_control, vs_matched)}**.",
                    "",
                    lr_text,
                ]
            )
            + "\n"
        )
    return "\n".join(parts)


# --- the figure -------------------------------------------------------------------------------


def plot(doses: Sequence[DoseRegime], path: Path) -> Path:
    """Final gain against peak gain, one panel per regime: each run a point, each arm a colour, the arm's
    mean with standard-error bars (sd / sqrt(n)) on both axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sorl_verl.study.plots import DPI

    cmap = matplotlib.colormaps["tab10"]
    fig, axes = plt.subplots(1, len(doses), figsize=(6.0 * len(doses), 5.0), squeeze=False)
    for ax, dose in zip(axes.flat, doses, strict=True):
        lo, hi = 0.0, 0.0
        for i, arm in enumerate(dose.arms):
            if not arm.runs:
                continue
            x, y = arm.values("peak_gain"), arm.values("gain")
            lo, hi = min(lo, *x, *y), max(hi, *x, *y)
            c = cmap(i % cmap.N)
            tau = "" if arm.tau is None else f", tau {arm.tau_text}"
            ax.scatter(x, y, color=c, s=18, alpha=0.5, lw=0)
            se = [statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else 0.0 for v in (x, y)]
            ax.errorbar(statistics.fmean(x), statistics.fmean(y), xerr=se[0], yerr=se[1], color=c, marker="o",
                        ms=7, capsize=3, lw=1.4, label=f"{arm.label}{tau} (n={len(arm.runs)})")  # fmt: skip
        pad = 0.1 * (hi - lo or 0.1)
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="0.6", ls="--", lw=0.8, label="final = peak")
        ax.axhline(0.0, color="0.3", lw=0.6)
        ax.set_xlabel("peak gain over step 0", fontsize=9)
        ax.set_ylabel("final gain over step 0", fontsize=9)
        ax.set_title(f"{dose.regime}: each run a point; mean ± SE", fontsize=10)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def write_dose_table(
    grid: Grid,
    cells: Sequence[Cell],
    found: Sequence[tuple[Mapping[str, Any], Trace]],
    runs: Sequence[Mapping[str, Any]],
    results: Path,
    name: str,
    plots: bool = True,
) -> tuple[list[Path], list[MatchedLr]] | None:
    """Write ``<name>_dose.md`` (and ``<name>_dose.png`` with ``plots``) into ``results`` for a grid with
    dose regimes (None, nothing written, otherwise); returns the paths and each regime's matched lr."""
    traces = {(rec["regime"], rec["algorithm"], rec["seed"]): trace for rec, trace in found}
    doses = dose_regimes(grid, cells, runs, traces)
    if not doses:
        return None
    results.mkdir(parents=True, exist_ok=True)
    md = results / f"{name}_dose.md"
    md.write_text(report(doses))
    paths = [md]
    if plots and any(arm.runs for d in doses for arm in d.arms):
        paths.append(plot(doses, results / f"{name}_dose.png"))
    return paths, [m for d in doses if (m := matched_lr(d)) is not None]
