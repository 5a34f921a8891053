"""verl's default training strategy, FSDP1 (``actor_rollout_ref.actor.strategy=fsdp``), end to end on CPU.

One ``python -m verl.trainer.main_ppo`` of the CPU overlay (conftest's runner, small sizes) with FSDP1
for the actor and the reference model (the overlay's ``ref``/``critic`` strategies follow the actor's)
on two data-parallel ranks over gloo (two logical GPUs: ``trainer.n_gpus_per_node=2`` and Ray's
``num_gpus=2``): two SO-GRPO steps at the loss's defaults, two updates per rollout so that the second
is off-policy, a KL loss to the reference model, and verl's sharded FSDP1 checkpoint at step 2.
The CPU wrappers that make FSDP1 build and export weights here: ``sorl_verl/cpu/verl_compat.py``
(docs/cpu.md, "FSDP1 on CPU"). Plus the start-up refusal of ``clip_norm_reference=gradient`` under
FSDP1 through the same overlay, which needs no Ray.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config"
SO_GRPO = ["algorithm.adv_estimator=so_grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo"]
#: the recipes' clip_norm_tau (sorl_trainer.yaml), which this run keeps
TAU = 0.2
#: float64 unit roundoff (the update log's s, Z and 1/Z are float64)
FP64_U = 2.0**-53

FSDP1_TWO_RANKS = [
    "actor_rollout_ref.actor.strategy=fsdp",
    "trainer.n_gpus_per_node=2",
    "ray_kwargs.ray_init.num_gpus=2",
    # 8 rows a step, 4 per rank: the log-prob micro-batches must divide a rank's share
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=True",  # the reference model runs under FSDP1 too
    "actor_rollout_ref.actor.ppo_epochs=2",  # the second update of a step sees moved weights
    "actor_rollout_ref.actor.optim.lr=1e-3",  # a step that visibly moves the policy
    "trainer.total_training_steps=2",
    "trainer.save_freq=2",
    "trainer.resume_mode=disable",
]
#: the start of the loss's warning under FSDP1 (sorl_verl.algorithms.strategies.diagnostic_off_reason)
DIAGNOSTIC_OFF = "sorl/clip_bias_grad_norm is off under actor_rollout_ref.actor.strategy=fsdp"
SORL_METRICS = ("turn_ratio_mean", "turn_ratio_min", "turn_ratio_max", "turn_clipfrac", "clip_bias_norm",
                "norm_factor", "triggered", "num_turns_mean")  # fmt: skip


def test_so_grpo_trains_under_fsdp1_on_two_ranks(tmp_path, main_ppo):
    run = main_ppo(tmp_path, SO_GRPO, FSDP1_TWO_RANKS)
    steps = run.train_steps()
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        for key in ("actor/pg_loss", "actor/loss", "actor/grad_norm", "actor/kl_loss"):
            assert math.isfinite(float(m[key])), (key, m[key])
        for name in SORL_METRICS:
            assert math.isfinite(float(m[f"actor/sorl/{name}"])), (name, m.get(f"actor/sorl/{name}"))
        # the parameter-space diagnostic is off under FSDP1 (its extra backward breaks FSDP1's), with
        # one warning per rank (sorl_verl/algorithms/strategies.py)
        assert "actor/sorl/clip_bias_grad_norm" not in m
    assert DIAGNOSTIC_OFF in run.log.read_text()

    # verl's FSDP1 checkpoint: two ranks' shards
    actor_ckpt = tmp_path / "ckpt" / "global_step_2" / "actor"
    assert json.loads((actor_ckpt / "fsdp_config.json").read_text()) == {"FSDP_version": 1, "world_size": 2}
    assert all((actor_ckpt / f"model_world_size_2_rank_{r}.pt").exists() for r in (0, 1))

    # the weights changed: the SORL optimizer's update log (one record per optimizer step, 2 steps x 2
    # epochs x 1 mini-batch) measures every parameter change, and a gradient reached the actor
    updates = [json.loads(line) for line in (tmp_path / "ckpt" / "sorl_updates.jsonl").read_text().splitlines()]
    assert len(updates) == 4
    # the normalizer on two FSDP1 ranks: each of rank 0's micro-batches (the log is rank 0's) has Z = the
    # loss's max(1, rho / tau) (one float64 division: within one ulp) and 1/Z its reciprocal. The step
    # factor s is the share-weighted mean of 1/Z over BOTH ranks' micro-batches (one all-reduce, optim.py),
    # so it need not lie within rank 0's own 1/Z: here step 2's last update had Z = 1 on rank 0 and
    # s = 0.778 from rank 1's clipping. It lies in (0, 1], is 1 on the on-policy first update, and some
    # update was scaled
    for u in updates:
        for zi, ri, inv in zip(u["z"], u["clip_bias_rel"], u["inv_z"], strict=True):
            exact = max(Fraction(1), Fraction(ri) / Fraction(TAU))
            assert abs(Fraction(zi) - exact) <= FP64_U * exact, (zi, ri)
            assert abs(Fraction(inv) * Fraction(zi) - 1) <= 2 * FP64_U, (inv, zi)
        assert 0.0 < u["scale"] <= 1.0, u
    assert updates[0]["scale"] == 1.0 and all(z == 1.0 for z in updates[0]["z"]), updates[0]  # on-policy
    assert any(u["scale"] < 1.0 for u in updates), [u["z"] for u in updates]
    assert all(math.isfinite(u["update_norm"]) and u["update_norm"] > 0 for u in updates), updates
    assert max(float(m["actor/grad_norm"]) for m in steps.values()) > 0
    # a gradient update moved the policy: the step's second update sees turn ratios away from 1 by more
    # than weight decay alone moves them (lr x weight_decay = 1e-5 of each weight: ratios within ~2e-5
    # of 1 on a step without gradient; one with gradient went to 0.40 here)
    ratios = [(float(m["actor/sorl/turn_ratio_min"]), float(m["actor/sorl/turn_ratio_max"])) for m in steps.values()]
    assert any(lo < 0.99 or hi > 1.01 for lo, hi in ratios), ratios


def test_gradient_reference_under_fsdp1_stops_before_ray():
    """``clip_norm_reference=gradient`` with ``strategy=fsdp`` through the CPU overlay: verl's driver refuses
    it while building the actor config, naming ``strategy=fsdp2``, before Ray starts."""
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(CONFIG_DIR),
           "--config-name", "sorl_trainer", "+task=search_qa", "+platform=cpu", *SO_GRPO,
           "actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.policy_loss.clip_norm_reference=gradient"]  # fmt: skip
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    out = subprocess.run(cmd, cwd="/", env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "clip_norm_reference=gradient" in text and "strategy=fsdp2" in text, text[-3000:]
    assert "ray init kwargs" not in text and "Started a local Ray instance" not in text  # stopped before Ray
