"""SORL hyperparameters, settable under ``actor_rollout_ref.actor.policy_loss``.

Select the config class from hydra and the knobs become plain overrides::

    actor_rollout_ref.actor.policy_loss._target_=sorl_verl.algorithms.config.SORLPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo
    +actor_rollout_ref.actor.policy_loss.clip_norm_mode=add   # '+' only if the yaml lacks the key

verl builds the actor config with ``hydra.utils.instantiate`` (``omega_conf_to_dataclass``),
which honours the nested ``_target_``; a bad value fails in ``__post_init__`` at driver
start-up (``verl.utils.config.validate_config``) with a message naming the knob, and an
unknown key fails in hydra's struct mode (or as an unexpected keyword) naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.workers.config import PolicyLossConfig

from sorl_verl.algorithms.knobs import SORLKnobs, check_rejection_sampling


@dataclass
class SORLPolicyLossConfig(PolicyLossConfig, SORLKnobs):
    """verl's ``PolicyLossConfig`` plus the SORL knobs (inherited from :class:`SORLKnobs`), validated
    on construction.

    ``rollout_rs`` mirrors ``algorithm.rollout_correction.rollout_rs`` (``sorl_trainer.yaml``
    interpolates it) so that token-level rejection sampling with a turn-level loss fails at start-up.
    """

    rollout_rs: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # along the MRO: verl's config classes (none define one in 0.9), then SORLKnobs'
        check_rejection_sampling(self.loss_mode, self.rollout_rs)
