"""The collapse guard's evidence: guarded against unguarded runs, and the verdict of the GUARD-default rule.

Written by ``aggregate`` as ``<name>_guard.md`` for a study whose runs include a guarded algorithm
(a name ending in :data:`GUARD_SUFFIX`, paired with its unguarded twin by dropping the suffix:
``grpo_guard`` <-> ``grpo``, ``so_grpo_guard`` <-> ``so_grpo``). Per regime and pair, over the
seeds both arms have a judged run of (``judged`` and a finite ``gain``, :mod:`~sorl_verl.study.measures`):

- mean final gain and mean peak gain of each arm (``mean ± sd``, sd with n - 1);
- the difference ``d = mean_g - mean_u`` (guarded minus unguarded) with its standard error
  ``SE = sqrt(sd_g^2 / n_g + sd_u^2 / n_u)`` (:func:`diff_se`): the SE of a difference of two
  independent means, the one the rule names ("SE of the difference of two 3-seed means");
- collapsed counts, the guarded arm's restores per run (mean and the list by seed), and the
  **false restores**: restores of guarded runs in a *control* regime (the grid's
  ``guard_controls``: healthy runs, where any restore is a false alarm), over every run of the arm;
- per arm and run, the share of the cell's wall time (``wall_s``: the whole main_ppo process,
  start-up included) spent in checkpoints and in validations (:func:`run_timing`): checkpoints are
  verl's ``timing_s/save_checkpoint`` (its ``save_freq`` checkpoints) plus the guard's
  ``timing_s/sorl_guard`` (the guard's checkpoints of new bests, its restores and its rule);
  validations are verl's ``timing_s/testing`` (every ``test_freq`` steps and the last step).
  verl 0.9.1 logs no timing for the validation before training (step 0), which is therefore not
  in the share.

Under the tables, for a grid that names ``guard_controls``, the verdict of the rule that decides the
recipes' ``GUARD`` default (:data:`RULE_SOURCE`; its text, :func:`rule_text`, is generated from the
constants below): (a) no restore in any of the control regime's :data:`RULE_SEEDS` seeds of
:data:`RULE_GUARDED`; (b) in the control regime ``d > -K x SE`` (final gain, :data:`RULE_GUARDED`
minus :data:`RULE_UNGUARDED`); (c) in at least one *admitted* regime ``d > +K x SE``
(``K =`` :data:`GUARD_DEFAULT_K`). Each part holds, fails or is undecided (the missing cells named).
A regime other than a control is admitted (:func:`admission`) when unguarded :data:`RULE_UNGUARDED`
gained and then lost the gain (``measures.lost_gain``) or collapsed in at least
:data:`ADMIT_MIN_RUNS` of :data:`ADMIT_OF_SEEDS` seeds. A protocol twin (a regime with ``protocol_of``,
:attr:`~sorl_verl.study.grid.Grid.protocol_twins`: its base's training validated otherwise, natural.yaml's
question 5) is neither an admission candidate nor a control: question 1 admits mechanisms and question 4
is judged under the grid's own protocol, so the verdict leaves the twins' runs and cells out (the
comparison and time tables still show any guarded pair of theirs).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from sorl_verl.study.measures import GUARD_SECONDS, LOST_FRACTION, MIN_GAIN
from sorl_verl.study.metrics import Trace
from sorl_verl.study.report import judged, spread

#: a guarded algorithm's name ends in this; dropping it names its unguarded twin
GUARD_SUFFIX = "_guard"
#: the standard-error multiple of the rule's parts (b) and (c)
GUARD_DEFAULT_K = 2.0
#: the seeds each arm needs for a part of the rule to be decided
RULE_SEEDS = (1, 2, 3)
#: the pair the rule compares
RULE_UNGUARDED = "grpo"
RULE_GUARDED = RULE_UNGUARDED + GUARD_SUFFIX
#: admission: this many of ADMIT_OF_SEEDS seeds of unguarded RULE_UNGUARDED gained-then-lost or collapsed
ADMIT_MIN_RUNS = 2
ADMIT_OF_SEEDS = 3
#: where the rule was written (before any demo or guarded cell ran)
RULE_SOURCE = "recipe/sorl/study/natural.yaml, question 4, written 2026-11-28 before any demo or guarded cell ran"

#: verl's timers (``timing_s/<name>``) counted as checkpoint time, with the guard's own
CHECKPOINT_TIMERS = ("timing_s/save_checkpoint", GUARD_SECONDS)
#: verl's timer of the validations during training (the one before training is not timed)
VALIDATION_TIMER = "timing_s/testing"

HOLDS, FAILS, UNDECIDED = "holds", "fails", "undecided"


def rule_text(k: float = GUARD_DEFAULT_K) -> str:
    """The GUARD-default rule in words, from the module's constants."""
    n = len(RULE_SEEDS)
    return (
        f"The recipes keep GUARD=1 only if all three hold: "
        f"(a) no false alarm: {RULE_GUARDED} restores 0 times in each of the control regime's {n} seeds; "
        f"(b) no cost to a healthy run: in the control regime, mean final gain of {RULE_GUARDED} minus "
        f"{RULE_UNGUARDED} > -{k:g} x its standard error (SE of the difference of two {n}-seed means); "
        f"(c) a shown benefit: in at least one admitted regime, mean final gain of {RULE_GUARDED} minus "
        f"{RULE_UNGUARDED} > +{k:g} x its standard error. Otherwise the recipes' default becomes GUARD=0."
    )


ADMISSION_RULE = (
    f"a regime (other than a control) is admitted if unguarded {RULE_UNGUARDED} gains >= {MIN_GAIN:g} at its "
    f"peak and then ends below {LOST_FRACTION:g} x its peak gain (measures.lost_gain), or collapses by the "
    f"study's rule, in >= {ADMIT_MIN_RUNS} of {ADMIT_OF_SEEDS} seeds"
)


# --- statistics -------------------------------------------------------------------------------


def diff_se(a: Sequence[float], b: Sequence[float]) -> float | None:
    """``sqrt(sd_a^2 / n_a + sd_b^2 / n_b)`` (sd with n - 1): the standard error of ``mean(a) - mean(b)``
    for independent samples; None when either has fewer than two values."""
    if len(a) < 2 or len(b) < 2:
        return None
    return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


@dataclass(frozen=True)
class Diff:
    """``mean(a) - mean(b)`` and its standard error (None with fewer than two values a side)."""

    d: float
    se: float | None

    @classmethod
    def of(cls, a: Sequence[float], b: Sequence[float]) -> Diff:
        return cls(statistics.mean(a) - statistics.mean(b), diff_se(a, b))

    def text(self) -> str:
        if self.se is None:
            return f"{self.d:+.3f} (no SE)"
        units = f" ({self.d / self.se:+.1f} SE)" if self.se > 0 else ""
        return f"{self.d:+.3f} ± {self.se:.3f}{units}"


# --- timing -----------------------------------------------------------------------------------


def run_timing(trace: Trace) -> dict[str, float]:
    """``checkpoint_s``: the sum of :data:`CHECKPOINT_TIMERS` over the steps; ``validation_s``: the sum of
    :data:`VALIDATION_TIMER` (non-finite values skipped; 0 where a timer was never logged)."""

    def total(keys: Iterable[str]) -> float:
        return math.fsum(v for k in keys for _, v in trace.series(k) if math.isfinite(v))

    return {"checkpoint_s": total(CHECKPOINT_TIMERS), "validation_s": total([VALIDATION_TIMER])}


def share(run: Mapping, key: str) -> float | None:
    """``run[key] / run["wall_s"]`` (None without either)."""
    wall = run.get("wall_s")
    return run[key] / wall if run.get(key) is not None and wall else None


# --- pairing ----------------------------------------------------------------------------------


def twin(algorithm: str) -> str | None:
    """The unguarded twin of a guarded algorithm (None for an unguarded one)."""
    return algorithm[: -len(GUARD_SUFFIX)] if algorithm.endswith(GUARD_SUFFIX) else None


def has_guarded(runs: Iterable[Mapping]) -> bool:
    """True when some run's algorithm is a guarded one."""
    return any(twin(r["algorithm"]) for r in runs)


def by_cell(runs: Iterable[Mapping]) -> dict[tuple[str, str], dict[int, Mapping]]:
    """(regime, algorithm) -> seed -> run."""
    out: dict[tuple[str, str], dict[int, Mapping]] = defaultdict(dict)
    for r in runs:
        out[(r["regime"], r["algorithm"])][r["seed"]] = r
    return out


@dataclass(frozen=True)
class Pair:
    """One regime's guarded arm and its unguarded twin over the seeds both have a judged run of."""

    regime: str
    guarded: str
    unguarded: str
    seeds: tuple[int, ...]
    g: tuple[Mapping, ...]
    u: tuple[Mapping, ...]
    #: every run of the guarded arm in the regime (judged or not, any seed): false restores count here
    all_guarded: tuple[Mapping, ...]
    only: str = ""

    def values(self, key: str, arm: str) -> list[float]:
        return [r[key] for r in (self.g if arm == "g" else self.u)]

    def diff(self, key: str) -> Diff | None:
        return Diff.of(self.values(key, "g"), self.values(key, "u")) if self.seeds else None


def pairs(runs: Sequence[Mapping]) -> list[Pair]:
    """Every (regime, guarded algorithm) with runs, paired with its twin's runs of the same seeds."""
    cells = by_cell(runs)
    out = []
    for (regime, alg), seeds in sorted(cells.items()):
        base = twin(alg)
        if base is None:
            continue
        g = {s: r for s, r in seeds.items() if judged(r)}
        u = {s: r for s, r in cells.get((regime, base), {}).items() if judged(r)}
        common = tuple(sorted(set(g) & set(u)))
        extra = [f"{name} also {','.join(map(str, sorted(set(mine) - set(common))))}"
                 for name, mine in ((alg, g), (base, u)) if set(mine) - set(common)]  # fmt: skip
        out.append(
            Pair(
                regime=regime,
                guarded=alg,
                unguarded=base,
                seeds=common,
                g=tuple(g[s] for s in common),
                u=tuple(u[s] for s in common),
                all_guarded=tuple(seeds[s] for s in sorted(seeds)),
                only="; ".join(extra),
            )
        )
    return out


# --- the tables -------------------------------------------------------------------------------


def restores(runs: Iterable[Mapping]) -> list[int]:
    """The logged restores of each run (a run that logged none counts 0)."""
    return [int(r.get("guard_restores") or 0) for r in runs]


def _restores_text(p: Pair) -> str:
    rs = restores(p.g)
    return f"{statistics.mean(rs):.1f} ({', '.join(map(str, rs))})" if rs else "-"


def _false_text(p: Pair, controls: Sequence[str]) -> str:
    if p.regime not in controls:
        return "- (not a control)"
    n = len(p.all_guarded)
    return f"{sum(restores(p.all_guarded))} in {n} run{'' if n == 1 else 's'}"


def _collapsed(runs: Sequence[Mapping]) -> str:
    return f"{sum(bool(r.get('collapsed')) for r in runs)}/{len(runs)}"


def comparison_table(ps: Sequence[Pair], controls: Sequence[str]) -> str:
    """Markdown: per regime and pair, gains of each arm, differences ± SE, collapses, restores."""
    lines = [
        "| regime | guarded - unguarded | seeds | final gain, unguarded | final gain, guarded | final gain difference "
        "| peak gain, unguarded | peak gain, guarded | peak gain difference | collapsed, unguarded vs guarded "
        "| restores / run (by seed) | false restores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in ps:
        seeds = ",".join(map(str, p.seeds)) or "none in common"
        if p.only:
            seeds += f" ({p.only})"
        final, peak = p.diff("gain"), p.diff("peak_gain")
        lines.append(
            f"| {p.regime} | {p.guarded} - {p.unguarded} | {seeds} "
            f"| {spread(p.values('gain', 'u'), sign='+')} | {spread(p.values('gain', 'g'), sign='+')} "
            f"| {final.text() if final else '-'} "
            f"| {spread(p.values('peak_gain', 'u'), sign='+')} | {spread(p.values('peak_gain', 'g'), sign='+')} "
            f"| {peak.text() if peak else '-'} | {_collapsed(p.u)} vs {_collapsed(p.g)} "
            f"| {_restores_text(p)} | {_false_text(p, controls)} |"
        )
    return "\n".join(lines) + "\n"


def _share_text(runs: Sequence[Mapping], key: str) -> str:
    shares = [s for r in runs if (s := share(r, key)) is not None]
    if not shares:
        return "-"
    return f"{100 * statistics.mean(shares):.3f}% ({100 * min(shares):.3f}-{100 * max(shares):.3f})"


def _mean_text(runs: Sequence[Mapping], key: str, digits: int) -> str:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return f"{statistics.mean(vals):.{digits}f}" if vals else "-"


def time_table(ps: Sequence[Pair]) -> str:
    """Markdown: per regime, pair and arm, checkpoint and validation seconds per run and their share of
    the wall time (mean over runs, min-max)."""
    lines = [
        "| regime | algorithm | runs | checkpoint s / run | checkpoint share of wall | validation s / run "
        "| validation share of wall | wall s / run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in ps:
        for alg, runs in ((p.unguarded, p.u), (p.guarded, p.g)):
            lines.append(
                f"| {p.regime} | {alg} | {len(runs)} | {_mean_text(runs, 'checkpoint_s', 2)} "
                f"| {_share_text(runs, 'checkpoint_s')} | {_mean_text(runs, 'validation_s', 1)} "
                f"| {_share_text(runs, 'validation_s')} | {_mean_text(runs, 'wall_s', 0)} |"
            )
    return "\n".join(lines) + "\n"


FOOTNOTES = (
    "Gains are validation-score gains over step 0 (mean ± sd over seeds, sd with n - 1), over the seeds both "
    "arms have a judged run of. The difference is guarded minus unguarded, ± its standard error "
    "SE = sqrt(sd_g^2/n_g + sd_u^2/n_u), in brackets in SE units. Seeds are paired by number (a guarded run is "
    "its unguarded twin bit for bit until the guard acts), but the SE treats the two arms as independent "
    f"samples: it is the SE the rule below was written with (the difference of two {len(RULE_SEEDS)}-seed means). "
    "When the twins' gains go together (positively correlated seeds) it is larger than a paired SE: harder to "
    "show a benefit (part c), easier to pass the no-cost part (b). False restores: restores in a control regime "
    "(the grid's guard_controls), over every run of the guarded arm there."
)
TIME_NOTE = (
    "Shares of the cell's wall time (the whole main_ppo process, start-up included), mean over runs "
    "(min-max). Checkpoints: verl's timing_s/save_checkpoint (trainer.save_freq) plus the guard's "
    "timing_s/sorl_guard (its checkpoints of new bests, its restores and its rule). Validations: verl's "
    "timing_s/testing (every test_freq steps and at the last step); the validation before training "
    "(step 0) is not timed by verl 0.9.1 and is not included."
)


# --- admission and the verdict ----------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """A regime's admission: ``status`` admitted / not admitted / undecided, and why."""

    regime: str
    status: str
    hits: int
    judged: int
    missing: tuple[str, ...] = ()
    reason: str = ""

    def text(self) -> str:
        why = f"{self.hits} of {self.judged} judged seeds meet the rule"
        if self.reason:
            why += f"; {self.reason}"
        if self.missing:
            why += f"; missing {', '.join(self.missing)}"
        return f"{self.regime}: {self.status} ({why})"


def _lost_or_collapsed(run: Mapping) -> bool:
    return bool(run.get("lost_gain")) or bool(run.get("collapsed"))


def admission(
    runs: Sequence[Mapping],
    controls: Sequence[str],
    planned: Mapping[tuple[str, str], Iterable[int]] | None = None,
    twins: Collection[str] = (),
) -> list[Admission]:
    """The admission of every regime other than a control or a protocol twin (``twins``) that has
    unguarded :data:`RULE_UNGUARDED` runs or cells: admitted with >= :data:`ADMIT_MIN_RUNS` hits; not
    admitted when the misses leave too few seeds of :data:`ADMIT_OF_SEEDS`, or every seed the grid plans
    (``planned``: (regime, algorithm) -> seeds) has run; else undecided, naming the planned seeds not yet
    run."""
    cells = by_cell(runs)
    regimes = {r for r, a in cells if a == RULE_UNGUARDED}
    regimes |= {r for r, a in (planned or {}) if a == RULE_UNGUARDED}
    out = []
    for regime in sorted(regimes - set(controls) - set(twins)):
        judged = [r for r in cells.get((regime, RULE_UNGUARDED), {}).values() if r.get("judged")]
        hits = sum(_lost_or_collapsed(r) for r in judged)
        ran = set(cells.get((regime, RULE_UNGUARDED), {}))
        todo = sorted(set((planned or {}).get((regime, RULE_UNGUARDED), ())) - ran)
        missing = tuple(f"{regime}/{RULE_UNGUARDED}/seed{s}" for s in todo)
        reason = ""
        if hits >= ADMIT_MIN_RUNS:
            status = "admitted"
        elif len(judged) - hits > ADMIT_OF_SEEDS - ADMIT_MIN_RUNS:
            status, reason = "not admitted", f"{ADMIT_MIN_RUNS} of {ADMIT_OF_SEEDS} can no longer be reached"
        elif planned is not None and not todo:
            status, reason = "not admitted", "the grid plans no further seed: question 1's search order"
        else:
            status = UNDECIDED
        out.append(Admission(regime, status, hits, len(judged), missing if status == UNDECIDED else (), reason))
    return out


@dataclass(frozen=True)
class Part:
    """One part of the rule: ``status`` holds / fails / undecided, and the evidence or missing cells."""

    name: str
    status: str
    detail: str


def missing_cells(
    cells: Mapping[tuple[str, str], dict[int, Mapping]],
    regime: str,
    algs: Sequence[str],
    seeds: Sequence[int] = RULE_SEEDS,
) -> list[str]:
    """The cells ``<regime>/<algorithm>/seed<k>`` of ``seeds`` (default :data:`RULE_SEEDS`) without a judged
    run (``cells``: :func:`by_cell` of the runs)."""
    return [f"{regime}/{a}/seed{s}" for a in algs for s in seeds if not judged(cells.get((regime, a), {}).get(s, {}))]


def _compare(cells: Mapping, regime: str) -> Diff | None:
    """The final-gain difference :data:`RULE_GUARDED` - :data:`RULE_UNGUARDED` over :data:`RULE_SEEDS`
    in a regime (None while a cell is missing)."""
    if missing_cells(cells, regime, (RULE_UNGUARDED, RULE_GUARDED)):
        return None
    g = [cells[(regime, RULE_GUARDED)][s]["gain"] for s in RULE_SEEDS]
    u = [cells[(regime, RULE_UNGUARDED)][s]["gain"] for s in RULE_SEEDS]
    return Diff.of(g, u)


def _compare_text(regime: str, diff: Diff, k: float, sign: int) -> str:
    line = sign * k * (diff.se or 0.0)
    return f"{regime}: d = {diff.d:+.4f}, SE = {diff.se:.4f}, line {line:+.4f}"


def part_a(runs: Sequence[Mapping], controls: Sequence[str]) -> Part:
    """(a) no restore of :data:`RULE_GUARDED` in any seed of a control regime (a restore in any run fails it)."""
    cells = by_cell(runs)
    restored = [f"{c}/{RULE_GUARDED}/seed{s} ({int(r['guard_restores'])})" for c in controls
                for s, r in sorted(cells.get((c, RULE_GUARDED), {}).items()) if (r.get("guard_restores") or 0) > 0]  # fmt: skip
    if restored:
        return Part("a", FAILS, "restores in " + ", ".join(restored))
    missing = [f"{c}/{RULE_GUARDED}/seed{s}" for c in controls for s in RULE_SEEDS
               if cells.get((c, RULE_GUARDED), {}).get(s, {}).get("guard_restores") is None]  # fmt: skip
    if missing:
        return Part("a", UNDECIDED, "no restore so far; missing " + ", ".join(missing))
    return Part("a", HOLDS, f"0 restores in {len(controls) * len(RULE_SEEDS)} runs")


def part_b(runs: Sequence[Mapping], controls: Sequence[str], k: float = GUARD_DEFAULT_K) -> Part:
    """(b) in each control regime, final-gain difference > -k x SE."""
    cells = by_cell(runs)
    texts, failed, missing = [], False, []
    for c in controls:
        diff = _compare(cells, c)
        if diff is None:
            missing += missing_cells(cells, c, (RULE_UNGUARDED, RULE_GUARDED))
            continue
        failed |= not diff.d > -k * (diff.se or 0.0)
        texts.append(_compare_text(c, diff, k, -1))
    if failed:
        return Part("b", FAILS, "; ".join(texts))
    if missing:
        return Part("b", UNDECIDED, "; ".join([*texts, "missing " + ", ".join(missing)]))
    return Part("b", HOLDS, "; ".join(texts))


def part_c(admitted: Sequence[Admission], runs: Sequence[Mapping], k: float = GUARD_DEFAULT_K) -> Part:
    """(c) in at least one admitted regime, final-gain difference > +k x SE; undecided while an admitted
    regime lacks cells or a regime's admission is undecided."""
    cells = by_cell(runs)
    texts, held, missing = [], False, []
    for a in admitted:
        if a.status == UNDECIDED:
            missing += a.missing or [f"{a.regime}/{RULE_UNGUARDED} (admission)"]
        if a.status != "admitted":
            continue
        diff = _compare(cells, a.regime)
        if diff is None:
            missing += missing_cells(cells, a.regime, (RULE_UNGUARDED, RULE_GUARDED))
            continue
        held |= diff.d > k * (diff.se or 0.0)
        texts.append(_compare_text(a.regime, diff, k, +1))
    if held:
        return Part("c", HOLDS, "; ".join(texts))
    if missing:
        return Part("c", UNDECIDED, "; ".join([*texts, "missing " + ", ".join(missing)]))
    return Part("c", FAILS, "; ".join(texts) or "no admitted regime")


def decision(parts: Sequence[Part]) -> str:
    """GUARD=1 when every part holds, GUARD=0 when one fails; while none fails and some are undecided
    the rule has not shown GUARD=1, so the default is GUARD=0 until it does (the rule keeps GUARD=1
    only if all three hold), and the decision says it is provisional."""
    if any(p.status == FAILS for p in parts):
        return "GUARD=0 (a part fails)"
    if all(p.status == HOLDS for p in parts):
        return "GUARD=1 (every part holds)"
    return "GUARD=0 for now (undecided: no part fails, some lack cells; GUARD=1 needs all three to hold)"


def verdict(
    runs: Sequence[Mapping],
    controls: Sequence[str],
    planned: Mapping[tuple[str, str], Iterable[int]] | None = None,
    k: float = GUARD_DEFAULT_K,
    twins: Collection[str] = (),
) -> str:
    """Markdown: the rule, the admission of each regime, parts (a)-(c) and the decision. Protocol twins
    (``twins``) are left out of the admission, so of part (c); parts (a) and (b) read the controls only,
    which are never twins (the grid refuses one in ``guard_controls``)."""
    if not controls:
        return "No verdict of the GUARD-default rule: the grid names no guard_controls.\n"
    if set(controls) & set(twins):
        raise ValueError(f"a protocol twin is not a control: {sorted(set(controls) & set(twins))}")
    admitted = admission(runs, controls, planned, twins)
    parts = [part_a(runs, controls), part_b(runs, controls, k), part_c(admitted, runs, k)]
    lines = [
        f"### The recipes' GUARD default (rule: {RULE_SOURCE})",
        "",
        rule_text(k),
        "",
        f"Control regimes: {', '.join(controls)}. Admission: {ADMISSION_RULE}.",
        "",
        *[f"- {a.text()}" for a in admitted],
        "",
        *[f"- ({p.name}) **{p.status}**: {p.detail}" for p in parts],
        "",
        f"Decision: **{decision(parts)}**.",
    ]
    return "\n".join(lines) + "\n"


def guard_report(
    runs: Sequence[Mapping],
    controls: Sequence[str],
    planned: Mapping[tuple[str, str], Iterable[int]] | None = None,
    twins: Collection[str] = (),
) -> str:
    """The whole ``<name>_guard.md``: the comparison table, the time table, their notes and the verdict
    (``twins``: the grid's protocol twins, left out of the verdict). ``runs`` are stability.json run
    records with :func:`run_timing`'s keys added."""
    ps = pairs(runs)
    return (
        "## The collapse guard: guarded against unguarded runs\n\n"
        f"{comparison_table(ps, controls)}\n{FOOTNOTES}\n\n"
        f"{time_table(ps)}\n{TIME_NOTE}\n\n{verdict(runs, controls, planned, twins=twins)}"
    )
