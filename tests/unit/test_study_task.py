"""The grid-level ``task`` of a study (sorl_verl/study/grid.py, runner.py, metrics.py): which overlay and embedded
default the cells run, when a recorded cell counts as changed, and which validation sources belong to which task."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sorl_verl.embedded.demo_paths import TASK_OVERLAYS, train_files
from sorl_verl.embedded.medical_world import QUESTION_TYPES, data_source
from sorl_verl.study.grid import DEFAULT_TASK, DEFAULT_WARMSTART, TASKS, GridError, load_grid
from sorl_verl.study.metrics import TASK_SOURCES, parse_records, source_task
from sorl_verl.study.runner import EMBEDDED_TASK, Inputs, cell_command, cell_dir, cell_state, changed_keys, write_record

REPO = Path(__file__).resolve().parents[2]
INPUTS = Inputs(Path("/t.parquet"), Path("/v.parquet"), Path("/model"), "http://127.0.0.1:9/retrieve")
GRID = """\
    name: t
    steps: 2
    seed_keys: [data.seed]
    algorithms: {a: {overrides: {x.y: 1}}}
    regimes: {r: {overrides: {}}}
    cells: [{regimes: [r], algorithms: [a], seeds: [1, 2]}]
"""


def grid_file(tmp_path: Path, head: str = "") -> Path:
    path = tmp_path / "g.yaml"
    path.write_text(head + textwrap.dedent(GRID) + f"config_dir: {REPO / 'recipe' / 'sorl' / 'config'}\n")
    return path


def test_task_defaults_to_search_qa_and_the_command_carries_it(tmp_path):
    grid = load_grid(grid_file(tmp_path))
    assert grid.task == DEFAULT_TASK == "search_qa"
    cell = grid.cells[0]
    assert cell.task == "search_qa" and "+task=search_qa" in cell_command(grid, cell, INPUTS, tmp_path)


def test_medical_grid_runs_the_medical_overlay(tmp_path):
    grid = load_grid(grid_file(tmp_path, "task: medical_mcq\n"))
    assert grid.task == "medical_mcq" and {c.task for c in grid.cells} == {"medical_mcq"}
    cmd = cell_command(grid, grid.cells[0], INPUTS, tmp_path)
    assert [a for a in cmd if a.startswith("+task=")] == ["+task=medical_mcq"]
    assert "task" not in grid.cells[0].overrides and grid.cells[0].key == "r/a/seed1"  # grid-level, not a cell key


def test_every_grid_task_is_an_overlay_with_an_embedded_default():
    for task in TASKS:
        assert (REPO / "recipe" / "sorl" / "config" / "task" / f"{task}.yaml").is_file()
        assert TASK_OVERLAYS[EMBEDDED_TASK[task]] == task


@pytest.mark.parametrize("value", ["medical", "search-qa", "[search_qa]", "null"])
def test_unknown_task_names_file_and_line(tmp_path, value):
    path = grid_file(tmp_path, f"task: {value}\n")
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert str(err.value).startswith(f"{path}:1: task: unknown task") and "search_qa, medical_mcq" in str(err.value)


def test_a_cell_run_for_another_task_is_changed(tmp_path):
    qa = load_grid(grid_file(tmp_path)).cells[0]
    med = load_grid(grid_file(tmp_path, "task: medical_mcq\n")).cells[0]
    out = tmp_path / "out"
    record = {"status": "done", "overrides": dict(qa.overrides)}  # written before the task was recorded
    write_record(cell_dir(out, qa), record)
    assert changed_keys(record, qa) == [] and cell_state(out, qa) == "done"
    assert changed_keys(record, med) == ["task"] and cell_state(out, med) == "changed"
    write_record(cell_dir(out, med), {**record, "task": "medical_mcq"})
    assert cell_state(out, med) == "done" and cell_state(out, qa) == "changed"


def test_warmstart_is_grid_level_validated_and_part_of_a_cells_identity(tmp_path):
    grid = load_grid(grid_file(tmp_path))
    assert grid.warmstart == DEFAULT_WARMSTART == "expert" and {c.warmstart for c in grid.cells} == {"expert"}
    es = load_grid(grid_file(tmp_path, "warmstart: early-stop-50\n"))
    assert {c.warmstart for c in es.cells} == {"early-stop-50"} and es.cells[0].overrides == grid.cells[0].overrides
    record = {"status": "done", "overrides": dict(grid.cells[0].overrides)}  # a record without one ran the expert
    assert changed_keys(record, grid.cells[0]) == [] and changed_keys(record, es.cells[0]) == ["warmstart"]
    path = grid_file(tmp_path, "warmstart: early-stop-70\n")
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert str(err.value).startswith(f"{path}:1: warmstart: unknown warm-start 'early-stop-70'")
    assert "early-stop-50" in str(err.value)


def test_the_early_stop_qa_warm_starts_train_on_the_hops_they_have_demonstrations_for():
    parquet = {name: Path(f"/d/{name}.parquet") for name in ("train", "train_1hop", "train_2hop", "train_3hop")}
    for name in ("early-stop", "early-stop-50"):
        assert train_files("qa", name, parquet) == "[/d/train_1hop.parquet,/d/train_2hop.parquet]"
    assert train_files("qa", "expert", parquet) == Path("/d/train.parquet")
    assert train_files("medical", "early-stop", {"train": Path("/m.parquet")}) == Path("/m.parquet")


def _validation_line(step: int, scores: dict[str, float]) -> str:
    return json.dumps({"step": step, "data": {f"val-core/{s}/reward/mean@1": v for s, v in scores.items()}})


def test_medical_validation_sources_are_recognised_and_averaged_per_type():
    scores = {data_source(t): i / 10 for i, t in enumerate(QUESTION_TYPES)}
    trace = parse_records([_validation_line(0, scores), _validation_line(5, {k: 1.0 for k in scores})])
    assert trace.task == "medical_mcq"
    assert trace.val_scores == [(0, pytest.approx(sum(scores.values()) / 9)), (5, 1.0)]
    qa = parse_records([_validation_line(0, {f"synthetic_{k}hop": 0.5 for k in (1, 2, 3)})])
    assert qa.task == "search_qa"
    mixed = parse_records([_validation_line(0, {"synthetic_1hop": 0.5, data_source("diagnosis"): 0.5})])
    assert mixed.task is None and parse_records([_validation_line(0, {"medqa": 0.5})]).task is None


@given(st.from_regex(r"[a-z0-9_]{1,30}", fullmatch=True))
def test_a_source_belongs_to_at_most_one_task(source):
    owners = [t for t, pattern in TASK_SOURCES.items() if pattern.match(source)]
    assert len(owners) <= 1 and source_task(source) == (owners[0] if owners else None)
    assert source_task(source) != "medical_mcq" or source.startswith("synthetic_med_")
