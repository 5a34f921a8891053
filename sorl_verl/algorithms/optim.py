"""Update-level clipping-triggered normalization: optimizers whose step shrinks by ``1/Z``.

Dividing the loss by a normalizer ``Z`` that is constant over a mini-batch barely changes an Adam
update (Adam divides by the running RMS of the gradient; its first step is sign-like). In
``clip_norm_apply = update`` mode the SORL loss leaves the loss as it is and publishes ``1/Z_i``
for each micro-batch ``i`` it computes with gradients on; the optimizer of that worker process
then takes the step with its learning rate multiplied by

    s = mean over the step's micro-batches (and data-parallel ranks) of 1 / Z_i

and restores the learning rate afterwards. For Adam, AdamW, SGD (with momentum) and every torch
optimizer whose parameter change is proportional to ``lr``, the whole update of that step -
weight decay included - is ``s`` times the optimizer's own, while its moment estimates see the
true gradient. With ``s == 1`` (no clipping, or no SORL loss at all) ``step`` is the optimizer's
own, bit for bit.

Select it in verl with ``actor_rollout_ref.actor.optim.optimizer_impl=sorl_verl.algorithms.optim``
(``optimizer=AdamW`` | ``Adam`` | ``SGD``); verl's ``build_optimizer`` passes
``override_optimizer_config`` as keyword arguments, so ``update_log`` (a JSON-lines path written
by global rank 0, one record per step) and ``log_update_norm`` (L2 norm of the parameter change,
costs one copy of the local parameters) are set there.

The hand-off is this module's: the loss calls :func:`publish_normalizer` once per micro-batch
with gradients on, and the optimizers and step hooks below read what it recorded; the record
(:data:`LEDGER`) is per process, and no other module touches it. Records made between
``zero_grad`` (verl calls it before the micro-batches of a mini-batch, and instead of ``step``
when the gradient is not finite) and ``step`` belong to that step.

With verl's own optimizer (``optimizer_impl=torch.optim``, verl's stock ``ppo_trainer``): the
plugin calls :func:`install_step_hooks`, torch's global optimizer-step pre/post hooks, which give
every other torch optimizer of the process the same step - ``lr * s`` for that step, restored
after it, nothing touched when ``s == 1`` or nothing was published - so one flag
(``policy_loss.loss_mode=so_grpo``) works on verl's stock config. The hooks leave an
:class:`UpdateScaledOptimizer` to its own ``step`` (no double scaling); they write no update log
(that and ``update_norm`` are the SORL optimizer's). A stock optimizer's ``zero_grad`` does not
clear the ledger: the micro-batches of a step verl skips for a non-finite gradient count towards
the next step's ``s``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from sorl_verl.algorithms.parallel import data_parallel_group

__all__ = [
    "LEDGER",
    "Adam",
    "AdamW",
    "SGD",
    "UpdateLedger",
    "UpdateScaledOptimizer",
    "install_step_hooks",
    "publish_normalizer",
    "update_scaled",
]


@dataclass
class UpdateLedger:
    """What the SORL loss published since the last ``zero_grad``/``step`` of this process."""

    inv_z: list[float] = field(default_factory=list)
    z: list[float] = field(default_factory=list)
    clip_bias_norm: list[float] = field(default_factory=list)
    clip_bias_rel: list[float] = field(default_factory=list)
    consumers: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, step_share: float, z: float, clip_bias_norm: float, clip_bias_rel: float) -> None:
        """Publish one micro-batch: its share of the step factor (``1/Z`` when the normalizer acts
        on the update, else 1) and, for the record, its ``Z``, ``||C||`` and ``rho``."""
        with self.lock:
            self.inv_z.append(step_share)
            self.z.append(z)
            self.clip_bias_norm.append(clip_bias_norm)
            self.clip_bias_rel.append(clip_bias_rel)

    def take(self) -> dict[str, list[float]]:
        """Return and clear the records of the current step."""
        with self.lock:
            out = {"inv_z": self.inv_z, "z": self.z, "clip_bias_norm": self.clip_bias_norm,
                   "clip_bias_rel": self.clip_bias_rel}  # fmt: skip
            self.inv_z, self.z, self.clip_bias_norm, self.clip_bias_rel = [], [], [], []
        return out

    def clear(self) -> None:
        self.take()


#: the process-wide record of the hand-off: written by :func:`publish_normalizer`, read by the
#: update-scaled optimizers and the step hooks
LEDGER = UpdateLedger()


def publish_normalizer(z: float, clip_bias_norm: float, clip_bias_rel: float, acts_on_update: bool) -> None:
    """The SORL loss's hand-off to the step of this process, one call per micro-batch with gradients.

    Records the step share ``1/Z`` when the normalizer acts on the update (``clip_norm_apply=update``),
    else ``1``, with ``Z``, ``||C||`` and ``rho`` for the update log. Without a reader in this process
    (no :class:`UpdateScaledOptimizer`, no :func:`install_step_hooks`) nothing is recorded, and a
    normalizer that should act on the update raises ``RuntimeError`` naming the fixes.
    """
    if LEDGER.consumers == 0:
        if not acts_on_update:
            return
        raise RuntimeError(
            "sorl_verl: actor_rollout_ref.actor.policy_loss.clip_norm_apply=update needs a step that reads the "
            "normalizer in this process: the plugin's optimizer-step hooks (installed when verl loads the "
            "sorl_verl plugin; else call sorl_verl.algorithms.optim.install_step_hooks()), or the SORL optimizer "
            "(actor_rollout_ref.actor.optim.optimizer_impl=sorl_verl.algorithms.optim), or use clip_norm_apply=loss"
        )
    LEDGER.record(1.0 / z if acts_on_update else 1.0, z, clip_bias_norm, clip_bias_rel)


def _local(p: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 DTensor parameter (the tensor itself otherwise)."""
    return p._local_tensor if getattr(p, "_local_tensor", None) is not None else p


def _all_reduce_sum(values: list[float], params: list[torch.Tensor]) -> list[float]:
    """Sum ``values`` over the data-parallel group (identity without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(data_parallel_group()) == 1:
        return values
    device = _local(params[0]).device if params else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=data_parallel_group())
    return t.tolist()


def _step_factor(records: dict[str, list[float]], params: list[torch.Tensor]) -> float:
    """``s = sum(1/Z_i) / count`` over this rank's micro-batches and the data-parallel group; 1 if none."""
    total, count = _all_reduce_sum([math.fsum(records["inv_z"]), float(len(records["inv_z"]))], params)
    return 1.0 if count == 0 else total / count


class UpdateScaledOptimizer:
    """Mixin for a torch optimizer: ``step`` runs with ``lr * s``, ``s`` from :data:`LEDGER`."""

    def __init__(
        self, params: Any, *args: Any, update_log: str | None = None, log_update_norm: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(params, *args, **kwargs)
        self.update_log = update_log
        self.log_update_norm = bool(log_update_norm)
        self.num_steps = 0
        #: the last step's record (scale, micro-batch Z values, update norm)
        self.last_update: dict[str, Any] = {}
        LEDGER.consumers += 1

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        LEDGER.clear()
        super().zero_grad(set_to_none=set_to_none)

    def step_factor(self, records: dict[str, list[float]]) -> float:
        """``s = sum(1/Z_i) / count`` over this rank's micro-batches and the data-parallel group; 1 if none."""
        return _step_factor(records, self._params())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        records = LEDGER.take()
        scale = self.step_factor(records)
        params = self._params() if self.log_update_norm else []
        before = [_local(p).detach().clone() for p in params]
        if scale == 1.0:
            loss = super().step(closure)
        else:
            saved = [group["lr"] for group in self.param_groups]
            for group in self.param_groups:
                group["lr"] = group["lr"] * scale
            try:
                loss = super().step(closure)
            finally:
                for group, lr in zip(self.param_groups, saved, strict=True):
                    group["lr"] = lr
        self.num_steps += 1
        record: dict[str, Any] = {"step": self.num_steps, "scale": scale, **records}
        if params:
            sq = math.fsum(
                float((_local(p).double() - b.double()).square().sum()) for p, b in zip(params, before, strict=True)
            )
            record["update_norm"] = math.sqrt(_all_reduce_sum([sq], params)[0])
        self.last_update = record
        self._write(record)
        return loss

    def _write(self, record: dict[str, Any]) -> None:
        if self.update_log is None or (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.update_log)), exist_ok=True)
        with open(self.update_log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": time.time(), "lr": self.param_groups[0]["lr"], **record}) + "\n")


def update_scaled(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` with :class:`UpdateScaledOptimizer`'s step; keeps the class name verl looks up."""
    return type(cls.__name__, (UpdateScaledOptimizer, cls), {"__module__": __name__, "__doc__": cls.__doc__})


AdamW = update_scaled(torch.optim.AdamW)
Adam = update_scaled(torch.optim.Adam)
SGD = update_scaled(torch.optim.SGD)


# --- the same step for any torch optimizer: global step hooks ---------------------------------

#: optimizer -> its learning rates saved by the pre-hook, restored by the post-hook
_SAVED_LR: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]] = weakref.WeakKeyDictionary()
_HOOK_HANDLES: list[Any] = []


def _restore_lr(optimizer: torch.optim.Optimizer) -> None:
    saved = _SAVED_LR.pop(optimizer, None)
    if saved is not None:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr


def _scale_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Pre-hook: take the ledger and run this step with ``lr * s`` (``s`` as in :class:`UpdateScaledOptimizer`).

    Skipped for an :class:`UpdateScaledOptimizer` (it scales its own step) and when this rank
    published nothing since the last step (an optimizer no SORL loss fed, e.g. the critic's: no
    collective, no change). Every rank of an actor runs its loss with gradients before stepping,
    so the data-parallel all-reduce is entered by all of them or by none.
    """
    if isinstance(optimizer, UpdateScaledOptimizer):
        return
    _restore_lr(optimizer)  # a previous step that raised left its scaled lr behind
    records = LEDGER.take()
    if not records["inv_z"]:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    scale = _step_factor(records, params)
    if scale == 1.0:
        return
    _SAVED_LR[optimizer] = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale


def _restore_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Post-hook: the learning rates of before the step (a no-op unless the pre-hook scaled them)."""
    _restore_lr(optimizer)


def install_step_hooks() -> bool:
    """Register the global step hooks once per process (the plugin does); True if this call registered them.

    They count as a consumer of :data:`LEDGER`, so ``clip_norm_apply=update`` works with any torch
    optimizer verl builds; :func:`uninstall_step_hooks` undoes it (tests).
    """
    if _HOOK_HANDLES:
        return False
    _HOOK_HANDLES.extend(
        [register_optimizer_step_pre_hook(_scale_step), register_optimizer_step_post_hook(_restore_step)]
    )
    LEDGER.consumers += 1
    return True


def uninstall_step_hooks() -> None:
    """Remove the hooks :func:`install_step_hooks` registered (and their consumer count)."""
    if not _HOOK_HANDLES:
        return
    for handle in _HOOK_HANDLES:
        handle.remove()
    _HOOK_HANDLES.clear()
    LEDGER.consumers -= 1
