"""What the collapse guard changes inside the actor's Ray worker processes.

The trainer reaches each worker with Ray's ``actor.__ray_call__`` (the function runs in the worker
process with the worker object as its first argument), so no verl worker class is patched. Both
setters take an *absolute* scale of the configured value, so calling them again, after a
checkpoint load or a resume, never compounds.

- :func:`scale_learning_rate`: every parameter group's learning rate becomes ``scale`` times its
  schedule's value. With a torch LR scheduler (verl's FSDP engines: constant or cosine with
  warm-up, a ``LambdaLR``) its ``base_lrs`` become ``scale * initial_lr``, so every later
  scheduler step keeps the scale; the current ``lr`` is rescaled in place.
- :func:`set_clip_norm_tau`: the SORL loss's ``clip_norm_tau`` (read by the loss on every call).
"""

from __future__ import annotations

from typing import Any

import torch

from sorl_verl.algorithms.knobs import SORLKnobs

#: param-group key where the unscaled learning rate is kept when there is no scheduler
BASE_LR_KEY = "sorl_guard_base_lr"


def scale_learning_rate(optimizer: torch.optim.Optimizer, scheduler: Any, scale: float) -> list[float]:
    """Set each group's learning rate to ``scale`` x its unscaled schedule value; returns the new lrs.

    Needs a torch LR scheduler (``base_lrs``, ``initial_lr``) or none; another scheduler (Megatron's
    ``OptimizerParamScheduler``) is left alone at ``scale == 1`` and raises for any other scale."""
    if scale <= 0:
        raise ValueError(f"learning-rate scale must be > 0, got {scale}")
    groups = optimizer.param_groups
    if scheduler is None:
        for group in groups:
            group.setdefault(BASE_LR_KEY, group["lr"])
            group["lr"] = group[BASE_LR_KEY] * scale
        return [group["lr"] for group in groups]
    base_lrs = getattr(scheduler, "base_lrs", None)
    if base_lrs is None or len(base_lrs) != len(groups) or any("initial_lr" not in g for g in groups):
        if scale == 1.0:  # nothing to scale: the guard never changed this schedule (it cannot), keep it
            return [group["lr"] for group in groups]
        raise NotImplementedError(
            f"sorl.guard cannot scale the learning rate of a {type(scheduler).__name__} scheduler (no torch "
            "base_lrs/initial_lr); use sorl.guard.backoff_target=clip_norm_tau or an FSDP engine"
        )
    new_base = [group["initial_lr"] * scale for group in groups]
    for group, old, new in zip(groups, base_lrs, new_base, strict=True):
        if new != old:  # the schedule's current multiplier, lr / base, carried over to the new base
            group["lr"] = new if old == 0 else group["lr"] / old * new
    scheduler.base_lrs = new_base
    return [group["lr"] for group in groups]


def _roles(worker: Any) -> list[Any]:
    """The role objects a verl Ray worker holds (colocated WorkerDict, fused worker, or itself)."""
    for attr in ("worker_dict", "fused_worker_dict"):
        held = getattr(worker, attr, None)
        if isinstance(held, dict) and held:
            return list(held.values())
    return [worker]


def _actor_engines(worker: Any) -> list[Any]:
    engines = []
    for role in _roles(worker):
        engine = getattr(getattr(role, "actor", None), "engine", None)
        if engine is not None and getattr(engine, "optimizer", None) is not None:
            engines.append(engine)
    return engines


def actor_lr_scale(worker: Any, scale: float) -> list[float]:
    """``__ray_call__`` target: :func:`scale_learning_rate` on every actor engine of ``worker``."""
    lrs: list[float] = []
    for engine in _actor_engines(worker):
        lrs += scale_learning_rate(engine.optimizer, getattr(engine, "lr_scheduler", None), scale)
    return lrs


def _policy_loss_configs(worker: Any) -> list[Any]:
    """The ``policy_loss`` configs of the actor losses of ``worker``: verl's actor worker holds
    ``loss_fn = functools.partial(ppo_loss, config=ActorConfig)``. A loss whose config has no
    ``clip_norm_tau`` (not a SORL loss, or not the partial verl builds) raises ``TypeError``."""
    found = []
    for role in _roles(worker):
        loss_fn = getattr(role, "loss_fn", None)
        if loss_fn is None:
            continue
        config = getattr(loss_fn, "keywords", {}).get("config")
        policy_loss = getattr(config, "policy_loss", None)
        if not hasattr(policy_loss, "clip_norm_tau"):
            raise TypeError(
                "sorl.guard.backoff_target=clip_norm_tau: the actor's loss function "
                f"{getattr(loss_fn, 'func', loss_fn)!r} has no config.policy_loss.clip_norm_tau (policy_loss "
                f"{type(policy_loss).__name__}, loss_mode={getattr(policy_loss, 'loss_mode', None)}); use a SORL "
                "loss with a normalizer, or backoff_target=lr"
            )
        found.append(policy_loss)
    return found


def set_clip_norm_tau(worker: Any, tau: float) -> list[float]:
    """``__ray_call__`` target: set the actor loss's ``clip_norm_tau`` (a frozen verl config field);
    returns the values set, one per actor loss (empty: the worker holds no loss; the trainer raises
    when no worker holds one).

    ``tau`` is checked by the knobs' one validation (:class:`~sorl_verl.algorithms.knobs.SORLKnobs`)
    before any config changes, so a bad value fails with the same error as at start-up.
    """
    tau = SORLKnobs(clip_norm_tau=tau).clip_norm_tau
    configs = _policy_loss_configs(worker)
    for policy_loss in configs:
        object.__setattr__(policy_loss, "clip_norm_tau", float(tau))
    return [float(c.clip_norm_tau) for c in configs]
