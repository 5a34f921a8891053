"""``recipe/sorl/config/sorl_trainer.yaml`` composed against verl's real ppo_trainer config.

In-process: hydra's compose API (the yaml's own ``hydra.searchpath`` finds verl's configs) and
verl's ``omega_conf_to_dataclass`` — the conversion verl's ``validate_config`` does at start-up.
Through the CLI: ``python -m verl.trainer.main_ppo --config-path ... --config-name sorl_trainer``
exactly as a user runs it (``--cfg job`` prints the composed config; a bad value stops
``main_ppo`` in ``validate_config``, before Ray starts).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import verl  # noqa: F401 - loads the sorl_verl plugin (policy-loss config class, resolver)
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import ActorConfig

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config")
KNOB = "actor_rollout_ref.actor.policy_loss"
ALL_KNOBS = {
    "loss_mode": ("s_ppo", "s_ppo"),
    "clip_norm_mode": ("add", "add"),
    "clip_norm_tau": ("0.25", 0.25),
    "clip_norm_scope": ("global", "global"),
    "log_ratio_clamp": ("7.5", 7.5),
    "clip_norm_reference": ("absolute", "absolute"),
    "clip_norm_apply": ("loss", "loss"),
}


def compose_sorl(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(
            config_name="sorl_trainer",
            overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides],
        )


def actor_config(*overrides: str) -> ActorConfig:
    return omega_conf_to_dataclass(compose_sorl(*overrides).actor_rollout_ref.actor)


def test_defaults_select_so_grpo_with_the_sorl_trainer():
    from sorl_verl.algorithms.config import SORLPolicyLossConfig

    config = compose_sorl()
    assert config.algorithm.adv_estimator == "so_grpo"
    assert config.trainer.v1.trainer_mode == "sorl_sync"
    assert config.trainer.use_v1 is True
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert isinstance(actor, ActorConfig)
    loss = actor.policy_loss
    assert isinstance(loss, SORLPolicyLossConfig)
    assert (loss.loss_mode, loss.clip_norm_mode, loss.clip_norm_tau, loss.clip_norm_scope, loss.log_ratio_clamp) == (
        "so_grpo",
        "max",
        0.2,
        "micro_batch",
        20.0,
    )
    assert (loss.clip_norm_reference, loss.clip_norm_apply) == ("relative", "update")
    # the update-level normalizer's optimizer, and its update log next to the checkpoints
    assert actor.optim.optimizer_impl == "sorl_verl.algorithms.optim" and actor.optim.optimizer == "AdamW"
    assert actor.optim.override_optimizer_config["update_log"].endswith("/sorl_updates.jsonl")
    # verl's own settings come through from ppo_trainer untouched
    assert actor.clip_ratio_low == 0.2 and actor.loss_agg_mode == "token-mean"


def test_every_sorl_knob_is_settable_from_an_override_string():
    actor = actor_config(*(f"{KNOB}.{k}={text}" for k, (text, _) in ALL_KNOBS.items()))
    for key, (_, value) in ALL_KNOBS.items():
        assert getattr(actor.policy_loss, key) == value, key


@pytest.mark.parametrize("mode", ["so_ppo", "turn_ppo"])
def test_loss_mode_and_estimator_switch_independently(mode):
    config = compose_sorl("algorithm.adv_estimator=so_ppo", f"{KNOB}.loss_mode={mode}")
    assert omega_conf_to_dataclass(config.actor_rollout_ref.actor).policy_loss.loss_mode == mode
    assert config.critic.enable is True  # so_ppo turns the critic on
    assert compose_sorl("algorithm.adv_estimator=so_ppo", "critic.enable=false").critic.enable is False


def test_misspelled_knob_fails_naming_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        compose_sorl(f"{KNOB}.clip_norm_tua=2")
    assert "clip_norm_tua" in f"{err.value} {err.value.__cause__}"


def test_misspelled_knob_forced_in_with_plus_fails_when_the_config_is_built():
    with pytest.raises(Exception, match="clip_norm_tua"):
        actor_config(f"+{KNOB}.clip_norm_tua=2")


@pytest.mark.parametrize(
    ("override", "knob"),
    [
        ("clip_norm_mode=foo", "clip_norm_mode"),
        ("clip_norm_tau=0", "clip_norm_tau"),
        ("clip_norm_tau=-1", "clip_norm_tau"),
        ("clip_norm_scope=world", "clip_norm_scope"),
        ("log_ratio_clamp=0", "log_ratio_clamp"),
    ],
)
def test_out_of_range_value_fails_naming_the_knob(override, knob):
    with pytest.raises(Exception, match=rf"{KNOB}\.{knob}="):
        actor_config(f"{KNOB}.{override}")


# --- the real CLI: verl's main_ppo with --config-path/--config-name -----------------------------


def main_ppo(*args: str, stderr: int = subprocess.STDOUT) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", CONFIG_DIR, "--config-name", "sorl_trainer"]
    return subprocess.Popen([*cmd, *args], cwd="/", env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)


@pytest.fixture(scope="module")
def cli_runs() -> dict[str, tuple[int, str]]:
    procs = {
        "print": main_ppo(
            "--cfg",
            "job",
            "--resolve",
            "algorithm.adv_estimator=so_ppo",
            *(f"{KNOB}.{k}={text}" for k, (text, _) in ALL_KNOBS.items()),
            stderr=subprocess.DEVNULL,  # verl's import-time warnings; hydra prints the config on stdout
        ),
        "typo": main_ppo(f"{KNOB}.clip_norm_tua=2"),
        "bad_mode": main_ppo(f"{KNOB}.clip_norm_mode=foo"),
    }
    out = {}
    for label, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=300)
        finally:
            proc.kill()
        out[label] = (proc.returncode, text)
    return out


@pytest.mark.slow  # three main_ppo interpreters: ~20 s idle
def test_main_ppo_composes_sorl_trainer_from_its_config_path(cli_runs):
    import yaml

    rc, text = cli_runs["print"]
    assert rc == 0, text[-3000:]
    config = yaml.safe_load(text)
    assert config["trainer"]["v1"]["trainer_mode"] == "sorl_sync"
    assert config["critic"]["enable"] is True  # resolver registered by the plugin in main_ppo's process
    loss = config["actor_rollout_ref"]["actor"]["policy_loss"]
    assert loss["_target_"] == "sorl_verl.algorithms.config.SORLPolicyLossConfig"
    for key, (_, value) in ALL_KNOBS.items():
        assert loss[key] == value, key


@pytest.mark.slow
@pytest.mark.parametrize(("label", "needle"), [("typo", "clip_norm_tua"), ("bad_mode", f"{KNOB}.clip_norm_mode='foo'")])
def test_main_ppo_stops_at_start_up_naming_the_bad_knob(cli_runs, label, needle):
    rc, text = cli_runs[label]
    assert rc != 0
    assert needle in text, text[-3000:]
    assert "ray init kwargs" not in text  # stopped before Ray was started


@pytest.mark.parametrize("loss_mode", ["so_grpo", "turn_ppo"])
def test_token_level_rejection_sampling_with_turn_loss_is_refused_naming_the_keys(loss_mode):
    """verl's token_k* rejection zeroes single tokens of response_mask, which would split turns."""
    overrides = [
        f"{KNOB}.loss_mode={loss_mode}",
        "algorithm.rollout_correction.rollout_rs='seq_mean_k1,token_k1'",
        "algorithm.rollout_correction.rollout_rs_threshold=2.0",
    ]
    with pytest.raises(Exception) as err:
        actor_config(*overrides)
    assert "algorithm.rollout_correction.rollout_rs='seq_mean_k1,token_k1'" in str(err.value)
    assert f"loss_mode='{loss_mode}'" in str(err.value)
    # sequence-level rejection keeps turns whole; s_ppo's token ratio does not care
    assert actor_config(overrides[0], "algorithm.rollout_correction.rollout_rs=seq_mean_k1").policy_loss.rollout_rs
    assert actor_config(f"{KNOB}.loss_mode=s_ppo", *overrides[1:]).policy_loss.loss_mode == "s_ppo"
