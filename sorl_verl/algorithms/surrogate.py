"""verl's dual-clip PPO surrogate on the SORL importance ratio, with its gradient written out.

Per token (``m`` = response mask, ``d = clamp(where(m, log_prob - old_log_prob, 0), ±bound)``,
``A = where(m, advantages, 0)``)::

    r = exp(mean of d over the token's turn)  (turn level)   or   exp(d)   (token level)
    pg1 = -A r    pg2 = -A clip(r, 1 - low, 1 + high)    c1 = max(pg1, pg2)    pg3 = -A c
    L = min(pg3, c1) where A < 0, else c1        (the float operations of verl's ``vanilla``)

With ``G = dloss/dL`` the gradient is ``dL/dr = f * (-A)``: ``f = 0`` where clipping is active
(``pg2 > pg1``, or ``c1 > pg3`` with ``A < 0``), ``f = 1`` elsewhere, and at an exact float tie
of the ``max`` or the ``min`` (``pg1 == pg2`` with ``r`` outside the clip range, ``c1 == pg3``
with ``A < 0``) the half that torch's autograd routes through each side. Then::

    dloss/dd[t] = (1/n_k) * sum over the turn k of t of (G f (-A) r)    (turn level)
                =  G f (-A) r                                            (token level)

zeroed where ``m = 0`` or where the clamp of ``d`` is active. These are the float operations
autograd performs on the same forward graph (``f`` is 0, 1/4, 1/2 or 1, so scaling by it is
exact), so loss and gradient are autograd's bit for bit, with a third of autograd's full-size
backward passes. Gradients reach ``log_prob`` only; ``old_log_prob`` and ``advantages`` must
not require them.

The same backward with ``f`` replaced by ``1`` is ``dl_u/dd`` of the unclipped surrogate
``-A r``, and with ``1 - f`` it is ``delta = dl_u/dd - dl/dd``, the clipping-bias cotangent of
SORL-SPEC "The clipping-bias term in parameter space" (0 wherever clipping is not active):
:attr:`Surrogate.removed` and :attr:`Surrogate.unclipped` when asked for with ``directions=True``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sorl_verl.algorithms.turns import Runs, run_broadcast, run_sum


@dataclass(frozen=True)
class ClipRange:
    """``low``/``high``: the PPO clip range ``[1 - low, 1 + high]``; ``dual``: ``clip_ratio_c``;
    ``log_ratio_bound``: ``d`` is clamped to ``[-bound, bound]`` before any exp."""

    low: float
    high: float
    dual: float
    log_ratio_bound: float


@dataclass(frozen=True)
class Surrogate:
    """The per-token terms of one micro-batch (all ``[B, T]`` unless noted).

    ``pg_losses``: ``L``, carrying the gradient to ``log_prob`` when that requires one;
    ``log_ratio``: ``d``; ``turn_log_ratio``: ``[S]`` mean of ``d`` per run (turn level, else None);
    ``update_sq``: ``(r A)^2``; ``upper``: ``pg2 > pg1``; ``lower``: ``c1 > pg3`` with ``A < 0``;
    ``clipped``: ``upper | lower`` (where clipping zeroed ``dL/dr``);
    ``removed`` / ``unclipped`` (with ``directions=True``, else None): ``G -> delta`` and
    ``G -> dl_u/dd`` for ``G = dloss/dL`` (module docstring), in ``log_prob``'s dtype.
    """

    pg_losses: torch.Tensor
    log_ratio: torch.Tensor
    turn_log_ratio: torch.Tensor | None
    update_sq: torch.Tensor
    upper: torch.Tensor
    lower: torch.Tensor
    clipped: torch.Tensor
    removed: _SurrogateBackward | None = None
    unclipped: _SurrogateBackward | None = None


@dataclass(frozen=True)
class _SurrogateBackward:
    """``dloss/dlog_prob`` from ``dloss/dL`` (module docstring); ``slope = f * (-A)``."""

    slope: torch.Tensor
    ratio: torch.Tensor
    runs: Runs | None
    grad_mask: torch.Tensor
    dtype: torch.dtype

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        g = grad * self.slope
        g = g * self.ratio
        if self.runs is not None:
            g = run_broadcast(run_sum(g, self.runs) / self.runs.lengths.to(g.dtype), self.runs)
        g = torch.where(self.grad_mask, g, torch.zeros((), dtype=g.dtype, device=g.device))
        return g.to(self.dtype)


class _WithGradient(torch.autograd.Function):
    """``value`` (computed without autograd) as a function of ``log_prob`` with a given backward."""

    @staticmethod
    def forward(ctx: Any, log_prob: torch.Tensor, value: torch.Tensor, backward: _SurrogateBackward) -> torch.Tensor:
        ctx.surrogate_backward = backward
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.surrogate_backward(grad), None, None


def _tie_exact_share(
    pg1: torch.Tensor,
    pg2: torch.Tensor,
    clip1: torch.Tensor,
    pg3: torch.Tensor,
    in_range: torch.Tensor,
    negative: torch.Tensor,
) -> torch.Tensor:
    """``f`` as torch's autograd routes ``dL/dr`` through ``max(pg1, pg2)``, ``clip`` and
    ``min(pg3, c1)``: a tie sends half of the gradient to each side."""
    dtype = pg1.dtype
    half = torch.full((), 0.5, dtype=dtype, device=pg1.device)
    through_pg1 = torch.where(pg1 == pg2, half, (pg1 > pg2).to(dtype))
    through_pg2 = torch.where(pg1 == pg2, half, (pg1 < pg2).to(dtype)) * in_range
    through_c1 = torch.where(clip1 == pg3, half, (clip1 < pg3).to(dtype))
    return torch.where(negative, through_c1, torch.ones((), dtype=dtype, device=pg1.device)) * (
        through_pg1 + through_pg2
    )


def surrogate(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    runs: Runs | None,
    clip: ClipRange,
    directions: bool = False,
) -> Surrogate:
    """The terms of the module docstring for a bool ``mask``; ``runs`` (from
    :func:`~sorl_verl.algorithms.turns.segment_runs`) selects the turn ratio, ``None`` the token
    ratio; ``directions`` adds ``removed`` and ``unclipped``. Computes in float32 (float64 inputs
    stay float64)."""
    differentiable = torch.is_grad_enabled() and log_prob.requires_grad
    if differentiable and (old_log_prob.requires_grad or advantages.requires_grad):
        raise ValueError(
            "the SORL losses differentiate with respect to log_prob only: detach old_log_prob and advantages"
        )
    with torch.no_grad():
        dtype = torch.promote_types(log_prob.dtype, torch.float32)
        zero = torch.zeros((), dtype=dtype, device=log_prob.device)
        # m = 0 positions are replaced (not multiplied) by 0, so NaN/inf there cannot leak; with
        # A = 0 and d = 0 there, every per-token term is exactly 0 on m = 0 positions.
        log_ratio = torch.where(mask, log_prob.detach().to(dtype) - old_log_prob.to(dtype), zero)
        grad_mask = mask
        if log_ratio.numel() > 0:
            lowest, highest = torch.stack(list(torch.aminmax(log_ratio))).tolist()
            bound = clip.log_ratio_bound
            if not (-bound <= lowest and highest <= bound):  # NaN also lands here
                grad_mask = mask & (log_ratio >= -bound) & (log_ratio <= bound)
                log_ratio = torch.clamp(log_ratio, min=-bound, max=bound)
        adv = torch.where(mask, advantages.to(dtype), zero)
        if runs is not None:
            turn_log_ratio = run_sum(log_ratio, runs) / runs.lengths.to(dtype)
            ratio = torch.exp(run_broadcast(turn_log_ratio, runs))
        else:
            turn_log_ratio = None
            ratio = torch.exp(log_ratio)

        neg_adv = -adv
        pg1 = neg_adv * ratio
        clipped_ratio = torch.clamp(ratio, 1 - clip.low, 1 + clip.high)
        pg2 = neg_adv * clipped_ratio
        clip1 = torch.maximum(pg1, pg2)
        pg3 = neg_adv * clip.dual
        clip2 = torch.min(pg3, clip1)
        negative = adv < 0
        pg_losses = torch.where(negative, clip2, clip1)
        upper = torch.gt(pg2, pg1)
        lower = torch.gt(clip1, pg3) & negative
        clipped = upper | lower
        removed = unclipped = None
        if differentiable or directions:
            slope = torch.where(clipped, zero, neg_adv)
            ties = ((pg1 == pg2) & (ratio != clipped_ratio)) | ((clip1 == pg3) & negative)
            if int(torch.count_nonzero(ties)) > 0:  # count_nonzero: one vectorized pass (any() is not)
                share = _tie_exact_share(pg1, pg2, clip1, pg3, ratio == clipped_ratio, negative)
                slope = share * neg_adv
            backward = _SurrogateBackward(slope, ratio, runs, grad_mask, log_prob.dtype)
            if directions:  # (1 - f) * (-A) is exactly 0 where f = 1 (no clipping)
                removed = _SurrogateBackward(neg_adv - slope, ratio, runs, grad_mask, log_prob.dtype)
                unclipped = _SurrogateBackward(neg_adv, ratio, runs, grad_mask, log_prob.dtype)
    if differentiable:
        pg_losses = _WithGradient.apply(log_prob, pg_losses, backward)
    return Surrogate(pg_losses, log_ratio, turn_log_ratio, pg1.square(), upper, lower, clipped, removed, unclipped)
