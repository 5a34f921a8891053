"""The guard's default validation rule is ``stderr`` (natural.yaml's question 5, docs/results/natural_rules.md),
and everything fixed before that keeps ``drop`` written out: the studies' guarded arms (presets.yaml), the
recipes' ``GUARD=1``, and the runs already recorded (runner.changed_keys reads a record without the key as
the default it ran, ``drop``)."""

from __future__ import annotations

from pathlib import Path

import yaml

from sorl_verl.cli.recipe_plan import guard_overrides
from sorl_verl.study.grid import Cell, load_grid
from sorl_verl.study.runner import RAN_DEFAULTS, changed_keys
from sorl_verl.trainer.guard_rule import GuardConfig, guard_settings

REPO = Path(__file__).resolve().parents[2]
STUDY = REPO / "recipe" / "sorl" / "study"
RULE = "sorl.guard.rule"


def test_the_default_rule_is_stderr_at_k_2_without_a_floor():
    default = GuardConfig()
    assert (default.rule, default.stderr_k, default.min_drop, default.enable) == ("stderr", 2.0, 0.0, False)
    recipe = yaml.safe_load((REPO / "recipe" / "sorl" / "config" / "sorl_trainer.yaml").read_text())["sorl"]
    assert recipe["guard"]["rule"] == "stderr" and guard_settings(recipe)[0] == default


def test_every_guarded_cell_of_every_study_grid_runs_drop():
    """The guarded arms were fixed (drop 0.3) before their runs; the change of default must not reach them."""
    presets = yaml.safe_load((STUDY / "presets.yaml").read_text())["algorithms"]
    guarded = {n for n, a in presets.items() if a.get("overrides", {}).get("sorl.guard.enable")}
    assert guarded == {"grpo_guard", "so_grpo_guard"}
    assert all(presets[n]["overrides"][RULE] == "drop" for n in guarded)
    for path in sorted(STUDY.glob("*.yaml")):
        if path.name == "presets.yaml":
            continue
        grid = load_grid(path)
        for cell in grid.cells:
            if cell.overrides.get("sorl.guard.enable") == "true":
                assert cell.overrides.get(RULE) == "drop", (path.name, cell.key)


def test_the_recipes_guard_1_writes_drop_out():
    for platform, strategy in (("gpu", "fsdp"), ("gpu", "megatron"), ("cpu", "fsdp")):
        args = guard_overrides({"PLATFORM": platform, "STRATEGY": strategy})
        assert "sorl.guard.enable=true" in args and f"{RULE}=drop" in args and "sorl.guard.drop=0.3" in args


def cell_of(overrides: dict[str, str]) -> Cell:
    return Cell(index=0, regime="r", algorithm="a", seed=1, overrides=overrides)


def test_a_record_without_the_rule_ran_drop_where_the_cell_sets_it():
    assert RAN_DEFAULTS == {RULE: "drop"}
    guarded = {"sorl.guard.enable": "true", "sorl.guard.drop": "0.3"}
    before = {"status": "done", "overrides": dict(guarded)}  # recorded before the rule was written out
    assert changed_keys(before, cell_of({**guarded, RULE: "drop"})) == []
    assert changed_keys(before, cell_of({**guarded, RULE: "stderr"})) == [RULE]
    # a record that names its rule is compared as it is
    assert changed_keys({"overrides": {**guarded, RULE: "stderr"}}, cell_of({**guarded, RULE: "drop"})) == [RULE]
    assert changed_keys({"overrides": {**guarded, RULE: "drop"}}, cell_of({**guarded, RULE: "drop"})) == []
    # a cell that does not set the rule (unguarded, or guarded at the default) is compared as before
    assert changed_keys({"overrides": {"x.y": "1"}}, cell_of({"x.y": "1"})) == []
    assert changed_keys({"overrides": {**guarded, RULE: "drop"}}, cell_of(guarded)) == [RULE]
