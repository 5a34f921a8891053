"""Replaying the guard's rules on a run's validations (sorl_verl/study/rule_replay.py) and the table of
first fires (sorl_verl/study/rule_table.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sorl_verl.study.aggregate import stability
from sorl_verl.study.archive import read_archive, write_archive
from sorl_verl.study.grid import load_grid
from sorl_verl.study.metrics import parse_records
from sorl_verl.study.rule_replay import NO_RECORDS, Replay, guard_config, replay, replay_run, validation_questions
from sorl_verl.study.rule_table import fires_text, roles, write_rule_table
from sorl_verl.study.runner import write_record
from sorl_verl.trainer.guard_rule import GuardConfig

DROP = GuardConfig(enable=True, rule="drop", drop=0.3, patience=1)
STDERR = replace(DROP, rule="stderr")


def val(score: float, n: int | None = None, var: float | None = None) -> dict[str, float]:
    """One validation of one source ``a``: its score and, with ``n``, the trainer's question records
    (``var`` defaults to the binomial ``p (1 - p)``)."""
    out = {"val-core/a/reward/mean@1": score}
    if n is not None:
        out["val-aux/a/reward/questions"] = float(n)
        out["val-aux/a/reward/question_var"] = score * (1 - score) if var is None else var
    return out


def series(*points: tuple[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return dict(points)


# --- drop and stderr differ -------------------------------------------------------------------


def test_a_fall_from_030_to_020_is_noise_on_30_questions_and_a_collapse_on_300():
    # drop: line 0.7 x 0.30 = 0.21 > 0.20, fires whatever the size
    # stderr, n = 30:  2 sqrt(0.21/30 + 0.16/30) = 0.222 > 0.10: noise
    # stderr, n = 300: 2 sqrt(0.21/300 + 0.16/300) = 0.070 < 0.10: a collapse
    for n in (30, 300):
        vals = series((10, val(0.30, n)), (20, val(0.20, n)))
        assert replay(vals, DROP) == Replay(step=20)
    assert replay(series((10, val(0.30, 30)), (20, val(0.20, 30))), STDERR) == Replay()
    assert replay(series((10, val(0.30, 300)), (20, val(0.20, 300))), STDERR) == Replay(step=20)
    assert Replay().text() == "no fire" and Replay(step=20).text() == "step 20"


def test_a_negative_best_a_small_fall_fires_stderr_only_where_the_scores_are_precise():
    # best -0.5: drop's line -0.5 - 0.3 x 0.5 = -0.65, so -0.6 is not low
    # stderr with var 0.01 on 400 questions: se 0.005 each, 2 sqrt(2) 0.005 = 0.014 < 0.1: low
    vals = series((10, val(-0.5, 400, 0.01)), (20, val(-0.6, 400, 0.01)))
    assert replay(vals, DROP) == Replay()
    assert replay(vals, STDERR) == Replay(step=20)


def test_a_best_of_zero_drop_fires_on_any_negative_score_stderr_only_beyond_the_noise():
    # drop: line -min_drop = 0; stderr: var 0.25 on 10 questions, 2 sqrt(2 x 0.025) = 0.447
    vals = series((10, val(0.0, 10, 0.25)), (20, val(-0.05, 10, 0.25)), (30, val(-0.3, 10, 0.25)))
    assert replay(vals, DROP) == Replay(step=20)
    assert replay(vals, STDERR) == Replay()
    # a min_drop floor moves drop's line
    assert replay(vals, replace(DROP, min_drop=0.1)) == Replay(step=30)


def test_the_validation_before_training_is_not_used_and_patience_counts_in_a_row():
    # step 0 would be the best (0.9) and call step 10 a collapse; the guard does not use it
    vals = series((0, val(0.9)), (10, val(0.3)), (20, val(0.2)), (30, val(0.3)), (40, val(0.2)), (50, val(0.2)))
    assert replay(vals, DROP) == Replay(step=20)
    # patience 2: steps 20 and 40 are low but not in a row (30 is on the line); 40 and 50 are
    assert replay(vals, replace(DROP, patience=2)) == Replay(step=50)
    # the steps are replayed in step order, whatever the mapping's order
    assert replay(dict(reversed(list(vals.items()))), DROP) == Replay(step=20)


def test_non_finite_scores_are_read_as_the_guard_reads_them():
    # a non-finite source is left out of the mean (validation_score): 0.2 from source b alone
    two = {**val(math.nan), "val-core/b/reward/mean@1": 0.2}
    assert replay(series((10, val(0.3)), (20, two)), DROP) == Replay(step=20)
    # no finite source at all: the guard stops the run there, the replay cannot go on
    out = replay(series((10, val(0.3)), (20, val(math.nan)), (30, val(0.2))), DROP)
    assert out.cannot == "no finite metric matches val-core/*/reward/mean@* at step 20"


# --- cannot replay ----------------------------------------------------------------------------


def test_stderr_without_question_records_cannot_be_replayed_and_says_so():
    vals = series((10, val(0.3)), (20, val(0.1)))
    out = replay(vals, STDERR)
    assert out == Replay(cannot=NO_RECORDS) and out is not None and not out.fired and out != Replay()
    assert out.text() == "n/a (no question records)"
    assert replay(vals, DROP) == Replay(step=20)  # drop needs no records
    # a val_metric that matches nothing cannot be scored either (the guard would stop there)
    missing = replay(vals, replace(DROP, val_metric="val-core/*/acc/mean@*"))
    assert missing.cannot == "no finite metric matches val-core/*/acc/mean@* at step 10"


def test_a_warning_metric_is_refused():
    with pytest.raises(ValueError, match="only the validation rule"):
        replay({}, replace(DROP, warning_metric="actor/ppo_kl", warning_threshold=0.1))


# --- guarded runs: cut at the first restore ---------------------------------------------------


def metrics_lines(
    vals: dict[int, dict[str, float]], restores: dict[int, float] | None = None, steps: int = 40
) -> list[str]:
    """verl's metrics-file lines: step 0's validation on its own line, then a training record per step
    (the guard's restore count when given: the count from that step on) with the step's validation and
    its time (5 s; verl times none before training)."""
    lines = [json.dumps({"step": 0, "data": vals[0]})] if 0 in vals else []
    count = 0.0
    for s in range(1, steps + 1):
        data = {"training/global_step": s, "timing_s/step": 1.0, **vals.get(s, {})}
        if s in vals:
            data["timing_s/testing"] = 5.0
        if restores is not None:
            count = restores.get(s, count)
            data["sorl/guard/restores"] = count
        lines.append(json.dumps({"step": s, "data": data}))
    return lines


def test_a_guarded_run_is_replayed_up_to_its_first_restore_and_censored_there():
    # the guard restored at step 20 with a wider rule; after it the run is no longer the unguarded one:
    # its step-30 validation (0.1, far below) must not count
    vals = series((0, val(0.2, 300)), (10, val(0.30, 300)), (20, val(0.22, 300)), (30, val(0.10, 300)))
    trace = parse_records(metrics_lines(vals, restores={20: 1.0, 30: 2.0}))
    assert sorted(trace.val_metrics) == [0, 10, 20, 30]
    assert trace.val_metrics[20]["val-aux/a/reward/questions"] == 300.0
    out = replay_run(trace, DROP)  # 0.22 is above drop's line 0.21
    assert out == Replay(censored_at=20) and out.text() == "censored at step 20"
    assert replay_run(trace, STDERR) == Replay(step=20)  # 0.08 > 2 SE = 0.071: a fire at the cut counts
    # the same series unguarded (no restore logged): replayed in full
    assert replay_run(parse_records(metrics_lines(vals)), DROP) == Replay(step=30)


def test_guard_config_reads_an_algorithms_overrides_and_questions_come_from_the_records():
    cfg = guard_config({"sorl.guard.enable": True, "sorl.guard.drop": 0.4, "sorl.guard.patience": 1, "x.y": 1},
                       rule="stderr")  # fmt: skip
    assert (cfg.drop, cfg.patience, cfg.rule, cfg.stderr_k) == (0.4, 1, "stderr", 2.0)
    with pytest.raises(ValueError, match=r"sorl\.guard\.drop=1\.5 is invalid"):
        guard_config({"sorl.guard.drop": 1.5})
    two = {**val(0.3, 100), "val-core/b/reward/mean@1": 0.1, "val-aux/b/reward/questions": 50.0}
    assert validation_questions(two, DROP.val_metric) == 150
    assert validation_questions(val(0.3), DROP.val_metric) is None


# --- the table --------------------------------------------------------------------------------


def cell(out: Path, regime: str, alg: str, seed: int, vals: dict, restores: dict | None = None,
         test_freq: int = 10, questions: int = 300) -> None:  # fmt: skip
    d = out / regime / alg / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("\n".join(metrics_lines(vals, restores, steps=40)) + "\n")
    write_record(d, {"key": f"{regime}/{alg}/seed{seed}", "regime": regime, "algorithm": alg, "seed": seed,
                     "steps": 40, "status": "done", "exit_code": 0, "wall_s": 100.0,
                     "overrides": {"trainer.total_training_steps": "40", "trainer.test_freq": str(test_freq),
                                   "data.val_max_samples": str(questions), "data.val_batch_size": str(questions),
                                   "data.seed": str(seed)}})  # fmt: skip


def grid_text(controls: str = "guard_controls: [demo]") -> str:
    return f"""\
        name: g
        steps: 40
        test_freq: 10
        seed_keys: [data.seed]
        {controls}
        regimes: {{demo: {{}}, hot: {{}}}}
        algorithms:
          grpo: {{}}
          grpo_guard: {{overrides: {{sorl.guard.enable: true, sorl.guard.drop: 0.3, sorl.guard.patience: 1}}}}
        cells: [{{regimes: [demo, hot], algorithms: [grpo, grpo_guard], seeds: [1]}}]
        """


def test_the_rule_table_from_an_archive(tmp_path, write_grid):
    out, res = tmp_path / "out", tmp_path / "res"
    res.mkdir()
    healthy = {0: val(0.2), 10: val(0.30), 20: val(0.29), 30: val(0.31), 40: val(0.30)}
    noisy = {s: val(v["val-core/a/reward/mean@1"], 30) for s, v in healthy.items()} | {20: val(0.20, 30)}
    falls = {0: val(0.2), 10: val(0.30), 20: val(0.22), 30: val(0.10), 40: val(0.10)}
    cell(out, "demo", "grpo", 1, healthy)
    cell(out, "demo", "grpo_guard", 1, noisy, restores={20: 1.0})
    cell(out, "hot", "grpo", 1, falls)
    recorded = {s: val(v["val-core/a/reward/mean@1"], 300) for s, v in falls.items()}
    cell(out, "hot", "grpo_guard", 1, recorded, restores={30: 1.0})
    archive = tmp_path / "g.tar.xz"
    write_archive(out, archive)
    found = read_archive(archive)
    g = load_grid(write_grid(tmp_path, grid_text()))
    path = write_rule_table(g, found, stability(found, "g", "cmd")["runs"], res, "g")
    assert path == res / "g_rules.md"
    per_run = path.read_text().split("\n\n")[1].splitlines()  # the first table: one row per run
    head, rows = per_run[0], {tuple(c.strip() for c in line.split("|")[1:4]): line for line in per_run[2:]}
    assert "first fire, drop 0.3, patience 1 | first fire, stderr k 2, patience 1" in head
    # 4 validations x 5 s of 100 s
    assert rows[("demo", "control", "grpo")].endswith(
        "| 10 steps | 300 (val_max_samples) | - | no fire | n/a (no question records) | 20.0% |"
    )
    # drop's false restore at 20 (0.20 < 0.21); stderr calls it noise on 30 questions, censored at the restore
    assert rows[("demo", "control", "grpo_guard")].endswith(
        "| 10 steps | 30 | step 20 | step 20 | censored at step 20 | 20.0% |"
    )
    # hot: drop fires at 30 (0.10 < 0.21); stderr at 20 (0.08 > 0.071 on 300 questions), before the restore
    assert rows[("hot", "not admitted", "grpo")].endswith("| - | step 30 | n/a (no question records) | 20.0% |")
    assert rows[("hot", "not admitted", "grpo_guard")].endswith("| 300 | step 30 | step 30 | step 20 | 20.0% |")
    text = path.read_text()
    assert "| demo | control | grpo_guard | 1 | 1 of 1 (step 20) | 0 of 1, 1 censored |" in text
    assert "| hot | not admitted | grpo | 1 | 1 of 1 (step 30) | n/a (no question records) |" in text
    assert "The drop replay fires at the guard's own first restore in 2 of 2 guarded runs." in text
    # a grid without guard_controls: no table
    plain = tmp_path / "plain"
    plain.mkdir()
    assert write_rule_table(load_grid(write_grid(plain, grid_text(""))), found, [], res, "plain") is None
    assert not (res / "plain_rules.md").exists()


TWIN_GRID = """\
    name: g
    steps: 40
    test_freq: 10
    seed_keys: [data.seed]
    guard_controls: [demo]
    regimes:
      demo: {}
      hot: {}
      hot_p5: {protocol_of: hot, test_freq: 5, val_max_samples: 100}
      demo_p5: {protocol_of: demo, test_freq: 5, val_max_samples: 100}
    algorithms:
      grpo: {}
      grpo_guard: {overrides: {sorl.guard.enable: true, sorl.guard.drop: 0.3, sorl.guard.patience: 1}}
    cells:
      - {regimes: [demo, hot], algorithms: [grpo], seeds: [1, 2]}
      - {regimes: [hot_p5, demo_p5], algorithms: [grpo], seeds: [1]}
"""


def test_a_protocol_twin_takes_its_base_regimes_role_in_the_rule_table(tmp_path, write_grid):
    out, res = tmp_path / "out", tmp_path / "res"
    res.mkdir()
    healthy = {0: val(0.2), 10: val(0.30), 20: val(0.29), 30: val(0.31), 40: val(0.30)}
    falls = {0: val(0.2), 10: val(0.30), 20: val(0.22), 30: val(0.10), 40: val(0.10)}
    for s in (1, 2):
        cell(out, "demo", "grpo", s, healthy)
        cell(out, "hot", "grpo", s, falls)  # gained then lost in 2 of 2 planned seeds: admitted
    # P5: every 5 steps on 100 questions; hot_p5 falls below drop's line (0.21) and stderr's (0.11) at step 20
    fives = {0: 0.2, 5: 0.30, 10: 0.30, 15: 0.25, 20: 0.10, 25: 0.10, 30: 0.10, 35: 0.10, 40: 0.10}
    cell(out, "hot_p5", "grpo", 1, {s: val(v, 100) for s, v in fives.items()}, test_freq=5, questions=100)
    cell(out, "demo_p5", "grpo", 1, {s: val(0.3 if s else 0.2, 100) for s in fives}, test_freq=5, questions=100)
    archive = tmp_path / "g.tar.xz"
    write_archive(out, archive)
    found = read_archive(archive)
    runs = stability(found, "g", "cmd")["runs"]
    grid = load_grid(write_grid(tmp_path, TWIN_GRID))
    assert roles(grid, runs) == {
        "demo": "control",
        "hot": "admitted",
        "demo_p5": "control (protocol_of demo)",
        "hot_p5": "admitted (protocol_of hot)",
    }
    text = write_rule_table(grid, found, runs, res, "g").read_text()
    per_run = text.split("\n\n")[1].splitlines()
    rows = {tuple(c.strip() for c in line.split("|")[1:5]): line for line in per_run[2:]}
    # the twin's rows: its base's role, its own protocol (5 steps, 100 questions); 8 validations x 5 s of 100 s
    assert rows[("hot_p5", "admitted (protocol_of hot)", "grpo", "1")].endswith(
        "| 5 steps | 100 | - | step 20 | step 20 | 40.0% |"
    )
    assert rows[("demo_p5", "control (protocol_of demo)", "grpo", "1")].endswith(
        "| 5 steps | 100 | - | no fire | no fire | 40.0% |"
    )
    assert rows[("hot", "admitted", "grpo", "1")].endswith("| 10 steps | 300 (val_max_samples) | - | step 30 |"
                                                           " n/a (no question records) | 20.0% |")  # fmt: skip
    assert "| hot_p5 | admitted (protocol_of hot) | grpo | 1 | 1 of 1 (step 20) | 1 of 1 (step 20) |" in text
    assert "| demo_p5 | control (protocol_of demo) | grpo | 1 | 0 of 1 | 0 of 1 |" in text
    # the same regimes without protocol_of: candidates of their own (one seed planned: not admitted)
    own = TWIN_GRID.replace("protocol_of: hot, ", "").replace("protocol_of: demo, ", "")
    plain = load_grid(write_grid(tmp_path, own, "own.yaml"))
    assert roles(plain, runs) == {"demo": "control", "hot": "admitted", "demo_p5": "not admitted",
                                  "hot_p5": "not admitted"}  # fmt: skip


def test_fires_are_counted_apart_from_censored_and_unreplayable_runs():
    replays = [Replay(step=20), Replay(step=30), Replay(censored_at=40), Replay(), Replay(cannot=NO_RECORDS)]
    assert fires_text(replays) == "2 of 4 (mean step 25.0), 1 censored; 1 n/a"
    assert fires_text([Replay(cannot=NO_RECORDS)] * 2) == "n/a (no question records)"


def test_the_replay_and_the_table_import_no_torch():
    code = "import sys, sorl_verl.study.rule_table; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
