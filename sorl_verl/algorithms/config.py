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

from sorl_verl.algorithms.knobs import GRADIENT_REFERENCES, SORLKnobs, check_rejection_sampling
from sorl_verl.algorithms.strategies import check_gradient_reference_strategy


@dataclass
class SORLPolicyLossConfig(PolicyLossConfig, SORLKnobs):
    """verl's ``PolicyLossConfig`` plus the SORL knobs (inherited from :class:`SORLKnobs`), validated
    on construction.

    ``rollout_rs`` mirrors ``algorithm.rollout_correction.rollout_rs`` (``sorl_trainer.yaml``
    interpolates it) so that token-level rejection sampling with a turn-level loss fails at start-up.
    ``actor_strategy`` mirrors ``actor_rollout_ref.actor.strategy`` the same way, so that a gradient
    reference under a strategy that cannot take C(theta) (FSDP1, Megatron) fails at start-up, in
    verl's driver before Ray starts (:mod:`sorl_verl.algorithms.strategies`); without the mirror (verl's
    stock config) the loss refuses it at its first call. ``actor_optimizer_impl`` mirrors
    ``actor_rollout_ref.actor.optim.optimizer_impl``: with both mirrors, ``clip_norm_apply=update`` that
    no optimizer would take right (Megatron, or an actor optimizer other than the update-scaled one)
    fails here too (:func:`sorl_verl.algorithms.optim.check_step_scaling`).
    """

    rollout_rs: str | None = None
    actor_strategy: str | None = None
    actor_optimizer_impl: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # along the MRO: verl's config classes (none define one in 0.9), then SORLKnobs'
        check_rejection_sampling(self.loss_mode, self.rollout_rs)
        check_gradient_reference_strategy(self.actor_strategy, self.clip_norm_reference, GRADIENT_REFERENCES)
        if self.actor_strategy is not None:
            from sorl_verl.algorithms.losses import NORMALIZING_LOSSES
            from sorl_verl.algorithms.optim import check_step_scaling

            actor = {"strategy": self.actor_strategy, "optim": {"optimizer_impl": self.actor_optimizer_impl},
                     "policy_loss": self}  # fmt: skip
            check_step_scaling(actor, normalizes=self.loss_mode in NORMALIZING_LOSSES)
