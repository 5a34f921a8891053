"""The SORL losses called by verl's own actor loss, ``verl.workers.utils.losses.ppo_loss``."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss

from sorl_verl.algorithms import optim
from sorl_verl.algorithms.config import SORLPolicyLossConfig

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PROMPT = 4


def micro_batch(seed: int, rows: int = 4, length: int = 16, spread: float = 0.5, nan_outside: bool = False):
    """A right-padded micro-batch in verl's layout: flat model log-probs (prompt + response,
    shifted by one as verl's no_padding_2_padding expects) and a TensorDict with the rest.
    Returns (flat_log_probs, data, padded response log-probs, mask)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=gen)
    positions = torch.arange(length)
    valid = positions[None] < lengths[:, None]
    mask = valid & (torch.rand(rows, length, generator=gen) < 0.7)  # ragged turns inside the response
    mask[-1] = False  # a row where the policy generated nothing
    old = -torch.rand(rows, length, generator=gen) * 2
    new = old + spread * torch.randn(rows, length, generator=gen)
    adv = torch.randn(rows, 1, generator=gen).expand(-1, length).contiguous()
    if nan_outside:
        old = torch.where(mask, old, torch.tensor(float("nan")))
        adv = torch.where(mask, adv, torch.tensor(float("nan")))
    pieces = []
    for b in range(rows):
        pieces += [torch.zeros(PROMPT - 1), new[b, : lengths[b]], torch.zeros(1)]
    flat = torch.cat(pieces)
    attention = torch.cat([torch.ones(rows, PROMPT, dtype=torch.long), valid.long()], dim=1)
    data = TensorDict(
        {
            "prompts": torch.ones(rows, PROMPT, dtype=torch.long),
            "responses": torch.ones(rows, length, dtype=torch.long),
            "attention_mask": attention,
            "response_mask": mask.long(),
            "old_log_probs": old,
            "advantages": adv,
        },
        batch_size=[rows],
    )
    return flat, data, torch.where(valid, new, torch.zeros(())), mask


def set_global_info(data: TensorDict, batch_num_tokens: int, global_batch_size: int) -> None:
    tu.assign_non_tensor_data(data, "dp_size", 1)
    tu.assign_non_tensor_data(data, "batch_num_tokens", batch_num_tokens)
    tu.assign_non_tensor_data(data, "global_batch_size", global_batch_size)


@pytest.fixture(autouse=True)
def sorl_optimizer():
    """The update-scaled optimizer verl's actor worker builds (optimizer_impl=sorl_verl.algorithms.optim)."""
    opt = optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    optim.LEDGER.clear()
    yield opt
    optim.LEDGER.clear()


def actor(loss_mode: str, loss_agg_mode: str, **knobs) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=4,
        loss_agg_mode=loss_agg_mode,
        policy_loss=SORLPolicyLossConfig(loss_mode=loss_mode, **knobs),
    )


@pytest.mark.parametrize("loss_agg_mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", ["turn_ppo", "s_ppo", "so_ppo", "so_grpo"])
def test_through_verl_ppo_loss(loss_mode, loss_agg_mode):
    flat, data, _, mask = micro_batch(seed=1, nan_outside=True)
    set_global_info(data, int(mask.sum()), int(mask.any(-1).sum()))
    flat.requires_grad_(True)
    loss, metrics = ppo_loss(actor(loss_mode, loss_agg_mode), {"log_probs": flat}, data)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(flat.grad).all() and flat.grad.abs().sum() > 0
    values = {k: v.aggregate() for k, v in metrics.items()}
    unit = "token" if loss_mode == "s_ppo" else "turn"
    for key in (f"{unit}_ratio_mean", f"{unit}_ratio_max", f"{unit}_ratio_min", f"{unit}_clipfrac", "clip_bias_norm"):
        assert math.isfinite(values[f"sorl/{key}"])
    assert values["sorl/norm_factor"] >= 1.0 and values["sorl/num_turns_mean"] > 1.0
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/pg_loss"} <= set(values)


@pytest.mark.parametrize("loss_agg_mode", AGG_MODES)
def test_ppo_loss_matches_direct_call_with_global_batch_info(loss_agg_mode):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    flat, data, padded, mask = micro_batch(seed=2, spread=1.0)
    set_global_info(data, 100, 10)  # a micro-batch of a larger mini-batch
    config = actor("so_grpo", loss_agg_mode, clip_norm_tau=0.5, clip_norm_apply="loss")
    via_verl, _ = ppo_loss(config, {"log_probs": flat}, data)
    direct, metrics = get_policy_loss_fn("so_grpo")(
        data["old_log_probs"], padded, data["advantages"], mask, loss_agg_mode, config, None
    )
    assert metrics["sorl/triggered"] == 1.0
    torch.testing.assert_close(via_verl, direct)


def test_triggered_is_the_fraction_of_micro_batches_after_verl_aggregation():
    config = actor("so_grpo", "token-mean")
    collected: dict[str, Metric] = {}
    for seed, spread in ((3, 0.0), (4, 2.0)):  # on-policy micro-batch, then a heavily clipped one
        flat, data, _, mask = micro_batch(seed=seed, spread=spread)
        set_global_info(data, 200, 8)
        _, metrics = ppo_loss(config, {"log_probs": flat}, data)
        for key, metric in metrics.items():
            collected.setdefault(key, metric.init_list()).extend(metric)
    assert collected["sorl/triggered"].aggregate() == pytest.approx(0.5)
    assert collected["sorl/norm_factor"].aggregate() > 1.0
