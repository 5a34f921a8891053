"""Grid files of the stability study (sorl_verl/study/grid.py): the committed grids and bad input."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from sorl_verl.study.grid import (
    PLACEHOLDER,
    STEPS_KEY,
    TEST_FREQ_KEY,
    VAL_BATCH_KEY,
    VAL_SIZE_KEY,
    GridError,
    format_value,
    load_grid,
    matches,
)

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "recipe" / "sorl" / "study"
CPU = yaml.safe_load((ROOT / "recipe" / "sorl" / "config" / "platform" / "cpu.yaml").read_text())
ACTOR = "actor_rollout_ref.actor"
LOSS = f"{ACTOR}.policy_loss"


def cpu_default(key: str):
    node = CPU
    for part in key.split("."):
        node = node[part]
    return node


def updates_per_rollout(overrides: dict[str, str]) -> int:
    """ppo_epochs x mini-batches per rollout, the CPU overlay's value where the cell does not set it."""
    epochs = int(overrides.get(f"{ACTOR}.ppo_epochs", cpu_default(f"{ACTOR}.ppo_epochs")))
    batch = int(overrides.get("data.train_batch_size", cpu_default("data.train_batch_size")))
    mini = int(overrides.get(f"{ACTOR}.ppo_mini_batch_size", cpu_default(f"{ACTOR}.ppo_mini_batch_size")))
    return epochs * batch // mini


def test_stress_grid_has_the_issue_comparison():
    grid = load_grid(STUDY / "stress.yaml")
    assert grid.name == "stress" and grid.config_dir == ROOT / "recipe" / "sorl" / "config"
    seeds: dict[tuple[str, str], set[int]] = {}
    for c in grid.cells:
        seeds.setdefault((c.regime, c.algorithm), set()).add(c.seed)
    assert len({c.key for c in grid.cells}) == len(grid.cells)
    # >= 3 seeds for grpo and so_grpo in the main regime and in each other off-policy regime
    for regime in ("many_updates", "stale_async", "mismatch"):
        assert len(seeds[(regime, "grpo")]) >= 3 and len(seeds[(regime, "so_grpo")]) >= 3
    wanted = {"turn_ppo", "s_ppo", "gspo", "geo_mean", "cispo", "grpo_rc", "grpo_lowlr", "ppo", "so_ppo"}
    wanted |= {"so_grpo_update", "so_grpo_loss"}
    assert wanted <= {a for r, a in seeds if r == "many_updates"}
    for reference in ("abs", "rel"):
        sweep = [a for r, a in seeds if r == "many_updates" and a.startswith(f"so_grpo_{reference}_tau")]
        assert len(sweep) >= 3, sweep
    assert {"on_policy", "stale_async_separate"} <= {r for r, _ in seeds}


def overrides_of(grid, regime: str, algorithm: str) -> dict[str, str]:
    return next(c.overrides for c in grid.cells if c.regime == regime and c.algorithm == algorithm)


def test_regimes_are_off_policy_as_the_issue_defines():
    grid = load_grid(STUDY / "stress.yaml")
    assert updates_per_rollout(overrides_of(grid, "on_policy", "grpo")) == 1
    assert updates_per_rollout(overrides_of(grid, "many_updates", "grpo")) >= 8
    stale = overrides_of(grid, "stale_async", "grpo")
    assert stale["trainer.v1.trainer_mode"] == "sorl_colocate_async"
    assert int(stale["trainer.v1.colocate_async.num_warmup_batches"]) >= 2
    sep = overrides_of(grid, "stale_async_separate", "grpo")
    assert sep["trainer.v1.trainer_mode"] == "sorl_separate_async"
    # verl's separate-async trainer asserts train_batch_size == parameter_sync_step x ppo_mini_batch_size
    sync = int(sep["trainer.v1.separate_async.parameter_sync_step"])
    assert sync >= 2 and cpu_default("data.train_batch_size") == sync * int(sep[f"{ACTOR}.ppo_mini_batch_size"])
    mismatch = overrides_of(grid, "mismatch", "grpo")
    assert mismatch["actor_rollout_ref.rollout.dtype"] == "bfloat16"
    assert cpu_default(f"{ACTOR}.fsdp_config.mixed_precision.param_dtype") == "fp32"


def test_algorithm_overrides_and_seed():
    grid = load_grid(STUDY / "stress.yaml")
    o = overrides_of(grid, "many_updates", "gspo")
    assert (o[f"{LOSS}.loss_mode"], o[f"{ACTOR}.clip_ratio_low"], o[f"{ACTOR}.clip_ratio_high"]) == (
        "gspo",
        "0.0003",
        "0.0004",
    )
    assert o[f"{ACTOR}.loss_agg_mode"] == "seq-mean-token-mean"
    rc = overrides_of(grid, "mismatch", "grpo_rc")
    assert rc["algorithm.rollout_correction.rollout_is"] == "sequence"
    tau = overrides_of(grid, "many_updates", "so_grpo_rel_tau0.25")
    assert (tau[f"{LOSS}.clip_norm_reference"], tau[f"{LOSS}.clip_norm_tau"]) == ("relative", "0.25")
    # the seed drives episode sampling; data order and the validation questions stay the platform's
    assert "actor_rollout_ref.rollout.seed" in grid.seed_keys and "data.seed" not in grid.seed_keys
    for c in grid.cells:
        assert all(c.overrides[k] == str(c.seed) for k in grid.seed_keys)
        assert c.overrides["trainer.total_training_steps"] == "20"
    # grpo_lowlr: filled from the so_grpo cells where they ran (lr x mean step factor), placeholder elsewhere
    lowlr = {c.regime: c for c in grid.cells if c.algorithm == "grpo_lowlr"}
    filled = lowlr["many_updates"]
    assert not filled.unfilled and float(filled.overrides[f"{ACTOR}.optim.lr"]) < 3.0e-4
    assert all(
        c.unfilled == (f"{ACTOR}.optim.lr",) and c.overrides[f"{ACTOR}.optim.lr"] == PLACEHOLDER
        for r, c in lowlr.items()
        if r != "many_updates"
    )


def test_smoke_grid_is_one_short_cell():
    grid = load_grid(STUDY / "smoke.yaml")
    assert [c.key for c in grid.cells] == ["many_updates/so_grpo/seed1"]
    assert (grid.steps, grid.test_freq, grid.val_max_samples) == (2, 2, 16)


#: the collapse guard's settings of the learning study's guard algorithms, fixed before any run
GUARD = {
    "sorl.guard.enable": "true",
    "sorl.guard.rule": "drop",  # written out since the guard's default became stderr
    "sorl.guard.drop": "0.3",
    "sorl.guard.patience": "1",
    "sorl.guard.backoff": "0.5",
    "sorl.guard.backoff_target": "lr",
    "sorl.guard.max_restores": "3",
    "sorl.guard.warning_metric": "null",
}


def test_learning_grid_guard_cells_are_the_algorithms_plus_the_guard():
    from omegaconf import OmegaConf

    from sorl_verl.trainer.guard import check_guard_against_trainer
    from sorl_verl.trainer.guard_rule import guard_settings

    grid = load_grid(STUDY / "learning.yaml")
    cells = {c.key: c for c in grid.cells}
    jump = "updates16_const_jump21"
    for guarded, plain in (("grpo_guard", "grpo"), ("so_grpo_guard", "so_grpo")):
        entry = {k: format_value(v) for k, v in grid.algorithms[guarded].overrides.items()}
        assert entry == {**{k: format_value(v) for k, v in grid.algorithms[plain].overrides.items()}, **GUARD}
        cell = cells[f"{jump}/{guarded}/seed1"]
        # the cell: the regime's overrides (lr jump included) and the algorithm's, the guard's last
        assert {k: cell.overrides[k] for k in GUARD} == GUARD
        assert cell.overrides["sorl.fault_injection.from_step"] == "21"
        # the guard's sections as hydra composes them: the recipe's defaults under the cell's overrides
        recipe = yaml.safe_load((grid.config_dir / "sorl_trainer.yaml").read_text())["sorl"]
        sorl_overrides = [f"{k}={v}" for k, v in cell.overrides.items() if k.startswith("sorl.")]
        sorl = OmegaConf.to_container(
            OmegaConf.merge({"sorl": {k: recipe[k] for k in ("guard", "fault_injection")}},
                            OmegaConf.from_dotlist(sorl_overrides))
        )["sorl"]  # fmt: skip
        config, fault = guard_settings(sorl)
        assert (config.enable, config.rule, config.drop, config.patience, config.backoff) == (True, "drop", 0.3, 1, 0.5)
        assert (config.backoff_target, config.max_restores, config.warning_metric) == ("lr", 3, None)
        assert (fault.lr_factor, fault.from_step) == (2.0, 21)
        trainer = OmegaConf.create({
            "trainer": {"test_freq": int(cell.overrides["trainer.test_freq"])},
            "actor_rollout_ref": {"actor": {"policy_loss": {
                "loss_mode": cell.overrides["actor_rollout_ref.actor.policy_loss.loss_mode"]}}},
        })  # fmt: skip
        check_guard_against_trainer(trainer, config)
        assert cell.overrides["trainer.test_freq"] == "10" and cell.overrides["trainer.save_freq"] == "-1"
    # every guarded cell has its unguarded twin (same regime and seed) in the grid: the evidence is paired
    guarded = [c for c in grid.cells if c.algorithm.endswith("_guard")]
    assert guarded and {c.regime for c in guarded} == {jump}
    for c in guarded:
        assert c.key.replace(f"/{c.algorithm}/", f"/{c.algorithm.removesuffix('_guard')}/") in cells


BASE = """\
    name: t
    steps: 4
    seed_keys: [data.seed]
    common: {trainer.save_freq: -1}
    regimes:
      hot: {overrides: {actor_rollout_ref.actor.optim.lr: 1.0e-3, trainer.save_freq: 2}}
    algorithms:
      a: {overrides: {x.y: 1, actor_rollout_ref.actor.optim.lr: 2.0e-3}, per_regime: {hot: {x.y: 3}}}
      b: {overrides: {x.y: 2, data.seed: 99}}
    cells:
      - {regimes: [hot], algorithms: [a, b], seeds: [7]}
      - {regimes: hot, algorithms: [a], seeds: [7, 8]}
"""


def test_merge_order_and_dedup(tmp_path, write_grid):
    grid = load_grid(write_grid(tmp_path, BASE))
    assert [c.key for c in grid.cells] == ["hot/a/seed7", "hot/b/seed7", "hot/a/seed8"]
    a7, b7 = grid.cells[0].overrides, grid.cells[1].overrides
    assert a7["actor_rollout_ref.actor.optim.lr"] == "0.002"  # algorithm over regime
    assert a7["x.y"] == "3"  # per_regime over algorithm
    assert a7["trainer.save_freq"] == "2"  # regime over common
    assert b7["data.seed"] == "7"  # the seed over everything
    assert a7["trainer.test_freq"] == "4"  # test_freq defaults to steps
    assert list(a7)[:4] == [
        "trainer.total_training_steps",
        "trainer.test_freq",
        "data.val_max_samples",
        "data.val_batch_size",
    ]


def test_include_library_merged_key_by_key(tmp_path, write_grid):
    write_grid(
        tmp_path,
        """\
        seed_keys: [data.seed]
        algorithms:
          a: {description: lib, overrides: {x.y: 1, x.z: 1}}
        regimes:
          r: {overrides: {q: 1}}
        """,
        name="lib.yaml",
    )
    grid = load_grid(
        write_grid(
            tmp_path,
            """\
            include: lib.yaml
            steps: 2
            algorithms:
              a: {overrides: {x.z: 2}}
              s: {overrides: {k: 0}, sweep: {key: x.t, label: t, values: [0.5, 1, 2.0e-2]}}
            cells: [{regimes: [r], algorithms: [a, s], seeds: [0]}]
            """,
        )
    )
    assert grid.name == "g" and grid.algorithms["a"].description == "lib"
    assert dict(grid.algorithms["a"].overrides) == {"x.y": 1, "x.z": 2}
    assert [c.algorithm for c in grid.cells] == ["a", "s_t0.5", "s_t1", "s_t0.02"]
    assert grid.cells[3].overrides["x.t"] == "0.02"


@pytest.mark.parametrize(
    ("edit", "line", "words"),
    [
        (("steps: 4", "stepz: 4"), 2, "unknown key"),
        (("algorithms: [a, b]", "algorithms: [a, c]"), 11, "unknown algorithm 'c'"),
        (("seeds: [7, 8]", "seeds: [7, x]"), 12, "integers >= 0"),
        (("x.y: 2,", "x y: 2,"), 9, "not a hydra override key"),
        (("hot: {x.y: 3}", "cold: {x.y: 3}"), 8, "unknown regime 'cold'"),
        (("steps: 4", "steps: 0"), 2, "integer >= 1"),
        (("steps: 4", "steps: 4\nwarning_fall_rule: sometimes"), 3, "must be true or false"),
        (("x.y: 1,", "x.y: {p: 1},"), 8, "a mapping is not an override value"),
        (("steps: 4", "steps: 4\nguard_controls: [hot, cold]"), 3, "unknown regime 'cold' (known: hot)"),
        (("steps: 4", "steps: 4\nguard_controls: []"), 3, "non-empty list of regime names"),
        (
            ("  - {regimes: [hot], algorithms: [a, b], seeds: [7]}\n", "  - {regimes: [hot], algorithms: [a, b]}\n"),
            11,
            "needs 'seeds'",
        ),
    ],
)
def test_bad_grid_names_file_and_line(tmp_path, write_grid, edit, line, words):
    text = textwrap.dedent(BASE).replace(*edit)
    assert text != textwrap.dedent(BASE)
    path = write_grid(tmp_path, text)
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert str(err.value).startswith(f"{path}:{line}: ") and words in str(err.value), str(err.value)


def test_invalid_yaml_and_missing_file(tmp_path, write_grid):
    path = write_grid(tmp_path, "name: t\nsteps: [1,\n")
    with pytest.raises(GridError, match=r"g\.yaml:\d+: not valid YAML"):
        load_grid(path)
    with pytest.raises(GridError, match="grid file not found"):
        load_grid(tmp_path / "nope.yaml")


def test_matches_and_select(tmp_path, write_grid):
    assert matches("many_updates/so_grpo/seed1", "grpo")
    assert not matches("many_updates/so_grpo/seed1", "many_updates/grpo/*")
    assert matches("many_updates/grpo/seed1", "many_updates/grpo/*")
    assert matches("mismatch/grpo_rc/seed2", "*/seed2")
    grid = load_grid(write_grid(tmp_path, BASE))
    assert [c.key for c in grid.select(["b/", "*/seed8"])] == ["hot/b/seed7", "hot/a/seed8"]
    assert len(grid.select(None)) == 3


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (True, "true"),
        (None, "null"),
        (5.0e-4, "0.0005"),
        (1e-5, "1e-05"),
        (3, "3"),
        ("bfloat16", "bfloat16"),
        ([1, "a"], "[1,a]"),
    ],
)
def test_format_value(value, text):
    assert format_value(value) == text


def test_only_the_learning_grid_adds_the_fall_rule_to_its_warning_table(tmp_path, write_grid):
    assert load_grid(STUDY / "learning.yaml").warning_fall_rule is True
    for name in ("stress", "stress_b", "smoke", "boundary"):  # their committed tables stay as they are
        assert load_grid(STUDY / f"{name}.yaml").warning_fall_rule is False
    on = textwrap.dedent(BASE).replace("steps: 4", "steps: 4\nwarning_fall_rule: true")
    grid, plain = load_grid(write_grid(tmp_path, on, "on.yaml")), load_grid(write_grid(tmp_path, BASE))
    assert grid.warning_fall_rule and grid.cells == plain.cells  # no effect on what the cells run


def test_guard_controls_name_the_control_regimes(tmp_path, write_grid):
    assert load_grid(write_grid(tmp_path, BASE)).guard_controls == ()
    grid = load_grid(write_grid(tmp_path, textwrap.dedent(BASE).replace("steps: 4", "steps: 4\nguard_controls: [hot]")))
    assert grid.guard_controls == ("hot",)
    assert load_grid(STUDY / "natural.yaml").guard_controls == ("demo",)


# --- a regime's own run length (``steps:``) ----------------------------------------------------

STEPS_GRID = """\
    name: t
    steps: 4
    test_freq: 2
    seed_keys: [data.seed]
    regimes:
      short: {overrides: {x.y: 1}}
      long:
        description: a long run
        steps: 10
    algorithms:
      a: {overrides: {x.z: 1}}
    cells:
      - {regimes: [short, long], algorithms: [a], seeds: [1, 2]}
"""


def test_a_regimes_steps_apply_to_its_cells_only_and_the_others_inherit_the_grids(tmp_path, write_grid):
    grid = load_grid(write_grid(tmp_path, STEPS_GRID))
    assert grid.steps == 4 and grid.regimes["long"].steps == 10 and grid.regimes["short"].steps is None
    assert {c.key: (c.steps, grid.steps_of(c), c.overrides[STEPS_KEY]) for c in grid.cells} == {
        "short/a/seed1": (4, 4, "4"),
        "short/a/seed2": (4, 4, "4"),
        "long/a/seed1": (10, 10, "10"),
        "long/a/seed2": (10, 10, "10"),
    }
    assert all(list(c.overrides)[0] == STEPS_KEY and c.overrides["trainer.test_freq"] == "2" for c in grid.cells)
    # a regime without steps runs exactly the cells it ran before the key existed (finished runs stay done) ...
    plain = load_grid(write_grid(tmp_path, textwrap.dedent(STEPS_GRID).replace("    steps: 10\n", ""), "plain.yaml"))
    assert [c for c in grid.cells if c.regime == "short"] == [c for c in plain.cells if c.regime == "short"]
    assert {c.overrides[STEPS_KEY] for c in plain.cells} == {"4"}
    # ... and so does a regime whose steps are the grid's: a cell changes only with its own run length
    same = load_grid(write_grid(tmp_path, textwrap.dedent(STEPS_GRID).replace("steps: 10", "steps: 4"), "same.yaml"))
    assert same.cells == plain.cells
    # Cell.steps unset (a cell made by hand): the grid's
    assert grid.steps_of(replace(grid.cells[2], steps=None)) == 4


def test_a_regimes_steps_merge_over_the_included_library(tmp_path, write_grid):
    write_grid(
        tmp_path,
        """\
        seed_keys: [data.seed]
        regimes:
          lib_long: {steps: 7}
          lib_other: {steps: 7}
        """,
        name="lib.yaml",
    )
    grid = load_grid(
        write_grid(
            tmp_path,
            """\
            include: lib.yaml
            steps: 3
            regimes:
              lib_long: {description: kept}
              lib_other: {steps: 5}
            algorithms: {a: {}}
            cells: [{regimes: [lib_long, lib_other], algorithms: [a], seeds: [1]}]
            """,
        )
    )
    assert {c.regime: c.overrides[STEPS_KEY] for c in grid.cells} == {"lib_long": "7", "lib_other": "5"}


@pytest.mark.parametrize(
    ("edit", "line", "words"),
    [
        (("steps: 10", "steps: 0"), 9, "regimes.long.steps: must be an integer >= 1, got 0"),
        (("steps: 10", "steps: -3"), 9, "regimes.long.steps: must be an integer >= 1, got -3"),
        (("steps: 10", "steps: 2.5"), 9, "regimes.long.steps: must be an integer >= 1, got 2.5"),
        (("steps: 10", "steps: true"), 9, "regimes.long.steps: must be an integer >= 1, got True"),
        (("steps: 10", "steps: ten"), 9, "regimes.long.steps: must be an integer >= 1, got 'ten'"),
        (("steps: 10", "steps:"), 9, "regimes.long.steps: must be an integer >= 1, got None"),
        (("steps: 10", "steps: [10]"), 9, "regimes.long.steps: must be an integer >= 1, got [10]"),
        (
            ("steps: 10", "stepz: 10"),
            9,
            "regimes.long.stepz: unknown key (allowed: description, overrides, protocol_of, steps, test_freq, "
            "val_max_samples, warmstart, warmstart_pin)",
        ),
        (("a: {overrides: {x.z: 1}}", "a: {overrides: {x.z: 1}, steps: 3}"), 11, "algorithms.a.steps: unknown key"),
        # the run length is the steps key's alone: no override (any prefix) or sweep may set it
        (("{x.y: 1}", "{trainer.total_training_steps: 8}"), 6, "regimes.short.overrides.trainer.total_training_steps"),
        (("{x.z: 1}", "{++trainer.total_training_steps: 8}"), 11, "set by `steps`"),
        (
            ("seed_keys:", "common: {trainer.total_training_steps: 8}\nseed_keys:"),
            4,
            "common.trainer.total_training_steps",
        ),
        (
            ("a: {overrides: {x.z: 1}}", "a: {sweep: {key: trainer.total_training_steps, values: [5, 9]}}"),
            11,
            "algorithms.a.sweep.key: a cell's run length is set by `steps`",
        ),
    ],
)
def test_bad_regime_steps_fail_at_load_naming_the_regime_and_key(tmp_path, write_grid, edit, line, words):
    text = textwrap.dedent(STEPS_GRID).replace(*edit)
    assert text != textwrap.dedent(STEPS_GRID)
    path = write_grid(tmp_path, text)
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert str(err.value).startswith(f"{path}:{line}: ") and words in str(err.value), str(err.value)


def test_natural_grid_long_run_is_the_demo_recipe_for_100_steps():
    grid = load_grid(STUDY / "natural.yaml")
    assert grid.steps == 50 and grid.regimes["demo_long100"].steps == 100
    long_cells = [c.key for c in grid.cells if c.steps != 50]  # seed 1 first, each
    assert long_cells == [
        "demo_long100/grpo/seed1",
        "demo_long200_const/grpo/seed1",
        "demo_long200_nokl_const/grpo/seed1",
        "demo_long300_nokl_const/grpo/seed1",
    ]
    (long,) = [c for c in grid.cells if c.key == "demo_long100/grpo/seed1"]
    demo = next(c for c in grid.cells if c.key == "demo/grpo/seed1")
    # no override of its own: the demo regime's three restate the recipe's values (the CPU overlay's
    # 2 epochs x mini-batches of 4, the demo recipe's lr 3e-4)
    assert dict(grid.regimes["demo_long100"].overrides) == {}
    restated = dict(grid.regimes["demo"].overrides)
    assert restated == {
        f"{ACTOR}.ppo_epochs": cpu_default(f"{ACTOR}.ppo_epochs"),
        f"{ACTOR}.ppo_mini_batch_size": cpu_default(f"{ACTOR}.ppo_mini_batch_size"),
        f"{ACTOR}.optim.lr": yaml.safe_load((ROOT / "recipe/sorl/config/demo/early_stop.yaml").read_text())[
            "actor_rollout_ref"
        ]["actor"]["optim"]["lr"],
    }
    assert {k: v for k, v in demo.overrides.items() if k not in restated} == {**long.overrides, STEPS_KEY: "50"}
    assert long.overrides[STEPS_KEY] == "100" and long.overrides["trainer.test_freq"] == "10"


# --- a regime's own validation protocol (regimes.<name>.test_freq / val_max_samples) -----------------

PROTOCOL_GRID = """\
    name: t
    steps: 10
    test_freq: 10
    val_max_samples: 300
    seed_keys: [data.seed]
    regimes:
      demo: {overrides: {x.y: 1}}
      p5:
        description: every 5 steps on 100 questions
        test_freq: 5
        val_max_samples: 100
        overrides: {x.y: 1}
    algorithms:
      a: {overrides: {x.z: 1}}
    cells:
      - {regimes: [demo, p5], algorithms: [a], seeds: [1, 2]}
"""


#: the hydra keys the grid sets from steps, test_freq and val_max_samples, in the cells' order
PROTOCOL_KEYS = (STEPS_KEY, TEST_FREQ_KEY, VAL_SIZE_KEY, VAL_BATCH_KEY)


def protocol(cell) -> tuple[str, ...]:
    return tuple(cell.overrides[k] for k in PROTOCOL_KEYS)


def test_a_regimes_validation_protocol_applies_to_its_cells_only_and_the_others_inherit_the_grids(tmp_path, write_grid):
    grid = load_grid(write_grid(tmp_path, PROTOCOL_GRID))
    assert (grid.test_freq, grid.val_max_samples) == (10, 300)
    assert (grid.regimes["p5"].test_freq, grid.regimes["p5"].val_max_samples) == (5, 100)
    assert (grid.regimes["demo"].test_freq, grid.regimes["demo"].val_max_samples) == (None, None)
    got = {
        c.key: (c.test_freq, grid.test_freq_of(c), c.val_max_samples, grid.val_max_samples_of(c)) for c in grid.cells
    }
    assert got == {
        "demo/a/seed1": (10, 10, 300, 300),
        "demo/a/seed2": (10, 10, 300, 300),
        "p5/a/seed1": (5, 5, 100, 100),
        "p5/a/seed2": (5, 5, 100, 100),
    }
    # the keys stay where the grid puts them (first four, in this order), with the regime's values
    for c in grid.cells:
        assert tuple(c.overrides)[:4] == PROTOCOL_KEYS
        assert protocol(c) == (("10", "5", "100", "100") if c.regime == "p5" else ("10", "10", "300", "300"))
        assert {k: v for k, v in c.overrides.items() if k not in PROTOCOL_KEYS} == {
            "x.y": "1",
            "x.z": "1",
            "data.seed": str(c.seed),
        }
    # a regime without the keys runs exactly the cells it ran before they existed (finished runs stay done) ...
    plain_text = textwrap.dedent(PROTOCOL_GRID).replace("    test_freq: 5\n    val_max_samples: 100\n", "")
    plain = load_grid(write_grid(tmp_path, plain_text, "plain.yaml"))
    assert [c for c in grid.cells if c.regime == "demo"] == [c for c in plain.cells if c.regime == "demo"]
    assert {protocol(c) for c in plain.cells} == {("10", "10", "300", "300")}
    # ... and so does a regime whose values are the grid's: a cell changes only with its own protocol
    same_text = (
        textwrap.dedent(PROTOCOL_GRID)
        .replace("test_freq: 5", "test_freq: 10")
        .replace("val_max_samples: 100", "val_max_samples: 300")
    )
    assert load_grid(write_grid(tmp_path, same_text, "same.yaml")).cells == plain.cells
    # one key without the other: the other is the grid's
    only_freq = load_grid(
        write_grid(tmp_path, plain_text.replace("description:", "test_freq: 5\n    description:"), "f.yaml")
    )
    assert {protocol(c) for c in only_freq.cells if c.regime == "p5"} == {("10", "5", "300", "300")}
    # Cell.test_freq / val_max_samples unset (a cell made by hand): the grid's
    hand = replace(grid.cells[2], test_freq=None, val_max_samples=None)
    assert (grid.test_freq_of(hand), grid.val_max_samples_of(hand)) == (10, 300)


def test_a_grid_without_the_keys_has_its_defaults_and_a_regime_may_still_set_its_own(tmp_path, write_grid):
    text = textwrap.dedent(PROTOCOL_GRID).replace("test_freq: 10\n", "").replace("val_max_samples: 300\n", "")
    grid = load_grid(write_grid(tmp_path, text))
    assert (grid.test_freq, grid.val_max_samples) == (10, 96)  # the grid's steps, the grid default 96
    assert {c.regime: protocol(c) for c in grid.cells} == {
        "demo": ("10", "10", "96", "96"),
        "p5": ("10", "5", "100", "100"),
    }


def test_a_regimes_validation_protocol_merges_over_the_included_library(tmp_path, write_grid):
    write_grid(
        tmp_path,
        """\
        seed_keys: [data.seed]
        regimes:
          lib_p5: {test_freq: 5, val_max_samples: 100}
          lib_other: {test_freq: 5, val_max_samples: 100}
        """,
        name="lib.yaml",
    )
    grid = load_grid(
        write_grid(
            tmp_path,
            """\
            include: lib.yaml
            steps: 20
            regimes:
              lib_p5: {description: kept}
              lib_other: {test_freq: 4}
            algorithms: {a: {}}
            cells: [{regimes: [lib_p5, lib_other], algorithms: [a], seeds: [1]}]
            """,
        )
    )
    assert {c.regime: protocol(c)[1:] for c in grid.cells} == {
        "lib_p5": ("5", "100", "100"),
        "lib_other": ("4", "100", "100"),
    }


@pytest.mark.parametrize(
    ("edit", "line", "words"),
    [
        (("test_freq: 5", "test_freq: 0"), 10, "regimes.p5.test_freq: must be an integer >= 1, got 0"),
        (("test_freq: 5", "test_freq: -5"), 10, "regimes.p5.test_freq: must be an integer >= 1, got -5"),
        (("test_freq: 5", "test_freq: 2.5"), 10, "regimes.p5.test_freq: must be an integer >= 1, got 2.5"),
        (("test_freq: 5", "test_freq: true"), 10, "regimes.p5.test_freq: must be an integer >= 1, got True"),
        (("test_freq: 5", "test_freq: five"), 10, "regimes.p5.test_freq: must be an integer >= 1, got 'five'"),
        (("test_freq: 5", "test_freq:"), 10, "regimes.p5.test_freq: must be an integer >= 1, got None"),
        (
            ("val_max_samples: 100", "val_max_samples: 0"),
            11,
            "regimes.p5.val_max_samples: must be an integer >= 1, got 0",
        ),
        (
            ("val_max_samples: 100", "val_max_samples: -1"),
            11,
            "regimes.p5.val_max_samples: must be an integer >= 1, got -1",
        ),
        (
            ("val_max_samples: 100", "val_max_samples: 1.0e+2"),
            11,
            "regimes.p5.val_max_samples: must be an integer >= 1, got 100.0",
        ),
        (
            ("val_max_samples: 100", "val_max_samples: [100]"),
            11,
            "regimes.p5.val_max_samples: must be an integer >= 1, got [100]",
        ),
        (("test_freq: 5", "test_frq: 5"), 10, "regimes.p5.test_frq: unknown key (allowed: description, overrides,"),
        (
            ("a: {overrides: {x.z: 1}}", "a: {overrides: {x.z: 1}, test_freq: 3}"),
            14,
            "algorithms.a.test_freq: unknown key",
        ),
        (
            ("a: {overrides: {x.z: 1}}", "a: {overrides: {x.z: 1}, val_max_samples: 3}"),
            14,
            "algorithms.a.val_max_samples: unknown key",
        ),
        # the protocol is the keys' alone: no override (any prefix) or sweep may set its hydra keys
        (
            ("demo: {overrides: {x.y: 1}}", "demo: {overrides: {trainer.test_freq: 5}}"),
            7,
            "regimes.demo.overrides.trainer.test_freq: a cell's validation interval is set by `test_freq` "
            "(the grid's, or a regime's `test_freq:`), not an override",
        ),
        (
            ("demo: {overrides: {x.y: 1}}", "demo: {overrides: {+data.val_max_samples: 100}}"),
            7,
            "regimes.demo.overrides.+data.val_max_samples: a cell's validation size is set by `val_max_samples`",
        ),
        (
            ("{x.z: 1}", "{++data.val_batch_size: 100}"),
            14,
            "algorithms.a.overrides.++data.val_batch_size: a cell's validation size is set by `val_max_samples`",
        ),
        (
            ("seed_keys:", "common: {trainer.test_freq: 5}\nseed_keys:"),
            5,
            "common.trainer.test_freq: a cell's validation",
        ),
        (
            ("a: {overrides: {x.z: 1}}", "a: {sweep: {key: trainer.test_freq, values: [5, 10]}}"),
            14,
            "algorithms.a.sweep.key: a cell's validation interval is set by `test_freq` (a regime's `test_freq:`), "
            "not swept",
        ),
        (
            ("a: {overrides: {x.z: 1}}", "a: {sweep: {key: data.val_max_samples, values: [100, 300]}}"),
            14,
            "algorithms.a.sweep.key: a cell's validation size is set by `val_max_samples`",
        ),
    ],
)
def test_bad_regime_validation_protocol_fails_at_load_naming_the_regime_and_key(
    tmp_path, write_grid, edit, line, words
):
    text = textwrap.dedent(PROTOCOL_GRID).replace(*edit, 1)
    assert text != textwrap.dedent(PROTOCOL_GRID)
    path = write_grid(tmp_path, text)
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert str(err.value).startswith(f"{path}:{line}: ") and words in str(err.value), str(err.value)


def test_natural_grid_p5_regimes_are_two_regimes_validated_every_5_steps_on_100_questions():
    grid = load_grid(STUDY / "natural.yaml")
    p5 = {"demo_const_lr1e-3_p5": "demo_const_lr1e-3", "demo_p5": "demo"}
    for name, of in p5.items():
        regime = grid.regimes[name]
        assert (regime.steps, regime.test_freq, regime.val_max_samples) == (None, 5, 100), name
        # the training of the regime it is the P5 protocol of, unchanged (an alias / a copy of its overrides;
        # load_grid checks it for a protocol_of), whose role it takes in the guard and rule tables
        assert dict(regime.overrides) == dict(grid.regimes[of].overrides), name
        assert regime.protocol_of == of and grid.base_regime(name) == of, name
        assert "P5 protocol of question 5" in regime.description, name
    # every other regime keeps the grid's protocol: 300 questions every 10 steps, and its cells their overrides
    others = [r for r in grid.regimes.values() if r.name not in p5]
    assert {(r.test_freq, r.val_max_samples) for r in others} == {(None, None)}
    assert grid.protocol_twins == set(p5) and not set(grid.guard_controls) & grid.protocol_twins
    assert {(c.test_freq, c.val_max_samples) for c in grid.cells if c.regime not in p5} == {(10, 300)}
    # question 5's cells: unguarded grpo, seeds 1-3, in both P5 regimes
    assert sorted((c.regime, c.algorithm, c.seed) for c in grid.cells if c.regime in p5) == [
        (r, "grpo", s) for r in sorted(p5) for s in (1, 2, 3)
    ]
    assert {(c.test_freq, c.val_max_samples) for c in grid.cells if c.regime in p5} == {(5, 100)}
    # the fixed subset: verl draws the val_max_samples questions with data.seed (tests/integration/
    # test_study_val_subset.py), which is the CPU overlay's 42 in every cell, never a seed key or an override
    assert cpu_default("data.seed") == 42 and "data.seed" not in grid.seed_keys
    set_anywhere = [grid.common, *(e.overrides for e in [*grid.regimes.values(), *grid.algorithms.values()])]
    set_anywhere += [o for e in grid.algorithms.values() for o in e.per_regime.values()]
    assert not any(k.lstrip("+~") in ("data.seed", "data.shuffle") for o in set_anywhere for k in o)


@pytest.mark.parametrize(
    ("regime", "base", "changed", "kl"),
    [
        ("demo_long200_const", "demo", {f"{ACTOR}.optim.lr_scheduler_type": "constant", STEPS_KEY: "200"}, None),
        ("demo_long200_nokl_const", "demo_nokl_const", {STEPS_KEY: "200"}, "false"),
        ("demo_long300_nokl_const", "demo_nokl_const", {STEPS_KEY: "300"}, "false"),
        # memorization: the training set cut to 16 / 8 questions (8: verl's 30 default epochs of one batch
        # would end the 50 steps at 30, so the regime sets 50)
        ("demo_train16_nokl_const", "demo_nokl_const", {"data.train_max_samples": "16"}, "false"),
        (
            "demo_train8_nokl_const",
            "demo_nokl_const",
            {"data.train_max_samples": "8", "trainer.total_epochs": "50"},
            "false",
        ),
    ],
)
def test_natural_grid_regimes_are_their_base_cell_with_only_the_named_keys_changed(
    regime: str, base: str, changed: dict[str, str], kl: str | None
):
    """Each long run is its base cell (seed 1) with only the horizon changed and, for demo_long200_const,
    the lr schedule (constant after the recipe's warm-up); each memorization regime is demo_nokl_const with
    only its training set cut; the KL setting and the recipe's lr stay the base's (None: the demo recipe's
    KL loss, set by no override)."""
    grid = load_grid(STUDY / "natural.yaml")
    (long,) = [c for c in grid.cells if c.key == f"{regime}/grpo/seed1"]
    (short,) = [c for c in grid.cells if c.key == f"{base}/grpo/seed1"]
    assert long.steps == int(changed.get(STEPS_KEY, 50)) and short.steps == 50
    assert {k: v for k, v in long.overrides.items() if short.overrides.get(k) != v} == changed
    assert set(short.overrides) <= set(long.overrides)
    assert long.overrides["trainer.test_freq"] == "10"
    assert long.overrides.get(f"{ACTOR}.use_kl_loss") == kl
