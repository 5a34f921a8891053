"""verl's asynchronous trainer on CPU through the SORL trainer, with SO-PPO and its critic:
``sorl_colocate_async`` with two batches generated ahead, so step 2 trains on episodes sampled (at
least partly) by the weights of step 0: verl's own staleness metrics and the rollout/actor
probability gap must show it, and the critic's values reach the turn-level GAE in both steps.

Measured here at lr 1e-3 with SO-GRPO (three runs): step 1 staleness 0, rollout/actor gap ~1.9e-6;
step 2 gap 5.2e-5 to 9.8e-2, staleness 1 on every row on an idle machine, 0-1 under load (some rows
finished after the sync). The float32 bound on that gap for a fresh step is ~0.1 (tests/e2e/
conftest.py, LogprobNoise), so the step here is at lr 1e-2: one Adam step moves every weight by
about 1e-2, and the stale rows' gap must clear the bound by a factor."""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SO_PPO = [
    "algorithm.adv_estimator=so_ppo",
    "actor_rollout_ref.actor.policy_loss.loss_mode=so_ppo",
    "critic.enable=True",
]
LR = 1e-2
#: how many times the fresh step's float32 bound a stale step's rollout/actor gap must exceed
MARGIN = 3.0
#: verl's keys: rollout runs num_warmup_batches batches ahead of the trainer
COLOCATE_ASYNC = [
    "trainer.v1.trainer_mode=sorl_colocate_async",
    "trainer.v1.colocate_async.num_warmup_batches=2",
    "trainer.v1.sampler.max_off_policy_threshold=4",
    f"actor_rollout_ref.actor.optim.lr={LR}",  # a step that moves the policy beyond float noise
    "trainer.total_training_steps=2",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
]


def test_colocate_async_so_ppo_trains_on_stale_episodes(tmp_path, main_ppo, logprob_noise):
    run = main_ppo(tmp_path, SO_PPO, COLOCATE_ASYNC)
    steps = run.train_steps()
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/sorl/norm_factor", "critic/vf_loss"):
            assert math.isfinite(float(m[key])), (key, m[key])
        # so_ppo's turn-level GAE: A_k = (sum of rewards) - V_k varies across turns only because the
        # critic's values reached it (the estimator raises when none do)
        assert float(m["critic/advantages/max"]) > float(m["critic/advantages/min"])
    # step 1 trains on episodes of weights v0 (fresh); step 2 on the second batch, sampled by v0
    # while step 1 trained. How many of its rows finish before the weights move is a race: on an
    # idle machine every row was one version behind (staleness min 1), with a second main_ppo
    # beside it some rows of that batch finished after the sync (min 0, max 1). The guarantee is
    # that step 2 holds stale rows and step 1 none.
    assert float(steps[1]["training/off_policy/trajectory_staleness_worst/max"]) == 0
    assert float(steps[2]["training/off_policy/trajectory_staleness_worst/max"]) >= 1
    # fresh, the rollout's and the actor's probabilities of a token are two float32 evaluations of the
    # initial weights; stale, the actor scores with weights one lr-1e-2 step away: the gap clears the
    # bound of a fresh step at those weights by MARGIN
    fresh_bound = logprob_noise.prob()
    moved_bound = logprob_noise.prob(drift=logprob_noise.adam_step(LR))
    on_policy_gap = float(steps[1]["training/rollout_probs_diff_max"])
    stale_gap = float(steps[2]["training/rollout_probs_diff_max"])
    assert on_policy_gap <= fresh_bound, (on_policy_gap, fresh_bound)
    assert stale_gap > MARGIN * moved_bound, (stale_gap, moved_bound)
    assert not run.exposed_listeners()
