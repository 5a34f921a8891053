"""The SORL knobs: declared, defaulted and validated once (:class:`SORLKnobs`), read from any form of
verl's actor config (:func:`read_knobs`). Imports nothing from verl: the losses read their knobs
through this module while verl may still be importing (verl's import loads the plugin, which imports
the losses), and :mod:`sorl_verl.algorithms.config` builds verl's config class on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

CLIP_NORM_MODES = ("max", "add", "none")
CLIP_NORM_SCOPES = ("micro_batch", "global")
#: references whose q is the clipping-bias term in parameter space (:mod:`sorl_verl.algorithms.clip_bias_grad`)
GRADIENT_REFERENCES = ("gradient", "gradient_relative")
CLIP_NORM_REFERENCES = ("absolute", "relative", *GRADIENT_REFERENCES)
CLIP_NORM_APPLY = ("update", "loss")
KNOB_PREFIX = "actor_rollout_ref.actor.policy_loss"


@dataclass
class SORLKnobs:
    """The SORL knobs with their defaults (see docs/algorithms.md), declared once and validated on
    construction: :class:`SORLPolicyLossConfig` inherits both, :func:`read_knobs` builds one.

    A bad value raises ``ValueError`` naming ``actor_rollout_ref.actor.policy_loss.<knob>``, the
    value and what is allowed.
    """

    clip_norm_mode: str = "max"
    clip_norm_tau: float = 0.2
    clip_norm_scope: str = "micro_batch"
    log_ratio_clamp: float = 20.0
    clip_norm_reference: str = "relative"
    clip_norm_apply: str = "update"

    def __post_init__(self) -> None:
        _one_of("clip_norm_mode", self.clip_norm_mode, CLIP_NORM_MODES)
        _positive_number("clip_norm_tau", self.clip_norm_tau)
        _one_of("clip_norm_scope", self.clip_norm_scope, CLIP_NORM_SCOPES)
        _positive_number("log_ratio_clamp", self.log_ratio_clamp)
        _one_of("clip_norm_reference", self.clip_norm_reference, CLIP_NORM_REFERENCES)
        _one_of("clip_norm_apply", self.clip_norm_apply, CLIP_NORM_APPLY)


KNOB_NAMES = tuple(f.name for f in fields(SORLKnobs))


def _positive_number(name: str, value: Any) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"{KNOB_PREFIX}.{name}={value!r} is invalid: it must be a finite number > 0")


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{KNOB_PREFIX}.{name}={value!r} is invalid: allowed values are {', '.join(allowed)}")


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
    or a ``DictConfig`` policy_loss section; the knobs are validated as they are built.
    """
    policy_loss = _lookup(actor_config, "policy_loss")
    values = {name: _lookup(policy_loss, name) for name in KNOB_NAMES}
    return SORLKnobs(**{name: value for name, value in values.items() if value is not None})
