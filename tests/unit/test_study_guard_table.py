"""The guard comparison table and the GUARD-default verdict (sorl_verl/study/guard_table.py, cli aggregate)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from sorl_verl.study import cli
from sorl_verl.study.grid import load_grid
from sorl_verl.study.guard_table import (
    FAILS,
    GUARD_DEFAULT_K,
    HOLDS,
    RULE_SEEDS,
    UNDECIDED,
    admission,
    comparison_table,
    decision,
    diff_se,
    guard_report,
    pairs,
    part_a,
    part_b,
    part_c,
    rule_text,
    run_timing,
    share,
    time_table,
    verdict,
)
from sorl_verl.study.metrics import read_trace
from sorl_verl.study.runner import write_record

ROOT = Path(__file__).resolve().parents[2]


def run(regime: str, alg: str, seed: int, gain: float, peak: float | None = None, restores: int | None = None,
        lost: bool = False, collapsed: bool = False, judged: bool = True, **extra) -> dict:  # fmt: skip
    """A run record as stability.json carries it (only the keys the guard table reads)."""
    rec = {"regime": regime, "algorithm": alg, "seed": seed, "judged": judged, "gain": gain,
           "peak_gain": gain if peak is None else peak, "lost_gain": lost, "collapsed": collapsed, **extra}  # fmt: skip
    if alg.endswith("_guard"):
        rec["guard_restores"] = 0 if restores is None else restores
    return rec


def arms(regime: str, unguarded: list[float], guarded: list[float], restores: list[int] | None = None) -> list[dict]:
    """grpo and grpo_guard runs of seeds 1..n with these final gains (restores of the guarded arm)."""
    restores = restores or [0] * len(guarded)
    return [run(regime, "grpo", s, g) for s, g in enumerate(unguarded, 1)] + [
        run(regime, "grpo_guard", s, g, restores=r) for s, (g, r) in enumerate(zip(guarded, restores, strict=True), 1)
    ]


# --- the standard error -----------------------------------------------------------------------


def test_diff_se_is_the_se_of_two_independent_means_by_hand():
    # a: mean 0.2, deviations -0.1, 0, 0.1 -> variance (0.01 + 0 + 0.01) / 2 = 0.01
    # b: mean 0.1, deviations -0.1, -0.1, 0.2 -> variance (0.01 + 0.01 + 0.04) / 2 = 0.03
    # SE = sqrt(0.01 / 3 + 0.03 / 3) = sqrt(0.04 / 3)
    assert diff_se([0.1, 0.2, 0.3], [0.0, 0.0, 0.3]) == pytest.approx(math.sqrt(0.04 / 3), rel=1e-12)
    # unequal sizes: a = (0, 0.2): variance 0.02 / 1; SE = sqrt(0.02 / 2 + 0.03 / 3) = sqrt(0.02)
    assert diff_se([0.0, 0.2], [0.0, 0.0, 0.3]) == pytest.approx(math.sqrt(0.02), rel=1e-12)
    assert diff_se([0.1], [0.1, 0.2]) is None


def test_the_table_row_shows_means_the_difference_its_se_and_the_restores():
    runs = arms("hot", [0.10, 0.20, 0.30], [0.30, 0.20, 0.40], restores=[1, 0, 2])
    row = comparison_table(pairs(runs), controls=["demo"]).splitlines()[2]
    # d = 0.3 - 0.2 = 0.1; SE = sqrt(0.01/3 + 0.01/3) = 0.0816 -> 1.2 SE
    assert row.startswith(
        "| hot | grpo_guard - grpo | 1,2,3 | +0.200 ± 0.100 | +0.300 ± 0.100 | +0.100 ± 0.082 (+1.2 SE) |"
    )
    assert row.endswith("| 0/3 vs 0/3 | 1.0 (1, 0, 2) | - (not a control) |")


def test_only_the_seeds_both_arms_have_are_compared_and_the_others_named():
    runs = arms("hot", [0.1, 0.2, 0.3], [0.1, 0.2]) + [run("hot", "so_grpo_guard", 1, 0.5)]
    ps = {(p.regime, p.guarded): p for p in pairs(runs)}
    assert ps[("hot", "grpo_guard")].seeds == (1, 2)
    assert ps[("hot", "grpo_guard")].only == "grpo also 3"
    # a guarded arm without its twin: a row with no seeds in common
    assert ps[("hot", "so_grpo_guard")].unguarded == "so_grpo" and ps[("hot", "so_grpo_guard")].seeds == ()
    table = comparison_table(list(ps.values()), [])
    assert "| hot | so_grpo_guard - so_grpo | none in common (so_grpo_guard also 1) | - | - | - |" in table


# --- false restores ---------------------------------------------------------------------------


def test_a_restore_in_a_control_regime_is_a_false_one():
    runs = arms("demo", [0.1, 0.2, 0.3], [0.1, 0.2, 0.3], restores=[0, 1, 0])
    runs += arms("hot", [0.1, 0.2, 0.3], [0.1, 0.2, 0.3], restores=[2, 0, 0])
    rows = {line.split("|")[1].strip(): line for line in comparison_table(pairs(runs), ["demo"]).splitlines()[2:]}
    assert rows["demo"].endswith("| 0.3 (0, 1, 0) | 1 in 3 runs |")
    assert rows["hot"].endswith("| 0.7 (2, 0, 0) | - (not a control) |")
    # an unjudged control run's restore still counts as a false one (and fails part a)
    failed = run("demo", "grpo_guard", 4, 0.0, restores=3, judged=False)
    rows = comparison_table(pairs([*runs, failed]), ["demo"]).splitlines()
    assert rows[2].endswith("| 4 in 4 runs |")
    assert (
        part_a([*runs, failed], ["demo"]).detail == "restores in demo/grpo_guard/seed2 (1), demo/grpo_guard/seed4 (3)"
    )


# --- the rule, part by part -------------------------------------------------------------------


def test_part_a_holds_fails_and_is_undecided():
    assert part_a(arms("demo", [0.1] * 3, [0.1] * 3), ["demo"]).status == HOLDS
    failed = part_a(arms("demo", [0.1], [0.1], restores=[1]), ["demo"])  # one restore decides, seeds missing or not
    assert failed.status == FAILS and failed.detail == "restores in demo/grpo_guard/seed1 (1)"
    open_ = part_a(arms("demo", [0.1] * 3, [0.1] * 2), ["demo"])
    assert open_.status == UNDECIDED and open_.detail.endswith("missing demo/grpo_guard/seed3")


def test_part_b_holds_fails_and_is_undecided():
    # d = 0 > -2 SE
    assert part_b(arms("demo", [0.10, 0.12, 0.14], [0.10, 0.12, 0.14]), ["demo"]).status == HOLDS
    # d = -0.11, SE = sqrt(0.0001/3 + 0.0004/3) = 0.0129: -0.11 < -0.026
    failed = part_b(arms("demo", [0.10, 0.12, 0.14], [0.00, 0.01, 0.02]), ["demo"])
    assert failed.status == FAILS and "d = -0.1100, SE = 0.0129, line -0.0258" in failed.detail
    # inside the line: d = -0.02, SE = sqrt(0.0004/3 + 0.0004/3) = 0.0163, line -0.0327
    assert part_b(arms("demo", [0.10, 0.12, 0.14], [0.08, 0.10, 0.12]), ["demo"]).status == HOLDS
    # outside it: d = -0.04, SE = 0.0129, line -0.0258
    assert part_b(arms("demo", [0.10, 0.12, 0.14], [0.07, 0.08, 0.09]), ["demo"]).status == FAILS
    open_ = part_b(arms("demo", [0.1, 0.1], [0.1, 0.1, 0.1]), ["demo"])
    assert open_.status == UNDECIDED and open_.detail == "missing demo/grpo/seed3"


def hot_lost(gains: list[float], lost: list[bool]) -> list[dict]:
    return [run("hot", "grpo", s, g, peak=0.2, lost=x) for s, (g, x) in enumerate(zip(gains, lost, strict=True), 1)]


def test_part_c_holds_fails_and_is_undecided():
    unguarded = hot_lost([0.02, 0.03, 0.10], [True, True, False])  # admitted: 2 of 3
    admitted = admission(unguarded, ["demo"])
    assert [(a.regime, a.status) for a in admitted] == [("hot", "admitted")]
    # d = 0.15 - 0.05 = 0.10, SE = sqrt(0.0001/3 + 0.0019/3) = 0.0258: 0.10 > 0.0516
    better = [run("hot", "grpo_guard", s, g) for s, g in enumerate([0.14, 0.15, 0.16], 1)]
    held = part_c(admitted, [*unguarded, *better])
    assert held.status == HOLDS and "d = +0.1000, SE = 0.0258, line +0.0516" in held.detail
    same = [run("hot", "grpo_guard", s, g) for s, g in enumerate([0.02, 0.03, 0.10], 1)]
    assert part_c(admitted, [*unguarded, *same]).status == FAILS
    # better, but not by 2 SE: d = 0.07 - 0.05 = 0.02, SE = sqrt(0.0013/3 + 0.0019/3) = 0.0327, line +0.0653
    slightly = [run("hot", "grpo_guard", s, g) for s, g in enumerate([0.04, 0.06, 0.11], 1)]
    short = part_c(admitted, [*unguarded, *slightly])
    assert short.status == FAILS and "d = +0.0200, SE = 0.0327, line +0.0653" in short.detail
    open_ = part_c(admitted, [*unguarded, *better[:2]])
    assert open_.status == UNDECIDED and open_.detail == "missing hot/grpo_guard/seed3"
    # no admitted regime and none left to decide: fails
    assert part_c(admission(hot_lost([0.1] * 3, [False] * 3), ["demo"]), []).detail == "no admitted regime"
    assert part_c(admission(hot_lost([0.1] * 3, [False] * 3), ["demo"]), []).status == FAILS


def test_part_c_waits_for_a_regime_whose_admission_is_open():
    unguarded = hot_lost([0.02, 0.03, 0.10], [True, True, False])
    same = [run("hot", "grpo_guard", s, g) for s, g in enumerate([0.02, 0.03, 0.10], 1)]
    planned = {("cold", "grpo"): {1}, ("hot", "grpo"): {1, 2, 3}}
    admitted = admission([*unguarded, *same], ["demo"], planned)
    assert [(a.regime, a.status) for a in admitted] == [("cold", UNDECIDED), ("hot", "admitted")]
    c = part_c(admitted, [*unguarded, *same])
    assert c.status == UNDECIDED and c.detail.endswith("missing cold/grpo/seed1")


def test_admission_counts_lost_or_collapsed_seeds_of_unguarded_grpo():
    def status(runs, planned=None):
        return [(a.regime, a.status, a.hits, a.judged) for a in admission(runs, ["demo"], planned)]

    collapsed = [run("hot", "grpo", 1, -0.2, collapsed=True), *hot_lost([0.02], [True])]
    collapsed[1]["seed"] = 2
    assert status(collapsed) == [("hot", "admitted", 2, 2)]
    assert status(hot_lost([0.1, 0.1], [False, False])) == [("hot", "not admitted", 0, 2)]
    # one miss, no grid: still open; with a grid that plans no more seeds: not admitted (search order)
    assert status(hot_lost([0.1], [False])) == [("hot", UNDECIDED, 0, 1)]
    assert status(hot_lost([0.1], [False]), {("hot", "grpo"): {1}}) == [("hot", "not admitted", 0, 1)]
    # the control regime is never a candidate; a guarded run does not count
    assert status(arms("demo", [0.0] * 3, [0.0] * 3)) == []
    assert status([run("hot", "grpo_guard", 1, 0.0, lost=True)]) == []
    # an unjudged run counts neither way
    assert status([*hot_lost([0.02], [True]), run("hot", "grpo", 2, 0.0, lost=True, judged=False)]) == [
        ("hot", UNDECIDED, 1, 1)
    ]


def test_the_decision_needs_every_part_and_one_failure_decides():
    from sorl_verl.study.guard_table import Part

    held, failed, open_ = Part("a", HOLDS, ""), Part("b", FAILS, ""), Part("c", UNDECIDED, "")
    assert decision([held, held, held]).startswith("GUARD=1")
    assert decision([held, failed, open_]).startswith("GUARD=0")
    assert decision([held, held, open_]).startswith("GUARD=0 for now (undecided")


def test_the_verdict_names_the_rule_its_source_admission_and_parts():
    runs = arms("demo", [0.10, 0.12, 0.14], [0.10, 0.12, 0.14])
    runs += hot_lost([0.02, 0.03, 0.10], [True, True, False])
    runs += [run("hot", "grpo_guard", s, g) for s, g in enumerate([0.14, 0.15, 0.16], 1)]
    text = verdict(runs, ["demo"], {("hot", "grpo"): {1, 2, 3}})
    assert "(rule: recipe/sorl/study/natural.yaml, question 4" in text and rule_text() in text
    assert "- hot: admitted (2 of 3 judged seeds meet the rule)" in text
    assert "- (a) **holds**: 0 restores in 3 runs" in text and "- (b) **holds**" in text and "- (c) **holds**" in text
    assert text.rstrip().endswith("Decision: **GUARD=1 (every part holds)**.")
    assert verdict(runs, []).startswith("No verdict")


def test_a_protocol_twin_is_no_admission_candidate_and_part_c_does_not_wait_for_it():
    # hot admitted (2 of 3), the guard no better there: (c) fails once nothing else is open
    runs = arms("demo", [0.10, 0.12, 0.14], [0.10, 0.12, 0.14])
    runs += hot_lost([0.02, 0.03, 0.10], [True, True, False])
    runs += [run("hot", "grpo_guard", s, g) for s, g in enumerate([0.02, 0.03, 0.10], 1)]
    # hot_p5 and demo_p5: the two regimes' training under another protocol, planned, one run so far
    runs += [run("hot_p5", "grpo", 1, 0.0, peak=0.2, lost=True)]
    planned = {("hot", "grpo"): {1, 2, 3}, ("hot_p5", "grpo"): {1, 2, 3}, ("demo_p5", "grpo"): {1, 2, 3}}
    twins = {"hot_p5", "demo_p5"}
    assert [(a.regime, a.status) for a in admission(runs, ["demo"], planned)] == [
        ("demo_p5", UNDECIDED), ("hot", "admitted"), ("hot_p5", UNDECIDED)
    ]  # fmt: skip
    assert [(a.regime, a.status) for a in admission(runs, ["demo"], planned, twins)] == [("hot", "admitted")]
    # without the twins known, (c) waits for their cells; with them it is decided
    assert "- (c) **undecided**" in verdict(runs, ["demo"], planned) and "hot_p5" in verdict(runs, ["demo"], planned)
    text = verdict(runs, ["demo"], planned, twins=twins)
    assert "_p5" not in text
    assert "- (c) **fails**: hot: d = +0.0000" in text and "Decision: **GUARD=0 (a part fails)**." in text
    assert guard_report(runs, ["demo"], planned, twins=twins).endswith(text)
    # (a) and (b) read the controls, which a twin never is
    with pytest.raises(ValueError, match="a protocol twin is not a control"):
        verdict(runs, ["demo", "demo_p5"], planned, twins=twins)


def test_the_rule_text_and_the_grid_comment_agree():
    """natural.yaml's question 4 states the same multiple of the SE and the same number of seeds as the code."""
    comment = "\n".join(line for line in (ROOT / "recipe/sorl/study/natural.yaml").read_text().splitlines()
                        if line.startswith("#"))  # fmt: skip
    comment = re.sub(r"\s*\n#\s*", " ", comment)
    n = len(RULE_SEEDS)
    assert f"> -{GUARD_DEFAULT_K:g} x its standard error (SE of the difference of two {n}-seed means)" in comment
    assert f"> +{GUARD_DEFAULT_K:g} x its standard error" in comment
    assert f"restores 0 times in each of the demo regime's {n} seeds" in comment
    assert f"-{GUARD_DEFAULT_K:g} x its standard error (SE of the difference of two {n}-seed means)" in rule_text()


# --- wall-time shares -------------------------------------------------------------------------


def test_checkpoint_and_validation_time_from_a_metrics_file(tmp_path):
    step0 = {"step": 0, "data": {"val-core/s/reward/mean@1": 0.2}}  # verl logs no timing for it
    lines = [step0] + [
        {
            "step": s,
            "data": {
                "training/global_step": s,
                "timing_s/step": 5.0,
                **({"timing_s/testing": 12.5, "val-core/s/reward/mean@1": 0.3} if s % 2 == 0 else {}),
                **({"timing_s/save_checkpoint": 3.0} if s == 4 else {}),
                "timing_s/sorl_guard": 0.25,
            },
        }  # fmt: skip
        for s in range(1, 5)
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    timing = run_timing(read_trace(path))
    # checkpoints: 3.0 (verl's, step 4) + 4 x 0.25 (the guard's); validations: steps 2 and 4
    assert timing == {"checkpoint_s": 4.0, "validation_s": 25.0}
    assert share({**timing, "wall_s": 200.0}, "checkpoint_s") == pytest.approx(0.02)
    assert share({**timing, "wall_s": 200.0}, "validation_s") == pytest.approx(0.125)
    assert share({**timing, "wall_s": None}, "validation_s") is None
    assert run_timing(read_trace(tmp_path / "absent.jsonl")) == {"checkpoint_s": 0.0, "validation_s": 0.0}


def test_the_time_table_shows_both_arms_mean_and_range_of_the_shares():
    runs = [{**r, "wall_s": 100.0 * r["seed"], "checkpoint_s": 1.0, "validation_s": 10.0}
            for r in arms("demo", [0.1, 0.2], [0.1, 0.2])]  # fmt: skip
    rows = time_table(pairs(runs)).splitlines()
    # shares 1% and 0.5% (mean 0.75%), 10% and 5% (mean 7.5%)
    assert rows[2] == "| demo | grpo | 2 | 1.00 | 0.750% (0.500-1.000) | 10.0 | 7.500% (5.000-10.000) | 150 |"
    assert rows[3].startswith("| demo | grpo_guard | 2 |")


# --- aggregate writes it ----------------------------------------------------------------------


def cell(out: Path, regime: str, alg: str, seed: int, vals: list[float], restores: int | None = None) -> None:
    d = out / regime / alg / f"seed{seed}"
    d.mkdir(parents=True)
    recs = [{"step": 2 * i, "data": {"val-core/s1/reward/mean@1": v}} for i, v in enumerate(vals)]
    for s in range(1, 5):
        data = {"training/global_step": s, "actor/grad_norm": 0.5, "timing_s/testing": 2.0}
        if restores is not None:
            data |= {"sorl/guard/restores": float(restores if s == 4 else 0), "timing_s/sorl_guard": 0.5}
        recs.append({"step": s, "data": data})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    write_record(d, {"key": f"{regime}/{alg}/seed{seed}", "regime": regime, "algorithm": alg, "seed": seed,
                     "steps": 4, "status": "done", "exit_code": 0, "wall_s": 100.0,
                     "overrides": {"trainer.total_training_steps": "4", "trainer.test_freq": "2",
                                   "data.val_max_samples": "96", "data.val_batch_size": "96",
                                   "data.seed": str(seed)}})  # fmt: skip


def grid_text(algorithms: str, controls: str = "guard_controls: [demo]") -> str:
    return f"""\
        name: g
        steps: 4
        test_freq: 2
        seed_keys: [data.seed]
        {controls}
        regimes: {{demo: {{}}, hot: {{}}}}
        algorithms: {{grpo: {{}}, grpo_guard: {{}}}}
        cells: [{{regimes: [demo, hot], algorithms: [{algorithms}], seeds: [1, 2, 3]}}]
        """


def test_aggregate_writes_the_guard_table_only_for_a_study_with_a_guarded_algorithm(tmp_path, write_grid):
    out, res = tmp_path / "out", tmp_path / "res"
    for s in (1, 2, 3):
        cell(out, "demo", "grpo", s, [0.2, 0.3, 0.3])
        cell(out, "demo", "grpo_guard", s, [0.2, 0.3, 0.3], restores=1 if s == 2 else 0)
    path = write_grid(tmp_path, grid_text("grpo, grpo_guard"))
    args = ["aggregate", "--grid", str(path), "--out", str(out), "--no-plots"]
    assert cli.main([*args, "--results", str(res)]) == 0
    text = (res / "stability_guard.md").read_text()
    assert "| demo | grpo_guard - grpo | 1,2,3 | +0.100 ± 0.000 | +0.100 ± 0.000 | +0.000 ± 0.000 |" in text
    assert "| 0.3 (0, 1, 0) | 1 in 3 runs |" in text
    # 4 validations x 2 s of 100 s; the guard's 4 x 0.5 s of 100 s
    assert "| demo | grpo | 3 | 0.00 | 0.000% (0.000-0.000) | 8.0 | 8.000% (8.000-8.000) | 100 |" in text
    assert "| demo | grpo_guard | 3 | 2.00 | 2.000% (2.000-2.000) | 8.0 | 8.000% (8.000-8.000) | 100 |" in text
    assert "- (a) **fails**: restores in demo/grpo_guard/seed2 (1)" in text
    assert "- hot: undecided (0 of 0 judged seeds meet the rule; missing hot/grpo/seed1, hot/grpo/seed2" in text
    assert "Decision: **GUARD=0 (a part fails)**." in text
    # the same runs without guard_controls: the table, no verdict
    plain = tmp_path / "plain"
    plain.mkdir()
    path = write_grid(plain, grid_text("grpo, grpo_guard", ""))
    args = ["aggregate", "--grid", str(path), "--out", str(out), "--no-plots"]
    assert cli.main([*args, "--results", str(res), "--name", "plain"]) == 0
    assert "No verdict of the GUARD-default rule" in (res / "plain_guard.md").read_text()
    # no guarded run: no guard file
    path = write_grid(plain, grid_text("grpo"))
    args = ["aggregate", "--grid", str(path), "--out", str(out), "--no-plots", "--only", "/grpo/"]
    assert cli.main([*args, "--results", str(res), "--name", "unguarded"]) == 0
    assert not (res / "unguarded_guard.md").exists()


def test_aggregate_leaves_the_grids_protocol_twins_out_of_the_verdict(tmp_path, write_grid):
    out, res = tmp_path / "out", tmp_path / "res"
    for s in (1, 2, 3):
        cell(out, "demo", "grpo", s, [0.2, 0.3, 0.3])
        cell(out, "demo", "grpo_guard", s, [0.2, 0.3, 0.3])
        cell(out, "hot", "grpo", s, [0.2, 0.3, 0.2] if s < 3 else [0.2, 0.3, 0.3])  # gained then lost: 2 of 3
        cell(out, "hot", "grpo_guard", s, [0.2, 0.3, 0.2] if s < 3 else [0.2, 0.3, 0.3])
    text = """\
        name: g
        steps: 4
        test_freq: 2
        seed_keys: [data.seed]
        guard_controls: [demo]
        regimes:
          demo: {}
          hot: {}
          hot_p5: {protocol_of: hot, test_freq: 1}
          demo_p5: {protocol_of: demo, test_freq: 1}
        algorithms: {grpo: {}, grpo_guard: {}}
        cells:
          - {regimes: [demo, hot], algorithms: [grpo, grpo_guard], seeds: [1, 2, 3]}
          - {regimes: [hot_p5, demo_p5], algorithms: [grpo], seeds: [1, 2, 3]}
        """
    path = write_grid(tmp_path, text)
    assert load_grid(path).protocol_twins == {"hot_p5", "demo_p5"}
    args = ["aggregate", "--grid", str(path), "--out", str(out), "--no-plots"]
    assert cli.main([*args, "--results", str(res)]) == 0
    guard = (res / "stability_guard.md").read_text()
    assert "- hot: admitted (2 of 3 judged seeds meet the rule)" in guard and "_p5" not in guard
    assert "- (c) **fails**: hot: d = +0.0000" in guard and "Decision: **GUARD=0 (a part fails)**." in guard
    # the same grid with the twins as regimes of their own: candidates, and (c) waits for them
    path = write_grid(tmp_path, text.replace("protocol_of: hot, ", "").replace("protocol_of: demo, ", ""), "own.yaml")
    args = ["aggregate", "--grid", str(path), "--out", str(out), "--no-plots"]
    assert cli.main([*args, "--results", str(res), "--name", "own"]) == 0
    own = (res / "own_guard.md").read_text()
    assert "- hot_p5: undecided" in own and "- demo_p5: undecided" in own and "- (c) **undecided**" in own
