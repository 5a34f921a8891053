"""SORL knobs through verl's hydra config, built the way verl builds the actor config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass

from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.knobs import SORLKnobs, read_knobs

PREFIX = "actor_rollout_ref.actor.policy_loss"
# What a SORL recipe adds on top of verl's ppo_trainer: the config class and its knobs.
RECIPE = """
hydra:
  searchpath:
    - pkg://verl.trainer.config
defaults:
  - ppo_trainer
  - _self_
actor_rollout_ref:
  actor:
    ppo_micro_batch_size_per_gpu: 2
    policy_loss:
      _target_: sorl_verl.algorithms.config.SORLPolicyLossConfig
      loss_mode: so_grpo
      clip_norm_mode: max
      clip_norm_tau: 0.2
      clip_norm_scope: micro_batch
      log_ratio_clamp: 20.0
      clip_norm_reference: relative
      clip_norm_apply: update
"""


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sorl_hydra")
    (root / "sorl_test.yaml").write_text(RECIPE)
    return root


def compose_actor(config_dir: Path, overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        config = compose(config_name="sorl_test", overrides=overrides)
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)  # what verl's validate_config / workers do


def test_every_knob_is_a_plain_override(config_dir):
    actor = compose_actor(
        config_dir,
        [
            f"{PREFIX}.loss_mode=s_ppo",
            f"{PREFIX}.clip_norm_mode=add",
            f"{PREFIX}.clip_norm_tau=0.25",
            f"{PREFIX}.clip_norm_scope=global",
            f"{PREFIX}.log_ratio_clamp=5",
            f"{PREFIX}.clip_norm_reference=absolute",
            f"{PREFIX}.clip_norm_apply=loss",
        ],
    )
    assert isinstance(actor.policy_loss, SORLPolicyLossConfig)
    assert actor.policy_loss.loss_mode == "s_ppo"
    assert read_knobs(actor) == SORLKnobs("add", 0.25, "global", 5, "absolute", "loss")
    # the built config drives the registered loss: all ratios clamp at e^5, Z = 1 + ||C|| / 0.25
    mask = torch.ones(2, 6, dtype=torch.bool)
    log_prob = torch.full((2, 6), 9.0, requires_grad=True)
    loss, metrics = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        torch.zeros(2, 6), log_prob, torch.ones(2, 6), mask, actor.loss_agg_mode, actor, None
    )
    assert metrics["sorl/token_ratio_max"] == pytest.approx(torch.e**5, rel=1e-5)
    norm = metrics["sorl/clip_bias_norm"]
    assert norm == pytest.approx(torch.e**5, rel=1e-5)  # every token clipped with r * A = e^5
    assert metrics["sorl/norm_factor"] == pytest.approx(1 + norm / 0.25, rel=1e-6)


def test_defaults_when_not_overridden(config_dir):
    assert read_knobs(compose_actor(config_dir, [])) == SORLKnobs()


def test_misspelled_knob_fails_in_struct_mode_naming_it(config_dir):
    with pytest.raises(ConfigCompositionException, match="clip_norm_tua"):
        compose_actor(config_dir, [f"{PREFIX}.clip_norm_tua=2"])


def test_appended_unknown_knob_fails_naming_it(config_dir):
    with pytest.raises(InstantiationException, match="clip_norm_tua"):
        compose_actor(config_dir, [f"+{PREFIX}.clip_norm_tua=2"])


@pytest.mark.parametrize(
    "override,named",
    [
        ("clip_norm_mode=maxx", "clip_norm_mode='maxx'"),
        ("clip_norm_tau=0", "clip_norm_tau=0"),
        ("clip_norm_scope=all", "clip_norm_scope='all'"),
        ("clip_norm_reference=rms", "clip_norm_reference='rms'"),
        ("clip_norm_apply=grad", "clip_norm_apply='grad'"),
    ],
)
def test_out_of_range_knob_fails_at_start_up_naming_it(config_dir, override, named):
    with pytest.raises(InstantiationException) as err:
        compose_actor(config_dir, [f"{PREFIX}.{override}"])
    assert f"{PREFIX}.{named}" in str(err.value)
