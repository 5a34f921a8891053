"""SORL policy losses: the identities of SORL-SPEC.md, equality with verl's vanilla, robustness."""

from __future__ import annotations

import math

import pytest
import torch
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, get_policy_loss_fn
from verl.workers.config import ActorConfig, PolicyLossConfig

from sorl_verl.algorithms import optim
from sorl_verl.algorithms.clip_bias_grad import DIAGNOSTIC
from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.losses import SORL_LOSSES

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
NORMALIZER_KEYS = {
    "sorl/clip_bias_norm",
    "sorl/clip_bias_rel",
    "sorl/norm_factor",
    "sorl/triggered",
    "sorl/update_scale",
    "sorl/loss_scale",
    "sorl/num_turns_mean",
}
TURN_KEYS = {"sorl/turn_ratio_mean", "sorl/turn_ratio_max", "sorl/turn_ratio_min", "sorl/turn_clipfrac"}
TOKEN_KEYS = {key.replace("turn", "token") for key in TURN_KEYS}
VERL_KEYS = {"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}
ESS_KEYS = {"sorl/ess_token", "sorl/ess_turn"}


@pytest.fixture(autouse=True)
def sorl_optimizer(sorl_optimizer):
    """tests/conftest.py's update-scaled optimizer (ledger emptied) in every test; the once-per-step
    ``sorl/clip_bias_grad_norm`` diagnostic is not due (tests/unit/test_algo_clip_bias_grad.py covers
    it), so key sets are fixed."""
    DIAGNOSTIC.due = False
    return sorl_optimizer


def actor_config(**knobs) -> ActorConfig:
    """Loss-level normalization unless asked otherwise: the spec's loss identities (Z = 1 bit for
    bit, loss / Z under clipping) are about the loss; update-level tests pass clip_norm_apply."""
    policy_loss = SORLPolicyLossConfig(**{"clip_norm_apply": "loss", **knobs}) if knobs else PolicyLossConfig()
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss)


def ragged_mask(rows: int = 6, length: int = 40, seed: int = 0) -> torch.Tensor:
    """Random multi-turn mask: 1-4 turns of random length per row, gaps, right padding, and
    the last row without any policy token."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows - 1):
        pos = int(torch.randint(0, 3, (1,), generator=gen))
        for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
            size = int(torch.randint(1, 8, (1,), generator=gen))
            mask[b, pos : pos + size] = True
            pos += size + int(torch.randint(1, 5, (1,), generator=gen))
    return mask


def single_token_turns(rows: int = 5, length: int = 30, seed: int = 0) -> torch.Tensor:
    """Every turn has length 1 (isolated policy tokens), plus a row with none."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, length, generator=gen) < 0.5
    mask[:, 1:] &= ~mask[:, :-1]
    mask[-1] = False
    return mask


def batch(mask: torch.Tensor, spread: float = 0.5, seed: int = 1, turn_constant_adv: bool = False):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=gen) * 3
    new = old + spread * torch.randn(mask.shape, generator=gen)
    if turn_constant_adv:
        adv = torch.randn(mask.shape[0], 1, generator=gen).expand_as(old).contiguous()
    else:
        adv = torch.randn(mask.shape, generator=gen)
    return old, new, adv


def loss_and_grad(fn, old, new, adv, mask, mode="token-mean", config=None, weights=None):
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = fn(old, log_prob, adv, mask, mode, config or actor_config(), weights)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


def turn_lists(mask: torch.Tensor) -> list[list[list[int]]]:
    """Loop reference: per row, the list of token positions of each maximal run of ones."""
    rows = []
    for row in mask.tolist():
        turns, current = [], []
        for t, on in enumerate(row):
            if on:
                current.append(t)
            elif current:
                turns.append(current)
                current = []
        if current:
            turns.append(current)
        rows.append(turns)
    return rows


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", ["turn_ppo", "s_ppo", "so_ppo", "so_grpo"])
def test_reduces_to_vanilla_bit_for_bit(name, mode):
    """Length-1 turns (or token ratio) and clip_norm_mode=none -> exactly verl's vanilla."""
    mask = single_token_turns()
    old, new, adv = batch(mask, spread=1.0)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(3)) + 0.5
    config = actor_config(clip_norm_mode="none")
    ref_loss, ref_grad, ref_metrics = loss_and_grad(
        compute_policy_loss_vanilla, old, new, adv, mask, mode, config, weights
    )
    loss, grad, metrics = loss_and_grad(get_policy_loss_fn(name), old, new, adv, mask, mode, config, weights)
    assert ref_metrics["actor/pg_clipfrac"] > 0 and ref_metrics["actor/pg_clipfrac_lower"] > 0  # clipping happens
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grad, ref_grad)
    for key in VERL_KEYS:
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_token_ratio_without_normalization_equals_vanilla_on_ragged_turns(mode):
    mask = ragged_mask()
    old, new, adv = batch(mask, spread=1.0)
    config = actor_config(clip_norm_mode="none")
    ref_loss, ref_grad, _ = loss_and_grad(compute_policy_loss_vanilla, old, new, adv, mask, mode, config)
    loss, grad, _ = loss_and_grad(get_policy_loss_fn("s_ppo"), old, new, adv, mask, mode, config)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


@pytest.mark.parametrize("name", ["turn_ppo", "s_ppo", "so_ppo", "so_grpo"])
def test_on_policy_ratios_one_and_plain_policy_gradient(name):
    mask = ragged_mask()
    old, _, adv = batch(mask, turn_constant_adv=True)
    loss, grad, metrics = loss_and_grad(get_policy_loss_fn(name), old, old.clone(), adv, mask)
    n = mask.sum()
    unit = "token" if name == "s_ppo" else "turn"
    assert metrics[f"sorl/{unit}_ratio_mean"] == metrics[f"sorl/{unit}_ratio_max"] == 1.0
    assert metrics[f"sorl/{unit}_ratio_min"] == 1.0 and metrics["sorl/clip_bias_rel"] == 0.0
    assert metrics["sorl/norm_factor"] == 1.0 and metrics["sorl/triggered"] == 0.0
    assert metrics["sorl/clip_bias_norm"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0
    torch.testing.assert_close(grad, -adv * mask / n, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(loss, -(adv * mask).sum() / n)


def test_turn_ratio_is_geometric_mean_of_token_ratios():
    mask = ragged_mask(seed=4)
    old, new, adv = batch(mask, spread=0.05)
    _, _, metrics = loss_and_grad(get_policy_loss_fn("so_grpo"), old, new, adv, mask)
    geometric = []
    for b, turns in enumerate(turn_lists(mask)):
        for turn in turns:
            product = math.prod(math.exp(new[b, t].item() - old[b, t].item()) for t in turn)
            geometric.append(product ** (1 / len(turn)))
    assert metrics["sorl/turn_ratio_mean"] == pytest.approx(sum(geometric) / len(geometric), rel=1e-5)
    assert metrics["sorl/turn_ratio_max"] == pytest.approx(max(geometric), rel=1e-5)
    assert metrics["sorl/turn_ratio_min"] == pytest.approx(min(geometric), rel=1e-5)
    rows = [len(t) for t in turn_lists(mask) if t]
    assert metrics["sorl/num_turns_mean"] == pytest.approx(sum(rows) / len(rows))


def test_turn_gradient_formula_under_token_mean():
    """Unclipped: d loss / d log_prob[t] = -r_k * (sum of A over turn k) / (|turn k| * N)."""
    mask = ragged_mask(seed=5)
    old, new, adv = batch(mask, spread=0.03)
    _, grad, metrics = loss_and_grad(get_policy_loss_fn("turn_ppo"), old, new, adv, mask)
    assert metrics["actor/pg_clipfrac"] == 0.0
    n = int(mask.sum())
    expected = torch.zeros_like(grad)
    for b, turns in enumerate(turn_lists(mask)):
        for turn in turns:
            idx = torch.tensor(turn)
            r_k = torch.exp((new[b, idx] - old[b, idx]).mean())
            expected[b, idx] = -r_k * adv[b, idx].sum() / (len(turn) * n)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("clip_norm_mode", ["max", "add"])
def test_no_clipping_means_z_one_bit_for_bit(clip_norm_mode):
    mask = ragged_mask(seed=6)
    old, new, adv = batch(mask, spread=0.03)
    ref_loss, ref_grad, _ = loss_and_grad(get_policy_loss_fn("turn_ppo"), old, new, adv, mask)
    config = actor_config(clip_norm_mode=clip_norm_mode, clip_norm_tau=0.01)
    loss, grad, metrics = loss_and_grad(get_policy_loss_fn("so_ppo"), old, new, adv, mask, config=config)
    assert metrics["sorl/norm_factor"] == 1.0 and metrics["sorl/triggered"] == 0.0
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)


def expected_clip_bias_norm(old, new, adv, mask, turn_level, low=0.2, high=0.2, c=3.0) -> float:
    """Direct reading of the spec: c = x * r * A where clipping zeroed dL/dr."""
    total, n = 0.0, int(mask.sum())
    for b, turns in enumerate(turn_lists(mask)):
        for turn in turns:
            log_ratios = [new[b, t].item() - old[b, t].item() for t in turn]
            for i, t in enumerate(turn):
                r = math.exp(sum(log_ratios) / len(turn)) if turn_level else math.exp(log_ratios[i])
                a = adv[b, t].item()
                clipped = (a > 0 and r > 1 + high) or (a < 0 and r < 1 - low) or (a < 0 and r > c)
                total += (r * a) ** 2 if clipped else 0.0
    return math.sqrt(total / n)


@pytest.mark.parametrize("name,turn_level", [("so_ppo", True), ("s_ppo", False)])
@pytest.mark.parametrize("clip_norm_mode,tau", [("max", 0.5), ("add", 2.0)])
def test_heavy_clipping_normalizes_and_shrinks_gradient(name, turn_level, clip_norm_mode, tau):
    mask = ragged_mask(seed=7)
    old, new, adv = batch(mask, spread=1.5)
    config = actor_config(clip_norm_mode=clip_norm_mode, clip_norm_tau=tau, clip_norm_reference="absolute")
    loss, grad, metrics = loss_and_grad(get_policy_loss_fn(name), old, new, adv, mask, config=config)
    plain = actor_config(clip_norm_mode="none")
    ref_loss, ref_grad, ref_metrics = loss_and_grad(get_policy_loss_fn(name), old, new, adv, mask, config=plain)
    norm = expected_clip_bias_norm(old, new, adv, mask, turn_level)
    z = max(1.0, norm / tau) if clip_norm_mode == "max" else 1.0 + norm / tau
    assert metrics["sorl/clip_bias_norm"] == pytest.approx(norm, rel=1e-5)
    assert ref_metrics["sorl/clip_bias_norm"] == pytest.approx(norm, rel=1e-5)  # measured even when off
    assert z > 1.0 and metrics["sorl/norm_factor"] == pytest.approx(z, rel=1e-5)
    assert metrics["sorl/triggered"] == 1.0 and ref_metrics["sorl/norm_factor"] == 1.0
    torch.testing.assert_close(loss, ref_loss / z, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grad, ref_grad / z, rtol=1e-5, atol=1e-8)
    assert grad.norm() < ref_grad.norm()


def test_so_grpo_and_so_ppo_are_the_same_loss():
    mask = ragged_mask(seed=8)
    old, new, adv = batch(mask, spread=1.0)
    a = loss_and_grad(get_policy_loss_fn("so_grpo"), old, new, adv, mask)
    b = loss_and_grad(get_policy_loss_fn("so_ppo"), old, new, adv, mask)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_turn_clipfrac_counts_turns_outside_trust_region():
    mask = ragged_mask(seed=9)
    old, new, adv = batch(mask, spread=0.3)
    _, _, metrics = loss_and_grad(get_policy_loss_fn("turn_ppo"), old, new, adv, mask)
    outside, total = 0, 0
    for b, turns in enumerate(turn_lists(mask)):
        for turn in turns:
            r = math.exp(sum(new[b, t].item() - old[b, t].item() for t in turn) / len(turn))
            outside += r < 0.8 or r > 1.2
            total += 1
    assert 0 < outside < total
    assert metrics["sorl/turn_clipfrac"] == pytest.approx(outside / total)


@pytest.mark.parametrize("name", list(SORL_LOSSES))
def test_metrics_are_python_floats_with_all_keys(name):
    mask = ragged_mask()
    old, new, adv = batch(mask)
    _, _, metrics = loss_and_grad(get_policy_loss_fn(name), old, new, adv, mask)
    assert set(metrics) == NORMALIZER_KEYS | (TOKEN_KEYS if name == "s_ppo" else TURN_KEYS) | VERL_KEYS | ESS_KEYS
    assert all(type(v) is float and math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", list(SORL_LOSSES))
@pytest.mark.parametrize("extreme", [1e4, -1e4])
def test_extreme_log_ratios_stay_finite(name, extreme):
    mask = ragged_mask()
    old, new, adv = batch(mask)
    new = new + extreme * (torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) > 0.5)
    for mode in AGG_MODES:
        loss, grad, metrics = loss_and_grad(get_policy_loss_fn(name), old, new, adv, mask, mode)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", list(SORL_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_masked_micro_batch_gives_zero_not_nan(name, mode):
    mask = torch.zeros(3, 10, dtype=torch.bool)
    old, new, adv = batch(mask)
    loss, grad, metrics = loss_and_grad(get_policy_loss_fn(name), old, new, adv, mask, mode)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert metrics["sorl/norm_factor"] == 1.0 and metrics["sorl/num_turns_mean"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    ratio_keys = [
        k for k in metrics if k.startswith("sorl/") and k.endswith(("_ratio_mean", "_ratio_max", "_ratio_min"))
    ]
    assert len(ratio_keys) == 3 and all(metrics[k] == 1.0 for k in ratio_keys)  # no ratio: 1, decided on the device
    assert [metrics[k] for k in metrics if k.startswith("sorl/") and k.endswith("_clipfrac")] == [0.0]


@pytest.mark.parametrize("name", list(SORL_LOSSES))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_nan_on_masked_positions_does_not_leak(name, mode):
    mask = ragged_mask(seed=10)
    old, new, adv = batch(mask, spread=1.0)
    weights = torch.rand(mask.shape) + 0.5
    clean = loss_and_grad(get_policy_loss_fn(name), old, new, adv, mask, mode, None, weights)
    poison = torch.where(mask, torch.zeros(()), torch.tensor(float("nan")))
    dirty = loss_and_grad(
        get_policy_loss_fn(name), old + poison, new + poison, adv + poison, mask, mode, None, weights + poison
    )
    assert torch.isfinite(dirty[0]) and torch.isfinite(dirty[1]).all()
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1])
    assert dirty[2] == clean[2]


@pytest.mark.parametrize("name", list(SORL_LOSSES))
def test_bf16_inputs_are_computed_in_float32(name):
    """bf16 inputs are widened to float32 (exactly) and the loss is computed there: it is the float32
    loss of the same values bit for bit, its metrics too, and the gradient is that loss's gradient
    rounded once to bf16. (Nothing is reduced in bf16, so no bf16 rounding bound applies; the inputs'
    own rounding moves the loss as it would move any float32 input.)"""
    mask = ragged_mask(seed=11)
    old, new, adv = batch(mask, spread=0.5)
    fn = get_policy_loss_fn(name)
    bf = [x.to(torch.bfloat16) for x in (old, new, adv)]
    log_prob = bf[1].clone().requires_grad_(True)
    loss, metrics = fn(bf[0], log_prob, bf[2], mask, "token-mean", actor_config(), None)
    loss.backward()
    same_loss, same_grad, same_metrics = loss_and_grad(fn, *(x.float() for x in bf), mask)
    assert loss.dtype == torch.float32 and log_prob.grad.dtype == torch.bfloat16
    assert torch.equal(loss, same_loss) and metrics == same_metrics
    assert torch.equal(log_prob.grad, same_grad.to(torch.bfloat16))
    assert metrics["sorl/clip_bias_norm"] > 0  # clipped tokens: the normalizer's path runs too


def test_knobs_read_from_plain_verl_policy_loss_config_use_defaults():
    mask = ragged_mask(seed=12)
    old, new, adv = batch(mask, spread=1.5)
    plain = loss_and_grad(get_policy_loss_fn("so_ppo"), old, new, adv, mask, config=actor_config())
    explicit = loss_and_grad(
        get_policy_loss_fn("so_ppo"),
        old,
        new,
        adv,
        mask,
        config=actor_config(
            clip_norm_mode="max", clip_norm_tau=0.2, clip_norm_reference="relative", clip_norm_apply="update"
        ),
    )
    assert plain[2]["sorl/norm_factor"] > 1.0  # the defaults act on this heavily clipped micro-batch
    assert torch.equal(plain[0], explicit[0]) and plain[2] == explicit[2]


def test_log_ratio_clamp_knob_bounds_the_ratio():
    mask = torch.ones(1, 4, dtype=torch.bool)
    old = torch.zeros(1, 4)
    new = torch.full((1, 4), 8.0)
    adv = torch.ones(1, 4)
    _, _, metrics = loss_and_grad(
        get_policy_loss_fn("turn_ppo"), old, new, adv, mask, config=actor_config(log_ratio_clamp=2.0)
    )
    assert metrics["sorl/turn_ratio_max"] == pytest.approx(math.exp(2.0), rel=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(-2.0)


def test_clipped_turns_get_no_gradient_and_unclipped_turns_do():
    """The whole turn shares one ratio, so clipping silences every token of the turn together."""
    mask = ragged_mask(seed=13)
    old, new, adv = batch(mask, spread=0.4, turn_constant_adv=True)
    _, grad, _ = loss_and_grad(get_policy_loss_fn("turn_ppo"), old, new, adv, mask)
    silenced = active = 0
    for b, turns in enumerate(turn_lists(mask)):
        a = adv[b, 0].item()
        for turn in turns:
            r = math.exp(sum(new[b, t].item() - old[b, t].item() for t in turn) / len(turn))
            clipped = (a > 0 and r > 1.2) or (a < 0 and (r < 0.8 or r > 3.0))
            idx = torch.tensor(turn)
            if clipped:
                silenced += 1
                assert torch.all(grad[b, idx] == 0)
            else:
                active += 1
                assert torch.all(grad[b, idx] != 0)
    assert silenced > 0 and active > 0
    assert torch.all(grad[~mask] == 0)


def expected_clip_bias_rel(old, new, adv, mask, turn_level, low=0.2, high=0.2, c=3.0) -> float:
    """rho = sqrt(sum c^2 / sum (r A)^2), read directly from the spec."""
    norm = expected_clip_bias_norm(old, new, adv, mask, turn_level, low, high, c)
    total = 0.0
    for b, turns in enumerate(turn_lists(mask)):
        for turn in turns:
            log_ratios = [new[b, t].item() - old[b, t].item() for t in turn]
            for i, t in enumerate(turn):
                r = math.exp(sum(log_ratios) / len(turn)) if turn_level else math.exp(log_ratios[i])
                total += (r * adv[b, t].item()) ** 2
    return norm * math.sqrt(int(mask.sum()) / total)


@pytest.mark.parametrize("name,turn_level", [("so_grpo", True), ("s_ppo", False)])
@pytest.mark.parametrize("reference", ["absolute", "relative"])
def test_update_mode_leaves_the_loss_alone_and_publishes_one_over_z(name, turn_level, reference):
    """clip_norm_apply=update: loss and gradient are the un-normalized ones bit for bit; the
    micro-batch's Z goes to the optimizer's ledger (the update-level identity is in test_algo_optim)."""
    mask = ragged_mask(seed=7)
    old, new, adv = batch(mask, spread=1.5)
    tau = 0.5 if reference == "absolute" else 0.2
    knobs = {"clip_norm_tau": tau, "clip_norm_reference": reference}
    loss, grad, metrics = loss_and_grad(
        get_policy_loss_fn(name), old, new, adv, mask, config=actor_config(clip_norm_apply="update", **knobs)
    )
    records = optim.LEDGER.take()
    ref_loss, ref_grad, _ = loss_and_grad(
        get_policy_loss_fn(name), old, new, adv, mask, config=actor_config(clip_norm_mode="none")
    )
    norm = expected_clip_bias_norm(old, new, adv, mask, turn_level)
    rel = expected_clip_bias_rel(old, new, adv, mask, turn_level)
    z = max(1.0, (norm if reference == "absolute" else rel) / tau)
    assert 0 < rel < 1 and z > 1.0
    assert metrics["sorl/clip_bias_rel"] == pytest.approx(rel, rel=1e-5)
    assert metrics["sorl/norm_factor"] == pytest.approx(z, rel=1e-5)
    assert metrics["sorl/update_scale"] == pytest.approx(1 / z, rel=1e-5) and metrics["sorl/loss_scale"] == 1.0
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    assert records["z"] == [pytest.approx(z, rel=1e-5)] and records["inv_z"] == [pytest.approx(1 / z, rel=1e-5)]
    assert records["clip_bias_norm"] == [pytest.approx(norm, rel=1e-5)]


def test_loss_mode_reports_its_scale_at_the_loss():
    mask = ragged_mask(seed=7)
    old, new, adv = batch(mask, spread=1.5)
    config = actor_config(clip_norm_tau=0.5)
    _, _, metrics = loss_and_grad(get_policy_loss_fn("so_grpo"), old, new, adv, mask, config=config)
    assert metrics["sorl/norm_factor"] > 1.0 and metrics["sorl/update_scale"] == 1.0
    assert metrics["sorl/loss_scale"] == pytest.approx(1 / metrics["sorl/norm_factor"])
    records = optim.LEDGER.take()  # recorded for the update log, with step share 1
    assert records["inv_z"] == [1.0] and records["z"] == [pytest.approx(metrics["sorl/norm_factor"])]


def test_only_a_normalizing_update_mode_loss_with_gradients_shrinks_the_step():
    mask = ragged_mask(seed=7)
    old, new, adv = batch(mask, spread=1.5)
    config = actor_config(clip_norm_apply="update", clip_norm_tau=0.5)
    with torch.no_grad():  # e.g. a metrics-only forward: nothing published
        get_policy_loss_fn("so_grpo")(old, new, adv, mask, "token-mean", config, None)
    assert optim.LEDGER.take()["z"] == []
    loss_and_grad(get_policy_loss_fn("turn_ppo"), old, new, adv, mask, config=config)  # turn_ppo: Z = 1 always
    none = actor_config(clip_norm_apply="update", clip_norm_mode="none")
    loss_and_grad(get_policy_loss_fn("so_grpo"), old, new, adv, mask, config=none)
    records = optim.LEDGER.take()
    assert records["inv_z"] == [1.0, 1.0] and records["z"] == [1.0, 1.0]
    assert records["clip_bias_norm"][0] > 0  # ||C|| is recorded even when it does not act


def test_without_the_sorl_optimizer_only_update_mode_fails(monkeypatch):
    monkeypatch.setattr(optim.LEDGER, "consumers", 0)
    mask = ragged_mask(seed=7)
    old, new, adv = batch(mask, spread=1.5)
    loss_and_grad(get_policy_loss_fn("so_grpo"), old, new, adv, mask, config=actor_config(clip_norm_tau=0.5))
    loss_and_grad(get_policy_loss_fn("turn_ppo"), old, new, adv, mask, config=actor_config(clip_norm_apply="update"))
    assert optim.LEDGER.take()["z"] == []


def test_update_mode_without_the_sorl_optimizer_fails_naming_the_fix(monkeypatch):
    monkeypatch.setattr(optim.LEDGER, "consumers", 0)
    mask = ragged_mask(seed=7)
    old, new, adv = batch(mask, spread=1.5)
    with pytest.raises(RuntimeError, match="optimizer_impl=sorl_verl.algorithms.optim"):
        loss_and_grad(get_policy_loss_fn("so_grpo"), old, new, adv, mask, config=actor_config(clip_norm_apply="update"))


def test_s_ppo_reports_the_token_ratios_it_uses():
    mask = ragged_mask(seed=9)
    old, new, adv = batch(mask, spread=0.3)
    _, _, metrics = loss_and_grad(get_policy_loss_fn("s_ppo"), old, new, adv, mask)
    ratios = torch.exp(new - old)[mask].double()
    assert metrics["sorl/token_ratio_max"] == pytest.approx(float(ratios.max()), rel=1e-6)
    assert metrics["sorl/token_ratio_min"] == pytest.approx(float(ratios.min()), rel=1e-6)
    assert metrics["sorl/token_ratio_mean"] == pytest.approx(float(ratios.mean()), rel=1e-6)
    outside = float(((ratios < 0.8) | (ratios > 1.2)).double().mean())
    assert 0 < outside < 1 and metrics["sorl/token_clipfrac"] == pytest.approx(outside)
    assert not any(key.startswith("sorl/turn_") for key in metrics)
