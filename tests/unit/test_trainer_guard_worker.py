"""What the collapse guard does inside a worker and on disk: the learning-rate scale under verl's LR
schedules (absolute, kept by later scheduler steps, not compounded by a reload), the loss's
clip_norm_tau, the hard-linked best snapshot, and the start-up checks against the trainer config."""

from __future__ import annotations

import functools
import shutil
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


@pytest.mark.parametrize("rule", ["stderr", "drop"])  # the default (natural.yaml question 5) and the studies'
def test_start_up_checks_name_the_knob(rule):
    on = GuardConfig(enable=True, rule=rule)
    check_guard_against_trainer(trainer_config(), on)
    check_guard_against_trainer(trainer_config(**{"trainer.test_freq": -1}), GuardConfig())  # off: no check
    with pytest.raises(ValueError, match=r"trainer\.test_freq=-1"):
        check_guard_against_trainer(trainer_config(**{"trainer.test_freq": -1}), on)
    tau = GuardConfig(enable=True, rule=rule, backoff_target="clip_norm_tau")
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


# ---------------------------------------------------------------- issue 46: refusals, the tau setter on verl's loss


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("actor_rollout_ref.actor.checkpoint.async_save", True, r"actor_rollout_ref\.actor\.checkpoint\.async_save"),
        ("actor_rollout_ref.actor.checkpoint.save_contents", ["model"], r"actor\.checkpoint\.save_contents.*optimizer"),
        ("actor_rollout_ref.actor.checkpoint.load_contents", ["model", "optimizer"], r"load_contents.*'extra'"),
        ("critic.checkpoint.save_contents", ["model", "extra"], r"critic\.checkpoint\.save_contents.*optimizer"),
        ("trainer.nnodes", 2, r"trainer\.nnodes=2.*sorl\.guard\.shared_storage=true"),
    ],
)
def test_start_up_refuses_what_a_restore_cannot_use(key, value, named):
    config = trainer_config(**{"critic.enable": True, key: value})
    for rule in ("stderr", "drop"):
        with pytest.raises(ValueError, match=named):
            check_guard_against_trainer(config, GuardConfig(enable=True, rule=rule))
    check_guard_against_trainer(config, GuardConfig())  # off: no check


@pytest.mark.parametrize(
    "val_metric",
    ["val-core/*/reward/mean@*", "val-core/*/acc/mean@*", "val-core/nq/acc/mean@1", "val-aux/openai/gsm8k/reward/mean@1",
     "val-core/*", "val-*/nq/reward/mean@4"],
)  # fmt: skip
def test_stderr_takes_a_val_metric_that_can_name_a_source_and_variable(val_metric):
    check_guard_against_trainer(trainer_config(), GuardConfig(enable=True, val_metric=val_metric))


@pytest.mark.parametrize("val_metric", ["val-core/nq/reward", "actor/entropy", "val-aux/num_turns/mean", "score"])
def test_stderr_refuses_at_start_up_a_val_metric_without_question_records(val_metric):
    """An exact name that is no val-core/<source>/<var>/<stat> can never have the trainers' records: refused
    before any worker starts, naming rule drop; drop takes it (its score is any metric's mean)."""
    named = rf"sorl\.guard\.rule=stderr .*val_metric='{val_metric}'.*sorl\.guard\.rule=drop"
    with pytest.raises(ValueError, match=named):
        check_guard_against_trainer(trainer_config(), GuardConfig(enable=True, val_metric=val_metric))
    check_guard_against_trainer(trainer_config(), GuardConfig(enable=True, val_metric=val_metric, rule="drop"))


def test_several_nodes_with_storage_declared_shared_start():
    config = trainer_config(**{"trainer.nnodes": 4, "trainer.default_local_dir": "/shared/ckpt"})
    check_guard_against_trainer(config, GuardConfig(enable=True, shared_storage=True))
    verl_defaults = {"async_save": False, "save_contents": ["model", "optimizer", "extra"]}
    check_guard_against_trainer(
        trainer_config(**{"actor_rollout_ref.actor.checkpoint": verl_defaults}), GuardConfig(enable=True)
    )


def test_clip_norm_tau_is_set_in_verls_actor_loss_and_refused_where_it_has_none():
    from verl.workers.config import ActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    from sorl_verl.algorithms.config import SORLPolicyLossConfig

    def worker(policy_loss):
        actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=4, policy_loss=policy_loss)
        role = types.SimpleNamespace(loss_fn=functools.partial(ppo_loss, config=actor))  # as verl's actor worker
        return types.SimpleNamespace(worker_dict={"actor_rollout": role}), actor

    sorl, actor = worker(SORLPolicyLossConfig(loss_mode="so_grpo", clip_norm_tau=0.2))
    assert set_clip_norm_tau(sorl, 0.05) == [0.05] and actor.policy_loss.clip_norm_tau == 0.05
    vanilla, _ = worker(PolicyLossConfig(loss_mode="vanilla"))
    with pytest.raises(TypeError, match=r"clip_norm_tau.*PolicyLossConfig.*loss_mode=vanilla"):
        set_clip_norm_tau(vanilla, 0.05)


@pytest.mark.parametrize(("keep", "latest_survives"), [(2, False), (3, True)])
def test_rotation_bound_keeps_the_latest_through_a_restore_on_a_saved_step(tmp_path, keep, latest_survives):
    """verl's own rotation (``BaseCheckpointManager.ensure_checkpoint_capacity`` before a save,
    ``register_checkpoint`` after it) on the guard's sequence: verl saves step 100, the guard restores
    at step 100 and saves it again, then verl saves step 150. The recipes' bound (3) must leave step
    100, the latest, on disk while step 150 is written."""
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    from sorl_verl.cli.recipe_plan import GUARD_CKPT_TO_KEEP

    manager = types.SimpleNamespace(previous_saved_paths=[])
    manager.remove_previous_save_local_path = lambda paths: [shutil.rmtree(p, ignore_errors=True) for p in paths]

    def save(step, check=None):
        path = str(tmp_path / f"global_step_{step}" / "actor")
        BaseCheckpointManager.ensure_checkpoint_capacity(manager, keep)
        if check:
            check()
        (tmp_path / f"global_step_{step}" / "actor").mkdir(parents=True, exist_ok=True)
        BaseCheckpointManager.register_checkpoint(manager, path, keep)

    for step in (50, 100, 100):  # verl's save of 100, then the guard's restore point at 100
        save(step)
    seen = {}
    save(150, check=lambda: seen.setdefault("latest", (tmp_path / "global_step_100" / "actor").is_dir()))
    assert seen["latest"] is latest_survives
    assert GUARD_CKPT_TO_KEEP == 3
