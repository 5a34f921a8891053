"""Aggregation of a study (sorl_verl/study/aggregate.py, plots.py, cli aggregate/status) on synthetic runs."""

from __future__ import annotations

import json
import math
import tarfile
from pathlib import Path

import pytest

from sorl_verl.study import cli
from sorl_verl.study.aggregate import collect, lr_match, markdown_table, runs_table, stability, write_stability
from sorl_verl.study.archive import GUARD_EVENTS, ArchiveError, read_archive, write_archive
from sorl_verl.study.collapse import CRITERION
from sorl_verl.study.grid import load_grid
from sorl_verl.study.runner import write_record

LR = "actor_rollout_ref.actor.optim.lr"


def val(step: int, score: float) -> dict:
    return {"step": step, "data": {"val-core/s1/reward/mean@1": score, "val-core/s2/reward/mean@1": score / 2}}


def train(step: int, reward: float, z: float | None = None, **extra: float) -> dict:
    data = {"training/global_step": step, "critic/score/mean": reward, "actor/grad_norm": 0.5, "actor/ppo_kl": 0.01}
    if z is not None:
        data |= {"actor/sorl/norm_factor": z, "actor/sorl/turn_clipfrac": 0.1 * z}
    return {"step": step, "data": data | extra}


def grid_overrides(seed: int) -> dict[str, str]:
    """The overrides GRID gives cell hot/<algorithm>/seed<seed> (its runs record them)."""
    return {
        "trainer.total_training_steps": "4",
        "trainer.test_freq": "2",
        "data.val_max_samples": "96",
        "data.val_batch_size": "96",
        LR: "0.0005",
        "data.seed": str(seed),
    }


def make_cell(out: Path, regime: str, algorithm: str, seed: int, records: list[dict], **rec) -> Path:
    d = out / regime / algorithm / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    base = {
        "key": f"{regime}/{algorithm}/seed{seed}",
        "regime": regime,
        "algorithm": algorithm,
        "seed": seed,
        "steps": 4,
        "status": "done",
        "exit_code": 0,
        "wall_s": 100.0 + seed,
        "overrides": grid_overrides(seed),
    }
    write_record(d, base | rec)
    return d


def scores(*vs: float) -> list[dict]:
    """Validations at 0, 2, 4 with these mean-over-sources scores (s1 = 4/3 v, s2 = 2/3 v)."""
    return [val(2 * i, v * 4 / 3) for i, v in enumerate(vs)]


@pytest.fixture
def study(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    # grpo: seed 1 collapses (0.6 -> 0.1), seed 2 learns
    make_cell(out, "hot", "grpo", 1, scores(0.6, 0.3, 0.1) + [train(s, 0.5) for s in range(1, 5)])
    make_cell(out, "hot", "grpo", 2, scores(0.6, 0.6, 0.7) + [train(s, 0.5) for s in range(1, 5)])
    # so_grpo: Z = 2 at every step -> update scale 1/2; both stable
    for seed in (1, 2):
        make_cell(out, "hot", "so_grpo", seed, scores(0.6, 0.6, 0.5) + [train(s, 0.5, z=2.0) for s in range(1, 5)])
    # failed before step 1: not judged; running: not collected
    make_cell(out, "hot", "gspo", 1, scores(0.6), status="failed", exit_code=1, wall_s=30.0)
    make_cell(out, "hot", "cispo", 1, [], status="running")
    return out


def test_stability_json_records(study, tmp_path):
    found = collect(study)
    assert sorted(r["key"] for r, _ in found) == [
        "hot/grpo/seed1",
        "hot/grpo/seed2",
        "hot/gspo/seed1",
        "hot/so_grpo/seed1",
        "hot/so_grpo/seed2",
    ]
    data = stability(found, "t", "python -m sorl_verl.study --grid g.yaml", pending=["hot/cispo/seed1"])
    assert data["criterion"] == CRITERION and data["not_run"] == ["hot/cispo/seed1"]
    runs = {(r["algorithm"], r["seed"]): r for r in data["runs"]}
    g1 = runs[("grpo", 1)]
    assert (g1["collapsed"], g1["judged"], g1["onset_step"], g1["steps"], g1["wall_s"]) == (True, True, 4, 4, 101.0)
    assert g1["final_val_score"] == pytest.approx(0.1) and g1["peak_val_score"] == pytest.approx(0.6)
    assert g1["initial_val_score"] == pytest.approx(0.6)
    assert g1["final_val_by_source"] == {"s1": pytest.approx(0.4 / 3), "s2": pytest.approx(0.2 / 3)}
    assert runs[("grpo", 2)]["collapsed"] is False
    so = runs[("so_grpo", 1)]
    assert (so["mean_norm_factor"], so["mean_update_scale"], so["max_sorl_clipfrac"]) == (2.0, 0.5, 0.2)
    assert so["lr"] == 0.0005
    gspo = runs[("gspo", 1)]
    assert (gspo["judged"], gspo["collapsed"], gspo["status"]) == (False, False, "failed")
    # lr for grpo_lowlr: 5e-4 x mean(1/Z) = 2.5e-4
    assert data["lr_match"] == {
        "hot": {"reference": "so_grpo", "runs": 2, "lr": 0.0005, "mean_update_scale": 0.5, "matched_lr": 0.00025}
    }
    path = write_stability(data, tmp_path / "res" / "stability.json")
    assert json.loads(path.read_text()) == data


def test_markdown_table(study):
    data = stability(collect(study), "t", "cmd")
    table = markdown_table(data["runs"])
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in table.splitlines()[2:]}
    assert "| 1/2 | 0.400 ± 0.424 | 0.650 ± 0.071 | 102 | 0 |" in rows[("hot", "grpo")]
    assert "| 0/2 | 0.500 ± 0.000 | 0.600 ± 0.000 | 102 | 0 |" in rows[("hot", "so_grpo")]
    assert "| 0/0 | - | - | 30 | 1 |" in rows[("hot", "gspo")]


def test_runs_table_one_row_per_run(study):
    data = stability(collect(study), "t", "cmd")
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in runs_table(data["runs"]).splitlines()[2:]}
    assert len(rows) == 5
    g1 = [c.strip() for c in rows[("hot", "grpo", "1")].split("|")[4:9]]
    assert g1[0] == "0.60 / 0.30 / 0.10" and g1[1] == "-" and g1[4] == "collapsed (onset 4)"
    so = [c.strip() for c in rows[("hot", "so_grpo", "2")].split("|")[4:9]]
    assert so[1:3] == ["0.500", "0.200 (sorl)"] and so[4] == "held"
    assert "not judged" in rows[("hot", "gspo", "1")] and "exit 1" in rows[("hot", "gspo", "1")]


def test_update_scale_logged_wins_over_one_over_z():
    runs = [
        {"algorithm": "so_grpo", "regime": "r", "lr": 1e-3, "mean_update_scale": 0.8},
        {"algorithm": "so_grpo", "regime": "r", "lr": 1e-3, "mean_update_scale": 0.4},
        {"algorithm": "grpo", "regime": "r", "lr": 1e-3, "mean_update_scale": None},
    ]
    assert lr_match(runs)["r"]["matched_lr"] == pytest.approx(6e-4)


GRID = """\
    name: g
    steps: 4
    test_freq: 2
    seed_keys: [data.seed]
    regimes: {hot: {overrides: {actor_rollout_ref.actor.optim.lr: 5.0e-4}}}
    algorithms: {grpo: {}, so_grpo: {}, gspo: {}, cispo: {}, ppo: {}}
    cells: [{regimes: [hot], algorithms: [grpo, so_grpo, gspo, cispo, ppo], seeds: [1, 2]}]
"""


def test_cli_aggregate_writes_json_table_and_pngs(study, tmp_path, write_grid, capsys):
    res = tmp_path / "results"
    grid = write_grid(tmp_path, GRID)
    assert cli.main(["aggregate", "--grid", str(grid), "--out", str(study), "--results", str(res)]) == 0
    printed = capsys.readouterr().out
    assert "lr for grpo_lowlr in hot: 0.00025" in printed
    data = json.loads((res / "stability.json").read_text())
    assert len(data["runs"]) == 5
    assert sorted(data["not_run"]) == [
        "hot/cispo/seed1",
        "hot/cispo/seed2",
        "hot/gspo/seed2",
        "hot/ppo/seed1",
        "hot/ppo/seed2",
    ]
    assert (res / "stability_table.md").read_text() in printed
    assert (res / "stability_runs.md").read_text().count("\n| hot |") == 5
    png = res / "stability_hot.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    # --only restricts the runs
    assert (
        cli.main(
            [
                "aggregate",
                "--grid",
                str(grid),
                "--out",
                str(study),
                "--results",
                str(res),
                "--only",
                "so_grpo",
                "--no-plots",
                "--name",
                "x",
            ]
        )
        == 0
    )
    assert {r["algorithm"] for r in json.loads((res / "x.json").read_text())["runs"]} == {"so_grpo"}


def test_records_match_the_grid_and_an_edited_grid_is_flagged(study, tmp_path, write_grid, capsys):
    grid = load_grid(write_grid(tmp_path, GRID))
    assert all(dict(c.overrides) == grid_overrides(c.seed) for c in grid.cells)
    path = write_grid(tmp_path, GRID)
    path.write_text(path.read_text().replace("5.0e-4", "2.5e-4"))
    res = tmp_path / "results"
    assert cli.main(["aggregate", "--grid", str(path), "--out", str(study), "--results", str(res), "--no-plots"]) == 0
    assert f"warning: hot/grpo/seed1 ran with other {LR} than the grid has now" in capsys.readouterr().err
    runs = json.loads((res / "stability.json").read_text())["runs"]
    assert all(r["grid_changed"] == [LR] for r in runs)


def test_cli_aggregate_with_nothing_finished(tmp_path, write_grid, capsys):
    grid = write_grid(tmp_path, GRID)
    assert (
        cli.main(["aggregate", "--grid", str(grid), "--out", str(tmp_path / "empty"), "--results", str(tmp_path / "r")])
        == 1
    )
    assert not (tmp_path / "r").exists()


def test_cli_status(study, tmp_path, write_grid, capsys):
    grid = write_grid(tmp_path, GRID)
    assert cli.main(["status", "--grid", str(grid), "--out", str(study), "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)["cells"]}
    states = {k: r["state"] for k, r in rows.items()}
    assert states == {
        "hot/grpo/seed1": "done",
        "hot/grpo/seed2": "done",
        "hot/so_grpo/seed1": "done",
        "hot/so_grpo/seed2": "done",
        "hot/gspo/seed1": "failed",
        "hot/gspo/seed2": "pending",
        "hot/cispo/seed1": "interrupted",  # 'running' but no study process holds the directory
        "hot/cispo/seed2": "pending",
        "hot/ppo/seed1": "pending",
        "hot/ppo/seed2": "pending",
    }
    assert rows["hot/grpo/seed1"]["final_val_score"] == pytest.approx(0.1) and rows["hot/grpo/seed1"]["steps"] == 4
    assert cli.main(["status", "--grid", str(grid), "--out", str(study)]) == 0
    text = capsys.readouterr().out
    assert "done 4, failed 1, interrupted 1, pending 4 of 10" in text


def test_cli_bad_grid_exit_2(tmp_path, write_grid, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [\n")
    assert cli.main(["status", "--grid", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert cli.main(["--grid", str(write_grid(tmp_path, GRID)), "--out", str(tmp_path / "o"), "--only", "nomatch"]) == 2


def test_nan_never_reaches_the_json(tmp_path):
    out = tmp_path / "out"
    make_cell(out, "hot", "grpo", 1, scores(0.6, 0.5) + [train(1, math.nan, **{"actor/pg_loss": math.nan})])
    data = stability(collect(out), "t", "cmd")
    run = data["runs"][0]
    assert run["collapsed"] and "actor/pg_loss" in run["reason"]
    write_stability(data, tmp_path / "s.json")  # allow_nan=False: would raise on a NaN


def test_cli_aggregate_grid_outside_the_repository(study, tmp_path, write_grid):
    """A grid file elsewhere that uses the repository's config: the command names its absolute path."""
    repo_config = Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config"
    text = write_grid(tmp_path, GRID).read_text() + f"config_dir: {repo_config}\n"
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text(text.replace("name: g", "name: e"))
    res = tmp_path / "res"
    args = ["aggregate", "--grid", str(elsewhere), "--out", str(study), "--results", str(res), "--no-plots"]
    assert cli.main(args) == 0
    assert (
        json.loads((res / "stability.json").read_text())["command"] == f"python -m sorl_verl.study --grid {elsewhere}"
    )


def test_archive_round_trip_regenerates_the_same_files(study, tmp_path, write_grid, capsys):
    """archive -> aggregate --from-archive writes byte-identical json/tables to aggregate from the run directory."""
    grid = write_grid(tmp_path, GRID)
    archive = tmp_path / "g.tar.xz"
    assert cli.main(["archive", "--grid", str(grid), "--out", str(study), "--archive", str(archive)]) == 0
    assert "(5 runs," in capsys.readouterr().out  # the 'running' cell is not archived
    with tarfile.open(archive, "r:xz") as tar:
        names = tar.getnames()
        assert {m.mtime for m in tar} == {0}
    assert names == [f"hot/{a}/seed{s}/{f}" for a, s in GRID_KEYS for f in ("cell.json", "metrics.jsonl")]
    from_dir, from_archive = tmp_path / "a", tmp_path / "b"
    common = ["--grid", str(grid), "--no-plots"]
    assert cli.main(["aggregate", *common, "--out", str(study), "--results", str(from_dir)]) == 0
    assert (
        cli.main(["aggregate", *common, "--from-archive", "--archive", str(archive), "--results", str(from_archive)])
        == 0
    )
    for name in ("stability.json", "stability_table.md", "stability_runs.md"):
        assert (from_archive / name).read_bytes() == (from_dir / name).read_bytes(), name
    # archiving the same runs again writes the same bytes
    again = tmp_path / "again.tar.xz"
    assert cli.main(["archive", "--grid", str(grid), "--out", str(study), "--archive", str(again)]) == 0
    assert again.read_bytes() == archive.read_bytes()


#: (algorithm, seed) of the study fixture's finished cells, in path order
GRID_KEYS = [("grpo", 1), ("grpo", 2), ("gspo", 1), ("so_grpo", 1), ("so_grpo", 2)]


def test_archive_restores_the_run_directory_and_honours_only(study, tmp_path):
    archive = tmp_path / "g.tar.xz"
    assert write_archive(study, archive, {"hot/grpo/seed1", "hot/cispo/seed1"}) == ["hot/grpo/seed1"]
    assert [r["key"] for r, _ in read_archive(archive)] == ["hot/grpo/seed1"]
    write_archive(study, archive)
    restored = tmp_path / "restored"
    with tarfile.open(archive, "r:xz") as tar:
        tar.extractall(restored, filter="data")
    assert [(r, t.val_scores, t.train) for r, t in collect(restored)] == [
        (r, t.val_scores, t.train) for r, t in collect(study)
    ]
    assert [r["key"] for r, _ in read_archive(archive, {"hot/so_grpo/seed2"})] == ["hot/so_grpo/seed2"]


def test_bad_archives_are_named(study, tmp_path, write_grid, capsys):
    grid = write_grid(tmp_path, GRID)
    bad = tmp_path / "bad.tar.xz"
    bad.write_bytes(b"not an archive")
    args = ["aggregate", "--grid", str(grid), "--from-archive", "--archive", str(bad), "--results", str(tmp_path / "r")]
    assert cli.main(args) == 2
    assert f"{bad}: not a readable .tar.xz study archive" in capsys.readouterr().err
    foreign = tmp_path / "foreign.tar.xz"
    with tarfile.open(foreign, "w:xz") as tar:
        tar.add(study / "hot" / "grpo" / "seed1" / "metrics.jsonl", arcname="notes/metrics.jsonl")
    with pytest.raises(ArchiveError, match="'notes/metrics.jsonl' is not <regime>/<algorithm>/seed<k>/"):
        read_archive(foreign)
    assert cli.main(["archive", "--grid", str(grid), "--out", str(tmp_path / "empty"), "--archive", str(bad)]) == 1
    assert "no finished run" in capsys.readouterr().err


def guard_train(step: int, restores: int, seconds: float) -> dict:
    """A training step of a guarded run: the guard's metrics as verl's file logger writes them."""
    return train(step, 0.5, **{"sorl/guard/restores": float(restores), "timing_s/sorl_guard": seconds})


def test_a_guarded_run_records_restores_and_guard_seconds_and_archives_its_events(study, tmp_path):
    steps = [guard_train(1, 0, 0.0625), guard_train(2, 0, 0.25), guard_train(3, 0, 0.0625), guard_train(4, 1, 0.5)]
    d = make_cell(study, "hot", "grpo_guard", 1, scores(0.6, 0.7, 0.2) + steps)
    events = b'{"step": 2, "event": "new_best", "seconds": 0.25}\n{"step": 4, "event": "restore", "seconds": 0.5}\n'
    (d / "checkpoints" / "sorl_guard" / "best_step_2" / "actor").mkdir(parents=True)
    (d / "checkpoints" / "sorl_guard" / "best_step_2" / "actor" / "model.pt").write_bytes(b"weights")
    (d / "checkpoints" / "global_step_2").mkdir()
    (d / "checkpoints" / "global_step_2" / "data.pt").write_bytes(b"position")
    (d / GUARD_EVENTS).write_bytes(events)
    runs = {(r["algorithm"], r["seed"]): r for r in stability(collect(study), "t", "cmd")["runs"]}
    guarded = runs[("grpo_guard", 1)]
    assert (guarded["guard_restores"], guarded["guard_s"]) == (1, 0.875)
    # a run without the guard carries neither key (the committed stability json stays as it was)
    assert "guard_restores" not in runs[("grpo", 1)] and "guard_s" not in runs[("grpo", 1)]
    archive = tmp_path / "g.tar.xz"
    write_archive(study, archive)
    with tarfile.open(archive, "r:xz") as tar:
        names = tar.getnames()
        assert tar.extractfile("hot/grpo_guard/seed1/" + GUARD_EVENTS).read() == events
    # cell.json, metrics.jsonl and the event log; never a checkpoint file
    assert [n for n in names if n.startswith("hot/grpo_guard/")] == [
        "hot/grpo_guard/seed1/cell.json",
        "hot/grpo_guard/seed1/metrics.jsonl",
        "hot/grpo_guard/seed1/" + GUARD_EVENTS,
    ]
    assert sum(n.endswith(GUARD_EVENTS) for n in names) == 1
    from_archive = {r["key"]: t for r, t in read_archive(archive)}
    assert from_archive["hot/grpo_guard/seed1"].series("sorl/guard/restores")[-1] == (4, 1.0)


def test_the_guard_event_log_is_where_the_guard_writes_it_in_a_run_directory():
    from sorl_verl.study.runner import CHECKPOINTS, RUN_OUTPUTS
    from sorl_verl.trainer.guard import GUARD_DIR

    assert f"{CHECKPOINTS}/{GUARD_DIR}/events.jsonl" == GUARD_EVENTS and CHECKPOINTS in RUN_OUTPUTS


REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("grid", "name"), [("stress", "stability"), ("stress_b", "stability_b")])
def test_committed_archive_regenerates_the_committed_tables(grid, name, tmp_path):
    """docs/results/study/<grid>.tar.xz -> the committed stability json, tables and warning table, byte for byte."""
    res = tmp_path / "res"
    args = ["aggregate", "--grid", str(REPO_ROOT / "recipe/sorl/study" / f"{grid}.yaml"), "--from-archive"]
    assert cli.main([*args, "--results", str(res), "--name", name, "--no-plots"]) == 0
    for suffix in (".json", "_table.md", "_runs.md", "_warnings.md"):
        committed = REPO_ROOT / "docs" / "results" / f"{name}{suffix}"
        assert (res / f"{name}{suffix}").read_bytes() == committed.read_bytes(), committed


def test_the_fall_rule_table_goes_below_the_fixed_one_and_needs_the_validation_size(
    study, tmp_path, write_grid, capsys
):
    from sorl_verl.study.warning_signals import FALL_RULE

    grid = write_grid(tmp_path, GRID)
    text = grid.read_text()
    fall_grid = grid.with_name("fall.yaml")
    fall_grid.write_text(text.replace("name: g\n", "name: g\nwarning_fall_rule: true\n"))
    plain, fall = tmp_path / "plain", tmp_path / "fall"
    for path, res in ((grid, plain), (fall_grid, fall)):
        args = ["aggregate", "--grid", str(path), "--out", str(study), "--results", str(res), "--no-plots"]
        assert cli.main(args) == 0
    fixed, both = (plain / "stability_warnings.md").read_text(), (fall / "stability_warnings.md").read_text()
    added = both.removeprefix(fixed)
    assert added != both and added.startswith(f"\n{FALL_RULE}\n\n| signal | warned / runs that fell")
    # grpo seed 1: 0.6 -> 0.3 at step 2 is 0.3 > 2 sqrt((0.24 + 0.21) / 96) = 0.137 (it also collapses, later);
    # so_grpo's 0.6 -> 0.5 is 0.1 < 2 sqrt((0.24 + 0.25) / 96) = 0.143
    assert both.endswith("Runs that fell: hot/grpo/seed1 (step 2) of 4 judged.\n")
    # a run whose record does not say how many questions it validated on: a clear error, nothing written
    cell = study / "hot" / "grpo" / "seed2" / "cell.json"
    rec = json.loads(cell.read_text())
    del rec["overrides"]["data.val_max_samples"]
    cell.write_text(json.dumps(rec))
    empty = tmp_path / "empty"
    capsys.readouterr()
    assert cli.main(["aggregate", "--grid", str(fall_grid), "--out", str(study), "--results", str(empty)]) == 2
    assert "hot/grpo/seed2: its record has no data.val_max_samples" in capsys.readouterr().err
    assert not empty.exists() or not any(empty.iterdir())


def test_episodes_come_from_this_checkout_when_the_recorded_config_path_is_gone(tmp_path):
    """A run made in another checkout (a removed worktree) aggregates to the same episodes per step."""
    from sorl_verl.study.aggregate import CHECKOUT_CONFIG_DIR, _config_dir
    from sorl_verl.study.report import episodes_per_step

    gone = {"command": ["python", "-m", "verl.trainer.main_ppo", "--config-path", str(tmp_path / "gone"), "x"]}
    here = {"command": ["python", "-m", "verl.trainer.main_ppo", "--config-path", str(CHECKOUT_CONFIG_DIR), "x"]}
    assert _config_dir(gone) == CHECKOUT_CONFIG_DIR == _config_dir(here)
    assert _config_dir({"command": ["python"]}) is None
    assert episodes_per_step({}, _config_dir(gone)) == episodes_per_step({}, CHECKOUT_CONFIG_DIR) is not None


def test_a_grid_mixing_reward_and_acc_runs_scores_each_by_its_core_metric(tmp_path):
    """A run whose reward returns ``acc`` (partial_credit > 0) logs verl's core metric under ``acc`` and
    the shaped reward under ``val-aux``; its scores are the ``acc`` ones, beside a run scored by ``reward``."""
    out = tmp_path / "out"
    make_cell(out, "demo", "grpo", 1, scores(0.3, 0.4, 0.2) + [train(s, 0.5) for s in range(1, 5)])
    shaped = [
        {"step": 2 * i, "data": {"val-core/s1/acc/mean@1": v, "val-aux/s1/reward/mean@1": v + 0.5}}
        for i, v in enumerate((0.3, 0.4, 0.1))
    ]
    make_cell(out, "demo_partial_f1", "grpo", 1, shaped + [train(s, 0.8) for s in range(1, 5)])
    runs = {r["regime"]: r for r in stability(collect(out), "t", "cmd")["runs"]}
    plain, partial = runs["demo"], runs["demo_partial_f1"]
    assert [v for _, v in plain["val_scores"]] == pytest.approx([0.3, 0.4, 0.2])
    assert [v for _, v in partial["val_scores"]] == pytest.approx([0.3, 0.4, 0.1])  # acc, not the shaped 0.8-0.9
    assert partial["final_val_by_source"] == {"s1": pytest.approx(0.1)}
    assert (partial["collapsed"], plain["collapsed"]) == (True, False)  # 0.1 < half the peak 0.4; 0.2 is not
