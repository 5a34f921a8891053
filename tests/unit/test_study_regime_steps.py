"""A regime's own run length (grid ``regimes.<name>.steps``) in the runner, status and aggregate: the cell's
steps are what main_ppo gets, what the progress line and "done" count to, what the default wall limit
scales with, and what the aggregate, its plots and the guard table read, next to regimes of other lengths."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from sorl_verl.study import cli, runner
from sorl_verl.study.grid import STEPS_KEY, load_grid
from sorl_verl.study.runner import Inputs, cell_command, cell_dir, default_timeout_s, read_record, run_cell, run_grid

REPO = Path(__file__).resolve().parents[2]
INPUTS = Inputs(Path("/t.parquet"), Path("/v.parquet"), Path("/model"), "http://127.0.0.1:9/retrieve")


def grid_text(algorithms: str = "grpo") -> str:
    """Regime ``demo`` at the grid's 4 steps, regime ``long`` at 10; validation every 2 steps."""
    return f"""\
        name: g
        steps: 4
        test_freq: 2
        seed_keys: [data.seed]
        guard_controls: [demo]
        regimes:
          demo: {{}}
          long: {{steps: 10}}
        algorithms: {{grpo: {{}}, grpo_guard: {{}}}}
        cells: [{{regimes: [demo, long], algorithms: [{algorithms}], seeds: [1, 2, 3]}}]
        """


#: natural.yaml's regimes with a horizon of their own (every other cell runs the grid's 50 steps)
LONG_RUN_STEPS = {
    "demo_long100": 100,
    "demo_long200_const": 200,
    "demo_long200_nokl_const": 200,
    "demo_long300_nokl_const": 300,
}


def test_the_command_carries_each_cells_steps_and_the_timeout_scales_with_them():
    grid = load_grid(REPO / "recipe" / "sorl" / "study" / "natural.yaml")
    for cell in grid.cells:
        cmd = cell_command(grid, cell, INPUTS, Path("/run"))
        want = LONG_RUN_STEPS.get(cell.regime, 50)
        assert [a for a in cmd if a.startswith(f"{STEPS_KEY}=")] == [f"{STEPS_KEY}={want}"], cell.key
        # 10 min of start-up + 1 min per step and per validation (step 0 and every test_freq steps)
        every = 5 if cell.regime.endswith("_p5") else 10
        assert default_timeout_s(grid, cell) == 600.0 + 60.0 * want + 60.0 * (1 + want // every)
    long = next(c for c in grid.cells if c.regime == "demo_long100")
    assert default_timeout_s(grid, long) == 7260.0 and default_timeout_s(grid) == 3960.0
    longer = next(c for c in grid.cells if c.regime == "demo_long200_const")
    assert default_timeout_s(grid, longer) == 600.0 + 60.0 * 200 + 60.0 * 21


def test_run_grid_gives_each_cell_its_own_default_wall_limit(tmp_path, write_grid, cell_wall_limits):
    grid = load_grid(write_grid(tmp_path, grid_text()))
    limits = cell_wall_limits
    cells = [c for c in grid.cells if c.seed == 1]
    log = io.StringIO()
    run_grid(grid, tmp_path / "out", cells, lock=None, log=log, inputs=INPUTS)
    assert limits == {"demo/grpo/seed1": 600.0 + 240.0 + 180.0, "long/grpo/seed1": 600.0 + 600.0 + 360.0}
    assert "[study 2/2 long/grpo/seed1] start (10 steps)" in log.getvalue()
    run_grid(grid, tmp_path / "again", cells, lock=None, log=io.StringIO(), inputs=INPUTS, timeout_s=5.0)
    assert limits == {"demo/grpo/seed1": 5.0, "long/grpo/seed1": 5.0}  # --cell-timeout: every cell


def fake_main_ppo(monkeypatch, last_step: int) -> None:
    """main_ppo replaced by a process that logs training steps 1..last_step and exits 0."""
    script = (
        "import json, os\n"
        "with open(os.environ['VERL_FILE_LOGGER_PATH'], 'w') as f:\n"
        f"    for s in range(1, {last_step} + 1):\n"
        "        f.write(json.dumps({'step': s, 'data': {'training/global_step': s}}) + '\\n')\n"
    )
    monkeypatch.setattr(runner, "cell_command", lambda *a: [sys.executable, "-c", script])


@pytest.mark.parametrize(("last_step", "status"), [(10, "done"), (4, "failed")])
def test_a_long_cell_is_done_only_at_its_own_last_step(tmp_path, write_grid, monkeypatch, last_step, status):
    grid = load_grid(write_grid(tmp_path, grid_text()))
    cell = next(c for c in grid.cells if c.regime == "long")
    fake_main_ppo(monkeypatch, last_step)
    out = io.StringIO()
    directory = cell_dir(tmp_path / "out", cell)
    rec = run_cell(grid, cell, directory, INPUTS, tag="[t]", timeout_s=60.0, out=out, poll_s=0.05)
    assert rec["status"] == status and rec["steps"] == 10 and rec["steps_done"] == last_step
    assert read_record(directory)["steps"] == 10
    if status == "failed":
        assert rec["reason"] == "exited 0 after step 4 of 10"  # the grid's 4 steps would have called it done
    assert f"[t] step {last_step}/10" in out.getvalue()


def val(step: int, score: float) -> dict:
    return {"step": step, "data": {"val-core/s1/reward/mean@1": score}}


def make_cell(out: Path, regime: str, alg: str, seed: int, steps: int, scores: list[float], restores=None) -> None:
    d = out / regime / alg / f"seed{seed}"
    d.mkdir(parents=True)
    recs = [val(2 * i, v) for i, v in enumerate(scores)]
    for s in range(1, steps + 1):
        data = {"training/global_step": s, "critic/score/mean": 0.5, "actor/grad_norm": 0.5}
        if s % 2 == 0:
            data["timing_s/testing"] = 2.0
        if restores is not None:
            data |= {"sorl/guard/restores": float(restores if s == steps else 0), "timing_s/sorl_guard": 0.5}
        recs.append({"step": s, "data": data})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    overrides = {STEPS_KEY: str(steps), "trainer.test_freq": "2", "data.val_max_samples": "96"}
    overrides |= {"data.val_batch_size": "96", "data.seed": str(seed)}
    runner.write_record(
        d,
        {"key": f"{regime}/{alg}/seed{seed}", "regime": regime, "algorithm": alg, "seed": seed, "steps": steps,
         "status": "done", "exit_code": 0, "wall_s": 100.0, "overrides": overrides},
    )  # fmt: skip


def test_aggregate_plots_guard_table_and_status_with_regimes_of_different_lengths(tmp_path, write_grid, capsys):
    out, res = tmp_path / "out", tmp_path / "res"
    for s in (1, 2, 3):
        make_cell(out, "demo", "grpo", s, 4, [0.2, 0.3, 0.3])
        make_cell(out, "demo", "grpo_guard", s, 4, [0.2, 0.3, 0.3], restores=0)
    # the long regime: validations at 0, 2, ..., 10; seeds 1-2 gain 0.2 by step 4 and keep less than half of it
    long_scores = {1: [0.2, 0.3, 0.4, 0.35, 0.3, 0.25], 2: [0.2, 0.3, 0.4, 0.3, 0.2, 0.2], 3: [0.2] * 6}
    for s, scores in long_scores.items():
        make_cell(out, "long", "grpo", s, 10, scores)
    grid = write_grid(tmp_path, grid_text("grpo, grpo_guard"))
    assert cli.main(["aggregate", "--grid", str(grid), "--out", str(out), "--results", str(res)]) == 0
    runs = {
        (r["regime"], r["algorithm"], r["seed"]): r for r in json.loads((res / "stability.json").read_text())["runs"]
    }
    long1, demo1 = runs[("long", "grpo", 1)], runs[("demo", "grpo", 1)]
    assert (long1["steps"], long1["steps_planned"], demo1["steps"], demo1["steps_planned"]) == (10, 10, 4, 4)
    assert [s for s, _ in long1["val_scores"]] == [0, 2, 4, 6, 8, 10] and long1["peak_step"] == 4
    assert long1["gain"] == pytest.approx(0.05) and long1["peak_gain"] == pytest.approx(0.2) and long1["lost_gain"]
    # mean gain over the 10 steps: trapezoids of 2 steps (0.1 + 0.3 + 0.35 + 0.25 + 0.15) / 10
    assert long1["auc_gain"] == pytest.approx(0.115)
    assert not runs[("long", "grpo", 3)]["lost_gain"]
    guard = (res / "stability_guard.md").read_text()
    assert "- long: admitted (2 of 3 judged seeds meet the rule)" in guard
    # validation time: 5 of 10 steps validate in the long runs, 2 of 4 in the demo runs
    assert "| demo | grpo | 3 | 0.00 | 0.000% (0.000-0.000) | 4.0 | 4.000% (4.000-4.000) | 100 |" in guard
    assert (res / "stability_long.png").is_file() and (res / "stability_demo.png").is_file()
    assert (res / "stability_demo_validation.png").is_file()
    capsys.readouterr()
    assert cli.main(["status", "--grid", str(grid), "--out", str(out), "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)["cells"]}
    assert (rows["long/grpo/seed1"]["state"], rows["long/grpo/seed1"]["steps"]) == ("done", 10)
    assert rows["long/grpo/seed1"]["steps_planned"] == 10 and rows["demo/grpo/seed1"]["steps_planned"] == 4
    assert rows["long/grpo_guard/seed1"]["state"] == "pending" and rows["long/grpo_guard/seed1"]["steps_planned"] == 10
    assert cli.main(["status", "--grid", str(grid), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "long/grpo/seed1        done        step  10/10" in text and "step   0/10" in text
