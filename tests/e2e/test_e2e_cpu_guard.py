"""The collapse guard in verl's ``main_ppo`` on CPU: a forced collapse is caught, the best checkpoint
comes back bit for bit, and the restore survives a kill and verl's resume.

One SO-PPO run with a critic and the KL loss (sync trainer, 24 greedy validation questions every 2
steps, verl's own checkpoint every 4 steps) at lr 1e-4 with ``sorl.fault_injection`` raising the
actor's learning rate 10^3-fold on steps 3 and 4 (lr 0.1: Adam's first steps at that size wreck the
tiny model). Validation at step 2 is the best and gets the guard's checkpoint; validation at step 4
falls below (1 - 0.3) x best, so with patience 1 the guard restores step 2 (actor weights, optimizer,
critic, data position), halves the learning rate and saves the restored state over verl's step-4
checkpoint. The run is SIGKILLed after step 5; verl's resume from step 4 trains steps 5-6 with the
guard's state read back from that checkpoint. The two launches are the session fixture
``guarded_so_ppo`` (tests/e2e/conftest.py), whose records tests/e2e/test_e2e_cpu_main_ppo.py also
reads for its step, resume, critic and KL-loss checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sorl_verl.trainer.guard_rule import GuardConfig, validation_score

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: a sync step rolls out with the weights the actor then scores: the rollout/actor probability gap is
#: float noise (~5e-6 in fp32, docs/cpu.md); a replica left with the collapsed weights differs by O(0.1)
ROLLOUT_AGREES = 1e-3


def shard(folder: Path, kind: str, role: str = "actor") -> dict:
    (path,) = (folder / role).glob(f"{kind}_world_size_1_rank_0.pt")
    return torch.load(path, map_location="cpu", weights_only=False)


def local(x):
    return x.to_local() if hasattr(x, "to_local") else x


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        if isinstance(a[key], dict):
            assert_same_tensors(a[key], b[key], f"{what}.{key}")
        elif torch.is_tensor(local(a[key])):
            assert torch.equal(local(a[key]), local(b[key])), f"{what}.{key} differs"


def test_guard_restores_best_checkpoint_and_survives_kill_and_resume(guarded_so_ppo, adam_step, fp32):
    run = guarded_so_ppo  # the scenario of the module docstring (tests/e2e/conftest.py runs it once)
    lr, fault, backoff = run.lr, run.fault, run.backoff
    steps = run.first.train_steps()
    assert sorted(steps)[:5] == [1, 2, 3, 4, 5], sorted(steps)
    pattern = GuardConfig().val_metric
    best = validation_score(steps[2], pattern)
    collapsed = validation_score(steps[4], pattern)
    assert best is not None and best > 0, f"the warm-started model must score at step 2: {best}"
    assert collapsed < (1 - 0.3) * best, f"lr x {fault} on steps 3-4 must collapse the score: {collapsed} vs {best}"

    assert steps[2]["sorl/guard/best_step"] == 2 and steps[2]["sorl/guard/restores"] == 0
    s4 = steps[4]
    assert s4["sorl/guard/collapse"] == 1 and s4["sorl/guard/reason"] == 1  # 1 = validation
    assert s4["sorl/guard/restores"] == 1 and s4["sorl/guard/lr_scale"] == backoff
    assert steps[5]["sorl/guard/collapse"] == 0 and steps[5]["sorl/guard/restores"] == 1
    # the replicas generate with the restored weights
    assert float(steps[5]["training/rollout_probs_diff_max"]) < ROLLOUT_AGREES

    ckpt = run.first_ckpt  # as the killed run left it (the resume checkpoints its step 6 into run.ckpt)
    best_dir = ckpt / "sorl_guard" / "best_step_2"
    restored = ckpt / "global_step_4"  # verl's own save at step 4, overwritten by the restored state
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    for kind in ("model", "optim"):
        assert_same_tensors(shard(best_dir, kind), shard(restored, kind), kind)
        assert_same_tensors(shard(ckpt / "global_step_2", kind), shard(best_dir, kind), kind)
        # the critic comes back with the actor (so_ppo)
        assert_same_tensors(shard(best_dir, kind, "critic"), shard(restored, kind, "critic"), f"critic {kind}")
        assert_same_tensors(shard(ckpt / "global_step_2", kind, "critic"), shard(best_dir, kind, "critic"), kind)
    # the data position came back with the weights: step 5 trains on the prompts of step 3
    first = run.first_prompts
    assert first[5] == first[3] and first[3] != first[4]
    state = json.loads((restored / "sorl_guard.json").read_text())
    assert (state["restores"], state["lr_scale"], state["best_step"]) == (1, backoff, 2)
    events = [json.loads(line) for line in (ckpt / "sorl_guard" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events] == [("new_best", 2), ("restore", 4)]

    again = run.resumed.train_steps()
    assert sorted(again) == [5, 6], "verl resumes from the restored checkpoint of step 4"
    for m in again.values():
        assert m["sorl/guard/restores"] == 1 and m["sorl/guard/lr_scale"] == backoff
        assert m["sorl/guard/collapse"] == 0
    assert validation_score(again[6], pattern) is not None
    # what training went on from: the final weights (the resumed run's checkpoint of step 6) are the
    # best checkpoint's plus steps 5 and 6 at the backed-off lr, each moving a weight by at most
    # adam_step(lr * backoff) (plus a float32 rounding of the weight): nothing of the collapsed steps'
    # lr x 10^3 updates survives (one of those moves a weight by up to 0.3)
    final_w, best_w = shard(run.ckpt / "global_step_6", "model"), shard(best_dir, "model")
    assert final_w.keys() == best_w.keys()
    step = adam_step(lr * backoff)
    excess = {}
    for key, w in final_w.items():
        w, b = local(w), local(best_w[key])
        allowed = 2 * (step + fp32.rounding(1.0, 1) * w.abs())
        excess[key] = float(((w - b).abs() / allowed).max())
    assert max(excess.values()) <= 1.0, sorted(excess.items(), key=lambda kv: -kv[1])[:3]
    assert any(not torch.equal(local(final_w[k]), local(best_w[k])) for k in final_w)  # steps 5-6 trained
    assert run.prompts(5) == run.prompts(3), "the resumed run starts from the restored data position too"

    # the learning rate of every optimizer step (the SORL optimizer's update log): lr, fault x 10^4 on
    # steps 3-4, then the backed-off lr after the restore, in the killed run and after the resume
    lrs = [json.loads(line)["lr"] for line in (run.ckpt / "sorl_updates.jsonl").read_text().splitlines()]
    assert lrs[:4] == pytest.approx([lr, lr, lr * fault, lr * fault], rel=1e-9)
    assert lrs[4:] == pytest.approx([lr * backoff] * len(lrs[4:]), rel=1e-9) and len(lrs) >= 6
