"""``sorl/turn_ratio_max`` / ``_min`` reach verl's logs as the max / min over every micro-batch and rank.

verl's actor loss (``verl.workers.utils.losses.ppo_loss``) wraps every policy-loss metric in a
``Metric`` with MEAN aggregation; the engine merges micro-batches (``append_to_dict``) and the
worker merges data-parallel ranks (``Metric.aggregate_dp``). The SORL trainers give the actor's loss
function MAX / MIN for the ratio extrema (:mod:`sorl_verl.trainer.metric_aggregation`); this test
runs that loss function through verl's own functions on micro-batches of different spreads and
compares with the true extremes of the turn ratios, computed here from the same data.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss

from sorl_verl.algorithms import optim
from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.turns import segment_runs
from sorl_verl.trainer.metric_aggregation import ExtremaAggregatingLoss, install_extrema_aggregation

PROMPT = 2


def micro_batch(seed: int, spread: float, rows: int = 3, length: int = 10):
    """(flat log-probs as the engine hands them, verl's TensorDict, padded new log-probs, mask)."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, length, generator=gen) < 0.7
    mask[:, 0] = True
    old = -torch.rand(rows, length, generator=gen) * 2
    new = old + spread * torch.randn(rows, length, generator=gen)
    adv = torch.randn(rows, 1, generator=gen).expand(-1, length).contiguous()
    flat = torch.cat([torch.cat([torch.zeros(PROMPT - 1), new[b], torch.zeros(1)]) for b in range(rows)])
    data = TensorDict(
        {
            "prompts": torch.ones(rows, PROMPT, dtype=torch.long),
            "responses": torch.ones(rows, length, dtype=torch.long),
            "attention_mask": torch.ones(rows, PROMPT + length, dtype=torch.long),
            "response_mask": mask.long(),
            "old_log_probs": old,
            "advantages": adv,
        },
        batch_size=[rows],
    )
    for key, value in {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None}.items():
        tu.assign_non_tensor_data(data, key, value)
    return flat.requires_grad_(), data, new, mask, old


def true_turn_ratios(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Every turn's ratio, exp(mean over the turn of log_prob - old_log_prob), computed here."""
    runs = segment_runs(mask)
    out = []
    for b in range(mask.shape[0]):
        ids = torch.cumsum((mask[b] & ~torch.cat([torch.tensor([False]), mask[b, :-1]])).long(), 0) * mask[b]
        for k in range(1, int(ids.max()) + 1):
            d = (new[b] - old[b]).double()[ids == k]
            out.append(torch.exp(d.clamp(-20, 20).mean()))
    assert len(out) == int(runs.num_turns)
    return torch.stack(out)


def actor_config() -> ActorConfig:
    policy_loss = SORLPolicyLossConfig(loss_mode="so_grpo", clip_norm_apply="loss")
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=3, policy_loss=policy_loss)


def verl_reduction(loss_fn, ranks: list[list[tuple]]) -> dict:
    """What verl's engine and worker make of the loss function's metrics: micro-batches merged by
    ``append_to_dict`` on each rank, ranks merged by ``Metric.aggregate_dp``."""
    per_rank = []
    for micro_batches in ranks:
        merged: dict = {}
        for flat, data, *_ in micro_batches:
            _, metrics = loss_fn(model_output={"log_probs": flat}, data=data)
            append_to_dict(merged, metrics)
        per_rank.append(merged)
    keys = [f"sorl/turn_ratio_{name}" for name in ("max", "min", "mean")]
    return {key: Metric.aggregate_dp([r[key] for r in per_rank]) for key in keys}


def test_ratio_extrema_are_the_max_and_min_over_micro_batches_and_ranks():
    ranks = [[micro_batch(1, 0.05), micro_batch(2, 0.6)], [micro_batch(3, 0.1), micro_batch(4, 0.02)]]
    ratios = torch.cat([true_turn_ratios(new, old, mask) for rank in ranks for _, _, new, mask, old in rank])
    stock = partial(ppo_loss, config=actor_config())  # what verl's actor worker builds
    reduced = verl_reduction(ExtremaAggregatingLoss(stock), ranks)
    # the loss averages a turn's float32 log-ratios: |error of l| <= length * eps32 * max|d|, and
    # r = exp(l) carries it as a relative error
    max_d = max(float((new - old).abs().max()) for rank in ranks for _, _, new, _, old in rank)
    rel = ranks[0][0][2].shape[-1] * torch.finfo(torch.float32).eps * max_d
    assert reduced["sorl/turn_ratio_max"] == pytest.approx(float(ratios.max()), rel=rel)
    assert reduced["sorl/turn_ratio_min"] == pytest.approx(float(ratios.min()), rel=rel)
    assert reduced["sorl/turn_ratio_mean"] == verl_reduction(stock, ranks)["sorl/turn_ratio_mean"]  # MEAN as before
    # verl's MEAN of per-micro-batch extremes, what the loss's metrics alone give, is not the max
    assert verl_reduction(stock, ranks)["sorl/turn_ratio_max"] < float(ratios.max()) * (1 - 100 * rel)


class StandInRole:
    """Stand-in for a verl actor role inside a Ray worker: ``actor`` is verl's TrainingWorker, whose
    ``set_loss_fn`` the engine's ``train_batch`` reads back as ``loss_fn``."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn = loss_fn
        self.actor = type("StandInTrainingWorker", (), {"loss_fn": loss_fn})()
        self.actor.set_loss_fn = lambda fn: setattr(self.actor, "loss_fn", fn)


def test_installation_in_a_worker_wraps_the_actor_loss_once_and_keeps_its_config():
    config = actor_config()
    role = StandInRole(partial(ppo_loss, config=config))
    worker = type("StandInWorker", (), {"worker_dict": {"actor_rollout": role}})()
    assert install_extrema_aggregation(worker) == 1
    assert isinstance(role.actor.loss_fn, ExtremaAggregatingLoss)
    assert role.actor.loss_fn.keywords["config"] is config  # the guard finds the loss config through it
    assert install_extrema_aggregation(worker) == 0  # a second call (a restore) does not wrap twice
    assert not isinstance(role.actor.loss_fn.loss_fn, ExtremaAggregatingLoss)


@pytest.fixture(autouse=True)
def empty_ledger():
    optim.LEDGER.clear()
    yield
    optim.LEDGER.clear()
