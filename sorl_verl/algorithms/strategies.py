"""What each of verl's training strategies supports of the parameter-space clipping-bias term C(theta).

C(theta) is a second backward through the actor's graph before verl's own backward
(:mod:`sorl_verl.algorithms.clip_bias_grad`). That is safe only where the engine tolerates it:

==========  =======  =====================================  ===========================================
strategy    losses   diagnostic ``sorl/clip_bias_grad_norm``  ``clip_norm_reference=gradient*``
==========  =======  =====================================  ===========================================
fsdp2       yes      on                                      yes
fsdp        yes      off, one warning                        refused at start-up
megatron    yes      off, one warning                        refused at start-up
==========  =======  =====================================  ===========================================

FSDP1 (``strategy=fsdp``, verl's default): its post-backward callback reshards the flat parameters
at the end of the extra pass, and the real backward then fails on their freed storage. Megatron:
``vocab_parallel_cross_entropy`` computes its backward in place of its saved softmax, so a second
backward through it would be wrong; a deny-list of such kernels cannot be complete. Imports nothing
from verl or torch (the config class and the loss both use it).
"""

from __future__ import annotations

from typing import Any

#: strategies under which C(theta) is never taken (the diagnostic is off, the gradient reference refused)
UNSAFE_STRATEGIES: dict[str, str] = {
    "fsdp": (
        "torch FSDP1 (strategy=fsdp) reshards its flat parameters at the end of the extra backward that "
        "C(theta) takes, and verl's real backward then fails on their freed storage"
    ),
    "megatron": (
        "Megatron's vocab_parallel_cross_entropy overwrites its saved softmax in its backward, so the "
        "extra backward that C(theta) takes would corrupt verl's real one"
    ),
}

#: the strategy name that detection of FSDP1's flat parameters in the graph stands for
FSDP1 = "fsdp"


def unsafe_reason(strategy: Any) -> str | None:
    """Why C(theta) cannot be taken under actor ``strategy`` (None where it can)."""
    return UNSAFE_STRATEGIES.get(str(strategy)) if strategy is not None else None


def config_unsafe_strategy(strategy: Any) -> str | None:
    """``strategy`` if the actor config alone refuses C(theta) (Megatron: its kernels are not torch's, the
    graph cannot show them), else None. FSDP1 is not decided here but in the graph (its flat parameters,
    :func:`sorl_verl.algorithms.clip_bias_grad.is_fsdp1_graph`): a config saying ``fsdp`` over a plain
    module still takes the product."""
    return str(strategy) if str(strategy) != FSDP1 and unsafe_reason(strategy) is not None else None


def gradient_reference_refusal(strategy: Any, reference: str) -> str:
    """The message that refuses ``clip_norm_reference=reference`` under ``strategy`` (naming the fix)."""
    return (
        f"actor_rollout_ref.actor.policy_loss.clip_norm_reference={reference} needs a second backward through "
        f"the actor, which actor_rollout_ref.actor.strategy={strategy} cannot take: {unsafe_reason(strategy)}. "
        "Use actor_rollout_ref.actor.strategy=fsdp2 (model_engine=dp), or "
        "clip_norm_reference=relative|absolute with this strategy"
    )


def diagnostic_off_reason(strategy: Any) -> str:
    """The one warning that says why ``sorl/clip_bias_grad_norm`` is not logged under ``strategy``."""
    return (
        f"sorl_verl: sorl/clip_bias_grad_norm is off under actor_rollout_ref.actor.strategy={strategy}: "
        f"{unsafe_reason(strategy)}; use strategy=fsdp2 to log it"
    )


def check_gradient_reference_strategy(strategy: Any, reference: str, gradient_references: tuple[str, ...]) -> None:
    """Refuse a gradient reference (one of ``gradient_references``) under an unsafe ``strategy`` (ValueError)."""
    if reference in gradient_references and unsafe_reason(strategy) is not None:
        raise ValueError(gradient_reference_refusal(strategy, reference))
