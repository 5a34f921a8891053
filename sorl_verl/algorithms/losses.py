"""SORL policy losses: turn-level importance sampling and clipping-triggered normalization.

Per token (``m`` = response_mask, ``d = clamp(log_prob - old_log_prob, ±log_ratio_clamp)``)::

    r = exp(mean of d over the token's turn)   (turn ratio)   or   exp(d)   (token ratio)
    L = verl vanilla dual-clip surrogate with r in place of the token ratio [* rollout_is_weights]
    x = 1 where clipping zeroed dL/dr;  c = x * r * A  (no gradient)
    ||C|| = sqrt(sum c^2 / sum m);  rho = sqrt(sum c^2 / sum (r A)^2)   (sums over the data-parallel
            group if scope=global)
    q = ||C|| (reference=absolute) | rho (reference=relative)
      | ||C(theta)|| (reference=gradient) | ||C(theta)|| / ||grad l_u|| (reference=gradient_relative)
        with C(theta) the clipping-bias term in parameter space (:mod:`~sorl_verl.algorithms.clip_bias_grad`)
    Z = max(1, q/tau) | 1 + q/tau | 1     (clip_norm_mode = max | add | none)
    apply=loss:   loss = agg_loss(L, m, loss_agg_mode, **global_batch_info) / Z      (Z a constant)
    apply=update: loss = agg_loss(...); 1/Z is published to the optimizer of this process, whose
                  step is scaled by the mean of 1/Z over the step's micro-batches (the hand-off
                  is :func:`sorl_verl.algorithms.optim.publish_normalizer`)

Every mode logs ``sorl/clip_bias_grad_norm`` = ||C(theta)|| on the first micro-batch after each
optimizer step (on every micro-batch where a gradient reference drives Z), whatever its reference,
and on every micro-batch the effective sample sizes ``sorl/ess_token`` and ``sorl/ess_turn`` of the
importance weights (:mod:`~sorl_verl.algorithms.ess`; detached, they change no loss or gradient).

``turn_ppo`` (turn ratio, Z = 1), ``s_ppo`` (token ratio, Z on), ``so_ppo`` and ``so_grpo``
(turn ratio, Z on) share :func:`sorl_policy_loss`; ``vanilla_diag`` is verl's ``vanilla``
unchanged plus that diagnostic (for GRPO/PPO baselines); registration is in :mod:`sorl_verl.plugin`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_vanilla

from sorl_verl.algorithms.clip_bias_grad import DIAGNOSTIC, GradientNorms, clip_bias_gradient_norms
from sorl_verl.algorithms.ess import ess_metrics
from sorl_verl.algorithms.knobs import GRADIENT_REFERENCES, SORLKnobs, read_knobs
from sorl_verl.algorithms.optim import check_step_scaling, publish_normalizer
from sorl_verl.algorithms.parallel import data_parallel_group
from sorl_verl.algorithms.surrogate import ClipRange, Surrogate, surrogate
from sorl_verl.algorithms.turns import segment_runs


def _clip_params(config: Any) -> tuple[float, float, float]:
    """(clip_ratio_low, clip_ratio_high, clip_ratio_c) read exactly as verl's ``vanilla`` does."""
    clip_ratio = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    clip_ratio_c = config.get("clip_ratio_c", 3.0)
    if not clip_ratio_c > 1.0:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    return low, high, clip_ratio_c


def clip_bias_stats(
    sum_sq_bias: torch.Tensor, num_tokens: torch.Tensor, sum_sq_update: torch.Tensor, scope: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||C||, rho)``: ``sqrt(sum c^2 / sum m)`` and ``sqrt(sum c^2 / sum (r A)^2)`` (float64; 0 without tokens).

    The three sums are all-reduced over the data-parallel group (:func:`data_parallel_group`)
    when ``scope == "global"`` and ``torch.distributed`` is initialized; every rank of that group
    must then call the loss equally often.
    """
    sums = torch.stack([sum_sq_bias.double(), num_tokens.double(), sum_sq_update.double()])
    if scope == "global" and dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=data_parallel_group())
    norm = torch.sqrt(sums[0] / sums[1].clamp_min(1.0))
    rel = torch.where(sums[2] > 0, torch.sqrt(sums[0] / torch.where(sums[2] > 0, sums[2], 1.0)), 0.0)
    return norm, rel.clamp(max=1.0)


def aggregation_mass(mask: torch.Tensor, loss_agg_mode: str, config: Any) -> torch.Tensor:
    """``w = agg_loss(m)`` (float64, no gradient): the micro-batch's aggregation mass, its share of the
    mini-batch loss. verl's ``agg_loss`` (with ``global_batch_info``) is linear in ``L``, so ``w`` is the
    sum over the policy tokens of ``G = dl/dL`` (:func:`aggregation_weights`), without
    ``rollout_is_weights``; 0 for a micro-batch without policy tokens (no 0/0). It weighs the micro-batch
    in the step factor ``s`` (:func:`~sorl_verl.algorithms.optim.publish_normalizer`'s ``share``) and
    scales its ``C(theta)`` to a whole mini-batch's (:func:`whole_batch_scale`)."""
    if not bool(mask.any()):
        return torch.zeros((), dtype=torch.float64, device=mask.device)
    with torch.no_grad():
        return agg_loss(loss_mat=mask.double(), loss_mask=mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info)


def aggregation_weights(
    mask: torch.Tensor, loss_agg_mode: str, config: Any, dtype: torch.dtype, rollout_is_weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, w)``: ``G = dl/dL`` per token and the micro-batch's aggregation mass ``w``
    (:func:`aggregation_mass`). verl's ``agg_loss`` is linear in ``L``, so its gradient at a zero probe
    is exactly the weight the loss gives each token; ``G`` is then multiplied by ``rollout_is_weights``
    as the loss applies them, 0 where ``m = 0``."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    probe = torch.zeros(mask.shape, dtype=dtype, device=mask.device, requires_grad=True)
    with torch.enable_grad():
        aggregated = agg_loss(loss_mat=probe, loss_mask=mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info)
        (weights,) = torch.autograd.grad(aggregated, probe, allow_unused=True, materialize_grads=True)
    weights = torch.where(mask, weights, zero)
    if rollout_is_weights is not None:
        weights = weights * rollout_is_weights.to(dtype)
    return weights, aggregation_mass(mask, loss_agg_mode, config)


def whole_batch_mass(loss_agg_mode: str, batch_info: dict, horizon: int) -> float | None:
    """``W = (1/dp) * sum of G`` over the whole mini-batch (all micro-batches, all ranks; FSDP averages
    the ranks' gradients) from verl's ``global_batch_info``: 1 for token-mean and seq-mean-token-mean,
    ``N`` for token-sum, ``N / B`` for seq-mean-token-sum (``/ loss_scale_factor`` for -norm, by default
    this micro-batch's ``horizon``). None without the global counts: the micro-batch is its own whole."""
    tokens, rows = batch_info.get("batch_num_tokens"), batch_info.get("global_batch_size")
    if loss_agg_mode == "token-mean":
        return None if tokens is None else 1.0
    if loss_agg_mode == "token-sum":
        return None if tokens is None else float(tokens)
    if loss_agg_mode == "seq-mean-token-mean":
        return None if rows is None else 1.0
    if tokens is None or rows is None:
        return None
    mass = float(tokens) / float(rows)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        mass /= float(batch_info.get("loss_scale_factor") or horizon)
    return mass


def whole_batch_scale(mass: torch.Tensor, loss_agg_mode: str, config: Any, horizon: int, scope: str) -> torch.Tensor:
    """``k = W / w``: scales a micro-batch's ``C`` (its share of the globally aggregated loss) back to a
    whole mini-batch's, so that ``q`` does not depend on how the mini-batch is split over micro-batches
    and ranks. ``w`` = this micro-batch's aggregation mass ``sum of G``, averaged over the data-parallel
    group for scope ``global`` (whose ``C`` is the ranks' mean); 1 where ``W`` is unknown or ``w = 0``."""
    whole = whole_batch_mass(loss_agg_mode, dict(config.global_batch_info), horizon)
    if scope == "global" and dist.is_available() and dist.is_initialized():
        group = data_parallel_group()
        if dist.get_world_size(group) > 1:
            mass = mass.clone()
            dist.all_reduce(mass, op=dist.ReduceOp.SUM, group=group)
            mass = mass / dist.get_world_size(group)
    one = torch.ones((), dtype=torch.float64, device=mass.device)
    if whole is None:
        return one
    return torch.where(mass > 0, whole / torch.where(mass > 0, mass, 1.0), one)


def clip_bias_gradient(
    terms: Surrogate,
    log_prob: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None,
    scope: str,
    reference: str | None,
) -> GradientNorms | None:
    """``||C(theta)||`` (and ``/ ||grad l_u||`` for ``gradient_relative``) of one micro-batch, scaled to a
    whole mini-batch's (:func:`whole_batch_scale`); ``terms`` built with ``directions=True``. A micro-batch
    without policy tokens contributes ``delta = 0``. ``reference`` is the gradient reference that drives
    ``Z`` (it raises where the product cannot be taken); None for the diagnostic, which then gives None
    with one warning (:func:`~sorl_verl.algorithms.clip_bias_grad.clip_bias_gradient_norms`)."""
    dtype = terms.update_sq.dtype
    if bool(mask.any()):
        weights, mass = aggregation_weights(mask, loss_agg_mode, config, dtype, rollout_is_weights)
    else:  # no token: no weights to take (0/0), and delta = 0
        weights = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        mass = torch.zeros((), dtype=torch.float64, device=mask.device)
    unclipped = (lambda: terms.unclipped(weights)) if reference == "gradient_relative" else None
    strategy = getattr(config, "strategy", None)
    norms = clip_bias_gradient_norms(
        log_prob, terms.removed(weights), unclipped, scope, strict=reference is not None, strategy=strategy,
        reference=reference or "gradient",
    )  # fmt: skip
    if norms is None or not norms.computed:
        return norms
    scale = whole_batch_scale(mass, loss_agg_mode, config, mask.shape[-1], scope)
    return GradientNorms(norms.norm * scale.to(norms.norm.device), norms.rel, True)


def normalizer(norm: torch.Tensor, knobs: SORLKnobs) -> torch.Tensor:
    """``Z`` from the reference quantity ``q``: ``max(1, q/tau)``, ``1 + q/tau`` or ``1``."""
    if knobs.clip_norm_mode == "none":
        return torch.ones((), dtype=torch.float64, device=norm.device)
    scaled = norm / knobs.clip_norm_tau
    if knobs.clip_norm_mode == "add":
        return 1.0 + scaled
    return torch.clamp(scaled, min=1.0)


#: metric -> how verl must aggregate it over micro-batches and ranks where the mean would be wrong
#: (``AggregationType`` values; :mod:`sorl_verl.trainer.metric_aggregation` applies them)
RATIO_EXTREMA = {f"sorl/{unit}_ratio_{end}": end for unit in ("turn", "token") for end in ("max", "min")}


def _ratio_metrics(log_ratio: torch.Tensor, valid: torch.Tensor, low: float, high: float, unit: str) -> dict:
    """Mean / max / min of the ratios the loss uses and the fraction outside the trust region.

    ``unit`` is ``turn`` (``[B, K]`` turn log-ratios, geometric-mean ratios) or ``token``
    (``[B, T]`` token log-ratios); an empty micro-batch gives ratios 1 and clip fraction 0. The
    ``_max`` / ``_min`` entries are this micro-batch's; :data:`RATIO_EXTREMA` says how to combine them.
    """
    one = torch.ones((), dtype=torch.float64, device=log_ratio.device)
    if log_ratio.numel() == 0:  # a shape, known on the host
        log_ratio, valid = (
            torch.zeros(1, device=log_ratio.device),
            torch.zeros(1, dtype=torch.bool, device=valid.device),
        )
    ratios = torch.exp(log_ratio.double())
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=ratios.device)
    n = valid.sum()
    some = n > 0  # decided on the device: the metrics cost no host synchronization
    outside = ((ratios < 1.0 - low) | (ratios > 1.0 + high)) & valid
    return {
        f"sorl/{unit}_ratio_mean": torch.where(some, torch.where(valid, ratios, 0.0).sum() / n.clamp_min(1), one),
        f"sorl/{unit}_ratio_max": torch.where(some, torch.where(valid, ratios, -inf).amax(), one),
        f"sorl/{unit}_ratio_min": torch.where(some, torch.where(valid, ratios, inf).amin(), one),
        f"sorl/{unit}_clipfrac": outside.sum() / n.clamp_min(1),
    }


def sorl_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    turn_level: bool,
    normalize: bool,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The SORL surrogate (module docstring) with verl's ``PolicyLossFn`` contract.

    ``turn_level`` picks the turn ratio over the token ratio; ``normalize=False`` forces Z = 1
    whatever ``clip_norm_mode`` says. Computes in float32 (float64 inputs stay float64).
    """
    assert config is not None
    low, high, clip_ratio_c = _clip_params(config)
    knobs = read_knobs(config)
    mask = response_mask.bool()
    runs = segment_runs(mask)
    clip = ClipRange(low=low, high=high, dual=clip_ratio_c, log_ratio_bound=knobs.log_ratio_clamp)
    publish = torch.is_grad_enabled() and log_prob.requires_grad
    active = normalize and knobs.clip_norm_mode != "none"
    by_gradient = active and knobs.clip_norm_reference in GRADIENT_REFERENCES
    # ||C(theta)|| on every micro-batch when it drives Z, else once per optimizer step (diagnostic)
    take_gradient = publish and (by_gradient or DIAGNOSTIC.claim())
    terms = surrogate(
        old_log_prob, log_prob, advantages, mask, runs if turn_level else None, clip, directions=take_gradient
    )
    grad_norms = None
    if take_gradient:
        grad_norms = clip_bias_gradient(
            terms,
            log_prob,
            mask,
            loss_agg_mode,
            config,
            rollout_is_weights,
            knobs.clip_norm_scope,
            knobs.clip_norm_reference if by_gradient else None,
        )
    pg_losses = terms.pg_losses
    zero = torch.zeros((), dtype=pg_losses.dtype, device=pg_losses.device)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * torch.where(mask, rollout_is_weights.to(pg_losses.dtype), zero)

    with torch.no_grad():
        num_tokens = torch.where(runs.is_turn, runs.lengths, 0).sum()
        sum_sq_bias = torch.where(terms.clipped, terms.update_sq, zero).sum()  # c^2, c = x * r * A
        norm, rel = clip_bias_stats(sum_sq_bias, num_tokens, terms.update_sq.sum(), knobs.clip_norm_scope)
        if knobs.clip_norm_reference in GRADIENT_REFERENCES:  # no gradient to take: q = 0, Z = 1
            grad_q = None if grad_norms is None else grad_norms.rel if grad_norms.rel is not None else grad_norms.norm
            reference = torch.zeros_like(norm) if grad_q is None else grad_q.to(norm.device)
        else:
            reference = rel if knobs.clip_norm_reference == "relative" else norm
        z = normalizer(reference, knobs) if active else torch.ones((), dtype=torch.float64, device=norm.device)
        at_update = knobs.clip_norm_apply == "update"
        if publish and active and at_update:
            check_step_scaling(config)
        loss_share = aggregation_mass(mask, loss_agg_mode, config)  # its weight in the step factor s (optim.py)

    if bool(runs.is_turn.any()):
        pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info)
        if not at_update:
            pg_loss = pg_loss / z.to(pg_loss.dtype)
    else:  # no policy token: a zero loss that still reaches the graph, never 0/0
        pg_loss = torch.where(mask, log_prob, torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)).sum() * 0

    with torch.no_grad():
        if turn_level:
            stats = _ratio_metrics(terms.turn_log_ratio, runs.is_turn, low, high, "turn")
        else:
            stats = _ratio_metrics(terms.log_ratio, mask, low, high, "token")
        stats["sorl/num_turns_mean"] = runs.num_turns.double() / runs.rows_with_turns.clamp_min(1)
        stats.update(ess_metrics(terms.log_ratio, mask, runs))  # detached, float64: no effect on the loss
        token_denominator = num_tokens + 1e-8  # verl's masked_mean
        inv_z = 1.0 / z
        stats["sorl/clip_bias_norm"] = norm
        stats["sorl/clip_bias_rel"] = rel
        if grad_norms is not None:
            stats["sorl/clip_bias_grad_norm"] = grad_norms.norm
            if grad_norms.rel is not None:
                stats["sorl/clip_bias_grad_rel"] = grad_norms.rel
        stats["sorl/norm_factor"] = z
        stats["sorl/triggered"] = (z > 1.0).double()
        stats["sorl/update_scale"] = inv_z if at_update else torch.ones_like(z)
        stats["sorl/loss_scale"] = torch.ones_like(z) if at_update else inv_z
        stats["loss_share"] = loss_share
        stats["actor/pg_clipfrac"] = terms.upper.sum().to(torch.float32) / token_denominator
        stats["actor/ppo_kl"] = -terms.log_ratio.sum() / token_denominator
        stats["actor/pg_clipfrac_lower"] = terms.lower.sum().to(torch.float32) / token_denominator
        values = torch.stack([v.double().reshape(()).to(norm.device) for v in stats.values()]).tolist()  # one sync
    metrics = dict(zip(stats, values, strict=True))
    share = metrics.pop("loss_share")
    if publish:
        z_, norm_, rel_ = (metrics[f"sorl/{name}"] for name in ("norm_factor", "clip_bias_norm", "clip_bias_rel"))
        publish_normalizer(z_, norm_, rel_, acts_on_update=active and at_update, share=share)
    return pg_loss, metrics


def _sorl_loss(loss_mode: str, turn_level: bool, normalize: bool, doc: str) -> Callable[..., tuple[torch.Tensor, dict]]:
    """``compute_policy_loss_<loss_mode>``: :func:`sorl_policy_loss` with its two switches fixed, under
    verl's ``PolicyLossFn`` signature."""

    def loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return sorl_policy_loss(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
            turn_level=turn_level, normalize=normalize,
        )  # fmt: skip

    loss.__name__ = loss.__qualname__ = f"compute_policy_loss_{loss_mode}"  # the module attribute it is bound to
    loss.__doc__ = doc
    loss.normalizes = normalize  # type: ignore[attr-defined]
    return loss


compute_policy_loss_turn_ppo = _sorl_loss(
    "turn_ppo", turn_level=True, normalize=False, doc="Turn-PPO ablation: turn-level ratio, no normalization."
)
compute_policy_loss_s_ppo = _sorl_loss(
    "s_ppo",
    turn_level=False,
    normalize=True,
    doc="S-PPO ablation: token-level ratio with clipping-triggered normalization.",
)
compute_policy_loss_so_ppo = _sorl_loss(
    "so_ppo",
    turn_level=True,
    normalize=True,
    doc="SO-PPO loss: turn-level ratio with clipping-triggered normalization.",
)
compute_policy_loss_so_grpo = _sorl_loss(
    "so_grpo",
    turn_level=True,
    normalize=True,
    doc="SO-GRPO loss: the SO-PPO loss under its own name (pair it with the ``so_grpo`` estimator).",
)


def _vanilla_ess(old_log_prob: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """:func:`~sorl_verl.algorithms.ess.ess_metrics` of ``vanilla``'s token ratio (its log-ratio clamped to
    ±20 as ``vanilla`` clamps it), with turns from the response mask as the turn-level losses take them."""
    with torch.no_grad():
        mask = response_mask.bool()
        zero = torch.zeros((), dtype=torch.float64, device=log_prob.device)
        log_ratio = torch.where(mask, log_prob.detach().double() - old_log_prob.detach().double(), zero)
        stats = ess_metrics(log_ratio.clamp(min=-20.0, max=20.0), mask, segment_runs(mask))
        values = torch.stack(list(stats.values())).tolist() if stats else []  # one host synchronization
    return dict(zip(stats, values, strict=True))


def compute_policy_loss_vanilla_diag(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``vanilla`` loss, called unchanged (loss, gradient and metrics are its own), plus the
    diagnostic ``sorl/clip_bias_grad_norm`` of its token-ratio dual-clip surrogate on the first
    micro-batch after each optimizer step and ``sorl/ess_token`` / ``sorl/ess_turn`` on every
    micro-batch (detached): the GRPO/PPO baselines log what the SORL modes log."""
    pg_loss, metrics = compute_policy_loss_vanilla(
        old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )
    metrics = {**metrics, **_vanilla_ess(old_log_prob, log_prob, response_mask)}
    if torch.is_grad_enabled() and log_prob.requires_grad and DIAGNOSTIC.claim():
        low, high, clip_ratio_c = _clip_params(config)
        knobs = read_knobs(config)
        mask = response_mask.bool()
        clip = ClipRange(low=low, high=high, dual=clip_ratio_c, log_ratio_bound=20.0)  # vanilla's own clamp
        with torch.no_grad():
            terms = surrogate(old_log_prob, log_prob.detach(), advantages, mask, None, clip, directions=True)
        grad_norms = clip_bias_gradient(
            terms, log_prob, mask, loss_agg_mode, config, rollout_is_weights, knobs.clip_norm_scope, None
        )
        if grad_norms is not None:
            metrics = {**metrics, "sorl/clip_bias_grad_norm": float(grad_norms.norm)}
    return pg_loss, metrics


#: the SORL losses (:func:`sorl_policy_loss`)
SORL_LOSSES = {
    "turn_ppo": compute_policy_loss_turn_ppo,
    "s_ppo": compute_policy_loss_s_ppo,
    "so_ppo": compute_policy_loss_so_ppo,
    "so_grpo": compute_policy_loss_so_grpo,
}
#: loss_mode name -> function, registered into verl by :mod:`sorl_verl.plugin`
POLICY_LOSSES = {**SORL_LOSSES, "vanilla_diag": compute_policy_loss_vanilla_diag}
#: the SORL losses whose normalizer can act (``turn_ppo``'s Z is 1 by definition)
NORMALIZING_LOSSES = tuple(name for name, fn in SORL_LOSSES.items() if fn.normalizes)  # type: ignore[attr-defined]
