"""What the collapse guard does inside a worker and on disk: the learning-rate scale under verl's LR
schedules (absolute, kept by later scheduler steps, not compounded by a reload), the loss's
clip_norm_tau, the hard-linked best snapshot, and the start-up checks against the trainer config."""

from __future__ import annotations

import functools
import types

import pytest
import torch
from omegaconf import OmegaConf
from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from sorl_verl.trainer.guard import check_guard_against_trainer, link_tree, unshare_tree
from sorl_verl.trainer.guard_rule import GuardConfig
from sorl_verl.trainer.guard_worker import actor_lr_scale, scale_learning_rate, set_clip_norm_tau

LR = 1e-3
SCHEDULES = {
    "constant": lambda opt: get_constant_schedule_with_warmup(opt, num_warmup_steps=3),
    "cosine": lambda opt: get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=20),
}


def make(schedule: str) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": LR / 2}], lr=LR)
    return opt, SCHEDULES[schedule](opt)


def lrs_over(opt, sched, steps: int) -> list[list[float]]:
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("scale", [0.5, 0.125, 1000.0])
def test_scale_is_absolute_and_kept_by_the_schedule(schedule, scale):
    reference_opt, reference_sched = make(schedule)
    reference = lrs_over(reference_opt, reference_sched, 10)
    opt, sched = make(schedule)
    lrs_over(opt, sched, 4)
    scale_learning_rate(opt, sched, scale)
    scale_learning_rate(opt, sched, scale)  # twice: the same, never compounded
    scaled = lrs_over(opt, sched, 6)
    for got, want in zip(scaled, reference[4:], strict=True):
        assert got == pytest.approx([scale * w for w in want], rel=1e-12)
    # back to 1 after the same 10 steps: the schedule's own values again
    scale_learning_rate(opt, sched, 1.0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([g["lr"] for g in reference_opt.param_groups])


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_reload_of_a_scaled_checkpoint_then_rescale_does_not_compound(schedule):
    opt, sched = make(schedule)
    lrs_over(opt, sched, 3)
    scale_learning_rate(opt, sched, 0.5)
    saved_opt, saved_sched = opt.state_dict(), sched.state_dict()  # a checkpoint taken with the scale on
    fresh_opt, fresh_sched = make(schedule)
    fresh_opt.load_state_dict(saved_opt)
    fresh_sched.load_state_dict(saved_sched)
    scale_learning_rate(fresh_opt, fresh_sched, 0.25)
    reference_opt, reference_sched = make(schedule)
    unscaled = lrs_over(reference_opt, reference_sched, 6)
    got = lrs_over(fresh_opt, fresh_sched, 3)
    for g, want in zip(got, unscaled[3:], strict=True):
        assert g == pytest.approx([0.25 * w for w in want], rel=1e-12)


def test_without_scheduler_and_unsupported_scheduler():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert scale_learning_rate(opt, None, 0.5) == [pytest.approx(0.05)]
    assert scale_learning_rate(opt, None, 0.5) == [pytest.approx(0.05)]
    with pytest.raises(NotImplementedError, match="backoff_target=clip_norm_tau"):
        scale_learning_rate(opt, types.SimpleNamespace(), 0.5)
    # scale 1 on a scheduler that is not torch's (the guard's call at every load with
    # backoff_target=clip_norm_tau): nothing to scale, the lrs and the scheduler stay as they are
    megatron_like = types.SimpleNamespace(max_lr=0.2, min_lr=0.0, num_steps=7)
    before = [dict(g) for g in opt.param_groups]
    assert scale_learning_rate(opt, megatron_like, 1.0) == [g["lr"] for g in before]
    assert [dict(g) for g in opt.param_groups] == before
    assert vars(megatron_like) == {"max_lr": 0.2, "min_lr": 0.0, "num_steps": 7}
    with pytest.raises(ValueError, match="> 0"):
        scale_learning_rate(opt, None, 0.0)


def test_worker_targets_find_the_actor_engine_and_the_loss_config():
    opt, sched = make("constant")
    policy_loss = types.SimpleNamespace(clip_norm_tau=0.2)
    role = types.SimpleNamespace(
        actor=types.SimpleNamespace(engine=types.SimpleNamespace(optimizer=opt, lr_scheduler=sched)),
        loss_fn=functools.partial(print, config=types.SimpleNamespace(policy_loss=policy_loss)),
    )
    worker = types.SimpleNamespace(worker_dict={"actor_rollout": role, "critic": types.SimpleNamespace()})
    expected = [0.5 * g["lr"] for g in opt.param_groups]
    assert actor_lr_scale(worker, 0.5) == pytest.approx(expected)
    assert set_clip_norm_tau(worker, 0.05) == [0.05] and policy_loss.clip_norm_tau == 0.05
    for bad in (0.0, -0.1, float("nan")):  # the knobs' own validation, before any config changes
        with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.policy_loss\.clip_norm_tau=.* > 0"):
            set_clip_norm_tau(worker, bad)
        assert policy_loss.clip_norm_tau == 0.05


def test_snapshot_survives_rotation_and_rewrite(tmp_path):
    step = tmp_path / "global_step_2" / "actor"
    step.mkdir(parents=True)
    torch.save({"w": torch.arange(4.0)}, step / "model.pt")
    link_tree(step, tmp_path / "best" / "actor")
    unshare_tree(step.parent)  # what the guard does before verl writes into a folder again
    torch.save({"w": torch.zeros(4)}, step / "model.pt")
    assert torch.equal(torch.load(tmp_path / "best" / "actor" / "model.pt")["w"], torch.arange(4.0))
    link_tree(step, tmp_path / "best2" / "actor")
    (step / "model.pt").unlink()  # verl's max_ckpt_to_keep rotation
    assert torch.equal(torch.load(tmp_path / "best2" / "actor" / "model.pt")["w"], torch.zeros(4))


def trainer_config(**over):
    base = {
        "trainer": {"test_freq": 5},
        "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "so_grpo", "clip_norm_mode": "max"}}},
    }
    config = OmegaConf.create(base)
    for key, value in over.items():
        OmegaConf.update(config, key, value)
    return config


def test_start_up_checks_name_the_knob():
    on = GuardConfig(enable=True)
    check_guard_against_trainer(trainer_config(), on)
    check_guard_against_trainer(trainer_config(**{"trainer.test_freq": -1}), GuardConfig())  # off: no check
    with pytest.raises(ValueError, match=r"trainer\.test_freq=-1"):
        check_guard_against_trainer(trainer_config(**{"trainer.test_freq": -1}), on)
    tau = GuardConfig(enable=True, backoff_target="clip_norm_tau")
    check_guard_against_trainer(trainer_config(), tau)
    for key, value in (("loss_mode", "vanilla"), ("clip_norm_mode", "none")):
        bad = trainer_config(**{f"actor_rollout_ref.actor.policy_loss.{key}": value})
        with pytest.raises(ValueError, match=r"sorl\.guard\.backoff_target=clip_norm_tau"):
            check_guard_against_trainer(bad, tau)


def test_unit_scale_leaves_the_schedule_bit_for_bit():
    opt, sched = make("cosine")
    reference_opt, reference_sched = make("cosine")
    lrs_over(opt, sched, 3)
    scale_learning_rate(opt, sched, 1.0)
    assert lrs_over(opt, sched, 5) == lrs_over(reference_opt, reference_sched, 8)[3:]
