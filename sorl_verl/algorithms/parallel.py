"""The process group over which the SORL normalizer's sums are reduced (``clip_norm_scope=global``).

verl hands the data-parallel group to its loss wrapper but not to the policy loss, so it is
resolved here, in this order:

1. a group set with :func:`set_data_parallel_group` (an engine hook, or a test);
2. Megatron's data-parallel group when ``megatron.core.parallel_state`` is initialized: with
   pipeline parallelism only the last stage computes the loss, so a world all-reduce would hang;
3. the default (world) group: verl's FSDP engines run the loss on every rank, and ranks of one
   Ulysses sequence-parallel group carry the same sequences, which leaves both ratios of the
   normalizer unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

_GROUP: Any = None


def set_data_parallel_group(group: Any) -> None:
    """Reduce over ``group`` from now on in this process (``None`` restores the automatic choice)."""
    global _GROUP
    _GROUP = group


def data_parallel_group() -> Any:
    """The data-parallel process group of this rank (see the module docstring)."""
    if _GROUP is not None:
        return _GROUP
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is not None and mpu.model_parallel_is_initialized():
        try:
            return mpu.get_data_parallel_group()
        except Exception as exc:  # noqa: BLE001 - re-raised with the fix
            raise RuntimeError(
                "sorl_verl: clip_norm_scope=global cannot determine Megatron's data-parallel group "
                f"({exc}); use actor_rollout_ref.actor.policy_loss.clip_norm_scope=micro_batch or call "
                "sorl_verl.algorithms.parallel.set_data_parallel_group(group) in the worker"
            ) from exc
    return dist.group.WORLD
