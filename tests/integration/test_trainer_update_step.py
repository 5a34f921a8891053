"""``clip_norm_apply=update`` where no step would take it right is refused at start-up.

Megatron is not installed here: ``actor_rollout_ref.actor.strategy=megatron`` on the composed
``sorl_trainer.yaml`` is the named stand-in for a Megatron run's config (the check reads only the
config). The SORL trainers refuse it in their constructor, before any worker is built; every run,
verl's own trainers included, meets the same check in the loss's first training micro-batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import verl  # noqa: F401 - loads the sorl_verl plugin (config class, resolvers)
from hydra import compose, initialize_config_dir
from verl.utils.config import omega_conf_to_dataclass

from sorl_verl.algorithms import optim
from sorl_verl.algorithms.losses import compute_policy_loss_so_grpo
from sorl_verl.trainer.trainers import SORLTrainerSync, check_update_step

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config")
#: stand-in for a Megatron run's config: the strategy key alone (Megatron-Core is not installed)
MEGATRON_STAND_IN = "actor_rollout_ref.actor.strategy=megatron"
KNOB = "actor_rollout_ref.actor.policy_loss"


def compose_sorl(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(
            config_name="sorl_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides]
        )


@pytest.mark.parametrize("trainer", [SORLTrainerSync])
def test_the_sorl_trainer_refuses_update_mode_under_megatron_before_any_worker(trainer):
    config = compose_sorl(MEGATRON_STAND_IN)
    assert config.actor_rollout_ref.actor.policy_loss.clip_norm_apply == "update"  # the yaml's default
    with pytest.raises(ValueError, match=r"strategy=megatron.*clip_norm_apply=loss"):
        trainer(config)


def test_the_sorl_trainer_refuses_update_mode_with_verls_own_optimizer():
    config = compose_sorl("actor_rollout_ref.actor.optim.optimizer_impl=torch.optim")
    with pytest.raises(ValueError, match=r"optimizer_impl=torch\.optim.*optimizer_impl=sorl_verl\.algorithms\.optim"):
        SORLTrainerSync(config)


@pytest.mark.parametrize(
    "overrides",
    [
        [MEGATRON_STAND_IN, f"{KNOB}.clip_norm_apply=loss"],
        [MEGATRON_STAND_IN, f"{KNOB}.clip_norm_mode=none"],
        [MEGATRON_STAND_IN, f"{KNOB}.loss_mode=turn_ppo"],
        [MEGATRON_STAND_IN, f"{KNOB}.loss_mode=vanilla"],
        [],  # the yaml as it is: FSDP with the SORL optimizer
    ],
)
def test_what_the_check_lets_through(overrides):
    check_update_step(compose_sorl(*overrides))


def test_the_loss_refuses_update_mode_under_megatron_at_its_first_training_micro_batch():
    """verl's own trainers have no SORL start-up: the loss meets the same check (verl hands it the
    actor config, strategy included)."""
    actor = omega_conf_to_dataclass(compose_sorl().actor_rollout_ref.actor)
    object.__setattr__(actor, "strategy", "megatron")  # the stand-in, on the built config
    reader = optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    mask = torch.ones(1, 4, dtype=torch.bool)
    log_prob = torch.full((1, 4), -1.0, requires_grad=True)
    with pytest.raises(ValueError, match=r"strategy=megatron.*clip_norm_apply=loss"):
        compute_policy_loss_so_grpo(log_prob.detach(), log_prob, torch.ones(1, 4), mask, "token-mean", actor)
    with torch.no_grad():  # validation: no step to scale, nothing refused
        compute_policy_loss_so_grpo(log_prob.detach(), log_prob, torch.ones(1, 4), mask, "token-mean", actor)
    del reader
