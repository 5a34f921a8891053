"""The study runner's bookkeeping (sorl_verl/study/runner.py) around real ``main_ppo`` processes.

Cells that must not run (done, failed, unfilled) are skipped without starting anything. A cell
found ``running`` (cut off) restarts from scratch; a real main_ppo that fails at start-up (an
invalid SORL knob, rejected before Ray starts) is recorded as failed with its exit code and log
tail, and the grid goes on.
"""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import pytest

from sorl_verl.study.grid import load_grid
from sorl_verl.study.runner import (
    Inputs,
    StudyBusy,
    cell_command,
    cell_dir,
    cell_state,
    cpu_name,
    model_digest,
    read_record,
    run_grid,
    study_lock,
    write_record,
)

REPO = Path(__file__).resolve().parents[2]
STUDY = REPO / "recipe" / "sorl" / "study"
#: main_ppo fails on these before reading any data file, so the inputs can be placeholders
NO_INPUTS = Inputs(
    train=Path("/nonexistent/train.parquet"),
    val=Path("/nonexistent/val.parquet"),
    model=Path("/nonexistent/model"),
    retrieval_url="http://127.0.0.1:9/retrieve",
)


def grid_file(tmp_path: Path) -> Path:
    """A grid in the study folder's place (config_dir ../config = the repository's)."""
    path = tmp_path / "g.yaml"
    path.write_text(
        textwrap.dedent(
            f"""\
            name: t
            include: {STUDY / "presets.yaml"}
            config_dir: {REPO / "recipe" / "sorl" / "config"}
            steps: 2
            algorithms:
              bad_tau: {{overrides: {{actor_rollout_ref.actor.policy_loss.clip_norm_tau: 0}}}}
            cells:
              - {{regimes: [on_policy], algorithms: [bad_tau, so_grpo, grpo, grpo_lowlr], seeds: [1]}}
            """
        )
    )
    return path


def test_skips_without_starting_anything(tmp_path):
    grid = load_grid(grid_file(tmp_path))
    out = tmp_path / "out"
    cells = {c.algorithm: c for c in grid.cells}
    write_record(cell_dir(out, cells["so_grpo"]), {"status": "done", "wall_s": 1.0})
    write_record(cell_dir(out, cells["grpo"]), {"status": "failed", "reason": "x", "wall_s": 1.0})
    log = io.StringIO()
    counts = run_grid(grid, out, [cells[a] for a in ("so_grpo", "grpo", "grpo_lowlr")], lock=None, log=log)
    assert counts == {"done": 1, "failed": 1, "unfilled": 1, "changed": 0, "ran": 0}
    text = log.getvalue()
    assert "[study 1/3 on_policy/so_grpo/seed1] done, skipped" in text
    assert "--retry-failed" in text and "actor_rollout_ref.actor.optim.lr still '???'" in text
    assert not (out / "on_policy" / "grpo_lowlr").exists()


def test_a_cell_the_grid_changed_since_it_ran_is_not_silently_kept(tmp_path):
    grid = load_grid(grid_file(tmp_path))
    out = tmp_path / "out"
    cell = next(c for c in grid.cells if c.algorithm == "so_grpo")
    ran_with = {**cell.overrides, "actor_rollout_ref.actor.optim.lr": "0.001"}
    write_record(cell_dir(out, cell), {"status": "done", "wall_s": 1.0, "overrides": ran_with})
    assert cell_state(out, cell) == "changed"
    log = io.StringIO()
    assert run_grid(grid, out, [cell], lock=None, log=log)["changed"] == 1
    assert "skipped: ran with other actor_rollout_ref.actor.optim.lr (--rerun-changed)" in log.getvalue()
    write_record(cell_dir(out, cell), {"status": "done", "wall_s": 1.0, "overrides": dict(cell.overrides)})
    assert cell_state(out, cell) == "done"


def test_cell_command_is_the_demo_command(tmp_path):
    grid = load_grid(grid_file(tmp_path))
    cell = next(c for c in grid.cells if c.algorithm == "so_grpo")
    cmd = cell_command(grid, cell, NO_INPUTS, tmp_path / "cell")
    assert cmd[1:9] == [
        "-m",
        "verl.trainer.main_ppo",
        "--config-path",
        str(REPO / "recipe" / "sorl" / "config"),
        "--config-name",
        "sorl_trainer",
        "+task=search_qa",
        "+platform=cpu",
    ]
    assert "sorl.agent.retrieval_url=http://127.0.0.1:9/retrieve" in cmd
    assert "algorithm.adv_estimator=so_grpo" in cmd and "actor_rollout_ref.rollout.seed=1" in cmd
    assert len({a.split("=", 1)[0] for a in cmd[9:]}) == len(cmd[9:])  # each key once


def test_study_lock_is_exclusive(tmp_path):
    with study_lock(tmp_path), pytest.raises(StudyBusy, match="another study process"), study_lock(tmp_path):
        pass


@pytest.mark.slow
def test_interrupted_cell_restarts_and_a_failure_is_recorded(tmp_path):
    grid = load_grid(grid_file(tmp_path))
    out = tmp_path / "out"
    cells = {c.algorithm: c for c in grid.cells}
    bad = cell_dir(out, cells["bad_tau"])
    write_record(bad, {"status": "running", "pid": 1})
    (bad / "metrics.jsonl").write_text('{"step": 1, "data": {"training/global_step": 1}}\n')
    write_record(cell_dir(out, cells["so_grpo"]), {"status": "done", "wall_s": 1.0})
    log = io.StringIO()
    counts = run_grid(grid, out, [cells["bad_tau"], cells["so_grpo"]], lock=None, log=log, inputs=NO_INPUTS)
    assert counts == {"done": 1, "failed": 1, "unfilled": 0, "changed": 0, "ran": 1}
    rec = read_record(bad)
    assert rec["status"] == "failed" and rec["exit_code"] == 1 and rec["steps_done"] == 0
    assert any("clip_norm_tau=0 is invalid" in line for line in rec["log_tail"])
    assert rec["command"][2] == "verl.trainer.main_ppo" and "clip_norm_tau=0" in rec["command_line"]
    assert rec["command_line"].startswith("VERL_PLATFORM=cpu ")
    assert rec["env"]["VERL_FILE_LOGGER_PATH"] == str(bad / "metrics.jsonl")
    assert not (bad / "metrics.jsonl").exists()  # the cut-off run's metrics were removed
    assert rec["wall_s"] > 0 and rec["finished"] >= rec["started"]
    text = log.getvalue()
    assert "was interrupted: restarting from scratch" in text
    assert (
        "[study 1/2 on_policy/bad_tau/seed1] FAILED" in text
        and "[study 2/2 on_policy/so_grpo/seed1] done, skipped" in text
    )
    assert json.loads((bad / "cell.json").read_text()) == rec


@pytest.mark.slow
def test_sigterm_stops_the_cell_and_records_it_interrupted(tmp_path):
    """``kill <study pid>`` mid-cell: main_ppo's process group is stopped, the cell is 'interrupted'."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "sorl_verl.study", "--grid", str(grid_file(tmp_path)), "--out", str(out)]
    cmd += ["--lock", "none", "--only", "bad_tau"]
    study = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    record = out / "on_policy" / "bad_tau" / "seed1" / "cell.json"
    deadline = time.monotonic() + 120
    while not (record.exists() and "pid" in read_record(record.parent)):
        assert study.poll() is None and time.monotonic() < deadline, study.stdout.read()
        time.sleep(0.2)
    child = read_record(record.parent)["pid"]
    study.send_signal(signal.SIGTERM)
    output, _ = study.communicate(timeout=60)
    assert study.returncode == 128 + signal.SIGTERM, output
    assert "interrupted; the cut-off cell restarts from scratch next time" in output
    rec = read_record(record.parent)
    assert rec["status"] == "interrupted"
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_model_digest_tells_weights_apart_and_cpu_is_named(tmp_path):
    """Runs compare only on the same warm-start weights: the digest covers every weight file."""
    a, b, empty = tmp_path / "a", tmp_path / "b", tmp_path / "empty"
    for d in (a, b, empty):
        d.mkdir()
    (a / "model.safetensors").write_bytes(b"\x00" * 3_000_000)
    (b / "model.safetensors").write_bytes(b"\x00" * 3_000_000)
    (a / "config.json").write_text("{}")  # not a weight file
    assert model_digest(a) == model_digest(b) and len(model_digest(a)) == 16
    (b / "model.safetensors").write_bytes(b"\x00" * 2_999_999 + b"\x01")
    assert model_digest(b) != model_digest(a)
    assert model_digest(empty) is None
    name = cpu_name()
    assert isinstance(name, str) and (not Path("/proc/cpuinfo").exists() or name)
