"""The update-scaled step reaches only the actor's optimizer, restores its lr at once, and weighs
each micro-batch's ``1/Z`` as the loss weighs the micro-batch.

SGD with lr 1 and gradient 1 moves a weight by exactly ``-lr * s`` (every factor here is a dyadic
fraction, so float32 holds each product exactly): the tests compare with ``==``.
"""

from __future__ import annotations

import gc

import pytest
import torch
import verl  # noqa: F401 - loads the sorl_verl plugin, as in every verl process
from verl.workers.config import ActorConfig

from sorl_verl.algorithms import optim
from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.losses import compute_policy_loss_so_grpo


@pytest.fixture(autouse=True)
def empty_ledger():
    optim.LEDGER.clear()
    yield
    optim.LEDGER.clear()


def weight(value: float = 0.0) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full((1,), value))


def sgd_step(opt: torch.optim.Optimizer, w: torch.nn.Parameter, closure=None) -> float:
    """Gradient 1 on ``w``, one step; returns the change of ``w``."""
    before = float(w)
    w.grad = torch.ones_like(w)
    opt.step(closure)
    return float(w) - before


def test_records_of_a_skipped_actor_step_never_reach_another_optimizer():
    """The actor's micro-batch publishes Z = 4, the actor's step is skipped, the critic (verl's
    stock SGD, lr 1, gradient 1) steps: it moves by 1, not 0.25."""
    actor = optim.AdamW([weight()], lr=1e-3)
    actor.zero_grad()
    optim.publish_normalizer(4.0, 0.0, 0.0, acts_on_update=True)
    critic_w = weight()
    critic = torch.optim.SGD([critic_w], lr=1.0)
    assert sgd_step(critic, critic_w) == -1.0
    assert critic.param_groups[0]["lr"] == 1.0
    del actor


def test_a_skipped_step_drops_its_records():
    """verl skips a non-finite step with ``zero_grad``: the next step does not inherit its Z."""
    w = weight()
    actor = optim.SGD([w], lr=1.0)
    actor.zero_grad()
    optim.publish_normalizer(4.0, 0.0, 0.0, acts_on_update=True)
    actor.zero_grad()  # the skip
    optim.publish_normalizer(1.0, 0.0, 0.0, acts_on_update=True)
    assert sgd_step(actor, w) == -1.0


def test_update_mode_without_an_update_scaled_optimizer_fails_naming_the_fixes():
    """Only the SORL optimizer scales the step: with verl's stock optimizer alone in the process the
    loss's first micro-batch fails naming optimizer_impl and clip_norm_apply=loss."""
    gc.collect()  # optimizers of earlier tests
    stock = torch.optim.AdamW([weight()], lr=1e-3)
    with pytest.raises(RuntimeError, match="optimizer_impl=sorl_verl.algorithms.optim.*clip_norm_apply=loss"):
        optim.publish_normalizer(4.0, 0.0, 0.0, acts_on_update=True)
    optim.publish_normalizer(1.0, 0.0, 0.0, acts_on_update=False)  # loss mode: nothing to hand over
    del stock


def test_a_stock_optimizer_whose_step_raises_keeps_its_lr():
    keep = optim.SGD([weight()], lr=1.0)  # an update-scaled optimizer alive in the process
    optim.publish_normalizer(4.0, 0.0, 0.0, acts_on_update=True)
    w = weight()
    stock = torch.optim.SGD([w], lr=1.0)

    def boom():
        raise ArithmeticError("step failed")

    with pytest.raises(ArithmeticError):
        sgd_step(stock, w, closure=boom)
    assert stock.param_groups[0]["lr"] == 1.0
    stock.param_groups[0]["lr"] = 0.5  # a scheduler's next value
    assert sgd_step(stock, w) == -0.5
    del keep


def test_the_lr_is_restored_when_the_step_raises():
    w = weight()
    opt = optim.SGD([w], lr=1.0)
    optim.publish_normalizer(4.0, 0.0, 0.0, acts_on_update=True)

    def boom():
        raise ArithmeticError("step failed")

    with pytest.raises(ArithmeticError):
        sgd_step(opt, w, closure=boom)
    assert opt.param_groups[0]["lr"] == 1.0


def test_an_lr_someone_else_set_during_the_step_is_kept():
    w = weight()
    opt = optim.SGD([w], lr=1.0)
    optim.publish_normalizer(4.0, 0.0, 0.0, acts_on_update=True)

    def scheduler_moves_lr():
        opt.param_groups[0]["lr"] = 0.5
        return None

    sgd_step(opt, w, closure=scheduler_moves_lr)
    assert opt.param_groups[0]["lr"] == 0.5


def test_the_step_factor_weighs_each_micro_batch_by_its_share_of_the_loss():
    """A 1-token micro-batch (share 1/8, Z = 1) and a 7-token one (share 7/8, Z = 4):
    s = 1/8 + 7/8 / 4 = 0.34375, not the unweighted (1 + 1/4) / 2 = 0.625."""
    w = weight()
    opt = optim.SGD([w], lr=1.0)
    optim.publish_normalizer(1.0, 0.0, 0.0, acts_on_update=True, share=0.125)
    optim.publish_normalizer(4.0, 0.0, 0.0, acts_on_update=True, share=0.875)
    assert sgd_step(opt, w) == -0.34375
    assert opt.last_update["scale"] == 0.34375


def test_micro_batches_without_tokens_leave_the_step_alone():
    w = weight()
    opt = optim.SGD([w], lr=1.0)
    optim.publish_normalizer(1.0, 0.0, 0.0, acts_on_update=True, share=0.0)
    assert sgd_step(opt, w) == -1.0


def actor_config(loss_agg_mode: str, global_batch_info: dict) -> ActorConfig:
    """A verl actor config with the SORL loss; the absolute reference at a small tau clips here."""
    policy_loss = SORLPolicyLossConfig(loss_mode="so_grpo", clip_norm_reference="absolute", clip_norm_tau=0.05)
    config = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=loss_agg_mode,
        policy_loss=policy_loss,
    )  # fmt: skip
    config.global_batch_info.update(global_batch_info)
    return config


@pytest.mark.parametrize(
    "loss_agg_mode,info,shares",
    [
        ("token-mean", {"dp_size": 1, "batch_num_tokens": 8}, [1 / 8, 7 / 8]),
        ("token-mean", {"dp_size": 2, "batch_num_tokens": 16}, [1 / 8, 7 / 8]),
        ("seq-mean-token-mean", {"dp_size": 1, "global_batch_size": 2}, [1 / 2, 1 / 2]),
    ],
)
def test_the_loss_publishes_its_micro_batchs_share_of_the_mini_batch_loss(loss_agg_mode, info, shares):
    """Uneven micro-batches (1 and 7 policy tokens) as dynamic batching makes them: each publishes
    what verl's agg_loss gives it of the mini-batch loss (token-mean: tokens / batch_num_tokens times
    dp_size, seq-mean: rows / global_batch_size times dp_size)."""
    keep = optim.SGD([weight()], lr=1.0)
    config = actor_config(loss_agg_mode, info)
    for tokens in (1, 7):
        mask = torch.zeros(1, 8, dtype=torch.bool)
        mask[0, :tokens] = True
        log_prob = torch.full((1, 8), -1.0, requires_grad=True)
        old = torch.full((1, 8), -1.5)
        compute_policy_loss_so_grpo(old, log_prob, torch.ones(1, 8), mask, loss_agg_mode, config)
    records = optim.LEDGER.take()
    assert records["share"] == pytest.approx(shares, rel=2**-23)
    del keep
