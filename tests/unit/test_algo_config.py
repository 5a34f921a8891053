"""SORL knobs: dataclass validation and reading from every form verl hands the loss."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from verl.workers.config import ActorConfig, PolicyLossConfig

from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.knobs import SORLKnobs, read_knobs


def test_defaults_follow_the_calibration():
    """docs/algorithms.md#calibration-of-the-trigger: relative reference, tau 0.2, applied to the update."""
    config = SORLPolicyLossConfig()
    assert (config.clip_norm_mode, config.clip_norm_tau, config.clip_norm_scope, config.log_ratio_clamp) == (
        "max",
        0.2,
        "micro_batch",
        20.0,
    )
    assert (config.clip_norm_reference, config.clip_norm_apply) == ("relative", "update")
    assert isinstance(config, PolicyLossConfig) and config.loss_mode == "vanilla"


@pytest.mark.parametrize(
    "knobs,named,allowed",
    [
        ({"clip_norm_mode": "maxx"}, "clip_norm_mode='maxx'", "max, add, none"),
        ({"clip_norm_tau": 0.0}, "clip_norm_tau=0.0", "> 0"),
        ({"clip_norm_tau": -1.0}, "clip_norm_tau=-1.0", "> 0"),
        ({"clip_norm_tau": float("nan")}, "clip_norm_tau=nan", "> 0"),
        ({"clip_norm_scope": "world"}, "clip_norm_scope='world'", "micro_batch, global"),
        ({"log_ratio_clamp": 0}, "log_ratio_clamp=0", "> 0"),
        ({"clip_norm_reference": "rel"}, "clip_norm_reference='rel'", "absolute, relative"),
        ({"clip_norm_apply": "optimizer"}, "clip_norm_apply='optimizer'", "update, loss"),
    ],
)
def test_bad_values_fail_naming_the_knob_and_allowed_values(knobs, named, allowed):
    for build in (SORLPolicyLossConfig, SORLKnobs):
        with pytest.raises(ValueError) as err:
            build(**knobs)
        assert f"actor_rollout_ref.actor.policy_loss.{named}" in str(err.value)
        assert allowed in str(err.value)


def actor(policy_loss) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss)


def test_read_knobs_from_sorl_config_plain_verl_config_and_dictconfig():
    custom = SORLKnobs("add", 0.5, "global", 7.0)
    assert (
        read_knobs(
            actor(
                SORLPolicyLossConfig(
                    clip_norm_mode="add", clip_norm_tau=0.5, clip_norm_scope="global", log_ratio_clamp=7.0
                )
            )
        )
        == custom
    )
    assert read_knobs(actor(PolicyLossConfig())) == SORLKnobs()
    section = OmegaConf.create({"policy_loss": {"loss_mode": "so_grpo", "clip_norm_mode": "add", "clip_norm_tau": 0.5}})
    OmegaConf.set_struct(section, True)
    assert read_knobs(section) == SORLKnobs(clip_norm_mode="add", clip_norm_tau=0.5)
    assert read_knobs(OmegaConf.create({})) == SORLKnobs()
    assert read_knobs(None) == SORLKnobs()


def test_read_knobs_validates_dictconfig_values():
    with pytest.raises(ValueError, match="clip_norm_scope='everywhere'"):
        read_knobs(OmegaConf.create({"policy_loss": {"clip_norm_scope": "everywhere"}}))
