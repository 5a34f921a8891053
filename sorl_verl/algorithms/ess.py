"""Effective sample size of the importance weights, logged by every policy loss the plugin registers.

For importance weights ``w_i = exp(l_i)`` over the ``n`` valid entries of one micro-batch::

    ESS = (sum w)^2 / (n * sum w^2)  =  exp(2 LSE(l) - LSE(2 l) - log n)        (LSE = log-sum-exp)

in ``[1/n, 1]``: 1 when every weight is equal (on-policy, ``l = 0``), ``1/n`` when one weight holds all
the mass. It is invariant to scaling every ``w`` by a constant (a shift of every ``l``), so it measures
how unevenly the data are weighted, not how far the mean ratio is from 1. It is computed in float64 from
the log-ratios through the log-sum-exp form (no overflow for any ``|l|``) under ``torch.no_grad`` from
detached inputs, and clamped to ``[1/n, 1]`` against rounding; a micro-batch with no valid entry gives 1
(nothing is weighted unevenly), as the ratio metrics give ratio 1 there.

Two metrics (:func:`ess_metrics`):

- ``sorl/ess_token``: ``l`` = the token log-ratio ``d = log_prob - old_log_prob`` of every policy token
  (``response_mask = 1``), clamped to ``±log_ratio_clamp`` as the loss clamps it before any exp;
- ``sorl/ess_turn``: ``l`` = the turn log-ratio, the mean of ``d`` over the tokens of each turn (turns
  from :func:`~sorl_verl.algorithms.turns.segment_runs`: maximal runs of policy tokens in a row), i.e.
  the weight is the turn ratio of the turn-level losses, the geometric mean of the turn's token ratios.
  The token-ratio losses (``s_ppo``, ``vanilla_diag``) log the same quantity from the same turns.

Aggregation over micro-batches and ranks: verl's actor loss (``ppo_loss``) wraps every loss metric in
a MEAN ``Metric``, so the value logged for a training step is the unweighted mean of the micro-batch
ESS values over all micro-batches of every mini-batch, epoch and data-parallel rank of that step. It is
deliberately not re-labelled in :mod:`sorl_verl.trainer.metric_aggregation` (unlike the ratio extrema):
a mean of a bounded, scale-free per-micro-batch quantity stays in ``(0, 1]`` and is not driven by a
single micro-batch; it is not the ESS of the pooled mini-batch (which would need the sums all-reduced).
"""

from __future__ import annotations

import math

import torch

from sorl_verl.algorithms.turns import Runs, run_sum

#: metric keys (verl's actor prefixes them with ``actor/``)
ESS_TOKEN, ESS_TURN = "sorl/ess_token", "sorl/ess_turn"


@torch.no_grad()
def effective_sample_size(log_weights: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """float64 scalar ``(sum w)^2 / (n sum w^2)`` over the entries where ``valid``, ``w = exp(log_weights)``
    (module docstring); ``log_weights`` and ``valid`` have the same shape; 1 when no entry is valid."""
    log_w = log_weights.detach().to(torch.float64)
    valid = valid.bool()
    n = valid.sum()
    if log_w.numel() == 0:
        return torch.ones((), dtype=torch.float64, device=log_w.device)
    neg_inf = torch.tensor(-math.inf, dtype=torch.float64, device=log_w.device)
    some = n > 0  # decided on the device: no host synchronization
    safe = torch.where(valid, log_w, 0.0)  # finite wherever it is used
    lse = torch.logsumexp(torch.where(valid, safe, neg_inf).reshape(-1), dim=0)
    lse_sq = torch.logsumexp(torch.where(valid, 2.0 * safe, neg_inf).reshape(-1), dim=0)
    count = n.to(torch.float64).clamp_min(1.0)
    log_ess = torch.where(some, 2.0 * lse - lse_sq - torch.log(count), 0.0)
    return torch.exp(log_ess).clamp(min=1.0 / count, max=1.0)


@torch.no_grad()
def ess_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, runs: Runs) -> dict[str, torch.Tensor]:
    """``{sorl/ess_token, sorl/ess_turn}`` of one micro-batch (float64 scalars).

    ``log_ratio``: ``[B, T]`` token log-ratios (already clamped, 0 where ``mask`` is False); ``runs``:
    :func:`~sorl_verl.algorithms.turns.segment_runs` of ``mask``. The turn log-ratios are the per-run
    means of ``log_ratio`` taken here in float64, the same for every loss mode.
    """
    log_ratio = log_ratio.detach().to(torch.float64)
    turn_log_ratio = run_sum(log_ratio, runs) / runs.lengths.to(torch.float64).clamp_min(1.0)
    return {
        ESS_TOKEN: effective_sample_size(log_ratio, mask),
        ESS_TURN: effective_sample_size(turn_log_ratio, runs.is_turn),
    }
