"""Issue 49's dose-response table and figure (sorl_verl/study/dose_table.py, cli aggregate) and its grid, dose.yaml."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from sorl_verl.study import cli
from sorl_verl.study.archive import read_archive
from sorl_verl.study.dose_table import (
    DOES_NOT,
    DOMINATES,
    SEEDS,
    UNDECIDED,
    Arm,
    DoseRegime,
    DoseRun,
    answer,
    defaults,
    matched_lr,
    reading,
    rule_text,
    significant,
)
from sorl_verl.study.grid import Grid, load_grid
from sorl_verl.study.runner import changed_keys, write_record

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "recipe" / "sorl" / "study"
TAU_KEY = "actor_rollout_ref.actor.policy_loss.clip_norm_tau"


def runs(gains: list[float], peaks: list[float] | None = None, scales: list[float] | None = None) -> tuple:
    """DoseRuns of seeds 1..n with these final (and peak) gains; each run logs ``scales`` (lr 3e-4)."""
    peaks = peaks or [max(g, 0.0) for g in gains]
    return tuple(
        DoseRun(s, g, p, None, None, None, None, None, tuple(scales or ()), 3e-4)
        for s, (g, p) in enumerate(zip(gains, peaks, strict=True), 1)
    )


def arm(label: str, gains: list[float], peaks: list[float] | None = None, tau: float | None = None, **kw) -> Arm:
    done = runs(gains, peaks, kw.pop("scales", None))
    missing = tuple(f"r/{label}/seed{s}" for s in SEEDS if s > len(gains))
    return Arm(label, "r", label, tau, done, missing)


# --- the standard error and the rule ----------------------------------------------------------


def test_the_difference_and_its_se_are_those_of_two_independent_means_by_hand():
    # tau: mean 0.2, variance (0.01 + 0 + 0.01) / 2 = 0.01; control: mean 0.1, variance (0.01 + 0.01 + 0.04) / 2
    # = 0.03; SE = sqrt(0.01 / 3 + 0.03 / 3)
    r = reading(arm("t", [0.1, 0.2, 0.3], tau=0.02), arm("grpo", [0.0, 0.0, 0.3]))
    assert r.final.d == pytest.approx(0.1) and r.final.se == pytest.approx(math.sqrt(0.04 / 3), rel=1e-12)
    # d = 0.1 < 2 x 0.115: not beyond noise
    assert r.status == DOES_NOT
    assert "final d = +0.1000, SE 0.1155, line +0.2309" in r.text()


def test_a_tau_dominates_when_its_final_gain_is_2_se_above_and_its_peak_not_2_se_below():
    control = arm("grpo", [-0.10, -0.08, -0.12], [0.05, 0.02, 0.04])
    # final d = +0.10, SE sqrt(0.0001/3 * 2) = 0.0082: far beyond 2 SE; peaks equal
    assert reading(arm("t", [0.0, 0.02, -0.02], [0.05, 0.02, 0.04], 0.02), control).status == DOMINATES
    # the same final gains with peaks lower by 0.03 (SE of the peak difference 0.017): peak lower by > 2 SE
    lower = reading(arm("t", [0.0, 0.02, -0.02], [0.02, -0.01, 0.01], 0.02), control)
    assert lower.status == DOES_NOT and lower.peak.d == pytest.approx(-0.03)
    # final gain 1 SE above: does not
    assert reading(arm("t", [-0.09, -0.07, -0.11], [0.05, 0.02, 0.04], 0.02), control).status == DOES_NOT


def test_a_missing_seed_of_either_arm_leaves_the_reading_undecided_naming_the_cells():
    r = reading(arm("t", [0.5, 0.5], tau=0.01), arm("grpo", [0.0]))
    assert r.status == UNDECIDED
    assert r.missing == ("r/t/seed3", "r/grpo/seed2", "r/grpo/seed3")
    assert r.text() == "t (tau 0.01) against grpo: **undecided**: missing r/t/seed3, r/grpo/seed2, r/grpo/seed3"


def test_the_answer_and_the_defaults_follow_the_rule():
    control, matched = arm("grpo", [-0.1, -0.08, -0.12]), arm("matched", [-0.05, -0.04, -0.06])
    strong, weak = arm("t2", [0.0, 0.02, -0.02], tau=0.02), arm("t5", [-0.09, -0.07, -0.11], tau=0.05)
    open_ = arm("t1", [0.3], tau=0.01)
    vs_c = [reading(a, control) for a in (weak, strong)]
    vs_m = [reading(a, matched) for a in (weak, strong)]
    assert answer(vs_m).startswith("yes (t2 dominates")
    assert defaults(vs_c, vs_m) == "change to clip_norm_tau 0.02 (t2), clip_norm_reference gradient"
    # t2 dominates grpo but not the matched control: no change, and "no" once every tau is decided
    late = arm("matched", [0.0, 0.02, -0.02])
    vs_late = [reading(a, late) for a in (weak, strong)]
    assert answer(vs_late) == "no (no tau dominates matched-step grpo)"
    assert defaults(vs_c, vs_late) == "unchanged (no tau dominates both controls)"
    # an undecided tau keeps the answer open while none dominates
    vs_open = [*vs_late, reading(open_, late)]
    assert answer(vs_open).startswith("undecided (t1 not yet decided")
    assert defaults([*vs_c, reading(open_, control)], vs_open).startswith("unchanged for now (undecided")


def test_the_rule_text_is_the_one_learning_yaml_and_dose_yaml_wrote():
    for name in ("learning.yaml", "dose.yaml"):
        comment = " ".join(line.lstrip("# ").strip() for line in (STUDY / name).read_text().splitlines()
                           if line.lstrip().startswith("#"))  # fmt: skip
        assert rule_text() in re.sub(r"\s+", " ", comment), name


# --- the matched-step lr ----------------------------------------------------------------------


def test_significant_digits():
    assert significant(0.7792) == 0.78
    assert significant(0.012345) == 0.012
    assert significant(0.996) == 1.0
    assert significant(3.14159, 3) == 3.14
    assert significant(0.0) == 0.0


def dose(*variants: Arm) -> DoseRegime:
    return DoseRegime("r", 3, 4, arm("grpo", [-0.1, -0.1, -0.1]), arm("matched", []), tuple(variants))


def test_the_matched_lr_is_the_best_taus_mean_step_scale_rounded_times_its_lr():
    weak = arm("t5", [-0.09, -0.07, -0.11], tau=0.05, scales=[1.0, 0.9])
    strong = arm("t2", [0.0, 0.02, -0.02], tau=0.02, scales=[0.61, 0.62, 0.58, 0.6])
    m = matched_lr(dose(weak, strong))
    # the best tau by mean final gain (t2: 0.0); m over its 3 x 4 steps = 0.6025 -> 0.6; 3e-4 x 0.6
    assert m.best is strong and m.m == pytest.approx(0.6025) and m.m_rounded == 0.6
    assert m.lr == pytest.approx(1.8e-4) and m.steps == 12 and m.provisional == ()
    assert m.text().endswith("Regime to add: r_matched = r with actor_rollout_ref.actor.optim.lr: 0.00018")
    assert "(final: every tau has its seeds)" in m.text()
    # a tau without its seeds: the pick is provisional and names the missing cells
    m = matched_lr(dose(weak, arm("t1", [-0.2], tau=0.01, scales=[0.5])))
    assert m.best.label == "t5" and m.m_rounded == 0.95 and m.lr == pytest.approx(2.85e-4)
    assert m.provisional == ("r/t1/seed2", "r/t1/seed3") and "provisional, 2 cells" in m.text()
    # no tau run yet, or no step scale logged: none
    assert matched_lr(dose(arm("t5", [], tau=0.05), arm("t2", [], tau=0.02))) is None
    assert matched_lr(dose(arm("t5", [0.1, 0.1, 0.1], tau=0.05), arm("t2", [], tau=0.02))) is None


# --- the table on a tiny archive --------------------------------------------------------------

GRID = """\
    name: g
    steps: 4
    test_freq: 2
    seed_keys: [data.seed]
    regimes:
      jump:
        overrides: {actor_rollout_ref.actor.optim.lr: 3.0e-4, sorl.fault_injection.from_step: 3}
      jump_matched:
        overrides: {actor_rollout_ref.actor.optim.lr: 1.8e-4, sorl.fault_injection.from_step: 3}
    algorithms:
      grpo: {}
      so_grpo_grad: {overrides: {actor_rollout_ref.actor.policy_loss.clip_norm_tau: 0.05}}
      so_grpo_grad_tau0.02: {overrides: {actor_rollout_ref.actor.policy_loss.clip_norm_tau: 0.02}}
    cells:
      - {regimes: [jump], algorithms: [grpo, so_grpo_grad, so_grpo_grad_tau0.02], seeds: [1, 2, 3]}
      - {regimes: [jump_matched], algorithms: [grpo], seeds: [1, 2, 3]}
    """

#: validation scores at steps 0, 2, 4 (both sources alike) and the step scales of steps 1-4, by (algorithm, seed)
VALS = {
    ("jump", "grpo"): [[0.2, 0.25, 0.1], [0.2, 0.22, 0.12], [0.2, 0.24, 0.08]],
    ("jump_matched", "grpo"): [[0.2, 0.25, 0.15], [0.2, 0.22, 0.16], [0.2, 0.24, 0.14]],
    ("jump", "so_grpo_grad"): [[0.2, 0.26, 0.11], [0.2, 0.23, 0.13], [0.2, 0.25, 0.09]],
    ("jump", "so_grpo_grad_tau0.02"): [[0.2, 0.25, 0.2], [0.2, 0.22, 0.22]],  # seed 3 not run
}
SCALES = {"so_grpo_grad": [1.0, 0.9, 0.8, 0.7], "so_grpo_grad_tau0.02": [0.61, 0.62, 0.58, 0.6]}
#: the share of micro-batches with Z > 1 at steps 1-4
TRIGGERED = {"so_grpo_grad": [0.0, 0.25, 0.25, 0.5], "so_grpo_grad_tau0.02": [0.5, 0.25, 0.5, 0.5]}


def write_runs(out: Path, grid: Grid) -> None:
    for c in grid.cells:
        series = VALS.get((c.regime, c.algorithm), [])
        if c.seed > len(series):
            continue
        d = out / c.key
        d.mkdir(parents=True)
        vals = series[c.seed - 1]
        recs = [{"step": 2 * i, "data": {f"val-core/synthetic_{h}hop/reward/mean@1": v for h in (1, 2)}}
                for i, v in enumerate(vals)]  # fmt: skip
        for s in range(1, 5):
            data = {"training/global_step": s, "actor/grad_norm": 0.5}
            if c.algorithm in SCALES:
                data["actor/sorl/update_scale"] = SCALES[c.algorithm][s - 1]
                data["actor/sorl/triggered"] = TRIGGERED[c.algorithm][s - 1]
            recs.append({"step": s, "data": data})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        write_record(d, {"key": c.key, "regime": c.regime, "algorithm": c.algorithm, "seed": c.seed, "steps": 4,
                         "status": "done", "exit_code": 0, "wall_s": 100.0, "overrides": dict(c.overrides)})  # fmt: skip


def test_aggregate_writes_the_dose_table_and_figure_from_an_archive(tmp_path, write_grid, capsys):
    out, res = tmp_path / "out", tmp_path / "res"
    path = write_grid(tmp_path, GRID)
    grid = load_grid(path)
    write_runs(out, grid)
    archive = tmp_path / "g.tar.xz"
    assert cli.main(["archive", "--grid", str(path), "--out", str(out), "--archive", str(archive)]) == 0
    assert len(read_archive(archive)) == 11
    assert cli.main(["aggregate", "--grid", str(path), "--from-archive", "--archive", str(archive),
                     "--results", str(res)]) == 0  # fmt: skip
    text = (res / "stability_dose.md").read_text()
    assert (res / "stability_dose.png").stat().st_size > 0
    assert "### jump (lr jump at step 3)" in text and "### jump_matched" not in text
    assert "| step scale, steps 1-2 | step scale, steps 3-4 | share of micro-batches scaled (Z > 1) |" in text
    # grpo: finals -0.1, -0.08, -0.12; peaks 0.05, 0.02, 0.04; 2-hop best 0.25/0.22/0.24, end 0.1/0.12/0.08
    assert "| grpo | - | 1,2,3 | -0.100 ± 0.020 | +0.037 ± 0.015 |" in text
    # against matched-step grpo (finals -0.05 ± 0.01): d = -0.05, SE = sqrt(0.02^2 / 3 + 0.01^2 / 3) = 0.0129
    assert (
        "| 0.237 ± 0.015 | 0.100 ± 0.020 | - | - | - | - | - | -0.050 ± 0.013 (-3.9 SE) | +0.000 ± 0.012 (+0.0 SE) |"
        in text
    )
    # tau 0.05: step scale 0.95 before the jump, 0.75 after, a quarter of the micro-batches scaled (mean of
    # 0, 0.25, 0.25, 0.5); final +0.010 ± 0.016 above grpo
    row = next(line for line in text.splitlines() if line.startswith("| so_grpo_grad | 0.05 |"))
    assert "| 0.950 ± 0.000 | 0.750 ± 0.000 | 0.250 ± 0.000 | +0.010 ± 0.016 (+0.6 SE) |" in row
    # tau 0.02: 0.4375 scaled in both seeds (grpo logs no share: its '-' in the matched-step row above)
    row = next(line for line in text.splitlines() if line.startswith("| so_grpo_grad_tau0.02 | 0.02 |"))
    assert "| 0.438 ± 0.000 | +" in row
    assert "| matched-step grpo (jump_matched) | - | 1,2,3 | -0.050 ± 0.010 |" in text
    assert "- so_grpo_grad (tau 0.05) against grpo: **does not dominate**" in text
    assert "- so_grpo_grad (tau 0.05) against matched-step grpo: **does not dominate**" in text
    assert (
        "- so_grpo_grad_tau0.02 (tau 0.02) against grpo: **undecided**: missing jump/so_grpo_grad_tau0.02/seed3" in text
    )
    assert "Answer in jump: **undecided (so_grpo_grad_tau0.02 not yet decided" in text
    # the best tau so far is tau 0.02 (final +0.010 over seeds 1-2), provisional; m 0.6025 -> 0.6
    assert (
        "Matched-step lr for jump (provisional, 1 cells of the taus missing: jump/so_grpo_grad_tau0.02/seed3)" in text
    )
    assert "lr = 0.0003 x 0.6 = 0.00018. Regime to add: jump_matched = jump with" in text
    assert "Matched-step lr for jump (provisional" in capsys.readouterr().out


def test_no_dose_table_for_a_grid_with_fewer_than_two_doses(tmp_path, write_grid):
    out, res = tmp_path / "out", tmp_path / "res"
    path = write_grid(tmp_path, GRID.replace(", so_grpo_grad_tau0.02], seeds", "], seeds"))
    write_runs(out, load_grid(path))
    assert cli.main(["aggregate", "--grid", str(path), "--out", str(out), "--results", str(res), "--no-plots"]) == 0
    assert (res / "stability_headline.md").exists() and not (res / "stability_dose.md").exists()


# --- the grids --------------------------------------------------------------------------------


def test_dose_yaml_runs_the_four_arms_seed_by_seed_from_the_pinned_avx512_warm_start():
    dose_grid, learning, natural = (load_grid(STUDY / f"{n}.yaml") for n in ("dose", "learning", "natural"))
    arms = ["grpo", "so_grpo_grad", "so_grpo_grad_tau0.02", "so_grpo_grad_tau0.01"]
    assert [c.key for c in dose_grid.cells] == [
        *(f"updates16_const_jump21/{a}/seed{s}" for s in (1, 2, 3) for a in arms),
        *(f"updates16_const_jump21_matched/grpo/seed{s}" for s in (1, 2, 3)),
    ]  # seed 1 of every arm first, matched-step grpo last
    assert dose_grid.name == "dose" and dose_grid.warmstart == learning.warmstart == "early-stop-50"
    assert dose_grid.warmstart_pin == natural.warmstart_pin and dose_grid.warmstart_pin.is_file()
    assert dose_grid.warmstart_digest is None and learning.warmstart_digest == "4a317b47011afc65"
    assert "601fbc378da4b285" in dose_grid.warmstart_pin.name
    assert [float(dose_grid.algorithms[a].overrides.get(TAU_KEY, "nan")) for a in arms[1:]] == [0.05, 0.02, 0.01]
    # the learning grid's cells of the same keys, override for override (steps, validation, seeds included)
    same = {c.key: c for c in learning.cells}
    for c in dose_grid.cells:
        if c.regime.endswith("_matched"):
            continue
        assert list(c.overrides.items()) == list(same[c.key].overrides.items()), c.key
        assert (c.steps, c.test_freq, c.val_max_samples) == (50, 10, 300)
    assert dose_grid.seed_keys == learning.seed_keys and dose_grid.common == learning.common


def test_dose_yamls_matched_step_regime_is_the_rules_lr_from_the_committed_archive(tmp_path):
    """updates16_const_jump21_matched is updates16_const_jump21 with one change, the base lr, and that lr is
    what the rule gives from the committed runs of the three taus (final: every tau has seeds 1-3)."""
    from sorl_verl.study.aggregate import LR_KEY, stability
    from sorl_verl.study.dose_table import write_dose_table

    grid = load_grid(STUDY / "dose.yaml")
    jump, matched = grid.regimes["updates16_const_jump21"], grid.regimes["updates16_const_jump21_matched"]
    assert {k: v for k, v in matched.overrides.items() if k != LR_KEY} == {
        k: v for k, v in jump.overrides.items() if k != LR_KEY
    }
    tau_cells = [c for c in grid.cells if c.regime == "updates16_const_jump21"]
    found = read_archive(ROOT / "docs" / "results" / "study" / "dose.tar.xz", {c.key for c in tau_cells})
    assert len(found) == len(tau_cells) == 12
    data = stability(found, grid.name, "test", pending=[], changed={})
    written = write_dose_table(grid, tau_cells, found, data["runs"], tmp_path, "dose", plots=False)
    assert written is not None
    (lr,) = written[1]
    assert lr.provisional == () and lr.seeds == (1, 2, 3) and lr.base_lr == float(jump.overrides[LR_KEY])
    assert float(matched.overrides[LR_KEY]) == lr.lr == pytest.approx(3e-4 * lr.m_rounded, rel=1e-9)


def test_dose_yaml_copies_learning_yamls_matched_step_definition_and_reading_rule_word_for_word():
    def comment(name: str) -> str:
        lines = [line.strip().lstrip("#").strip() for line in (STUDY / name).read_text().splitlines()]
        return " ".join(line for line in lines if line)

    learning, dose_text = comment("learning.yaml"), comment("dose.yaml")
    for start, end in (("2. MATCHED-STEP GRPO:", "reported too.)"), ("READING RULE:", "gradient reference.")):
        block = learning[learning.index(start) : learning.index(end, learning.index(start)) + len(end)]
        assert block in dose_text, start
    assert "ee95365" in dose_text and "Written 2026-11-28 before any of its runs" in dose_text


def test_learning_yaml_keeps_every_archived_cell_as_it_ran():
    """The shared definitions moved to presets.yaml: every archived learning run still matches its cell (the one
    run made before grpo logged the diagnostic, updates16/grpo/seed1, as before)."""
    grid = load_grid(STUDY / "learning.yaml")
    cells = {c.key: c for c in grid.cells}
    found = read_archive(ROOT / "docs" / "results" / "study" / "learning.tar.xz")
    assert len(found) == 25
    changed = {rec["key"]: keys for rec, _ in found if (keys := changed_keys(rec, cells[rec["key"]]))}
    assert changed == {"updates16/grpo/seed1": ["actor_rollout_ref.actor.policy_loss.loss_mode"]}
    assert {c.key for c in grid.cells if c.algorithm.startswith("so_grpo_grad_tau")} == {
        f"updates16_const_jump21/so_grpo_grad_tau{t}/seed{s}" for t in ("0.02", "0.01") for s in (1, 2, 3)
    }
