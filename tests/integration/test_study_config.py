"""Every cell of the committed study grids composes into a valid verl config (no run needed).

The base config is composed once with hydra's compose API as main_ppo composes it
(sorl_trainer + task/search_qa + platform/cpu); each algorithm and each regime of
every committed grid (``recipe/sorl/study/*.yaml`` but the presets library) then applies its overrides, parsed by hydra's override parser,
to a struct-mode copy, so a misspelled key fails here rather than hours into a study; the actor and algorithm sections are converted to verl's dataclasses (the validation
main_ppo does at start-up), and loss modes and advantage estimators are looked up in verl's
registries.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import verl  # noqa: F401 - loads the sorl_verl plugin (registries, config class, resolver)
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from verl.trainer.config import RolloutCorrectionConfig
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass

from sorl_verl.study.grid import PLACEHOLDER, Cell, load_grid

REPO = Path(__file__).resolve().parents[2]
GRIDS = [load_grid(p) for p in sorted((REPO / "recipe" / "sorl" / "study").glob("*.yaml")) if p.name != "presets.yaml"]
CONFIG_DIRS = {g.config_dir for g in GRIDS}
assert len(CONFIG_DIRS) == 1, f"the grids compose from different config dirs {CONFIG_DIRS}: compose a base per dir"
(CONFIG_DIR,) = CONFIG_DIRS
PATHS = [
    "data.train_files=/x/train.parquet",
    "data.val_files=/x/val.parquet",
    "actor_rollout_ref.model.path=/x/model",
    "sorl.agent.retrieval_url=http://127.0.0.1:9/retrieve",
]


def representative_cells() -> list[Cell]:
    """Per grid, every algorithm once (in its first regime) and every regime once (with grpo and so_grpo)."""
    chosen: dict[tuple[str, str, str], Cell] = {}
    for grid in GRIDS:
        for c in grid.cells:
            if c.seed == min(x.seed for x in grid.cells if (x.regime, x.algorithm) == (c.regime, c.algorithm)):
                first_of_alg = all(x.algorithm != c.algorithm for k, x in chosen.items() if k[0] == grid.name)
                if first_of_alg or c.algorithm in ("grpo", "so_grpo"):
                    chosen.setdefault((grid.name, c.regime, c.algorithm), c)
    return list(chosen.values())


def overrides(cell: Cell) -> list[str]:
    """The cell's overrides with a placeholder ``???`` filled by a number (it is filled before a run)."""
    return [f"{k}={'1.0e-4' if v == PLACEHOLDER else v}" for k, v in cell.overrides.items()]


@pytest.fixture(scope="module")
def base_config():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="sorl_trainer", overrides=["+task=search_qa", "+platform=cpu", *PATHS])


def apply(base, cell: Cell):
    """``base`` with the cell's overrides, as hydra applies command-line overrides (struct mode)."""
    cfg = base.copy()
    OmegaConf.set_struct(cfg, True)
    for ov in OverridesParser.create().parse_overrides(overrides(cell)):
        add = ov.is_add() or ov.is_force_add()
        OmegaConf.update(cfg, ov.key_or_group, ov.value(), merge=True, force_add=add)
    return cfg


@pytest.mark.parametrize("cell", representative_cells(), ids=lambda c: f"{c.regime}/{c.algorithm}")
def test_cell_composes_and_validates(base_config, cell):
    cfg = apply(base_config, cell)
    for key, value in cell.overrides.items():
        if value != PLACEHOLDER:
            assert str(OmegaConf.select(cfg, key.lstrip("+"))) == str(
                OverridesParser.create().parse_override(f"{key}={value}").value()
            ), key
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert get_policy_loss_fn(actor.policy_loss.loss_mode) is not None
    assert get_adv_estimator_fn(cfg.algorithm.adv_estimator) is not None
    omega_conf_to_dataclass(cfg.algorithm)
    correction = omega_conf_to_dataclass(cfg.algorithm.rollout_correction, RolloutCorrectionConfig)
    if "algorithm.rollout_correction.rollout_is" in cell.overrides:
        assert correction.rollout_is == "sequence"


def test_a_misspelled_key_fails(base_config):
    cell = Cell(index=0, regime="r", algorithm="a", seed=1, overrides={"actor_rollout_ref.actor.ppo_epoch": "4"})
    with pytest.raises(Exception, match="ppo_epoch"):
        apply(base_config, cell)
