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

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from verl.workers.config import PolicyLossConfig

CLIP_NORM_MODES = ("max", "add", "none")
CLIP_NORM_SCOPES = ("micro_batch", "global")
#: references whose q is the clipping-bias term in parameter space (:mod:`sorl_verl.algorithms.clip_bias_grad`)
GRADIENT_REFERENCES = ("gradient", "gradient_relative")
CLIP_NORM_REFERENCES = ("absolute", "relative", *GRADIENT_REFERENCES)
CLIP_NORM_APPLY = ("update", "loss")
KNOB_PREFIX = "actor_rollout_ref.actor.policy_loss"


@dataclass(frozen=True)
class SORLKnobs:
    """The SORL knobs with their defaults (see docs/algorithms.md)."""

    clip_norm_mode: str = "max"
    clip_norm_tau: float = 0.2
    clip_norm_scope: str = "micro_batch"
    log_ratio_clamp: float = 20.0
    clip_norm_reference: str = "relative"
    clip_norm_apply: str = "update"

    def __post_init__(self) -> None:
        validate_knobs(**knob_values(self))


KNOB_NAMES = tuple(SORLKnobs.__dataclass_fields__)


def knob_values(obj: Any) -> dict[str, Any]:
    """The SORL knobs of a dataclass instance (``SORLKnobs`` or ``SORLPolicyLossConfig``)."""
    return {name: getattr(obj, name) for name in KNOB_NAMES}


def _positive_number(name: str, value: Any) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"{KNOB_PREFIX}.{name}={value!r} is invalid: it must be a finite number > 0")


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{KNOB_PREFIX}.{name}={value!r} is invalid: allowed values are {', '.join(allowed)}")


def validate_knobs(
    clip_norm_mode: Any,
    clip_norm_tau: Any,
    clip_norm_scope: Any,
    log_ratio_clamp: Any,
    clip_norm_reference: Any = "relative",
    clip_norm_apply: Any = "update",
) -> None:
    """Raise ``ValueError`` naming the first bad knob and its allowed values."""
    _one_of("clip_norm_mode", clip_norm_mode, CLIP_NORM_MODES)
    _positive_number("clip_norm_tau", clip_norm_tau)
    _one_of("clip_norm_scope", clip_norm_scope, CLIP_NORM_SCOPES)
    _positive_number("log_ratio_clamp", log_ratio_clamp)
    _one_of("clip_norm_reference", clip_norm_reference, CLIP_NORM_REFERENCES)
    _one_of("clip_norm_apply", clip_norm_apply, CLIP_NORM_APPLY)


#: losses whose importance ratio (and normalizer) is defined per turn of the response mask
TURN_LOSS_MODES = ("turn_ppo", "so_ppo", "so_grpo")


def check_rejection_sampling(loss_mode: Any, rollout_rs: Any) -> None:
    """Refuse verl's token-level rollout rejection sampling with a turn-level loss.

    ``token_k*`` options set ``response_mask`` to 0 on single rejected tokens, which would split
    a turn in two for the segmentation of both the loss and the turn-level GAE; sequence-level
    options (``seq_*``) drop whole rows and keep turns intact.
    """
    if loss_mode not in TURN_LOSS_MODES or not rollout_rs:
        return
    token_level = [o.strip() for o in str(rollout_rs).split(",") if o.strip().startswith("token")]
    if token_level:
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs={rollout_rs!r} masks single tokens ({', '.join(token_level)}), "
            f"which splits the turns that actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} computes its "
            "ratios on: use a sequence-level option (seq_mean_k1, seq_sum_k3, ...) or loss_mode=s_ppo"
        )


@dataclass
class SORLPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the SORL knobs, validated on construction.

    ``rollout_rs`` mirrors ``algorithm.rollout_correction.rollout_rs`` (``sorl_trainer.yaml``
    interpolates it) so that token-level rejection sampling with a turn-level loss fails at start-up.
    """

    clip_norm_mode: str = "max"
    clip_norm_tau: float = 0.2
    clip_norm_scope: str = "micro_batch"
    log_ratio_clamp: float = 20.0
    clip_norm_reference: str = "relative"
    clip_norm_apply: str = "update"
    rollout_rs: str | None = None

    def __post_init__(self) -> None:
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        validate_knobs(**knob_values(self))
        check_rejection_sampling(self.loss_mode, self.rollout_rs)


def _lookup(container: Any, key: str) -> Any:
    if container is None:
        return None
    if isinstance(container, Mapping) or hasattr(container, "get"):
        try:
            return container.get(key, None)
        except Exception:  # noqa: BLE001 - e.g. a DictConfig in struct mode
            return getattr(container, key, None)
    return getattr(container, key, None)


def read_knobs(actor_config: Any) -> SORLKnobs:
    """Knobs from an ``ActorConfig`` (or actor ``DictConfig``); defaults where a knob is absent.

    Works with a :class:`SORLPolicyLossConfig`, verl's plain ``PolicyLossConfig`` (all defaults)
    or a ``DictConfig`` policy_loss section; values are validated like the dataclass does.
    """
    policy_loss = _lookup(actor_config, "policy_loss")
    defaults = SORLKnobs()
    values = {}
    for name in KNOB_NAMES:
        value = _lookup(policy_loss, name)
        values[name] = getattr(defaults, name) if value is None else value
    return SORLKnobs(**values)
