"""SORL advantage estimators: so_grpo against verl's grpo, turn-level GAE against a loop reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, get_adv_estimator_fn

from sorl_verl.algorithms.advantages import (
    compute_so_grpo_outcome_advantage,
    compute_so_ppo_advantage,
    compute_turn_gae_advantage_return,
)
from sorl_verl.algorithms.turns import broadcast_turns, segment_turns, turn_mean, turn_sum

EPS32 = torch.finfo(torch.float32).eps


def ragged_mask(rows: int, length: int, seed: int) -> torch.Tensor:
    """1-5 turns per row with gaps and padding; the last row has no policy token."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows - 1):
        pos = int(torch.randint(0, 3, (1,), generator=gen))
        for _ in range(int(torch.randint(1, 6, (1,), generator=gen))):
            size = int(torch.randint(1, 6, (1,), generator=gen))
            mask[b, pos : pos + size] = True
            pos += size + int(torch.randint(1, 4, (1,), generator=gen))
    return mask


def runs(row: list[bool]) -> list[list[int]]:
    turns, current = [], []
    for t, on in enumerate(row):
        if on:
            current.append(t)
        elif current:
            turns.append(current)
            current = []
    return turns + ([current] if current else [])


# --- turn segmentation ------------------------------------------------------------------


def test_segmentation_matches_loop_reference():
    mask = ragged_mask(8, 30, seed=0)
    turns = segment_turns(mask)
    values = torch.randn(mask.shape)
    sums, means = turn_sum(values, turns), turn_mean(values, turns)
    for b, row in enumerate(mask.tolist()):
        reference = runs(row)
        assert int(turns.num_turns[b]) == len(reference)
        for k, turn in enumerate(reference, start=1):
            assert turns.turn_id[b, turn].tolist() == [k] * len(turn)
            assert turns.count[b, k] == len(turn)
            # two float32 summation orders of n terms: each within n * eps32 * sum|v| of the exact sum
            bound = 2 * len(turn) * EPS32 * values[b, turn].abs().sum().item()
            assert sums[b, k].item() == pytest.approx(values[b, turn].sum().item(), abs=bound)
            assert means[b, k].item() == pytest.approx(values[b, turn].mean().item(), abs=bound / len(turn) + 1e-12)
    assert torch.equal(turns.turn_id == 0, ~mask)
    assert torch.equal(broadcast_turns(means, turns)[~mask], torch.zeros(int((~mask).sum())))


def test_segmentation_accepts_int_float_and_bool_masks():
    mask = ragged_mask(4, 12, seed=1)
    ids = [segment_turns(m).turn_id for m in (mask, mask.long(), mask.float())]
    assert torch.equal(ids[0], ids[1]) and torch.equal(ids[0], ids[2])


# --- so_grpo ----------------------------------------------------------------------------


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_so_grpo_equals_verl_grpo(norm_by_std):
    gen = torch.Generator().manual_seed(2)
    mask = ragged_mask(12, 20, seed=2)
    rewards = torch.zeros(mask.shape)
    rewards[:, -1] = torch.randint(0, 3, (12,), generator=gen).float()  # outcome reward, also ties
    rewards[3, 5] = 0.25  # a non-outcome token reward still counts in the score
    index = np.array(["a", "a", "a", "b", "b", "c", "d", "d", "d", "d", "e", "e"], dtype=object)  # c: singleton
    rewards[10:, -1] = 1.0  # group e: zero std
    rewards[5, -1] = 2.0
    ours, ours_returns = compute_so_grpo_outcome_advantage(
        rewards, mask, index, config=AlgoConfig(norm_adv_by_std_in_grpo=norm_by_std)
    )
    ref, _ = compute_grpo_outcome_advantage(rewards, mask.float(), index, norm_adv_by_std_in_grpo=norm_by_std)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours, ours_returns)
    assert torch.all(ours[~mask] == 0) and ours[5].abs().sum() > 0  # singleton: score itself (mean 0, std 1)


def test_so_grpo_registered_call_like_verl_trainer():
    mask = ragged_mask(4, 10, seed=3)
    rewards = torch.zeros(mask.shape)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    index = np.array([0, 0, 1, 1])
    fn = get_adv_estimator_fn("so_grpo")
    adv, _ = fn(token_level_rewards=rewards, response_mask=mask, config=AlgoConfig(), index=index)
    ref, _ = compute_grpo_outcome_advantage(rewards, mask.float(), index)
    torch.testing.assert_close(adv, ref)


def test_so_grpo_nan_free_on_masked_positions():
    mask = ragged_mask(4, 10, seed=4)
    rewards = torch.zeros(mask.shape)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv, _ = compute_so_grpo_outcome_advantage(rewards, mask, np.array([0, 0, 0, 0]))
    assert torch.isfinite(adv).all() and torch.all(adv[~mask] == 0)


# --- turn-level GAE ---------------------------------------------------------------------


def loop_turn_gae(rewards, values, mask, gamma, lam):
    """Direct reading of SORL-SPEC: per row, per turn, python floats; returns unwhitened (A, R)."""
    adv = torch.zeros(mask.shape, dtype=torch.float64)
    ret = torch.zeros(mask.shape, dtype=torch.float64)
    for b, row in enumerate(mask.tolist()):
        turns = runs(row)
        if not turns:
            continue
        owner = [0] * len(row)  # turn index owning each position's reward
        current = 0
        for t in range(len(row)):
            for k, turn in enumerate(turns):
                if t == turn[0]:
                    current = k
            owner[t] = current
        turn_reward = [0.0] * len(turns)
        for t in range(len(row)):
            turn_reward[owner[t]] += rewards[b, t].item()
        v = [values[b, turn[0]].item() for turn in turns] + [0.0]
        delta = [turn_reward[k] + gamma * v[k + 1] - v[k] for k in range(len(turns))]
        for k, turn in enumerate(turns):
            a_k = sum((gamma * lam) ** j * delta[k + j] for j in range(len(turns) - k))
            adv[b, turn] = a_k
            ret[b, turn] = a_k + v[k]
    return adv, ret


def whiten(x, mask):
    values = x[mask]
    return torch.where(mask, (x - values.mean()) / torch.sqrt(values.var() + 1e-8), torch.zeros(()))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (0.99, 0.95)])
def test_turn_gae_matches_loop_reference(gamma, lam, fp32):
    gen = torch.Generator().manual_seed(5)
    mask = ragged_mask(7, 26, seed=5)
    rewards = torch.zeros(mask.shape)
    rewards[:, -1] = torch.randn(7, generator=gen)  # outcome reward on the last position (often m = 0)
    rewards[mask & (torch.rand(mask.shape, generator=gen) < 0.1)] = 0.5  # some in-turn rewards
    values = torch.randn(mask.shape, generator=gen)
    adv, ret = compute_turn_gae_advantage_return(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = loop_turn_gae(rewards, values, mask, gamma, lam)
    assert max(len(runs(r)) for r in mask.tolist()) >= 3  # multi-turn rows present
    ref_white = whiten(ref_adv, mask)
    atol_adv, atol_ret = fp32.turn_gae(rewards, values, mask, ref_adv, ref_white)  # float32 vs float64
    torch.testing.assert_close(ret.double(), ref_ret, rtol=0, atol=atol_ret)
    torch.testing.assert_close(adv.double(), ref_white, rtol=0, atol=atol_adv)
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)


def test_turn_gae_single_token_turns_with_gamma_lam_one_is_reward_to_go_minus_value():
    mask = torch.tensor([[1, 0, 1, 0, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 9.0, 0.25, 9.0, 1.0, 9.0]])
    _, ret = compute_turn_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    assert ret[0].tolist() == [2.0, 0.0, 2.0, 0.0, 2.0, 0.0]  # gamma = lam = 1: returns = outcome


def test_so_ppo_estimator_reads_gamma_lam_and_values_argument():
    mask = ragged_mask(5, 16, seed=6)
    rewards = torch.zeros(mask.shape)
    rewards[:, -1] = 1.0
    values = torch.randn(mask.shape)
    fn = get_adv_estimator_fn("so_ppo")
    adv, ret = fn(token_level_rewards=rewards, response_mask=mask, config=AlgoConfig(gamma=0.9, lam=0.8), values=values)
    ref_adv, ref_ret = compute_turn_gae_advantage_return(rewards, values, mask, 0.9, 0.8)
    assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)


def test_so_ppo_estimator_takes_values_from_the_trainer_context():
    from sorl_verl.trainer.values_context import provide_values

    mask = ragged_mask(5, 16, seed=7)
    rewards = torch.zeros(mask.shape)
    rewards[:, -1] = 1.0
    values = torch.randn(mask.shape)
    with provide_values(values):
        adv, _ = compute_so_ppo_advantage(rewards, mask, config=AlgoConfig(gamma=1.0, lam=0.95))
    ref, _ = compute_turn_gae_advantage_return(rewards, values, mask, 1.0, 0.95)
    assert torch.equal(adv, ref)


def test_so_ppo_without_values_fails_with_the_fix_in_the_message():
    mask = ragged_mask(3, 8, seed=8)
    with pytest.raises(ValueError) as err:
        compute_so_ppo_advantage(torch.zeros(mask.shape), mask, config=AlgoConfig())
    message = str(err.value)
    assert "trainer.v1.trainer_mode=sorl_sync" in message and "critic.enable=True" in message
    assert "sorl_colocate_async" in message and "sorl_separate_async" in message


def test_turn_table_whitening_equals_verl_masked_whiten_on_tokens():
    import verl.utils.torch_functional as verl_F

    from sorl_verl.algorithms.advantages import whiten_over_tokens

    mask = ragged_mask(6, 30, seed=9)
    turns = segment_turns(mask)
    table = torch.randn(mask.shape[0], turns.max_turns, dtype=torch.float64)
    ours = broadcast_turns(
        torch.nn.functional.pad(whiten_over_tokens(table, turns.count[:, 1:].double()), (1, 0)), turns
    )
    tokens = broadcast_turns(torch.nn.functional.pad(table, (1, 0)), turns)
    reference = verl_F.masked_whiten(tokens, mask)
    # (verl computes the Bessel factor N / (N - 1) in float32, hence not 1e-12)
    torch.testing.assert_close(ours[mask], reference[mask], rtol=1e-6, atol=1e-7)
