"""Two runs of verl's ``main_ppo`` on CPU with one seed see the same data, the same rollouts and
make the same update: identical step-1 metrics (the rollout engine's own log-prob statistics
included) and bitwise identical actor weights after the step. The ``hf`` engine decodes one episode
at a time here (``max_batch_size=1``): batched, which rows share a decode batch depends on arrival
times, and the rollout's own log-probs carry that batch's float32 reduction-order noise.

Stress regime (lr 1e-3, 2 mini-batches x 2 epochs = 4 updates per rollout, 2 micro-batches each) so
that a difference in data order, rollouts or batch row order would show in the losses and the
weights. Its off-policy updates clip, and with ``clip_norm_tau=0.05`` the clipping-triggered
normalizer acts: the update log shows a step taken at ``lr * s`` with ``s`` the loss-share-weighted
mean of its micro-batches' ``1/Z`` (sorl_verl/algorithms/optim.py). The first run also records every
address its processes listen on: all must be loopback (Ray's GCS, raylet and workers, TransferQueue,
the ``hf`` server's process).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SO_GRPO = ["algorithm.adv_estimator=so_grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo"]
#: the normalizer's tau, below the recipes' 0.2: any micro-batch whose clipping removed more than 5% of
#: its update (rho > 0.05) gets Z > 1 (at 0.2 one of this regime's 4 updates had Z 1.93, rho 0.386)
TAU = 0.05
#: float64 unit roundoff (the update log's s, Z, 1/Z and shares are float64)
FP64_U = 2.0**-53
STRESS = [
    "data.seed=7",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    # 2 prompts x 2 samples per mini-batch, 2 rows per micro-batch: s aggregates two 1/Z_i per step
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    f"actor_rollout_ref.actor.policy_loss.clip_norm_tau={TAU}",
    # one episode per decode: the rollout's log-probs do not depend on which rows arrived together
    "+actor_rollout_ref.rollout.engine_kwargs.hf.max_batch_size=1",
    "trainer.total_training_steps=1",
    "trainer.save_freq=1",
    "trainer.resume_mode=disable",
    # greedy validation of 8 questions before training: the same questions and answers too
    "trainer.val_before_train=True",
    "data.val_max_samples=8",
]
#: wall-clock, throughput and memory figures legitimately differ between runs
UNTIMED = ("timing_s/", "timing_per_token_ms/", "perf/", "memory/", "actor/perf/", "critic/perf/")


def comparable(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if not k.startswith(UNTIMED) and isinstance(v, int | float)}


def same(x: float, y: float) -> bool:
    return x == y or (math.isnan(x) and math.isnan(y))


def assert_scaled_steps(updates: list[dict]) -> None:
    """The update log of the stress step: every record's ``s`` is the share-weighted mean of its
    micro-batches' ``1/Z`` (optim.py: ``s = sum w_i/Z_i / sum w_i``), each ``Z`` the loss's
    ``max(1, rho/tau)``, and some step was scaled (``s < 1``)."""
    assert len(updates) == 4, updates  # 1 step x 2 epochs x 2 mini-batches
    for u in updates:
        w, inv_z, z, rho = u["share"], u["inv_z"], u["z"], u["clip_bias_rel"]
        assert len(w) == len(inv_z) == len(z) == len(rho) == 2, u  # two micro-batches of 2 rows
        # Z = max(1, rho / tau) and 1/Z: one float64 division each, so within one ulp of the exact value
        for zi, ri, inv in zip(z, rho, inv_z, strict=True):
            exact = max(Fraction(1), Fraction(ri) / Fraction(TAU))
            assert abs(Fraction(zi) - exact) <= FP64_U * exact, (zi, ri)
            assert abs(Fraction(inv) * Fraction(zi) - 1) <= 2 * FP64_U, (inv, zi)
        # w_i: the micro-batch's tokens over the mini-batch's (token-mean, one rank), so they sum to 1;
        # each a float64 division, the sum two more roundings
        assert abs(math.fsum(w) - 1.0) <= 4 * FP64_U and all(wi > 0 for wi in w), w
        # s against the exact weighted mean of the logged values: 2 products, a correctly rounded fsum
        # of them and of the weights, one division: within 5 roundings
        exact = sum(Fraction(wi) * Fraction(vi) for wi, vi in zip(w, inv_z, strict=True)) / sum(map(Fraction, w))
        assert abs(Fraction(u["scale"]) - exact) <= 5 * FP64_U * exact, (u["scale"], float(exact), u)
    scaled = [u for u in updates if u["scale"] < 1.0]
    assert scaled, f"no step was scaled (clip_norm_tau={TAU}): {[u['z'] for u in updates]}"
    # the first update is on-policy (the weights that rolled out): nothing clipped, Z = 1 exactly
    assert updates[0]["z"] == [1.0, 1.0] and updates[0]["scale"] == 1.0, updates[0]


def update_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "ckpt" / "sorl_updates.jsonl").read_text().splitlines()]


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
    different = {k: (a[k], b[k]) for k in a if not same(a[k], b[k])}
    assert not different, f"step-1 metrics differ between two runs of one seed: {different}"

    val_a = [r["data"] for r in first.records if r["step"] == 0]
    val_b = [r["data"] for r in second.records if r["step"] == 0]
    assert val_a and len(val_a) == len(val_b)
    for va, vb in zip(val_a, val_b, strict=True):
        ca, cb = comparable(va), comparable(vb)
        assert ca.keys() == cb.keys() and all(same(ca[k], cb[k]) for k in ca), (ca, cb)

    # the clipping-triggered normalizer scaled a step, by the weighted mean of its micro-batches' 1/Z
    updates = {r: update_log(tmp_path / r) for r in "ab"}
    assert_scaled_steps(updates["a"])
    untimed = [{k: v for k, v in u.items() if k != "time"} for u in updates["a"]]
    assert untimed == [{k: v for k, v in u.items() if k != "time"} for u in updates["b"]]  # bit for bit

    weights_a, weights_b = actor_weights(tmp_path / "a"), actor_weights(tmp_path / "b")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a), "actor weights differ after step 1"

    # loopback only: Ray (GCS, raylet, workers), TransferQueue and every other listener of the run
    assert first.listening, "no listening socket seen: the watcher did not see the run"
    assert not first.exposed_listeners(), f"main_ppo processes listen beyond loopback: {first.exposed_listeners()}"
