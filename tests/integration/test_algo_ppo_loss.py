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
    return to_flat(new, data), data, torch.where(valid, new, torch.zeros(())), mask


def to_flat(padded: torch.Tensor, data: TensorDict) -> torch.Tensor:
    """A ``[rows, length]`` response tensor as the model's flat output over prompt + response, shifted by
    one (what verl's ``no_padding_2_padding`` reads back): per row ``PROMPT - 1`` zeros, the response, a zero."""
    pieces = []
    for b, n in enumerate(data["attention_mask"][:, PROMPT:].sum(-1).tolist()):
        pieces += [torch.zeros(PROMPT - 1), padded[b, :n], torch.zeros(1)]
    return torch.cat(pieces)


def set_global_info(data: TensorDict, batch_num_tokens: int, global_batch_size: int) -> None:
    tu.assign_non_tensor_data(data, "dp_size", 1)
    tu.assign_non_tensor_data(data, "batch_num_tokens", batch_num_tokens)
    tu.assign_non_tensor_data(data, "global_batch_size", global_batch_size)


#: the update-scaled optimizer of verl's actor worker, ledger emptied (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("sorl_optimizer")


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


ENTROPY_COEFF, KL_COEF, LR = 0.05, 0.1, 1.0


def sgd_step(apply: str, mode: str, entropy: bool, kl: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One step of the update-scaled SGD (no momentum: the change is ``-lr * s * grad``) on the loss verl's
    ``ppo_loss`` builds for a heavily clipped so_grpo micro-batch: its log-probs are the parameter ``theta``,
    with ``entropy`` its token entropies the parameter ``phi`` (``calculate_entropy``, ``entropy_coeff > 0``),
    with ``kl`` verl's KL loss to ``ref_log_prob``. Returns the changes of theta and phi, and ``Z``."""
    flat, data, _, mask = micro_batch(seed=5, spread=2.0)
    set_global_info(data, int(mask.sum()), len(mask))
    gen = torch.Generator().manual_seed(6)
    data["ref_log_prob"] = data["old_log_probs"] + 0.3 * torch.randn(data["old_log_probs"].shape, generator=gen)
    theta = torch.nn.Parameter(flat.clone())
    phi = torch.nn.Parameter(to_flat(2 * torch.rand(mask.shape, generator=gen), data))
    config = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=4, loss_agg_mode="token-mean",
        calculate_entropy=entropy, entropy_coeff=ENTROPY_COEFF if entropy else 0.0,
        use_kl_loss=kl, kl_loss_coef=KL_COEF, kl_loss_type="low_var_kl",
        policy_loss=SORLPolicyLossConfig(loss_mode="so_grpo", clip_norm_apply=apply, clip_norm_mode=mode),
    )  # fmt: skip
    opt = optim.SGD([theta, phi], lr=LR)
    opt.zero_grad()
    output = {"log_probs": theta * 1.0, **({"entropy": phi * 1.0} if entropy else {})}
    loss, metrics = ppo_loss(config, output, data)
    assert ("actor/entropy_loss" in metrics) == entropy and ("kl_loss" in metrics) == kl
    loss.backward()
    theta0, phi0 = theta.detach().clone(), phi.detach().clone()
    opt.step()
    return theta.detach() - theta0, phi.detach() - phi0, metrics["sorl/norm_factor"].aggregate()


def assert_scaled(changed: torch.Tensor, plain: torch.Tensor, factor: float, fp32) -> None:
    """``changed == factor * plain`` elementwise, up to the float32 roundings of taking the steps and their
    differences (parameters of magnitude <= 5: a few roundings of that size each). The term must move the
    parameters far more than that, so that a factor 1 and a factor 1/Z (Z > 1.5) cannot both pass."""
    atol = fp32.rounding(5.0, 8)
    assert plain.abs().max() > 100 * atol, "the term must move the parameters"
    torch.testing.assert_close(changed, factor * plain, rtol=0, atol=atol)


@pytest.mark.parametrize("apply", ["update", "loss"])
def test_entropy_and_kl_loss_terms_under_each_apply_mode(apply, fp32):
    """``calculate_entropy=True`` with ``entropy_coeff > 0`` and ``use_kl_loss`` through verl's ``ppo_loss``.

    The policy-gradient term shrinks by ``1/Z`` in both modes. ``clip_norm_apply=loss`` divides only
    ``pg_loss`` (SORL-SPEC: "Final loss pg_loss / Z"), so the entropy bonus and the KL loss move the
    parameters as without normalization; ``update`` scales the whole optimizer step (docs/algorithms.md,
    "Where Z acts": what shrinks is the actor's optimizer step), so they shrink by ``1/Z`` too. Each term's
    share of the step is isolated against twins without it and without normalization (``mode=none``)."""
    steps = {
        (mode, entropy, kl): sgd_step(apply, mode, entropy, kl)
        for mode in ("max", "none") for entropy, kl in ((False, False), (True, False), (True, True))
    }  # fmt: skip
    z = steps["max", False, False][2]
    assert z > 1.5 and steps["none", False, False][2] == 1.0
    others = 1.0 / z if apply == "update" else 1.0  # the factor on the entropy and KL terms
    # the policy-gradient term (theta without entropy and KL), both modes: 1/Z
    assert_scaled(steps["max", False, False][0], steps["none", False, False][0], 1.0 / z, fp32)
    # the entropy term: phi is moved by it alone
    assert_scaled(steps["max", True, False][1], steps["none", True, False][1], others, fp32)
    # the KL term: what adding it changes in theta's step
    kl_on = steps["max", True, True][0] - steps["max", True, False][0]
    kl_off = steps["none", True, True][0] - steps["none", True, False][0]
    assert_scaled(kl_on, kl_off, others, fp32)


def test_every_registered_loss_logs_the_ess_through_verl_ppo_loss_as_the_mean_over_micro_batches():
    """Each loss mode the plugin registers, looked up by verl's ``ppo_loss`` in verl's registry, logs
    ``sorl/ess_token`` and ``sorl/ess_turn``; verl's MEAN over an on-policy and an off-policy micro-batch
    is the mean of 1 and the off-policy micro-batch's ESS (sorl_verl/algorithms/ess.py)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from sorl_verl.algorithms.ess import ESS_TOKEN, ESS_TURN, ess_metrics
    from sorl_verl.algorithms.losses import POLICY_LOSSES
    from sorl_verl.algorithms.turns import segment_runs
    from sorl_verl.plugin import register_all

    modes = register_all()["policy_loss"]
    assert set(modes) == set(POLICY_LOSSES) and all(POLICY_LOSS_REGISTRY[m] is POLICY_LOSSES[m] for m in modes)
    _, off_data, off_padded, off_mask = micro_batch(seed=7, spread=1.0)
    log_ratio = torch.where(off_mask, off_padded.double() - off_data["old_log_probs"].double(), 0.0)
    off = {k: v.item() for k, v in ess_metrics(log_ratio, off_mask, segment_runs(off_mask)).items()}
    assert 0.0 < off[ESS_TOKEN] < 0.9 and 0.0 < off[ESS_TURN] < 0.9
    for mode in modes:
        collected: dict[str, Metric] = {}
        for seed, spread in ((6, 0.0), (7, 1.0)):
            flat, data, _, mask = micro_batch(seed=seed, spread=spread)
            set_global_info(data, 200, 8)
            _, metrics = ppo_loss(actor(mode, "token-mean"), {"log_probs": flat}, data)
            for key, metric in metrics.items():
                collected.setdefault(key, metric.init_list()).extend(metric)
        for key in (ESS_TOKEN, ESS_TURN):
            assert collected[key].aggregate() == pytest.approx((1.0 + off[key]) / 2, rel=1e-6), (mode, key)
