"""Smoke study: ``python -m sorl_verl.study`` on recipe/sorl/study/smoke.yaml end to end.

One cell (SO-GRPO, many-updates regime, 2 steps, validation of 16 questions at steps 0 and 2)
through the real runner: embedded default, live retrieval server, verl ``main_ppo`` on CPU. Then
the same command again (the finished cell is skipped), ``status`` and ``aggregate``.
Starts Ray: run it under the shared lock (``flock /tmp/sorl-heavy.lock pytest ...``); the study
itself is told ``--lock none`` so that it does not wait for the lock its caller holds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
GRID = REPO / "recipe" / "sorl" / "study" / "smoke.yaml"
KEY = "many_updates/so_grpo/seed1"


def study(*args: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sorl_verl.study", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_smoke_study_runs_resumes_and_aggregates(tmp_path):
    out, results = tmp_path / "study", tmp_path / "results"
    t0 = time.monotonic()
    run = study("--grid", str(GRID), "--out", str(out), "--lock", "none", timeout=600)
    wall = time.monotonic() - t0
    cell = out / KEY
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + (cell / "train.log").read_text()[-3000:]
    assert f"[study 1/1 {KEY}] start (2 steps)" in run.stdout
    assert f"[study 1/1 {KEY}] step 2/2" in run.stdout
    assert f"[study 1/1 {KEY}] done in" in run.stdout
    rec = json.loads((cell / "cell.json").read_text())
    assert (rec["status"], rec["exit_code"], rec["steps_done"]) == ("done", 0, 2)
    assert 0 < rec["wall_s"] < wall
    assert len(rec["model_digest"]) == 16 and int(rec["model_digest"], 16) >= 0  # which warm-start weights ran
    assert rec["command"][1:3] == ["-m", "verl.trainer.main_ppo"]
    records = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines()]
    val_steps = [r["step"] for r in records if any(k.startswith("val-core/") for k in r["data"])]
    assert val_steps == [0, 2]
    assert any("actor/sorl/norm_factor" in r["data"] for r in records)

    again = study("--grid", str(GRID), "--out", str(out), "--lock", "none", timeout=120)
    assert again.returncode == 0 and f"[study 1/1 {KEY}] done, skipped" in again.stdout
    assert "retrieval server" not in again.stdout  # nothing to run: nothing started
    assert json.loads((cell / "cell.json").read_text()) == rec

    status = study("status", "--grid", str(GRID), "--out", str(out), "--json", timeout=120)
    assert json.loads(status.stdout)["cells"][0]["state"] == "done"

    agg = study("aggregate", "--grid", str(GRID), "--out", str(out), "--results", str(results), timeout=300)
    assert agg.returncode == 0, agg.stderr
    data = json.loads((results / "stability.json").read_text())
    (r,) = data["runs"]
    assert (r["algorithm"], r["regime"], r["seed"], r["steps"], r["judged"]) == ("so_grpo", "many_updates", 1, 2, True)
    assert 0.0 <= r["final_val_score"] <= r["peak_val_score"] <= 1.0
    assert data["command"] == "python -m sorl_verl.study --grid recipe/sorl/study/smoke.yaml"
    assert (results / "stability_many_updates.png").stat().st_size > 20_000
