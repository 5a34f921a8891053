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
#: one Adam step at this lr moves every weight by ~1e-2: turn ratios and rollout/actor gaps of the
#: moved weights clear the float32 bounds of tests/e2e/conftest.py's LogprobNoise (~0.1) by MARGIN
LR = 1e-2
MARGIN = 3.0
SEPARATE_ASYNC = [
    "+platform/cpu=separate_async",
    # verl: train_batch_size (4 in the small e2e sizes) == parameter_sync_step (2) x ppo_mini_batch_size
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    # old log-probs are computed per mini-batch: 2 prompts x 2 samples
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    f"actor_rollout_ref.actor.optim.lr={LR}",  # a step that moves the policy beyond float noise
    # ... whatever the rewards: a mini-batch of 2 prompts x 2 samples whose groups each score alike has
    # GRPO advantage 0 and no gradient; the entropy bonus always has one
    "actor_rollout_ref.actor.entropy_coeff=1e-3",
    "trainer.total_training_steps=2",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
]


def test_separate_async_syncs_weights_over_gloo_and_trains_on_stale_episodes(tmp_path, main_ppo, logprob_noise):
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
    fresh_bound = logprob_noise.prob()
    assert float(steps[1]["training/rollout_probs_diff_max"]) <= fresh_bound, fresh_bound

    # verl's staleness: step 1 trains on fresh episodes; step 2 on the second warm-up batch, which
    # the standalone rollout sampled with weights v0 ahead of the trainer (a row still decoding at
    # the sync would resume under v1: trajectory_spans 2, staleness_worst still >= 1)
    assert float(steps[1]["training/off_policy/trajectory_staleness_worst/max"]) == 0
    assert float(steps[2]["training/off_policy/trajectory_staleness_worst/max"]) >= 1
    # the stale rows were sampled by v0 and are scored by v1, two lr-1e-2 Adam steps away (step 1's two
    # mini-batches): their gap clears the float32 bound of a fresh step at v1 by MARGIN
    moved = logprob_noise.adam_step(LR)
    stale_gap, fresh_at_v1 = float(steps[2]["training/rollout_probs_diff_max"]), logprob_noise.prob(drift=2 * moved)
    assert stale_gap > MARGIN * fresh_at_v1, (stale_gap, fresh_at_v1)

    # parameter_sync_step=2: the second mini-batch of a step recomputes old log-probs with the step's
    # starting weights (DetachActorWorker's host copy), the policy has moved by one update since, so
    # SORL's turn ratios leave 1 by more than float32 noise. A turn's log-ratio is the mean of its
    # tokens', each within the log-prob bound of two evaluations of one set of weights (at most three
    # Adam steps from the initial ones); some turn's exceeds MARGIN times that. (Before the CPU wrapper
    # of fsdp2_sharded_save_to_cpu the "copy" aliased the live parameters: every ratio 1 up to noise.)
    noise = logprob_noise.log_prob(drift=3 * moved)
    ratios = [(float(m["actor/sorl/turn_ratio_min"]), float(m["actor/sorl/turn_ratio_max"])) for m in steps.values()]
    assert max(abs(math.log(r)) for pair in ratios for r in pair) > MARGIN * noise, (ratios, noise)
    assert not run.exposed_listeners()
