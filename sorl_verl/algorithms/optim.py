"""Update-level clipping-triggered normalization: the actor's optimizer step shrinks by ``s``.

Dividing the loss by a normalizer ``Z`` that is constant over a mini-batch barely changes an Adam
update (Adam divides by the running RMS of the gradient; its first step is sign-like). In
``clip_norm_apply = update`` mode the SORL loss leaves the loss as it is and publishes, for each
micro-batch ``i`` it computes with gradients on, ``1/Z_i`` and the micro-batch's share ``w_i`` of
the mini-batch loss (what verl's ``agg_loss`` with ``global_batch_info`` gives it: tokens /
``batch_num_tokens`` x ``dp_size`` for ``token-mean``, rows / ``global_batch_size`` x ``dp_size`` for
the ``seq-mean`` modes). The actor's optimizer then takes the step with its learning rate times

    s = sum_i w_i / Z_i  /  sum_i w_i     (over the step's micro-batches and data-parallel ranks)

so a one-row micro-batch of dynamic batching weighs in ``s`` what it weighs in the loss
(``s = 1`` when no micro-batch has a policy token). The learning rate is restored in a
``finally`` right after the step, unless something else set it during the step. For Adam, AdamW,
SGD (with momentum) and every torch optimizer whose parameter change is proportional to ``lr``,
the whole update of that step - weight decay included - is ``s`` times the optimizer's own, while
its moment estimates see the true gradient. With ``s == 1`` ``step`` is the optimizer's own, bit
for bit.

One mechanism, the actor's own optimizer class: verl builds the actor's optimizer (FSDP1 and FSDP2
engines, ``verl.workers.config.optimizer.build_optimizer``) from
``actor_rollout_ref.actor.optim.optimizer_impl`` + ``optimizer``, the critic's from ``critic.optim``;
``optimizer_impl=sorl_verl.algorithms.optim`` (``optimizer=AdamW`` | ``Adam`` | ``SGD``) makes
exactly the actor's optimizer an :class:`UpdateScaledOptimizer`, and no other optimizer of the
process (the colocated critic's) is touched. verl's ``build_optimizer`` passes
``override_optimizer_config`` as keyword arguments, so ``update_log`` (a JSON-lines path written by
global rank 0, one record per step) and ``log_update_norm`` (L2 norm of the parameter change, costs
one copy of the local parameters) are set there. Megatron builds its DistributedOptimizer without
``optimizer_impl`` and computes the loss on the last pipeline stage only, so
``clip_norm_apply=update`` is refused there (:func:`check_step_scaling`).

The hand-off is this module's: the loss calls :func:`publish_normalizer` once per micro-batch with
gradients on, and the update-scaled optimizer reads what it recorded (:data:`LEDGER`, per
process; no other module touches it). ``zero_grad`` clears the record: verl calls it before the
micro-batches of a mini-batch and instead of ``step`` when the gradient is not finite, so the
records of a skipped step are dropped, never inherited.
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

from sorl_verl.algorithms.knobs import KNOB_PREFIX, read_knobs
from sorl_verl.algorithms.knobs import _lookup as lookup
from sorl_verl.algorithms.parallel import data_parallel_group

__all__ = [
    "LEDGER",
    "Adam",
    "AdamW",
    "SGD",
    "UpdateLedger",
    "UpdateScaledOptimizer",
    "check_step_scaling",
    "publish_normalizer",
    "update_scaled",
]


@dataclass
class UpdateLedger:
    """What the SORL loss published since the last ``zero_grad``/``step`` of the actor's optimizer."""

    inv_z: list[float] = field(default_factory=list)
    share: list[float] = field(default_factory=list)
    z: list[float] = field(default_factory=list)
    clip_bias_norm: list[float] = field(default_factory=list)
    clip_bias_rel: list[float] = field(default_factory=list)
    #: live update-scaled optimizers of this process (the readers of the record)
    consumers: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(
        self, step_share: float, z: float, clip_bias_norm: float, clip_bias_rel: float, share: float = 1.0
    ) -> None:
        """Publish one micro-batch: its factor on the step (``1/Z`` when the normalizer acts on the
        update, else 1), its share ``w`` of the mini-batch loss, and ``Z``, ``||C||``, ``rho``."""
        with self.lock:
            self.inv_z.append(step_share)
            self.share.append(share)
            self.z.append(z)
            self.clip_bias_norm.append(clip_bias_norm)
            self.clip_bias_rel.append(clip_bias_rel)

    def take(self) -> dict[str, list[float]]:
        """Return and clear the records of the current step."""
        with self.lock:
            out = {"inv_z": self.inv_z, "share": self.share, "z": self.z, "clip_bias_norm": self.clip_bias_norm,
                   "clip_bias_rel": self.clip_bias_rel}  # fmt: skip
            self.inv_z, self.share, self.z, self.clip_bias_norm, self.clip_bias_rel = [], [], [], [], []
        return out

    def clear(self) -> None:
        self.take()


#: the process-wide record of the hand-off: written by :func:`publish_normalizer`, read by the
#: update-scaled optimizer
LEDGER = UpdateLedger()


def publish_normalizer(
    z: float, clip_bias_norm: float, clip_bias_rel: float, acts_on_update: bool, share: float = 1.0
) -> None:
    """The SORL loss's hand-off to the actor's step, one call per micro-batch with gradients.

    Records the step factor ``1/Z`` when the normalizer acts on the update (``clip_norm_apply=update``),
    else ``1``, the micro-batch's share of the mini-batch loss (its weight in ``s``), and ``Z``,
    ``||C||``, ``rho`` for the update log. Without an :class:`UpdateScaledOptimizer` in this process
    nothing is recorded, and a normalizer that should act on the update raises ``RuntimeError``
    naming the fixes.
    """
    if LEDGER.consumers == 0:
        if not acts_on_update:
            return
        raise RuntimeError(
            f"sorl_verl: {KNOB_PREFIX}.clip_norm_apply=update scales the step of the actor's optimizer, but this "
            "process has no update-scaled optimizer: set actor_rollout_ref.actor.optim.optimizer_impl="
            f"{__name__} (optimizer=AdamW|Adam|SGD; recipe/sorl/config/sorl_trainer.yaml does), or use "
            f"{KNOB_PREFIX}.clip_norm_apply=loss"
        )
    LEDGER.record(1.0 / z if acts_on_update else 1.0, z, clip_bias_norm, clip_bias_rel, share)


def check_step_scaling(actor_config: Any, normalizes: bool = True) -> None:
    """Refuse an actor config whose ``clip_norm_apply=update`` step no optimizer would take right.

    Checked only where the loss's normalizer acts (``normalizes``, ``clip_norm_mode != none``,
    ``clip_norm_apply == update``): ``strategy=megatron`` is refused (the loss and its ``Z`` exist on the
    last pipeline stage only, and Megatron's DistributedOptimizer is not built from ``optimizer_impl``),
    and so is an ``optim.optimizer_impl`` other than this module's when the config names one. Raises
    ``ValueError`` naming the setting and the fix. Works on a ``DictConfig`` or verl's ``ActorConfig``.
    """
    knobs = read_knobs(actor_config)
    if not normalizes or knobs.clip_norm_mode == "none" or knobs.clip_norm_apply != "update":
        return
    strategy = lookup(actor_config, "strategy")
    if strategy == "megatron":
        raise ValueError(
            f"{KNOB_PREFIX}.clip_norm_apply=update is not supported with actor_rollout_ref.actor.strategy=megatron "
            "(with pipeline parallel > 1 only the last stage computes the loss and its normalizer, and Megatron's "
            f"optimizer is not built from optim.optimizer_impl): set {KNOB_PREFIX}.clip_norm_apply=loss"
        )
    impl = lookup(lookup(actor_config, "optim"), "optimizer_impl")
    if impl is not None and impl != __name__:
        raise ValueError(
            f"{KNOB_PREFIX}.clip_norm_apply=update scales the step of the actor's update-scaled optimizer, but "
            f"actor_rollout_ref.actor.optim.optimizer_impl={impl}: set optimizer_impl={__name__} "
            f"(optimizer=AdamW|Adam|SGD) or {KNOB_PREFIX}.clip_norm_apply=loss"
        )


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
    """``s = sum(w_i / Z_i) / sum(w_i)`` over this rank's micro-batches and the data-parallel group;
    1 when no micro-batch carries any share of the loss."""
    weighted = math.fsum(w * inv for w, inv in zip(records["share"], records["inv_z"], strict=True))
    total, weight = _all_reduce_sum([weighted, math.fsum(records["share"])], params)
    return 1.0 if weight <= 0.0 else total / weight


def _release_consumer() -> None:
    LEDGER.consumers -= 1


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
        weakref.finalize(self, _release_consumer)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        LEDGER.clear()
        super().zero_grad(set_to_none=set_to_none)

    def step_factor(self, records: dict[str, list[float]]) -> float:
        """``s`` of :func:`_step_factor` for this optimizer's step."""
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
            scaled = [lr * scale for lr in saved]
            for group, lr in zip(self.param_groups, scaled, strict=True):
                group["lr"] = lr
            try:
                loss = super().step(closure)
            finally:  # back to the unscaled lr, unless something set another one during the step
                for group, lr, mine in zip(self.param_groups, saved, scaled, strict=True):
                    if group["lr"] == mine:
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
