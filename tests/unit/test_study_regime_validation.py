"""A regime's own validation protocol (grid ``regimes.<name>.test_freq`` / ``val_max_samples``) in the runner,
status and aggregate: the cell's interval and size are what main_ppo gets, what the default wall limit counts
validations by, and what the measures, the fall rule, the plots and the guard table read, next to a regime
that validates at the grid's interval on the grid's number of questions."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from sorl_verl.study import cli, runner
from sorl_verl.study.grid import Cell, load_grid
from sorl_verl.study.runner import Inputs, cell_command, default_timeout_s, run_grid

REPO = Path(__file__).resolve().parents[2]
INPUTS = Inputs(Path("/t.parquet"), Path("/v.parquet"), Path("/model"), "http://127.0.0.1:9/retrieve")
PROTOCOL = ("trainer.total_training_steps", "trainer.test_freq", "data.val_max_samples", "data.val_batch_size")


# regime ``demo`` at the grid's protocol (300 questions every 10 steps), regime ``p5`` every 5 steps on 100; both
# 10 steps, grpo and grpo_guard, seeds 1-3, the fall rule on
GRID = (
    "name: g\nsteps: 10\ntest_freq: 10\nval_max_samples: 300\nwarning_fall_rule: true\n"
    "seed_keys: [data.seed]\nguard_controls: [demo]\n"
    "regimes:\n  demo: {}\n  p5: {test_freq: 5, val_max_samples: 100}\n"
    "algorithms: {grpo: {}, grpo_guard: {}}\n"
    "cells: [{regimes: [demo, p5], algorithms: [grpo, grpo_guard], seeds: [1, 2, 3]}]\n"
)


def test_the_command_carries_each_cells_protocol_and_the_timeout_counts_its_validations(tmp_path, write_grid):
    grid = load_grid(write_grid(tmp_path, GRID))
    for cell in grid.cells:
        cmd = cell_command(grid, cell, INPUTS, Path("/run"))
        want = ["10", "5", "100", "100"] if cell.regime == "p5" else ["10", "10", "300", "300"]
        assert [next(a.split("=", 1)[1] for a in cmd if a.startswith(f"{k}=")) for k in PROTOCOL] == want, cell.key
        assert sum(a.startswith(PROTOCOL) for a in cmd) == 4  # each key once: the base command sets none of them
        # 10 min of start-up + 1 min per step + 1 min per validation: steps 0 and 10, or 0, 5 and 10
        validations = 3 if cell.regime == "p5" else 2
        assert default_timeout_s(grid, cell) == 600.0 + 600.0 + 60.0 * validations
    assert default_timeout_s(grid) == 1320.0  # without a cell: the grid's protocol


def test_the_natural_grid_keeps_its_timeouts_and_a_p5_cell_counts_11_validations():
    grid = load_grid(REPO / "recipe" / "sorl" / "study" / "natural.yaml")
    kinds = {(c.steps, c.regime.endswith("_p5"), default_timeout_s(grid, c)) for c in grid.cells}
    # a P5 cell: 50 steps validated at 0, 5, ..., 50; the long runs validate every 10 steps
    assert kinds == {
        (50, False, 3960.0),
        (100, False, 7260.0),
        (200, False, 600.0 + 12000.0 + 60.0 * 21),
        (300, False, 600.0 + 18000.0 + 60.0 * 31),
        (50, True, 600.0 + 3000.0 + 60.0 * 11),
    }
    p5 = Cell(0, "demo_p5", "grpo", 1, {}, steps=50, test_freq=5, val_max_samples=100)
    assert default_timeout_s(grid, p5) == 600.0 + 3000.0 + 60.0 * 11


def test_run_grid_gives_each_cell_the_wall_limit_of_its_protocol(tmp_path, write_grid, cell_wall_limits):
    grid = load_grid(write_grid(tmp_path, GRID))
    limits = cell_wall_limits
    cells = [c for c in grid.cells if c.seed == 1 and c.algorithm == "grpo"]
    run_grid(grid, tmp_path / "out", cells, lock=None, log=io.StringIO(), inputs=INPUTS)
    assert limits == {"demo/grpo/seed1": 1320.0, "p5/grpo/seed1": 1380.0}


def make_cell(out: Path, regime: str, alg: str, seed: int, scores: list[float], restores=None) -> None:
    """A finished 10-step cell of ``GRID``: validations every 10 steps on 300 questions in
    ``demo``, every 5 on 100 in ``p5`` (``scores`` one per validation, step 0 first)."""
    every, questions = (5, 100) if regime == "p5" else (10, 300)
    assert len(scores) == 1 + 10 // every
    d = out / regime / alg / f"seed{seed}"
    d.mkdir(parents=True)
    recs = [{"step": every * i, "data": {"val-core/s1/reward/mean@1": v}} for i, v in enumerate(scores)]
    for s in range(1, 11):
        data = {"training/global_step": s, "critic/score/mean": 0.5, "actor/grad_norm": 0.5}
        if s % every == 0:
            data["timing_s/testing"] = 2.0
        if restores is not None:
            data |= {"sorl/guard/restores": float(restores if s == 10 else 0), "timing_s/sorl_guard": 0.5}
        recs.append({"step": s, "data": data})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    overrides = dict(zip(PROTOCOL, ("10", str(every), str(questions), str(questions)), strict=True))
    runner.write_record(
        d,
        {"key": f"{regime}/{alg}/seed{seed}", "regime": regime, "algorithm": alg, "seed": seed, "steps": 10,
         "status": "done", "exit_code": 0, "wall_s": 100.0, "overrides": overrides | {"data.seed": str(seed)}},
    )  # fmt: skip


def test_measures_fall_rule_plots_guard_table_and_status_with_two_validation_protocols(tmp_path, write_grid, capsys):
    out, res = tmp_path / "out", tmp_path / "res"
    # demo seed 1 falls 0.08 below its best: more than 2 SE of a difference of 300-question scores (0.071);
    # p5 seed 1 falls 0.09 and p5 seed 2 0.08 below theirs: less than 2 SE on 100 questions (0.130, 0.124)
    make_cell(out, "demo", "grpo", 1, [0.3, 0.22])
    make_cell(out, "p5", "grpo", 1, [0.2, 0.35, 0.26])
    make_cell(out, "p5", "grpo", 2, [0.3, 0.3, 0.22])
    for s in (2, 3):
        make_cell(out, "demo", "grpo", s, [0.2, 0.2])
    make_cell(out, "p5", "grpo", 3, [0.2, 0.2, 0.2])
    for s in (1, 2, 3):
        make_cell(out, "demo", "grpo_guard", s, [0.2, 0.2], restores=0)
        make_cell(out, "p5", "grpo_guard", s, [0.2, 0.25, 0.25], restores=0)
    grid = write_grid(tmp_path, GRID)
    assert cli.main(["aggregate", "--grid", str(grid), "--out", str(out), "--results", str(res)]) == 0
    runs = {
        (r["regime"], r["algorithm"], r["seed"]): r for r in json.loads((res / "stability.json").read_text())["runs"]
    }
    p5, demo = runs[("p5", "grpo", 1)], runs[("demo", "grpo", 1)]
    assert [s for s, _ in p5["val_scores"]] == [0, 5, 10] and [s for s, _ in demo["val_scores"]] == [0, 10]
    # the mid-run peak only a 5-step protocol sees: peak +0.15 at step 5, final +0.06 (below half: lost)
    assert (p5["peak_step"], p5["lost_gain"]) == (5, True)
    assert p5["peak_gain"] == pytest.approx(0.15) and p5["gain"] == pytest.approx(0.06)
    # mean gain over the 10 steps: trapezoids of 5 steps (0.375 + 0.525) / 10
    assert p5["auc_gain"] == pytest.approx(0.09)
    assert (demo["peak_step"], demo["lost_gain"]) == (0, False)
    # the fall rule takes each run's own number of questions (its data.val_max_samples)
    warnings = (res / "stability_warnings.md").read_text()
    assert "Runs that fell: demo/grpo/seed1 (step 10) of 12 judged." in warnings
    assert "Runs that dropped: p5/grpo/seed1 (step 10) of 12 judged." in warnings
    guard = (res / "stability_guard.md").read_text()
    # admission reads each run's own validations: p5 seed 1 lost the gain it had at step 5, seeds 2-3 did not
    assert "- p5: not admitted (1 of 3 judged seeds meet the rule; 2 of 3 can no longer be reached)" in guard
    # validation time: 2 validations of 2 s in the p5 runs, 1 in the demo runs
    assert "| p5 | grpo | 3 | 0.00 | 0.000% (0.000-0.000) | 4.0 | 4.000% (4.000-4.000) | 100 |" in guard
    assert "| demo | grpo | 3 | 0.00 | 0.000% (0.000-0.000) | 2.0 | 2.000% (2.000-2.000) | 100 |" in guard
    assert (res / "stability_p5.png").is_file() and (res / "stability_p5_validation.png").is_file()
    assert (res / "stability_demo.png").is_file()
    capsys.readouterr()
    assert cli.main(["status", "--grid", str(grid), "--out", str(out), "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)["cells"]}
    assert {k: (r["state"], r["test_freq"], r["val_max_samples"]) for k, r in rows.items() if "seed1" in k} == {
        "demo/grpo/seed1": ("done", 10, 300),
        "demo/grpo_guard/seed1": ("done", 10, 300),
        "p5/grpo/seed1": ("done", 5, 100),
        "p5/grpo_guard/seed1": ("done", 5, 100),
    }
