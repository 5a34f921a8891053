"""scripts/demo_summary.py: progress lines and the start/end table from a verl file-logger jsonl."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def load_summary_module():
    spec = importlib.util.spec_from_file_location("demo_summary", REPO / "scripts" / "demo_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_metrics(path: Path) -> None:
    lines = [{"step": 0, "data": {"val-core/synthetic_1hop/reward/mean@1": 0.5, "val-aux/x/em/mean@1": 0.4}}]
    for s in range(1, 7):
        lines.append(
            {
                "step": s,
                "data": {
                    "training/global_step": s,
                    "timing_s/step": 2.0 * s,
                    "critic/score/mean": 0.1 * s,
                    "actor/sorl/norm_factor": 1.0 + s,
                    "actor/sorl/num_turns_mean": 2.0,
                    "actor/pg_loss": -0.5,
                },
            }
        )
    lines.append({"step": 6, "data": {"val-core/synthetic_1hop/reward/mean@1": 0.75, "val-aux/x/em/mean@1": 0.6}})
    path.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"step": 7, "da')  # torn last line


def test_summary_table_start_end_means(tmp_path, capsys):
    mod = load_summary_module()
    m = tmp_path / "metrics.jsonl"
    write_metrics(m)
    assert mod.summary(str(m), log="L", ckpt="C") == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("reward (score) mean"))
    # first 3 steps mean 0.2, last 3 steps mean 0.5
    assert row.split()[-2:] == ["0.2", "0.5"]
    z = next(line for line in out.splitlines() if line.startswith("sorl/norm_factor"))
    assert z.split()[-2:] == ["3", "6"]
    val = next(line for line in out.splitlines() if line.startswith("synthetic_1hop/reward/mean@1"))
    assert val.split()[-2:] == ["0.5", "0.75"]
    assert "checkpoints:                C" in out


def test_summary_without_steps_fails(tmp_path):
    mod = load_summary_module()
    m = tmp_path / "metrics.jsonl"
    m.write_text("")
    assert mod.summary(str(m), None, None) == 1


def test_follow_prints_each_step_and_returns_when_process_is_gone(tmp_path, capsys):
    mod = load_summary_module()
    m = tmp_path / "metrics.jsonl"
    write_metrics(m)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    mod.follow(str(m), pid, total=6, poll_s=0.01)
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if "step " in line and "validation" not in line]
    assert len(steps) == 6 and "step 6/6" in steps[-1] and "Z=7" in steps[-1]
    assert sum("validation @ step" in line for line in out) == 2


def test_summary_states_the_validation_gain_and_update_norms(tmp_path, capsys):
    mod = load_summary_module()
    m = tmp_path / "metrics.jsonl"
    write_metrics(m)
    updates = tmp_path / "sorl_updates.jsonl"  # 2 optimizer steps per training step, norms 1..12
    updates.write_text(
        "".join(json.dumps({"step": i, "scale": 1.0, "update_norm": float(i)}) + "\n" for i in range(1, 13))
    )
    assert mod.summary(str(m), None, None, updates=str(updates)) == 0
    out = capsys.readouterr().out
    norm = next(line for line in out.splitlines() if line.startswith("update norm"))
    assert norm.split()[-2:] == ["3.5", "9.5"]  # steps 1-3: means 1.5, 3.5, 5.5; steps 4-6: 7.5, 9.5, 11.5
    mean = next(line for line in out.splitlines() if line.startswith("mean over the 1 splits"))
    assert mean.split()[-2:] == ["0.5", "0.75"]  # val-core splits only
    assert "validation gain: +0.250" in out


def test_follow_shows_the_update_norm_of_each_step(tmp_path, capsys):
    mod = load_summary_module()
    m = tmp_path / "metrics.jsonl"
    write_metrics(m)
    updates = tmp_path / "sorl_updates.jsonl"
    updates.write_text(json.dumps({"step": 1, "scale": 0.5, "update_norm": 0.25}) + "\n")
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    mod.follow(str(m), pid, total=6, updates=str(updates), poll_s=0.01)
    steps = [line for line in capsys.readouterr().out.splitlines() if "step " in line and "validation" not in line]
    assert "|dW|=0.25" in steps[0] and "|dW|" not in steps[1]
