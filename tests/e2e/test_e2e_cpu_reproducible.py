"""Two runs of verl's ``main_ppo`` on CPU with one seed see the same data, the same rollouts and
make the same update: identical step-1 metrics and bitwise identical actor weights after the step.
Only the statistics of the rollout engine's own log-probs may differ, by float32 reduction-order
noise of the batched ``hf`` engine (the trainer recomputes log-probs with the actor).

Stress regime (lr 1e-3, 2 mini-batches x 2 epochs = 4 updates per rollout) so that a difference in
data order, rollouts or batch row order would show in the losses and the weights. The first run
also records every address its processes listen on: all must be loopback (Ray's GCS, raylet and
workers, TransferQueue, the ``hf`` server's process).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SO_GRPO = ["algorithm.adv_estimator=so_grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo"]
STRESS = [
    "data.seed=7",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "trainer.total_training_steps=1",
    "trainer.save_freq=1",
    "trainer.resume_mode=disable",
    # greedy validation of 8 questions before training: the same questions and answers too
    "trainer.val_before_train=True",
    "data.val_max_samples=8",
]
#: wall-clock, throughput and memory figures legitimately differ between runs
UNTIMED = ("timing_s/", "timing_per_token_ms/", "perf/", "memory/", "actor/perf/", "critic/perf/")
#: metrics of the rollout's own log-probs (vs the actor's): the batched hf engine computes them with
#: float32 reduction-order noise that depends on which rows shared a decode batch (docs/cpu.md)
ROLLOUT_LOGPROB_METRICS = ("training/rollout_", "rollout_corr/")
#: that noise is below 4e-6 per token (tests/unit/test_cpu_hf_seeded_sampling.py's bound on this model
#: is of that order); a sequence-level statistic sums it over at most data.max_response_length tokens
ROLLOUT_LOGPROB_TOL = 448 * 4e-6


def comparable(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if not k.startswith(UNTIMED) and isinstance(v, int | float)}


def same(key: str, x: float, y: float) -> bool:
    if math.isnan(x) and math.isnan(y):
        return True
    if key.startswith(ROLLOUT_LOGPROB_METRICS):
        return abs(x - y) <= ROLLOUT_LOGPROB_TOL
    return x == y


def actor_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    shards = sorted((run_dir / "ckpt" / "global_step_1" / "actor").glob("model_world_size_*_rank_0.pt"))
    assert shards, f"no actor checkpoint under {run_dir}"
    state = torch.load(shards[0], map_location="cpu", weights_only=False)
    return {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in state.items()}


def test_same_seed_same_step_one(tmp_path, main_ppo, small_overrides):
    small = [s for s in small_overrides if not s.startswith("trainer.val_before_train")]
    first = main_ppo(tmp_path / "a", SO_GRPO, STRESS, small=small)
    second = main_ppo(tmp_path / "b", SO_GRPO, STRESS, small=small)

    steps_a, steps_b = first.train_steps(), second.train_steps()
    assert sorted(steps_a) == sorted(steps_b) == [1]
    a, b = comparable(steps_a[1]), comparable(steps_b[1])
    assert a.keys() == b.keys()
    for key in (
        "critic/score/mean",
        "response_length/mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/ppo_kl",
        "actor/sorl/turn_clipfrac",
        "actor/sorl/norm_factor",
    ):
        assert key in a and math.isfinite(a[key]), key
    assert a["actor/ppo_kl"] != 0.0, "the stress regime must move the policy within the step"
    different = {k: (a[k], b[k]) for k in a if not same(k, a[k], b[k])}
    assert not different, f"step-1 metrics differ between two runs of one seed: {different}"

    val_a = [r["data"] for r in first.records if r["step"] == 0]
    val_b = [r["data"] for r in second.records if r["step"] == 0]
    assert val_a and len(val_a) == len(val_b)
    for va, vb in zip(val_a, val_b, strict=True):
        ca, cb = comparable(va), comparable(vb)
        assert ca.keys() == cb.keys() and all(same(k, ca[k], cb[k]) for k in ca), (ca, cb)

    weights_a, weights_b = actor_weights(tmp_path / "a"), actor_weights(tmp_path / "b")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a), "actor weights differ after step 1"

    # loopback only: Ray (GCS, raylet, workers), TransferQueue and every other listener of the run
    assert first.listening, "no listening socket seen: the watcher did not see the run"
    assert not first.exposed_listeners(), f"main_ppo processes listen beyond loopback: {first.exposed_listeners()}"
