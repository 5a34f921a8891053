"""``clip_norm_reference=gradient*`` under a strategy that cannot take C(theta) (FSDP1, Megatron) fails at
start-up: ``sorl_trainer.yaml`` mirrors the actor's strategy into the policy-loss config, whose
construction (verl's ``validate_config`` in the driver, before Ray) refuses it naming ``strategy=fsdp2``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import verl  # noqa: F401 - loads the sorl_verl plugin (policy-loss config class, resolvers)
from hydra import compose, initialize_config_dir
from verl.utils.config import omega_conf_to_dataclass

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config")
KNOB = "actor_rollout_ref.actor.policy_loss"


def compose_sorl(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(
            config_name="sorl_trainer", overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides]
        )


@pytest.mark.parametrize("reference", ["gradient", "gradient_relative"])
def test_gradient_reference_with_fsdp1_is_refused_naming_fsdp2(reference):
    config = compose_sorl("actor_rollout_ref.actor.strategy=fsdp", f"{KNOB}.clip_norm_reference={reference}")
    with pytest.raises(Exception, match="strategy=fsdp2") as err:
        omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert f"clip_norm_reference={reference}" in str(err.value)
    assert "actor_rollout_ref.actor.strategy=fsdp " in str(err.value)


def test_gradient_reference_with_fsdp2_and_other_references_with_fsdp1_are_accepted():
    actor = omega_conf_to_dataclass(
        compose_sorl(
            "actor_rollout_ref.actor.strategy=fsdp2", f"{KNOB}.clip_norm_reference=gradient"
        ).actor_rollout_ref.actor
    )
    assert (actor.strategy, actor.policy_loss.actor_strategy, actor.policy_loss.clip_norm_reference) == (
        "fsdp2", "fsdp2", "gradient",
    )  # fmt: skip
    for reference in ("relative", "absolute"):
        actor = omega_conf_to_dataclass(
            compose_sorl("actor_rollout_ref.actor.strategy=fsdp", f"{KNOB}.clip_norm_reference={reference}")
            .actor_rollout_ref.actor
        )  # fmt: skip
        assert actor.policy_loss.actor_strategy == "fsdp"


def test_gradient_reference_with_megatron_is_refused_naming_fsdp2():
    """``model_engine=megatron`` makes the actor's strategy ``megatron`` (Megatron itself is not installed:
    the policy-loss section, where the refusal lives, is built alone)."""
    config = compose_sorl("model_engine=megatron", f"{KNOB}.clip_norm_reference=gradient")
    assert config.actor_rollout_ref.actor.strategy == "megatron"
    with pytest.raises(Exception, match="strategy=fsdp2") as err:
        omega_conf_to_dataclass(config.actor_rollout_ref.actor.policy_loss)
    assert "actor_rollout_ref.actor.strategy=megatron" in str(err.value)
    # (clip_norm_apply=update is refused under Megatron on its own: test_update_mode_that_no_optimizer...)
    relative = compose_sorl("model_engine=megatron", f"{KNOB}.clip_norm_apply=loss").actor_rollout_ref.actor.policy_loss
    assert omega_conf_to_dataclass(relative).actor_strategy == "megatron"


@pytest.mark.slow  # one main_ppo interpreter: ~10 s idle
def test_main_ppo_stops_before_ray_naming_fsdp2():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}  # the entry point loads it
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", CONFIG_DIR, "--config-name", "sorl_trainer",
           "actor_rollout_ref.actor.strategy=fsdp", f"{KNOB}.clip_norm_reference=gradient"]  # fmt: skip
    out = subprocess.run(cmd, cwd="/", env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "strategy=fsdp2" in text, text[-3000:]
    assert "ray init kwargs" not in text  # stopped before Ray was started


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (("model_engine=megatron",), "strategy=megatron"),
        (
            (
                "actor_rollout_ref.actor.optim.optimizer_impl=torch.optim",
                "actor_rollout_ref.actor.optim.override_optimizer_config=null",
            ),
            "optimizer_impl=torch.optim",
        ),
    ],
)
def test_update_mode_that_no_optimizer_takes_right_is_refused_at_start_up(overrides, named):
    """``clip_norm_apply=update`` (the default) under Megatron or with verl's own optimizer class: refused
    where the policy-loss config is built (the driver, before Ray), naming clip_norm_apply=loss."""
    config = compose_sorl(*overrides)
    with pytest.raises(Exception, match="clip_norm_apply=loss") as err:
        omega_conf_to_dataclass(config.actor_rollout_ref.actor.policy_loss)
    assert named in str(err.value)
    ok = compose_sorl(*overrides, f"{KNOB}.clip_norm_apply=loss")
    assert omega_conf_to_dataclass(ok.actor_rollout_ref.actor.policy_loss).clip_norm_apply == "loss"
    vanilla = compose_sorl(*overrides, f"{KNOB}.loss_mode=vanilla")  # no normalizer: nothing to refuse
    assert omega_conf_to_dataclass(vanilla.actor_rollout_ref.actor.policy_loss).loss_mode == "vanilla"


def test_update_mode_with_the_update_scaled_optimizer_is_accepted():
    loss = omega_conf_to_dataclass(compose_sorl().actor_rollout_ref.actor.policy_loss)
    assert (loss.clip_norm_apply, loss.actor_optimizer_impl) == ("update", "sorl_verl.algorithms.optim")
