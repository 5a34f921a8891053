"""Effective sample size of the importance weights (sorl_verl/algorithms/ess.py) and its logging by
every registered policy loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig

from sorl_verl.algorithms import losses
from sorl_verl.algorithms.clip_bias_grad import DIAGNOSTIC
from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.ess import ESS_TOKEN, ESS_TURN, effective_sample_size, ess_metrics
from sorl_verl.algorithms.losses import POLICY_LOSSES
from sorl_verl.algorithms.turns import segment_runs

LN = math.log


#: the update-scaled optimizer of verl's actor worker, ledger emptied (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("sorl_optimizer")


def test_exact_value_on_hand_built_weights():
    # w = 1, 2, 3 (the NaN is not valid): (1 + 2 + 3)^2 / (3 (1 + 4 + 9)) = 36 / 42
    log_w = torch.tensor([0.0, LN(2), LN(3), float("nan")], dtype=torch.float64)
    valid = torch.tensor([True, True, True, False])
    assert effective_sample_size(log_w, valid).item() == pytest.approx(6 / 7, rel=1e-15)
    # one weight holds (nearly) all the mass: 1/n
    assert effective_sample_size(torch.tensor([0.0, -50.0, -50.0, -50.0]), torch.ones(4, dtype=torch.bool)).item() == (
        pytest.approx(0.25, rel=1e-12)
    )


def test_token_and_turn_ess_on_a_hand_built_micro_batch():
    # row 0: turn 1 = tokens 0, 1 (w 2, 8: turn ratio sqrt(16) = 4), an observation, turn 2 = token 3 (w 1);
    # row 1: one turn of one token (w 2), then padding
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.bool)
    log_ratio = torch.tensor([[LN(2), LN(8), 0.0, 0.0], [LN(2), 0.0, 0.0, 0.0]], dtype=torch.float64)
    got = ess_metrics(log_ratio, mask, segment_runs(mask))
    assert got[ESS_TOKEN].item() == pytest.approx(13**2 / (4 * (4 + 64 + 1 + 4)), rel=1e-12)  # 169 / 292
    assert got[ESS_TURN].item() == pytest.approx((4 + 1 + 2) ** 2 / (3 * (16 + 1 + 4)), rel=1e-12)  # 7 / 9
    assert got[ESS_TOKEN].dtype == got[ESS_TURN].dtype == torch.float64


def test_on_policy_is_exactly_one_and_an_empty_micro_batch_is_one():
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    got = ess_metrics(torch.zeros(mask.shape), mask, segment_runs(mask))
    assert got[ESS_TOKEN].item() == 1.0 and got[ESS_TURN].item() == 1.0
    empty = torch.zeros(2, 3, dtype=torch.bool)
    got = ess_metrics(torch.zeros(empty.shape), empty, segment_runs(empty))
    assert got[ESS_TOKEN].item() == 1.0 and got[ESS_TURN].item() == 1.0
    none = torch.zeros(0, 0, dtype=torch.bool)
    assert ess_metrics(torch.zeros(0, 0), none, segment_runs(none))[ESS_TURN].item() == 1.0


log_weights = st.lists(st.floats(-30.0, 30.0, allow_nan=False), min_size=1, max_size=40)


@given(log_weights)
def test_ess_lies_between_one_over_n_and_one(values):
    ess = effective_sample_size(torch.tensor(values, dtype=torch.float64), torch.ones(len(values), dtype=torch.bool))
    assert 1.0 / len(values) <= ess.item() <= 1.0


@given(log_weights, st.floats(-30.0, 30.0, allow_nan=False))
def test_ess_does_not_change_when_every_weight_is_scaled_by_a_constant(values, log_c):
    valid = torch.ones(len(values), dtype=torch.bool)
    log_w = torch.tensor(values, dtype=torch.float64)
    assert effective_sample_size(log_w + log_c, valid).item() == pytest.approx(
        effective_sample_size(log_w, valid).item(), rel=1e-9
    )


@given(log_weights)
@settings(max_examples=50)
def test_ess_matches_the_plain_formula_where_it_does_not_overflow(values):
    w = [math.exp(v) for v in values]
    want = sum(w) ** 2 / (len(w) * sum(x * x for x in w))
    got = effective_sample_size(torch.tensor(values, dtype=torch.float64), torch.ones(len(values), dtype=torch.bool))
    assert got.item() == pytest.approx(min(max(want, 1 / len(w)), 1.0), rel=1e-9)


def test_the_metric_is_detached():
    log_w = torch.tensor([0.1, -0.3, 0.7], requires_grad=True)
    ess = effective_sample_size(log_w, torch.ones(3, dtype=torch.bool))
    assert not ess.requires_grad and ess.grad_fn is None


def micro_batch(seed: int = 0, spread: float = 0.7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old, new, advantages, mask): several turns per row, off-policy enough that clipping happens."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(5, 24, generator=gen) < 0.6
    mask[-1] = False
    old = -torch.rand(mask.shape, generator=gen) * 3
    new = old + spread * torch.randn(mask.shape, generator=gen)
    adv = torch.randn(mask.shape, generator=gen)
    return old, new, adv, mask


def config(loss_mode: str) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        policy_loss=SORLPolicyLossConfig(loss_mode=loss_mode, clip_norm_apply="loss", clip_norm_tau=0.05),
    )  # fmt: skip


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_loss_and_gradient_are_bit_identical_with_and_without_the_metric(name, monkeypatch):
    """The ESS computation is replaced by nothing: loss and gradient do not move by one bit."""
    old, new, adv, mask = micro_batch()
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(3)) + 0.5
    runs = []
    for stub in (False, True):
        if stub:
            monkeypatch.setattr(losses, "ess_metrics", lambda *a, **k: {})
        DIAGNOSTIC.due = True
        log_prob = new.clone().requires_grad_(True)
        loss, metrics = get_policy_loss_fn(name)(old, log_prob, adv, mask, "token-mean", config(name), weights)
        (grad,) = torch.autograd.grad(loss, log_prob)
        runs.append((loss.detach(), grad, metrics))
    (loss_with, grad_with, metrics_with), (loss_without, grad_without, metrics_without) = runs
    assert torch.equal(loss_with, loss_without) and torch.equal(grad_with, grad_without)
    assert {ESS_TOKEN, ESS_TURN} <= set(metrics_with) and not {ESS_TOKEN, ESS_TURN} & set(metrics_without)
    assert metrics_with["sorl/clip_bias_grad_norm"] == metrics_without["sorl/clip_bias_grad_norm"]


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_every_loss_logs_the_same_ess_of_its_weights(name):
    old, new, adv, mask = micro_batch(seed=4)
    DIAGNOSTIC.due = False
    _, metrics = get_policy_loss_fn(name)(old, new.clone().requires_grad_(True), adv, mask, "token-mean", config(name))
    log_ratio = torch.where(mask, new.double() - old.double(), 0.0)
    want = ess_metrics(log_ratio, mask, segment_runs(mask))
    assert 0.0 < metrics[ESS_TOKEN] < 1.0 and 0.0 < metrics[ESS_TURN] < 1.0
    assert metrics[ESS_TOKEN] == pytest.approx(want[ESS_TOKEN].item(), rel=1e-6)
    assert metrics[ESS_TURN] == pytest.approx(want[ESS_TURN].item(), rel=1e-6)
    _, on_policy = get_policy_loss_fn(name)(
        old, old.clone().requires_grad_(True), adv, mask, "token-mean", config(name)
    )
    assert on_policy[ESS_TOKEN] == 1.0 and on_policy[ESS_TURN] == 1.0
