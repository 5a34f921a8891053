"""verl's asynchronous trainer on CPU through the SORL trainer: ``sorl_colocate_async`` with two
batches generated ahead, so step 2 trains on episodes sampled (at least partly) by the weights of
step 0: verl's own staleness metrics and the rollout/actor probability gap must show it.

Measured here (three runs): step 1 staleness 0, rollout/actor gap ~1.9e-6; step 2 gap 5.2e-5 to 9.8e-2,
staleness 1 on every row on an idle machine, 0-1 under load (some rows finished after the sync)."""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SO_GRPO = ["algorithm.adv_estimator=so_grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo"]
#: verl's keys: rollout runs num_warmup_batches batches ahead of the trainer
COLOCATE_ASYNC = [
    "trainer.v1.trainer_mode=sorl_colocate_async",
    "trainer.v1.colocate_async.num_warmup_batches=2",
    "trainer.v1.sampler.max_off_policy_threshold=4",
    "actor_rollout_ref.actor.optim.lr=1e-3",  # a step that visibly moves the policy
    "trainer.total_training_steps=2",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
]


def test_colocate_async_trains_on_stale_episodes(tmp_path, main_ppo):
    run = main_ppo(tmp_path, SO_GRPO, COLOCATE_ASYNC)
    steps = run.train_steps()
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/sorl/norm_factor"):
            assert math.isfinite(float(m[key])), (key, m[key])
    # step 1 trains on episodes of weights v0 (fresh); step 2 on the second batch, sampled by v0
    # while step 1 trained. How many of its rows finish before the weights move is a race: on an
    # idle machine every row was one version behind (staleness min 1), with a second main_ppo
    # beside it some rows of that batch finished after the sync (min 0, max 1). The guarantee is
    # that step 2 holds stale rows and step 1 none.
    assert float(steps[1]["training/off_policy/trajectory_staleness_worst/max"]) == 0
    assert float(steps[2]["training/off_policy/trajectory_staleness_worst/max"]) >= 1
    # the stale rows were sampled by other weights than the actor now scores them with: the
    # rollout/actor probability gap grows beyond the fresh step's float noise
    on_policy_gap = float(steps[1]["training/rollout_probs_diff_max"])
    stale_gap = float(steps[2]["training/rollout_probs_diff_max"])
    assert stale_gap > on_policy_gap, (on_policy_gap, stale_gap)
    assert not run.exposed_listeners()
