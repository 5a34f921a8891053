"""``sorl-verl summary`` (sorl_verl/cli/summary.py): progress lines and the start/end table from a verl
file-logger jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sorl_verl import cli
from sorl_verl.cli import summary as mod


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
    m = tmp_path / "metrics.jsonl"
    write_metrics(m)
    assert mod.summary(str(m), log="L", ckpt="C") == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("reward (score) mean"))
    # first 3 steps mean 0.2, last 3 steps mean 0.5
    assert row.split()[-2:] == ["0.2", "0.5"]
    z = next(line for line in out.splitlines() if line.startswith("sorl/norm_factor"))
    assert z.split()[-2:] == ["3", "6"]
    val = [line for line in out.splitlines() if line.startswith("synthetic_1hop ")]
    assert len(val) == 1 and val[0].split()[-2:] == ["0.5", "0.75"]  # one row per split (val-core)
    assert any(line.startswith("checkpoints:") and line.split()[-1] == "C" for line in out.splitlines())


def test_summary_without_steps_fails(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text("")
    assert mod.summary(str(m), None, None) == 1


def _exited_pid() -> int:
    """The pid of a child that has exited and been reaped: ``follow`` must see it gone."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_follow_prints_each_step_and_returns_when_process_is_gone(tmp_path, capsys):
    m = tmp_path / "metrics.jsonl"
    write_metrics(m)
    pid = _exited_pid()
    mod.follow(str(m), pid, total=6, poll_s=0.01)
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if "step " in line and "validation" not in line]
    assert len(steps) == 6 and "step 6/6" in steps[-1] and "Z=7" in steps[-1]
    assert sum("validation @ step" in line for line in out) == 2


def test_summary_states_the_validation_gain_and_update_norms(tmp_path, capsys):
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
    m = tmp_path / "metrics.jsonl"
    write_metrics(m)
    updates = tmp_path / "sorl_updates.jsonl"
    updates.write_text(json.dumps({"step": 1, "scale": 0.5, "update_norm": 0.25}) + "\n")
    pid = _exited_pid()
    mod.follow(str(m), pid, total=6, updates=str(updates), poll_s=0.01)
    steps = [line for line in capsys.readouterr().out.splitlines() if "step " in line and "validation" not in line]
    assert "|dW|=0.25" in steps[0] and "|dW|" not in steps[1]


def test_start_is_the_first_step_with_a_non_zero_update(tmp_path):
    """Step 1 of a warm-up starting at lr 0 moves nothing: the start window begins at step 2."""
    m = tmp_path / "metrics.jsonl"
    write_metrics(m)
    updates = tmp_path / "sorl_updates.jsonl"
    norms = [0.0, 0.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 8.0, 8.0, 10.0, 10.0]  # 2 updates per step
    updates.write_text("".join(json.dumps({"step": i + 1, "update_norm": v}) + "\n" for i, v in enumerate(norms)))
    data = mod.build_summary(str(m), str(updates))
    assert data["start_steps"] == [2, 4] and data["end_steps"] == [4, 6]
    reward = next(r for r in data["train"] if r["key"] == "critic/score/mean")
    assert reward["start"] == pytest.approx(0.3) and reward["end"] == pytest.approx(0.5)
    lr_only = [(s, {"actor/lr": 0.0 if s == 1 else 1e-4}) for s in (1, 2, 3)]
    assert mod.first_update_index(lr_only) == 1
    assert mod.first_update_index([(1, {}), (2, {})]) == 0


def test_one_row_per_split_and_the_files_kept_in_the_run_directory(tmp_path, capsys):
    run = tmp_path / "so_grpo-qa-early-stop-50-20261126-120000"
    run.mkdir()
    m = run / "metrics.jsonl"
    lines = []
    for step, scores in ((0, (0.58, 0.0, 0.01)), (50, (0.46, 0.36, 0.0))):
        data = {}
        for hop, score in zip((1, 2, 3), scores, strict=True):
            for key in (f"val-core/synthetic_{hop}hop/reward/mean@1", f"val-aux/synthetic_{hop}hop/em/mean@1",
                        f"val-aux/synthetic_{hop}hop/score/mean@1"):  # fmt: skip
                data[key] = score
        lines.append({"step": step, "data": data})
    for s in range(1, 51):
        lines.insert(
            -1, {"step": s, "data": {"timing_s/step": 1.0, "critic/score/mean": 0.2, "actor/sorl/norm_factor": 1.0}}
        )
    m.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert mod.summary(str(m), None, None, out_dir=str(run), cli="CLI") == 0
    out = capsys.readouterr().out
    assert sum("synthetic_2hop" in line for line in out.splitlines()) == 1
    assert "validation gain: +0.077" in out and "start = step 0 (before training)" in out
    assert "sorl/ rows at 0 or 1" in out  # Z never left 1
    saved = json.loads((run / "summary.json").read_text())
    assert [s["split"] for s in saved["validation"]["splits"]] == ["synthetic_1hop", "synthetic_2hop", "synthetic_3hop"]
    assert saved["validation"]["splits"][1] == {
        "split": "synthetic_2hop", "key": "val-core/synthetic_2hop/reward/mean@1", "start": 0.0, "end": 0.36,
    }  # fmt: skip
    assert (run / "summary.txt").read_text().strip() in out
    assert (run / "curves.png").stat().st_size > 10_000
    assert f"CLI plot {run}" in out and f"CLI eval --metrics {run} --out-dir {run}/eval" in out


def test_metrics_lines_go_through_the_project_reader(tmp_path):
    """Lines the project's reader (sorl_verl.study.metrics.records) skips are skipped here too, and only
    validation means (val-<kind>/<source>/<var>/mean@N) make validation entries and splits."""
    m = tmp_path / "metrics.jsonl"
    assert mod.read_metrics(m) == [] and mod.read_update_log(tmp_path / "none.jsonl") == []
    lines = [
        {"step": 0, "data": {"val-core/synthetic_1hop/reward/mean@1": 0.25, "val-aux/num_turns/min": 2}},
        {"step": "1", "data": {"timing_s/step": 9.0, "critic/score/mean": 9.0}},  # step not an int
        {"data": "not a dict"},
        {"step": 1, "data": {"timing_s/step": 1.0, "critic/score/mean": 0.5}},
        {"step": 2, "data": {"timing_s/step": 1.0, "critic/score/mean": 0.75}},
        {"step": 2, "data": {"val-core/synthetic_1hop/reward/mean@1": 0.5, "val-aux/num_turns/max": 4}},
        {"step": 3, "data": {"val-aux/num_turns/mean": 3.0}},  # no validation mean: no entry
    ]
    m.write_text("".join(json.dumps(x) + "\n" for x in lines))
    from sorl_verl.study.metrics import read_records

    assert mod.read_metrics(m) == list(read_records(m))
    train, val = mod.split_records(mod.read_metrics(m))
    assert [s for s, _ in train] == [1, 2] and [s for s, _ in val] == [0, 2]
    data = mod.build_summary(str(m))
    reward = next(r for r in data["train"] if r["key"] == "critic/score/mean")
    assert (reward["start"], reward["end"]) == (0.5, 0.75)
    assert [s["split"] for s in data["validation"]["splits"]] == ["synthetic_1hop"]
    assert data["validation"]["gain"] == 0.25


def test_sorl_verl_summary_dispatches_both_actions_with_their_options(tmp_path, capsys):
    """``sorl-verl summary follow|summary`` reach the module's parser: follow's --pid/--steps, summary's
    table (what :func:`render` makes of :func:`build_summary`), and exit 1 on a file without steps."""
    m = tmp_path / "metrics.jsonl"
    write_metrics(m)
    pid = _exited_pid()
    assert cli.main(["summary", "follow", str(m), "--pid", str(pid), "--steps", "6"]) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if "step " in line and "validation" not in line]
    assert [line.split("] ", 1)[1].split()[:2] for line in steps] == [["step", f"{s}/6"] for s in range(1, 7)]
    assert cli.main(["summary", "summary", str(m), "--ckpt", "C"]) == 0
    out = capsys.readouterr().out
    assert mod.render(mod.build_summary(str(m))) in out and out.splitlines()[-1].split() == ["checkpoints:", "C"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"step": 0, "data": {"val-core/a/reward/mean@1": 0.5}}) + "\n")
    assert cli.main(["summary", "summary", str(empty)]) == 1
    assert "no training steps logged" in capsys.readouterr().err
