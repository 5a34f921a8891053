"""The SORL surrogate with its gradient written out, against autograd through verl's own formulas.

The reference below is the surrogate as verl's ``vanilla`` writes it, with the turn ratio built
from ``scatter_add``/``gather`` turn tables and differentiated by autograd; the fast version must
give the same loss and gradient bit for bit, including clamp activity, float64, every
``loss_agg_mode`` and the exact float ties where autograd splits a gradient in halves.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import agg_loss

from sorl_verl.algorithms.surrogate import ClipRange, surrogate
from sorl_verl.algorithms.turns import (
    broadcast_turns,
    run_broadcast,
    run_sum,
    segment_runs,
    segment_turns,
    turn_mean,
    turn_sum,
)

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
CLIP = ClipRange(low=0.2, high=0.2, dual=3.0, log_ratio_bound=20.0)


def autograd_ratio(old, log_prob, mask, turn_level: bool, clip: ClipRange) -> torch.Tensor:
    """The SORL ratio from ``[B, K + 1]`` turn tables (scatter_add / gather), differentiable."""
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    d = torch.where(mask, log_prob.to(dtype) - old.to(dtype), torch.zeros((), dtype=dtype))
    d = torch.clamp(d, -clip.log_ratio_bound, clip.log_ratio_bound)
    if turn_level:
        turns = segment_turns(mask)
        return torch.exp(broadcast_turns(turn_mean(d, turns, zero_outside=True), turns))
    return torch.exp(d)


def autograd_pg_losses(old, log_prob, adv, mask, turn_level: bool, clip: ClipRange) -> torch.Tensor:
    """verl's dual-clip surrogate on the SORL ratio, differentiated by autograd."""
    ratio = autograd_ratio(old, log_prob, mask, turn_level, clip)
    a = torch.where(mask, adv.to(ratio.dtype), torch.zeros((), dtype=ratio.dtype))
    pg1 = -a * ratio
    pg2 = -a * torch.clamp(ratio, 1 - clip.low, 1 + clip.high)
    clip1 = torch.maximum(pg1, pg2)
    pg3 = -a * clip.dual
    return torch.where(a < 0, torch.min(pg3, clip1), clip1)


def fast_pg_losses(old, log_prob, adv, mask, turn_level: bool, clip: ClipRange) -> torch.Tensor:
    return surrogate(old, log_prob, adv, mask, segment_runs(mask) if turn_level else None, clip).pg_losses


def loss_and_grad(fn, old, new, adv, mask, turn_level, clip=CLIP, mode="token-mean", weights=None):
    log_prob = new.clone().requires_grad_(True)
    pg = fn(old, log_prob, adv, mask, turn_level, clip)
    if weights is not None:
        pg = pg * torch.where(mask, weights.to(pg.dtype), torch.zeros((), dtype=pg.dtype))
    loss = agg_loss(loss_mat=pg, loss_mask=mask, loss_agg_mode=mode)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return pg.detach(), loss.detach(), grad


def assert_same_bits(old, new, adv, mask, turn_level, clip=CLIP, mode="token-mean", weights=None):
    ours = loss_and_grad(fast_pg_losses, old, new, adv, mask, turn_level, clip, mode, weights)
    ref = loss_and_grad(autograd_pg_losses, old, new, adv, mask, turn_level, clip, mode, weights)
    for got, want in zip(ours, ref, strict=True):  # equal bits (NaN where both are: an empty token-mean)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    return ours


def loop_runs(row: list[bool]) -> list[tuple[bool, int]]:
    """Loop reference: (value, length) of each maximal run of equal values."""
    out: list[tuple[bool, int]] = []
    for on in row:
        if out and out[-1][0] == on:
            out[-1] = (on, out[-1][1] + 1)
        else:
            out.append((on, 1))
    return out


@st.composite
def micro_batches(draw):
    """A random multi-turn micro-batch: runs of policy tokens and gaps, per-row or per-token
    advantages with zeros, log-ratio spreads from on-policy to beyond the clamp."""
    rows, length = draw(st.integers(1, 5)), draw(st.integers(1, 40))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    flips = torch.rand(rows, length, generator=gen) < draw(st.sampled_from([0.1, 0.3, 0.6]))
    mask = (flips.long().cumsum(-1) % 2 == 1) ^ draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    old = (-torch.rand(rows, length, generator=gen) * 3).to(dtype)
    spread = draw(st.sampled_from([0.0, 0.02, 0.3, 1.5, 30.0]))
    new = old + (spread * torch.randn(rows, length, generator=gen)).to(dtype)
    if draw(st.booleans()):
        adv = torch.randn(rows, 1, generator=gen).expand(rows, length).contiguous()
    else:
        adv = torch.randn(rows, length, generator=gen)
    adv = torch.where(torch.rand(rows, length, generator=gen) < 0.2, 0.0, adv).to(dtype)
    weights = torch.rand(rows, length, generator=gen) + 0.5 if draw(st.booleans()) else None
    bound = draw(st.sampled_from([20.0, 0.5]))
    return old, new, adv, mask, weights, ClipRange(low=0.2, high=0.28, dual=3.0, log_ratio_bound=bound)


@settings(max_examples=150, deadline=None)
@given(batch=micro_batches(), turn_level=st.booleans(), mode=st.sampled_from(AGG_MODES))
def test_loss_and_gradient_are_autograds_bit_for_bit(batch, turn_level, mode):
    old, new, adv, mask, weights, clip = batch
    assert_same_bits(old, new, adv, mask, turn_level, clip, mode, weights)


@pytest.mark.parametrize("turn_level", [True, False])
def test_tie_at_the_dual_clip_gets_half_the_gradient_as_in_autograd(turn_level):
    """A < 0 and r exactly clip_ratio_c: min(pg3, c1) ties, autograd sends half of dL/dr to r."""
    mask = torch.tensor([[False, True, True, True, False]])
    old = torch.zeros(1, 5)
    new = torch.tensor([[0.0, 1.0, 1.2, 1.1, 0.0]])
    adv = -torch.ones(1, 5)
    with torch.no_grad():  # r as the loss computes it (same ops, same shape), then c := r
        ratio = autograd_ratio(old, new, mask, turn_level, CLIP)
    dual = float(ratio[0, 2])
    assert dual > 1 + CLIP.high
    tied = ClipRange(CLIP.low, CLIP.high, dual, CLIP.log_ratio_bound)
    _, _, grad_tied = assert_same_bits(old, new, adv, mask, turn_level, tied)
    free = ClipRange(CLIP.low, CLIP.high, dual * 1.5, CLIP.log_ratio_bound)
    _, _, grad_free = assert_same_bits(old, new, adv, mask, turn_level, free)
    assert grad_free[0, 2] != 0 and grad_tied[0, 2] == grad_free[0, 2] / 2


@pytest.mark.parametrize("turn_level", [True, False])
def test_rounding_tie_at_the_clip_bound_gets_half_the_gradient_as_in_autograd(turn_level):
    """r one float above 1 + high while -A*r and -A*(1 + high) round to the same float:
    max(pg1, pg2) ties with r outside the clip range, autograd sends half of dL/dr to r."""
    mask = torch.tensor([[True]])
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), 0.3)
    r = torch.exp(new)
    bound = torch.nextafter(r, torch.zeros(())).reshape(())  # 1 + high, one float below r
    candidates = torch.linspace(0.5, 2.0, 20001)
    collide = (-candidates * r.reshape(())) == (-candidates * bound)
    assert bool(collide.any())
    adv = candidates[collide][:1].reshape(1, 1)
    tied = ClipRange(CLIP.low, float(bound) - 1.0, CLIP.dual, CLIP.log_ratio_bound)
    assert torch.clamp(r, 1 - tied.low, 1 + tied.high) != r  # r is outside the clip range
    _, _, grad_tied = assert_same_bits(old, new, adv, mask, turn_level, tied)
    inside = ClipRange(CLIP.low, float(r) - 0.5, CLIP.dual, CLIP.log_ratio_bound)
    _, _, grad_inside = assert_same_bits(old, new, adv, mask, turn_level, inside)
    assert grad_inside[0, 0] != 0 and grad_tied[0, 0] == grad_inside[0, 0] / 2


def test_clamped_log_ratios_get_no_gradient():
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.1, 5.0, -5.0]])
    adv = torch.ones(1, 3)
    clip = ClipRange(0.2, 1e6, 3.0, log_ratio_bound=1.0)  # no PPO clipping, only the log-ratio clamp
    _, _, grad = assert_same_bits(old, new, adv, mask, False, clip)
    assert grad[0, 0] != 0 and grad[0, 1] == 0 and grad[0, 2] == 0


def test_gradient_reaches_log_prob_only():
    mask = torch.ones(1, 2, dtype=torch.bool)
    old, adv = torch.zeros(1, 2, requires_grad=True), torch.ones(1, 2)
    with pytest.raises(ValueError, match="log_prob only"):
        surrogate(old, torch.zeros(1, 2, requires_grad=True), adv, mask, None, CLIP)


def test_without_gradient_the_terms_are_the_same_and_detached():
    mask = torch.tensor([[True, True, False, True]])
    old, new, adv = torch.zeros(1, 4), torch.tensor([[0.5, -0.2, 0.0, 0.9]]), torch.tensor([[1.0, 1.0, 0.0, -2.0]])
    with torch.no_grad():
        plain = surrogate(old, new.requires_grad_(True), adv, mask, segment_runs(mask), CLIP)
    tracked = surrogate(old, new, adv, mask, segment_runs(mask), CLIP)
    assert plain.pg_losses.grad_fn is None and tracked.pg_losses.grad_fn is not None
    assert torch.equal(plain.pg_losses, tracked.pg_losses.detach())


# --- run-length segmentation ------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.lists(st.booleans(), min_size=1, max_size=30), min_size=1, max_size=6).filter(
        lambda r: len({len(x) for x in r}) == 1
    )
)
def test_runs_match_loop_reference_and_turn_tables(rows):
    mask = torch.tensor(rows)
    runs = segment_runs(mask)
    expected = [run for row in rows for run in loop_runs(row)]
    assert runs.lengths.tolist() == [n for _, n in expected]
    assert runs.is_turn.tolist() == [on for on, _ in expected]
    assert int(runs.num_turns) == sum(on for on, _ in expected)
    assert int(runs.rows_with_turns) == sum(any(row) for row in rows)
    values = torch.randn(mask.shape) * mask
    per_run = run_sum(values, runs)
    turns = segment_turns(mask)
    table = turn_sum(values, turns, zero_outside=True)
    assert torch.equal(per_run[runs.is_turn], table[turns.valid])  # the same additions, in the same order
    assert torch.equal(run_broadcast(per_run, runs), broadcast_turns(table, turns))


def test_runs_of_an_empty_mask():
    for shape in [(0, 5), (3, 0)]:
        runs = segment_runs(torch.zeros(shape, dtype=torch.bool))
        assert runs.lengths.numel() == 0 and int(runs.num_turns) == 0
        assert run_sum(torch.zeros(shape), runs).numel() == 0
        assert run_broadcast(torch.zeros(0), runs).shape == shape
