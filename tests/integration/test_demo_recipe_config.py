"""The demo's learning recipe (``+demo=early_stop``) composes into verl's config and schedules the lr
the way docs/results.md measured it: linear warm-up over 10 % of the steps, cosine decay to 0.1x.

Composed with hydra's compose API as ``scripts/demo.sh`` launches main_ppo (sorl_trainer +
task/search_qa + platform/cpu + demo/early_stop, ``trainer.total_training_steps=50``); the actor's
optimizer section goes through verl's dataclass, and the schedule is verl's own
``get_cosine_schedule_with_warmup`` (what its FSDP engine builds from those fields) on a real optimizer.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import verl  # noqa: F401 - loads the sorl_verl plugin (config class, resolver)
from hydra import compose, initialize_config_dir
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.torch_functional import get_cosine_schedule_with_warmup

REPO = Path(__file__).resolve().parents[2]
STEPS = 50


@pytest.fixture(scope="module")
def cfg():
    with initialize_config_dir(config_dir=str(REPO / "recipe" / "sorl" / "config"), version_base=None):
        return compose(
            config_name="sorl_trainer",
            overrides=[
                "+task=search_qa",
                "+platform=cpu",
                "+demo=early_stop",
                f"trainer.total_training_steps={STEPS}",
                "data.train_files=/x/train.parquet",
                "data.val_files=/x/val.parquet",
                "actor_rollout_ref.model.path=/x/model",
            ],
        )


def test_recipe_sets_kl_loss_and_full_validation(cfg) -> None:
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.use_kl_loss and actor.kl_loss_coef == 0.1 and actor.kl_loss_type == "low_var_kl"
    assert cfg.data.val_max_samples == -1
    # unset: verl's validate_config prints "val_batch_size is deprecated" whenever it is not None
    assert cfg.data.get("val_batch_size") is None


def test_lr_warms_up_then_decays_to_a_tenth(cfg) -> None:
    optim = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).optim
    assert optim.lr_scheduler_type == "cosine" and optim.lr_warmup_steps <= 0  # the ratio applies
    warmup = int(optim.lr_warmup_steps_ratio * STEPS)  # as verl's FSDP engine computes it
    assert warmup == 5
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    sched = get_cosine_schedule_with_warmup(opt, warmup, STEPS, min_lr_ratio=optim.min_lr_ratio)
    lrs = []
    for _ in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    peak = optim.lr
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(peak / warmup) and lrs[warmup] == pytest.approx(peak)
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :], strict=False)), "decays monotonically"
    ratio = optim.min_lr_ratio
    expected_last = peak * (
        ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * (STEPS - 1 - warmup) / (STEPS - warmup)))
    )
    assert lrs[-1] == pytest.approx(expected_last) and peak * ratio < lrs[-1] < 0.11 * peak
