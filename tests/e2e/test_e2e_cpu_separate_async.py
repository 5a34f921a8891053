"""verl's separate-async trainer on CPU through the SORL trainer: ``sorl_separate_async`` with a
standalone ``hf`` rollout replica that receives the weights over the ``gloo`` checkpoint engine
(``+platform/cpu=separate_async``: a torch gloo group on 127.0.0.1), rollout two batches ahead,
two mini-batch updates per step (``parameter_sync_step=2``: verl's DetachActorWorker restores the
step's starting weights from its host copy to recompute old log-probs for the second one)."""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SO_GRPO = ["algorithm.adv_estimator=so_grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo"]
SEPARATE_ASYNC = [
    "+platform/cpu=separate_async",
    # verl: train_batch_size (4 in the small e2e sizes) == parameter_sync_step (2) x ppo_mini_batch_size
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    # old log-probs are computed per mini-batch: 2 prompts x 2 samples
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.optim.lr=1e-3",  # a step that visibly moves the policy
    "trainer.total_training_steps=2",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
]


def test_separate_async_syncs_weights_over_gloo_and_trains_on_stale_episodes(tmp_path, main_ppo):
    run = main_ppo(tmp_path, SO_GRPO, SEPARATE_ASYNC)
    steps = run.train_steps()
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/sorl/norm_factor"):
            assert math.isfinite(float(m[key])), (key, m[key])
        assert float(m["timing_s/update_weights"]) > 0  # separate_async's own sync after every step

    # the checkpoint engine's metrics of the sync after each step: the whole model, every time
    sent = [float(steps[s]["checkpoint_engine/tensors"]) for s in (1, 2)]
    mbytes = [float(steps[s]["checkpoint_engine/payload_mbytes"]) for s in (1, 2)]
    assert sent[0] == sent[1] > 0 and mbytes[0] == mbytes[1] > 0, (sent, mbytes)

    # the rollout starts from random weights (load_format=dummy); step 1's episodes were sampled by
    # the weights the engine pushed before training, so they score like the actor's own to fp32 noise
    assert float(steps[1]["training/rollout_probs_diff_max"]) < 1e-3

    # verl's staleness: step 1 trains on fresh episodes; step 2 on the second warm-up batch, which
    # the standalone rollout sampled with weights v0 ahead of the trainer (a row still decoding at
    # the sync would resume under v1: trajectory_spans 2, staleness_worst still >= 1)
    assert float(steps[1]["training/off_policy/trajectory_staleness_worst/max"]) == 0
    assert float(steps[2]["training/off_policy/trajectory_staleness_worst/max"]) >= 1

    # parameter_sync_step=2: the second mini-batch of a step recomputes old log-probs with the step's
    # starting weights (DetachActorWorker's host copy), the policy has moved by one update since,
    # so SORL's turn ratios leave 1. (Before the CPU wrapper of fsdp2_sharded_save_to_cpu the "copy"
    # aliased the live parameters and every ratio of the run was exactly 1.)
    ratios = [(float(m["actor/sorl/turn_ratio_min"]), float(m["actor/sorl/turn_ratio_max"])) for m in steps.values()]
    assert any(lo < 1.0 or hi > 1.0 for lo, hi in ratios), ratios
    assert not run.exposed_listeners()
