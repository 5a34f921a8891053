"""The SORL losses and estimators on a device: float32 (and bfloat16 inputs) against a CPU float64 reference,
the identities of SORL-SPEC.md on the device, and the overhead against verl's own loss and GAE.

On the GPU machine the device command is ``bash scripts/bench/loss_cuda_device.sh`` with ``.gpu`` carried: verl is
not installed there, so that script unpacks ``.gpu/site.tar.xz`` into /tmp/site and runs::

    PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 \
        python3 scripts/bench/loss_cuda.py --device cuda --json-out $OUT/loss_cuda_results.json

Here, on the CPU, with tiny shapes (what tests/unit/test_loss_cuda_script.py runs)::

    .venv/bin/python scripts/bench/loss_cuda.py --device cpu --small [--json-out PATH]

Correctness. Every quantity computed on ``--device`` (loss, gradient with respect to ``log_prob``, each
metric, advantages and returns) is compared with a float64 CPU reference written here from the formulas of
SORL-SPEC.md (independent of the project's turn segmentation and surrogate), element by element, against a
bound derived from float32 rounding: ``u = 2**-24`` per rounding, ``n u sum|x|`` for a reduction of ``n``
terms in any order (the worst case, so the bounds on sums over a whole micro-batch are loose: the printed
``err/bound`` says by how much), 2 ulps for ``exp``/``pow`` (CUDA's documented maximum), and ``2**-8`` for
a result rounded to bfloat16. Inputs are drawn so that no turn (or token) ratio lies within twice its own
error bound of a clip boundary (``1 - low``, ``1 + high``, ``clip_ratio_c``): float32 and float64 then take
the same branch and clip counts must agree exactly. The project's own float64 CPU result is checked against
the same reference (float64 bounds), which validates the reference. A check fails when any element is
outside its bound; the script exits 1 if any check fails.

Identities (SORL-SPEC.md, as tests/unit/test_algo_losses.py states them): on-policy ratios are 1 and
``Z = 1`` exactly and the gradient is ``-A m / N``; length-1 turns with ``clip_norm_mode=none`` give verl's
``vanilla`` loss and gradient bit for bit; ``so_grpo`` and ``so_ppo`` are the same loss bit for bit; no
clipping gives ``Z = 1`` and the ``turn_ppo`` loss and gradient bit for bit; heavy clipping gives ``Z > 1``,
loss and gradient ``1/Z`` of the un-normalized ones and a smaller gradient norm; the unclipped gradient is
``-r_k sum_turn(A) / (|turn| N)``; turn ratios are geometric means of token ratios; ``so_grpo`` advantages
equal verl's ``grpo`` and are 0 where ``m = 0``.

Timing (as scripts/bench/loss_overhead.py, whose ``multi_turn_mask`` and ``paired_medians`` this imports):
``so_grpo`` vs verl ``vanilla`` forward+backward (target ratio <= 1.3) and the ``so_ppo`` turn-level GAE vs
verl ``gae`` (target <= 1.0), alternating call by call; on CUDA each call ends with
``torch.cuda.synchronize()`` (wall and host-CPU medians) and is also timed with CUDA events. The losses
synchronize with the host (``.item()``/``.tolist()``, ``nonzero``); the number of synchronizing calls per
call, counted with ``torch.cuda.set_sync_debug_mode("warn")``, is reported. Timing targets are reported, not
part of the exit status.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import verl
from verl.trainer.ppo.core_algos import (
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_policy_loss_vanilla,
)
from verl.workers.config import ActorConfig

from sorl_verl.algorithms import optim
from sorl_verl.algorithms.advantages import compute_so_grpo_outcome_advantage, compute_turn_gae_advantage_return
from sorl_verl.algorithms.clip_bias_grad import DIAGNOSTIC
from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.losses import (
    compute_policy_loss_s_ppo,
    compute_policy_loss_so_grpo,
    compute_policy_loss_so_ppo,
    compute_policy_loss_turn_ppo,
)


def _load_loss_overhead() -> Any:
    """scripts/bench/loss_overhead.py as a module (scripts/ is not a package)."""
    path = Path(__file__).resolve().with_name("loss_overhead.py")
    spec = importlib.util.spec_from_file_location("sorl_bench_loss_overhead", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_overhead = _load_loss_overhead()
multi_turn_mask: Callable[..., torch.Tensor] = _overhead.multi_turn_mask
paired_medians: Callable[..., tuple[dict[str, float], dict[str, float]]] = _overhead.paired_medians

U32 = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53
U_BF16 = 2.0**-8  # bfloat16 unit roundoff (8 significant bits)
EXP_ULPS = 2  # max error of CUDA's expf/powf (CUDA C Programming Guide, mathematical functions); glibc/SLEEF <= 1
HIGHER_ORDER = 1.01  # first-order bounds times this cover the neglected products of tiny relative errors
LOW, HIGH, CLIP_C = 0.2, 0.2, 3.0  # verl's defaults, which ActorConfig() carries
LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {
    "so_grpo": compute_policy_loss_so_grpo,
    "so_ppo": compute_policy_loss_so_ppo,
    "turn_ppo": compute_policy_loss_turn_ppo,
    "s_ppo": compute_policy_loss_s_ppo,
    "vanilla": compute_policy_loss_vanilla,
}
TURN_LEVEL = {"so_grpo": True, "so_ppo": True, "turn_ppo": True, "s_ppo": False, "vanilla": False}
NORMALIZE = {"so_grpo": True, "so_ppo": True, "turn_ppo": False, "s_ppo": True, "vanilla": False}
_KEEP: list[Any] = []
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass
class Check:
    """One comparison: ``passed`` iff every element is within its bound (``bound == 0``: bit for bit)."""

    name: str
    passed: bool
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    max_bound: float = 0.0
    err_over_bound: float = 0.0
    note: str = ""


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        return check

    def compare(self, name: str, got: Any, ref: Any, bound: Any, note: str = "") -> Check:
        """Element-wise ``|got - ref| <= bound`` (``got`` on any device/dtype, ``ref``/``bound`` float64)."""
        got64 = (
            got.detach().to("cpu", torch.float64) if torch.is_tensor(got) else torch.tensor(got, dtype=torch.float64)
        )
        ref64 = torch.as_tensor(ref, dtype=torch.float64)
        bound64 = torch.broadcast_to(torch.as_tensor(bound, dtype=torch.float64), ref64.shape)
        err = (got64 - ref64).abs()
        finite = bool(torch.isfinite(got64).all())
        ok = finite and bool((err <= bound64).all())
        scale = ref64.abs().clamp_min(torch.finfo(torch.float64).tiny)
        ratio = torch.where(bound64 > 0, err / bound64.clamp_min(1e-300), torch.where(err > 0, math.inf, 0.0))
        return self.add(
            Check(
                name,
                ok,
                float(err.max()) if err.numel() else 0.0,
                float((err / scale).max()) if err.numel() else 0.0,
                float(bound64.max()) if bound64.numel() else 0.0,
                float(ratio.max()) if ratio.numel() else 0.0,
                note if finite else "non-finite result " + note,
            )
        )

    def truth(self, name: str, ok: bool, note: str = "") -> Check:
        return self.add(Check(name, bool(ok), note=note))

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


# --- inputs -----------------------------------------------------------------------------------


def turn_ids(mask: torch.Tensor) -> torch.Tensor:
    """long ``[B, T]``: 1..K for the turns of each row (the spec's cumsum definition), 0 where ``m = 0``."""
    start = mask & ~F.pad(mask[:, :-1], (1, 0), value=False)
    return torch.cumsum(start.long(), dim=-1) * mask


def per_turn(values: torch.Tensor, tid: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, K + 1]`` float64 sums over each turn (column 0 collects the ``m = 0`` positions)."""
    table = torch.zeros(values.shape[0], k + 1, dtype=torch.float64)
    return table.scatter_add(1, tid, values.double())


@dataclass
class Inputs:
    mask: torch.Tensor  # bool [B, T]
    old: torch.Tensor  # float32 [B, T]
    new_turn: torch.Tensor  # old + a shift per turn + token noise: turn ratios spread over the clip range
    new_token: torch.Tensor  # the same for token-ratio losses, with the token-level margin
    rewards: torch.Tensor  # float32 [B, T]: outcome on the last policy token, partial credit at turn ends
    index: np.ndarray  # group id per row (groups of `group` rollouts, the last row a singleton)
    gae_rewards: torch.Tensor  # per-token KL penalty + outcome + one reward on an observation position
    values: torch.Tensor  # critic values


def log_boundaries() -> torch.Tensor:
    return torch.tensor([math.log(1 - LOW), math.log(1 + HIGH), math.log(CLIP_C)], dtype=torch.float64)


def ratio_error(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor, turn_level: bool, u: float):
    """(log-ratio per token (float64), bound on the error of its computed log-ratio, same for the ratio).

    ``d = fl(new - old)`` errs by ``u|d|``; a turn mean of ``n`` of them summed in any order and divided by
    ``n`` by ``u (sum|d| + |l|)``; ``exp`` adds ``EXP_ULPS`` ulps (``2u`` each) relative.
    """
    d = torch.where(mask, new.double() - old.double(), 0.0)
    if not turn_level:
        e_l = u * d.abs()
        return d, e_l, HIGHER_ORDER * (e_l + 2 * EXP_ULPS * u)
    tid = turn_ids(mask)
    k = int(tid.max()) if tid.numel() else 0
    n = per_turn(mask.double(), tid, k).clamp_min(1.0)
    mean = per_turn(d, tid, k) / n
    e = u * (per_turn(d.abs(), tid, k) + mean.abs())
    l_tok, e_tok = torch.gather(mean, 1, tid), torch.gather(e, 1, tid)
    return l_tok, e_tok, HIGHER_ORDER * (e_tok + 2 * EXP_ULPS * u)


def enforce_margin(old: torch.Tensor, new: torch.Tensor, mask: torch.Tensor, turn_level: bool) -> torch.Tensor:
    """``new`` with every turn (token) log-ratio at least ``2 (rho + 4u)`` from each clip boundary, ``rho``
    the float32 error bound of its ratio, so float32 and float64 take the same clip branch. A turn (token)
    inside that window is shifted as a whole by a step of at least two of its own ulps, until none is."""
    dtype = new.dtype
    step = max(4 * torch.finfo(dtype).eps * 8, 1e-3)  # >= 2 ulps of |log-prob| < 8 in dtype, >> any margin
    new = new.clone()
    for _ in range(50):
        log_r, _, rho = ratio_error(old, new, mask, turn_level, U32)
        margin = 2 * (rho + 4 * U32)
        close = ((log_r.unsqueeze(-1) - log_boundaries()).abs() <= margin.unsqueeze(-1)).any(-1) & mask
        if not bool(close.any()):
            return new
        new = torch.where(close, (new.double() + step).to(dtype), new)
    raise RuntimeError("could not move the ratios away from the clip boundaries")


def make_inputs(rows: int, length: int, turns: tuple[int, int], group: int, seed: int, dtype: torch.dtype) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    mask = multi_turn_mask(rows, length, *turns, seed=seed)
    tid = turn_ids(mask)
    k = int(tid.max())
    old = (-torch.rand(rows, length, generator=gen) * 3).to(dtype)
    shift = F.pad(0.25 * torch.randn(rows, k, generator=gen), (1, 0))  # per turn: heavy, realistic clipping
    noise = 0.3 * torch.randn(rows, length, generator=gen)
    new_turn = (old.double() + torch.gather(shift, 1, tid) + noise).to(dtype)
    new_token = (old.double() + torch.gather(shift, 1, tid) * 0.3 + noise).to(dtype)
    new_turn = enforce_margin(old, new_turn, mask, turn_level=True)
    new_token = enforce_margin(old, new_token, mask, turn_level=False)

    last = (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)) & mask
    turn_end = mask & ~F.pad(mask[:, 1:], (0, 1), value=False)
    rewards = torch.where(last, (torch.rand(rows, 1, generator=gen) < 0.5).float(), 0.0)
    rewards = rewards + torch.where(turn_end, 0.1 * torch.rand(rows, length, generator=gen), 0.0)
    index = np.arange(rows) // group
    if rows >= 2 * group:
        rewards[group : 2 * group] = rewards[group]  # a zero-variance group
    if rows > group:
        index[-1] = index.max() + 1  # a singleton group (mean 0, std 1)

    gae_rewards = torch.where(mask, -1e-3 * torch.randn(rows, length, generator=gen).abs(), 0.0)
    gae_rewards = gae_rewards + torch.where(last, torch.randn(rows, 1, generator=gen), 0.0)
    after_last = F.pad(last[:, :-1], (1, 0), value=False)  # an observation right after the final turn
    gae_rewards = gae_rewards + torch.where(after_last, 0.5, 0.0)
    values = 0.5 * torch.randn(rows, length, generator=gen)
    return Inputs(mask, old, new_turn, new_token, rewards, index, gae_rewards, values)


# --- float64 references with their float32 error bounds ---------------------------------------


def grpo_reference(rewards: torch.Tensor, mask: torch.Tensor, index: np.ndarray, u: float, eps: float = 1e-6):
    """``(A, bound, kappa)`` ``[B, T]`` for ``A_i = (s_i - mean_g) / (std_g + eps)`` (unbiased std;
    singleton: mean 0, std 1) from float64 sums, the error bound of a float``u`` evaluation with a two-pass
    mean and variance (verl's ``group_mean_std``; each sum in any order), and the group's condition number
    ``sqrt(1 + mean^2 / var)``, by which an updating (Welford) variance such as ``torch.std``'s may exceed
    the two-pass bound (Chan, Golub & LeVeque 1983)."""
    r = rewards.double()
    s = r.sum(-1)
    e_s = u * (r != 0).sum(-1).double() * r.abs().sum(-1)  # a row sum; zeros add exactly
    adv = torch.zeros_like(s)
    bound = torch.zeros_like(s)
    kappa = torch.ones_like(s)
    for g in np.unique(index):
        rows = torch.as_tensor(np.nonzero(index == g)[0])
        n = len(rows)
        if n == 1:
            adv[rows] = s[rows] / (1.0 + eps)
            bound[rows] = e_s[rows] + 2 * u * adv[rows].abs()
            continue
        sg, eg = s[rows], e_s[rows]
        mean = sg.mean()
        e_mean = (eg.sum() + n * u * sg.abs().sum()) / n + u * mean.abs()
        c = sg - mean
        e_c = eg + e_mean + u * c.abs()
        var = c.square().sum() / (n - 1)
        e_var = ((2 * c.abs() * e_c + e_c.square()).sum() + (n + 1) * u * c.square().sum()) / (n - 1) + u * var
        std = var.sqrt()
        e_std = torch.minimum(e_var.sqrt(), e_var / std.clamp_min(1e-300)) + u * std
        den = std + eps
        e_den = e_std + u * den
        a = c / den
        adv[rows] = a
        kappa[rows] = torch.sqrt(1 + mean.square() / var) if var > 0 else torch.tensor(math.inf, dtype=torch.float64)
        ok = den > e_den
        bound[rows] = torch.where(
            ok, (e_c + a.abs() * e_den) / (den - e_den).clamp_min(1e-300) + u * a.abs(), torch.tensor(math.inf)
        )

    def tokens(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x.unsqueeze(-1), 0.0)

    return tokens(adv), tokens(bound), tokens(kappa)


@dataclass
class LossRef:
    loss: float
    loss_bound: float
    grad: torch.Tensor
    grad_bound: torch.Tensor
    metrics: dict[str, float]
    metric_bounds: dict[str, float]
    ambiguous: list[str]


def loss_reference(
    name: str,
    old: torch.Tensor,
    new: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    knobs: dict[str, Any],
    u: float,
    u_out: float,
) -> LossRef:
    """Token-mean loss, gradient and metrics of ``name`` from SORL-SPEC.md in float64, with the bounds of a
    float``u`` evaluation (``u_out``: rounding of the gradient to the ``log_prob`` dtype)."""
    turn_level, normalize = TURN_LEVEL[name], NORMALIZE[name]
    m = mask
    a = torch.where(m, adv.double(), 0.0)
    d = torch.where(m, new.double() - old.double(), 0.0)
    log_r, e_l, rho = ratio_error(old, new, mask, turn_level, u)
    r = torch.where(m, torch.exp(log_r), 1.0)
    pg1, pg2 = -a * r, -a * r.clamp(1 - LOW, 1 + HIGH)
    c1 = torch.maximum(pg1, pg2)
    pg3 = -a * CLIP_C
    neg = a < 0
    loss_mat = torch.where(neg, torch.minimum(pg3, c1), c1) * m
    upper, lower = (pg2 > pg1) & m, (c1 > pg3) & neg & m
    clipped = upper | lower
    n_tok = int(m.sum())
    n = float(n_tok)

    sq = (r * a).square() * m
    s_c, s_u = float((sq * clipped).sum()), float(sq.sum())
    e_sc = float((sq * clipped * (2 * rho + 3 * u)).sum()) + int(clipped.sum()) * u * s_c
    e_su = float((sq * (2 * rho + 3 * u)).sum()) + n_tok * u * s_u
    rel_sc, rel_su = (e_sc / s_c if s_c > 0 else 0.0), (e_su / s_u if s_u > 0 else 0.0)
    norm = math.sqrt(s_c / max(n, 1.0))
    rel = min(1.0, math.sqrt(s_c / s_u)) if s_u > 0 else 0.0
    e_norm = norm * (0.5 * rel_sc + 4 * U64)
    e_rel = rel * (0.5 * (rel_sc + rel_su) + 4 * U64)
    mode, tau = knobs["clip_norm_mode"], knobs["clip_norm_tau"]
    q, e_q = (rel, e_rel) if knobs["clip_norm_reference"] == "relative" else (norm, e_norm)
    active = normalize and mode != "none"
    ambiguous: list[str] = []
    if not active:
        z, e_z = 1.0, 0.0
    elif mode == "add":
        z, e_z = 1.0 + q / tau, e_q / tau + 2 * U64
    else:  # max(1, q/tau) is 1-Lipschitz in q/tau
        z, e_z = max(1.0, q / tau), e_q / tau + 2 * U64
        if abs(q / tau - 1.0) <= e_q / tau:
            ambiguous.append("sorl/triggered")
    at_update = knobs["clip_norm_apply"] == "update"
    z_loss = 1.0 if at_update else z
    eps_z = 0.0 if (at_update or not active) else e_z / z + 2 * u  # cast of Z to float32, division

    loss_unnorm = float(loss_mat.sum()) / n
    e_loss_mat = loss_mat.abs() * (rho + 2 * u)
    e_loss = (float(e_loss_mat.sum()) + n_tok * u * float(loss_mat.abs().sum())) / n + u * abs(loss_unnorm)
    loss = loss_unnorm / z_loss
    loss_bound = e_loss / z_loss + abs(loss) * eps_z

    g_scale = 1.0 / n / z_loss
    q_t = torch.where(clipped, 0.0, g_scale * -a * r) * m
    e_q_t = q_t.abs() * (rho + 6 * u + eps_z)  # G: 2u + eps_z; slope: u; ratio: rho + u
    if turn_level:
        tid = turn_ids(mask)
        k = int(tid.max()) if tid.numel() else 0
        cnt = per_turn(m.double(), tid, k).clamp_min(1.0)
        grad = torch.gather(per_turn(q_t, tid, k) / cnt, 1, tid) * m
        e_sum = per_turn(e_q_t, tid, k) + cnt * u * per_turn(q_t.abs(), tid, k)
        grad_bound = torch.gather(e_sum / cnt, 1, tid) * m + u * grad.abs()
    else:
        grad, grad_bound = q_t, e_q_t + u * q_t.abs()
    grad_bound = grad_bound * (1 + u_out) + u_out * grad.abs()  # rounding of the float32 value to the output dtype

    metrics: dict[str, float] = {}
    bounds: dict[str, float] = {}
    kl = -float(d.sum()) / n
    metrics["actor/ppo_kl"], bounds["actor/ppo_kl"] = kl, u * float(d.abs().sum()) * (1 + 1 / n) + u * abs(kl)
    n32 = torch.tensor(n, dtype=torch.float32)
    for key, flags in (("actor/pg_clipfrac", upper), ("actor/pg_clipfrac_lower", lower)):
        metrics[key] = float(torch.tensor(float(flags.sum()), dtype=torch.float32) / n32)
        bounds[key] = 0.0  # exact counts (margins), the same float32 division
    if name == "vanilla":
        return LossRef(loss, loss_bound, grad, grad_bound, metrics, bounds, ambiguous)

    unit = "turn" if turn_level else "token"
    if turn_level:
        tid = turn_ids(mask)
        k = int(tid.max())
        valid = per_turn(m.double(), tid, k)[:, 1:] > 0
        lk = (per_turn(d, tid, k) / per_turn(m.double(), tid, k).clamp_min(1.0))[:, 1:][valid]
        e_lk = HIGHER_ORDER * u * (per_turn(d.abs(), tid, k)[:, 1:][valid] + lk.abs())  # as ratio_error
        num_turns, rows_with = int(valid.sum()), int(valid.any(-1).sum())
    else:
        lk, e_lk = d[m], HIGHER_ORDER * u * d[m].abs()
        num_turns, rows_with = int(turn_ids(mask).amax(-1).sum()), int(m.any(-1).sum())
    rk = torch.exp(lk)
    e_rk = rk * (e_lk + 2 * U64)
    count = rk.numel()
    metrics[f"sorl/{unit}_ratio_mean"] = float(rk.mean())
    bounds[f"sorl/{unit}_ratio_mean"] = float(e_rk.sum()) / count + count * U64 * float(rk.mean())
    metrics[f"sorl/{unit}_ratio_max"], bounds[f"sorl/{unit}_ratio_max"] = float(rk.max()), float(e_rk.max())
    metrics[f"sorl/{unit}_ratio_min"], bounds[f"sorl/{unit}_ratio_min"] = float(rk.min()), float(e_rk.max())
    outside = int(((rk < 1 - LOW) | (rk > 1 + HIGH)).sum())
    metrics[f"sorl/{unit}_clipfrac"] = float(torch.tensor(outside) / torch.tensor(count))  # float32, as the loss
    bounds[f"sorl/{unit}_clipfrac"] = 0.0
    metrics["sorl/num_turns_mean"], bounds["sorl/num_turns_mean"] = num_turns / max(rows_with, 1), 0.0
    metrics["sorl/clip_bias_norm"], bounds["sorl/clip_bias_norm"] = norm, e_norm
    metrics["sorl/clip_bias_rel"], bounds["sorl/clip_bias_rel"] = rel, e_rel
    metrics["sorl/norm_factor"], bounds["sorl/norm_factor"] = z, e_z
    metrics["sorl/triggered"] = 1.0 if z > 1.0 else 0.0
    bounds["sorl/triggered"] = math.inf if ambiguous else 0.0
    inv = (1.0 / z, e_z / z**2 + 2 * U64)
    one = (1.0, 0.0)
    metrics["sorl/update_scale"], bounds["sorl/update_scale"] = inv if at_update else one
    metrics["sorl/loss_scale"], bounds["sorl/loss_scale"] = one if at_update else inv
    # effective sample sizes over the tokens and over the turns, whatever the loss's own ratio
    tid = turn_ids(mask)
    k_all = int(tid.max()) if tid.numel() else 0
    sizes = per_turn(m.double(), tid, k_all)[:, 1:]
    turn_valid = sizes > 0
    l_turn = (per_turn(d, tid, k_all)[:, 1:] / sizes.clamp_min(1.0))[turn_valid]
    e_turn = HIGHER_ORDER * u * (per_turn(d.abs(), tid, k_all)[:, 1:][turn_valid] + l_turn.abs())
    for key, logs, err in (("sorl/ess_token", d[m], HIGHER_ORDER * u * d[m].abs()), ("sorl/ess_turn", l_turn, e_turn)):
        metrics[key], bounds[key] = ess_reference(logs, err)
    return LossRef(loss, loss_bound, grad, grad_bound, metrics, bounds, ambiguous)


def ess_reference(log_w: torch.Tensor, err: torch.Tensor) -> tuple[float, float]:
    """``(sum w)^2 / (n sum w^2)`` (sorl_verl/algorithms/ess.py) in float64 from log-weights ``log_w`` whose
    evaluation errs by at most ``err`` each, and its bound: a relative error ``e`` of every ``w`` moves the
    square of the sum by ``2e`` and the sum of squares by ``2e``, so the ratio by at most ``4e`` (first
    order), plus the float64 sums and log-sum-exp of ``n`` terms. 1 (exact) without weights."""
    n = log_w.numel()
    if n == 0:
        return 1.0, 0.0
    w = torch.exp(log_w - log_w.max())
    ess = float(w.sum().square() / (n * w.square().sum()))
    return ess, ess * (4 * HIGHER_ORDER * float(err.max()) + 8 * (n + 4) * U64)


def actor_config(**knobs: Any) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=SORLPolicyLossConfig(**knobs)
    )


def knob_dict(config: ActorConfig) -> dict[str, Any]:
    pl = config.policy_loss
    return {k: getattr(pl, k) for k in ("clip_norm_mode", "clip_norm_tau", "clip_norm_reference", "clip_norm_apply")}


def run_loss(
    fn: Callable[..., tuple[torch.Tensor, dict[str, float]]],
    old: torch.Tensor,
    new: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    config: ActorConfig,
    mode: str = "token-mean",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    log_prob = new.clone().requires_grad_(True)
    DIAGNOSTIC.due = False  # the once-per-step sorl/clip_bias_grad_norm is not compared here: fixed key sets
    loss, metrics = fn(old, log_prob, adv, mask, mode, config, weights)
    loss.backward()
    optim.LEDGER.clear()
    assert log_prob.grad is not None
    return loss.detach(), log_prob.grad, metrics


# --- the checks -------------------------------------------------------------------------------


def check_losses(rep: Report, tag: str, inp: Inputs, adv: torch.Tensor, device: str, dtype: torch.dtype) -> None:
    """Each loss under three normalizer settings: ``device`` float32 (or bf16 inputs) and the project's
    float64 CPU result against the float64 reference."""
    configs = {
        "default": actor_config(),  # clip_norm_apply=update, reference relative, tau 0.2, mode max
        "loss_abs_max": actor_config(clip_norm_apply="loss", clip_norm_reference="absolute", clip_norm_tau=0.1),
        "loss_rel_add": actor_config(clip_norm_apply="loss", clip_norm_mode="add"),
    }
    names = list(LOSSES) if dtype == torch.float32 else ["so_grpo", "s_ppo"]
    u_out = 0.0 if dtype == torch.float32 else U_BF16
    mask_d = inp.mask.to(device)
    for name in names:
        new = inp.new_turn if TURN_LEVEL[name] else inp.new_token
        for cfg_name, config in configs.items():
            if name == "vanilla" and cfg_name != "default":
                continue
            knobs = knob_dict(config)
            ref = loss_reference(name, inp.old, new, adv, inp.mask, knobs, U32, u_out)
            ref64 = loss_reference(name, inp.old, new, adv, inp.mask, knobs, U64, 0.0)
            runs = {
                f"{device}-{str(dtype).replace('torch.', '')}": (
                    run_loss(LOSSES[name], inp.old.to(device), new.to(device), adv.to(device), mask_d, config),
                    ref,
                    1.0,
                ),
                "cpu-float64": (
                    run_loss(LOSSES[name], inp.old.double(), new.double(), adv.double(), inp.mask, config),
                    ref64,
                    2.0,  # both the project's float64 result and the reference are within ref64's bounds
                ),
            }
            for run_name, ((loss, grad, metrics), r, k) in runs.items():
                prefix = f"{tag}/{name}/{cfg_name}/{run_name}"
                rep.compare(f"{prefix}/loss", loss, r.loss, k * r.loss_bound)
                rep.compare(f"{prefix}/grad", grad, r.grad, k * r.grad_bound)
                missing = set(r.metrics) ^ set(metrics)
                rep.truth(f"{prefix}/metric_keys", not missing, f"differ: {sorted(missing)}" if missing else "")
                for key in sorted(set(r.metrics) & set(metrics)):
                    note = "ambiguous: Z within its error bound of the threshold" if key in r.ambiguous else ""
                    rep.compare(f"{prefix}/{key}", metrics[key], r.metrics[key], k * r.metric_bounds[key], note)


def check_identities(rep: Report, tag: str, inp: Inputs, adv: torch.Tensor, device: str) -> None:
    """The identities of SORL-SPEC.md on ``device`` float32 (statements of tests/unit/test_algo_losses.py)."""
    mask, old = inp.mask.to(device), inp.old.to(device)
    a = adv.to(device)
    n = int(inp.mask.sum())
    loss_cfg = actor_config(clip_norm_apply="loss")

    # on-policy: ratios 1, Z = 1, gradient -A m / N (A constant per row here, so per turn)
    for name in ("so_grpo", "so_ppo", "turn_ppo", "s_ppo"):
        loss, grad, met = run_loss(LOSSES[name], old, old.clone(), a, mask, loss_cfg)
        unit = "token" if name == "s_ppo" else "turn"
        ones = all(met[f"sorl/{unit}_ratio_{s}"] == 1.0 for s in ("mean", "max", "min"))
        zeros = met["sorl/clip_bias_norm"] == 0.0 and met["sorl/clip_bias_rel"] == 0.0
        z_one = met["sorl/norm_factor"] == 1.0 and met["sorl/triggered"] == 0.0 and met["actor/pg_clipfrac"] == 0.0
        rep.truth(f"{tag}/identity/on_policy/{name}/ratios_one_z_one", ones and zeros and z_one)
        expected = (-adv.double() * inp.mask) / n
        # r = exp(0) = 1 exactly; G = fl(1/N); a turn sum of n_k equal terms, divided by n_k
        counts = torch.gather(per_turn(inp.mask.double(), turn_ids(inp.mask), int(turn_ids(inp.mask).max())), 1,
                              turn_ids(inp.mask)).clamp_min(1.0)  # fmt: skip
        n_k = counts if unit == "turn" else torch.ones_like(counts)
        rep.compare(f"{tag}/identity/on_policy/{name}/grad", grad, expected, (n_k + 4) * U32 * expected.abs())
        ref_loss = -float((adv.double() * inp.mask).sum()) / n
        bound = (n + 2) * U32 * float((adv.double().abs() * inp.mask).sum()) / n
        rep.compare(f"{tag}/identity/on_policy/{name}/loss", loss, ref_loss, bound)

    # length-1 turns and clip_norm_mode=none: verl's vanilla bit for bit (with rollout IS weights)
    gen = torch.Generator().manual_seed(5)
    single = torch.rand(inp.mask.shape, generator=gen) < 0.5
    single[:, 1:] &= ~single[:, :-1]
    new = inp.new_token.to(device)
    weights = (torch.rand(inp.mask.shape, generator=gen) + 0.5).to(device)
    none_cfg = actor_config(clip_norm_mode="none")
    s_d = single.to(device)
    for name in ("so_grpo", "so_ppo", "turn_ppo", "s_ppo"):
        for mode in AGG_MODES if name == "so_grpo" else ["token-mean"]:
            ref = run_loss(compute_policy_loss_vanilla, old, new, a, s_d, none_cfg, mode, weights)
            got = run_loss(LOSSES[name], old, new, a, s_d, none_cfg, mode, weights)
            same = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
            rep.truth(f"{tag}/identity/single_token_turns_none_equals_vanilla/{name}/{mode}", same)

    # so_grpo and so_ppo: the same loss bit for bit
    x = run_loss(compute_policy_loss_so_grpo, old, inp.new_turn.to(device), a, mask, actor_config())
    y = run_loss(compute_policy_loss_so_ppo, old, inp.new_turn.to(device), a, mask, actor_config())
    same = torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]
    rep.truth(f"{tag}/identity/so_grpo_equals_so_ppo", same)

    # no clipping: Z = 1 and turn_ppo's loss and gradient bit for bit; unclipped gradient formula
    gen = torch.Generator().manual_seed(6)
    calm = enforce_margin(inp.old, (inp.old.double() + 0.003 * torch.randn(inp.old.shape, generator=gen)).float(),
                          inp.mask, turn_level=True)  # fmt: skip
    ref = run_loss(compute_policy_loss_turn_ppo, old, calm.to(device), a, mask, loss_cfg)
    for mode in ("max", "add"):
        got = run_loss(compute_policy_loss_so_ppo, old, calm.to(device), a, mask,
                       actor_config(clip_norm_apply="loss", clip_norm_mode=mode, clip_norm_tau=0.01))  # fmt: skip
        ok = got[2]["sorl/norm_factor"] == 1.0 and got[2]["actor/pg_clipfrac"] == 0.0
        same = torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        rep.truth(f"{tag}/identity/no_clipping_z_one_bit_for_bit/{mode}", ok and same)
    formula = loss_reference("turn_ppo", inp.old, calm, adv, inp.mask, knob_dict(loss_cfg), U32, 0.0)
    rep.compare(f"{tag}/identity/unclipped_turn_gradient_formula", ref[1], formula.grad, formula.grad_bound)

    # heavy clipping: Z > 1, loss and gradient 1/Z of the un-normalized ones, smaller gradient norm
    new = inp.new_turn.to(device)
    heavy = actor_config(clip_norm_apply="loss", clip_norm_reference="absolute", clip_norm_tau=0.05)
    loss, grad, met = run_loss(compute_policy_loss_so_ppo, old, new, a, mask, heavy)
    plain = run_loss(compute_policy_loss_so_ppo, old, new, a, mask, actor_config(clip_norm_mode="none"))
    z = met["sorl/norm_factor"]
    rep.truth(f"{tag}/identity/heavy_clipping/z_above_one", z > 1.0 and met["sorl/triggered"] == 1.0, f"Z = {z:.4g}")
    # loss / fl32(Z): two roundings; the gradient's products see G / Z instead of G: per term 4u, a turn sum n_k u
    rep.compare(
        f"{tag}/identity/heavy_clipping/loss_over_z", loss, float(plain[0]) / z, 3 * U32 * abs(float(plain[0]) / z)
    )
    counts = torch.gather(per_turn(inp.mask.double(), turn_ids(inp.mask), int(turn_ids(inp.mask).max())), 1,
                          turn_ids(inp.mask))  # fmt: skip
    g_ref = plain[1].double().cpu() / z
    # both gradients err from the exact g/Z by at most (n_k + 6) u times the turn mean of |terms| >= |g|
    g_bound = 2 * (counts + 8) * U32 * torch.abs(g_ref) + 1e-300
    rep.compare(f"{tag}/identity/heavy_clipping/grad_over_z", grad, g_ref, g_bound,
                "bounded relative to |g|: terms of one turn share one sign (A constant per row)")  # fmt: skip
    rep.truth(f"{tag}/identity/heavy_clipping/smaller_grad_norm", bool(grad.norm() < plain[1].norm()))

    # turn ratio = geometric mean of token ratios (independent float64 computation)
    met = run_loss(compute_policy_loss_so_grpo, old, new, a, mask, actor_config())[2]
    r = loss_reference("so_grpo", inp.old, inp.new_turn, adv, inp.mask, knob_dict(actor_config()), U32, 0.0)
    for key in ("sorl/turn_ratio_mean", "sorl/turn_ratio_max", "sorl/turn_ratio_min", "sorl/num_turns_mean"):
        rep.compare(f"{tag}/identity/geometric_mean/{key}", met[key], r.metrics[key], r.metric_bounds[key])


def check_estimators(rep: Report, tag: str, inp: Inputs, device: str) -> torch.Tensor:
    """so_grpo and verl grpo vs the float64 formula; turn-level GAE on ``device`` vs float64. Returns the
    float64 GRPO advantages (the losses' advantages)."""
    mask_d = inp.mask.to(device)
    ref, bound, kappa = grpo_reference(inp.rewards, inp.mask, inp.index, U32)
    ours, ours_ret = compute_so_grpo_outcome_advantage(inp.rewards.to(device), mask_d, inp.index)
    theirs, _ = compute_grpo_outcome_advantage(inp.rewards.to(device), mask_d.float(), inp.index)
    # a group of equal scores (std 0): its float32 std is rounding noise next to eps = 1e-6, so its
    # advantages are not 0 in float32 (verl's grpo alike); reported on their own, with the same bound
    flat = torch.isinf(kappa) | (kappa > 1e6)
    for part, sel in (("", ~flat & inp.mask), ("/zero_variance_group", flat & inp.mask)):
        if not bool(sel.any()):
            continue
        note = "equal scores: fp32 std ~ rounding noise vs eps=1e-6" if part else ""
        ours_c, theirs_c = ours.double().cpu()[sel], theirs.double().cpu()[sel]
        rep.compare(f"{tag}/so_grpo_adv{part}/{device}-float32", ours_c, ref[sel], bound[sel], note)
        k = torch.where(flat[sel], 0.0, kappa[sel])  # the Welford factor is moot where the bound is already loose
        rep.compare(f"{tag}/verl_grpo_adv{part}/{device}-float32", theirs_c, ref[sel], (1 + k) * bound[sel], note)
        rep.compare(f"{tag}/identity/so_grpo_equals_verl_grpo{part}", ours_c, theirs_c, (2 + k) * bound[sel], note)
    rep.truth(f"{tag}/identity/so_grpo_zero_on_m0", bool((ours[~mask_d] == 0).all()) and torch.equal(ours, ours_ret))
    ref64, bound64, _ = grpo_reference(inp.rewards.double(), inp.mask, inp.index, U64)
    cpu64, _ = compute_so_grpo_outcome_advantage(inp.rewards.double(), inp.mask, inp.index)
    rep.compare(f"{tag}/so_grpo_adv/cpu-float64", cpu64, ref64, bound + bound64,
                "verl's group_mean_std computes in float32 even for float64 scores")  # fmt: skip

    gamma, lam = 1.0, 0.95
    adv_d, ret_d = compute_turn_gae_advantage_return(inp.gae_rewards.to(device), inp.values.to(device), mask_d,
                                                     gamma, lam)  # fmt: skip
    adv64, ret64 = compute_turn_gae_advantage_return(inp.gae_rewards.double(), inp.values.double(), inp.mask,
                                                     gamma, lam)  # fmt: skip
    a_b, r_b = turn_gae_bounds(inp, gamma, lam, adv64, ret64)
    rep.compare(f"{tag}/turn_gae_adv/{device}-float32", adv_d, adv64, a_b)
    rep.compare(f"{tag}/turn_gae_returns/{device}-float32", ret_d, ret64, r_b)
    rep.truth(f"{tag}/turn_gae_zero_on_m0", bool((adv_d[~mask_d] == 0).all() and (ret_d[~mask_d] == 0).all()))
    v_adv, v_ret = compute_gae_advantage_return(inp.gae_rewards.to(device), inp.values.to(device),
                                                mask_d.float(), gamma, lam)  # fmt: skip
    v_adv64, v_ret64 = compute_gae_advantage_return(inp.gae_rewards.double(), inp.values.double(),
                                                    inp.mask.double(), gamma, lam)  # fmt: skip
    info = rep.compare(f"{tag}/verl_gae_adv/{device}-float32 (info)", v_adv * mask_d, v_adv64 * inp.mask, math.inf)
    info.note = "verl's own estimator, reported without a bound"
    return ref


def turn_gae_bounds(inp: Inputs, gamma: float, lam: float, adv64: torch.Tensor, ret64: torch.Tensor):
    """Float32 error bounds ``[B, T]`` of the turn-level GAE advantages and returns (advantages.py's
    operations: per-turn reward sums, a ``K x K`` decay matmul, whitening on the turn table)."""
    u = U32
    m = inp.mask
    tid = turn_ids(m)
    k = int(tid.max())
    owner = torch.where((tid.amax(-1, keepdim=True) > 0), torch.cummax(tid, -1).values.clamp_min(1), 0)
    rw = inp.gae_rewards.double()
    n_terms = per_turn((rw != 0).double(), owner, k)[:, 1:]
    rk = per_turn(rw, owner, k)[:, 1:]
    e_r = u * n_terms * per_turn(rw.abs(), owner, k)[:, 1:]
    start = m & ~F.pad(m[:, :-1], (1, 0), value=False)
    vk = per_turn(torch.where(start, inp.values.double(), 0.0), tid, k)[:, 1:]
    v_next = F.pad(vk[:, 1:], (0, 1))
    delta = rk + gamma * v_next - vk
    e_delta = e_r + 3 * u * (rk.abs() + abs(gamma) * v_next.abs() + vk.abs() + delta.abs())
    steps = torch.arange(k)
    off = steps.unsqueeze(0) - steps.unsqueeze(1)
    w = torch.where(off >= 0, torch.tensor(gamma * lam, dtype=torch.float64) ** off.clamp_min(0), 0.0)
    a_k = delta @ w.T
    # w = pow(fl(gamma lam), j): (j + 1) u + pow's ulps; the product u; a k-term dot product k u
    e_a = (e_delta + delta.abs() * (2 * k + 2 * EXP_ULPS + 2) * u) @ w.T
    ret_k = a_k + vk
    e_ret = e_a + u * ret_k.abs()
    nk = per_turn(m.double(), tid, k)[:, 1:]
    total = float(nk.sum())
    mean = float((a_k * nk).sum()) / total
    e_mean = (float((nk * (e_a + 2 * u * a_k.abs())).sum()) + nk.numel() * u * float((nk * a_k.abs()).sum())) / total
    e_mean += u * abs(mean)
    c = a_k - mean
    e_c = e_a + e_mean + u * c.abs()
    var = float((c.square() * nk).sum()) / total * (total / (total - 1))
    e_var = float((nk * (2 * c.abs() * e_c + e_c.square())).sum()) + (nk.numel() + 3) * u * float(
        (nk * c.square()).sum()
    )
    e_var = e_var / total * (total / (total - 1)) + 4 * u * var
    rs = 1.0 / math.sqrt(var + 1e-8)
    rel_rs = e_var / (2 * (var + 1e-8)) + (EXP_ULPS * 2 + 1) * u
    e_w = e_c * rs + (c * rs).abs() * (rel_rs + u)
    adv_b = torch.gather(F.pad(HIGHER_ORDER * e_w, (1, 0)), 1, tid) * m
    ret_b = torch.gather(F.pad(HIGHER_ORDER * e_ret, (1, 0)), 1, tid) * m
    return adv_b, ret_b


# --- timing -----------------------------------------------------------------------------------


def count_syncs(fn: Callable[[], object], device: str) -> int | None:
    """Host-synchronizing CUDA calls made by one ``fn()`` (``torch.cuda.set_sync_debug_mode``)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def paired_event_medians(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median CUDA-event seconds of ``a`` and ``b``, alternating (after paired_medians' warm-up)."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, acc in ((a, times[0]), (b, times[1])):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            acc.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def time_pair(
    a: Callable[[], object], b: Callable[[], object], reps: int, device: str, warmup: int = 2
) -> tuple[dict[str, float], dict[str, float]]:
    if device == "cuda":

        def synced(fn: Callable[[], object]) -> Callable[[], None]:
            def run() -> None:
                fn()
                torch.cuda.synchronize()

            return run

        ta, tb = paired_medians(synced(a), synced(b), reps, warmup=warmup)
        ta["cuda_event"], tb["cuda_event"] = paired_event_medians(a, b, reps)
        return ta, tb
    return paired_medians(a, b, reps, warmup=warmup)


def timing(inp: Inputs, adv: torch.Tensor, device: str, reps: int, gae_reps: int) -> dict[str, Any]:
    mask = inp.mask.to(device)
    old, data, a = inp.old.to(device), inp.new_turn.to(device), adv.to(device)
    config = actor_config()  # clip_norm_apply=update, as verl runs it with the SORL optimizer

    def step(loss_fn: Callable[..., Any]) -> Callable[[], None]:
        def run() -> None:
            log_prob = data.clone().requires_grad_(True)
            loss, _ = loss_fn(old, log_prob, a, mask, "token-mean", config)
            loss.backward()
            optim.LEDGER.clear()

        return run

    vanilla, sorl = step(compute_policy_loss_vanilla), step(compute_policy_loss_so_grpo)
    t_vanilla, t_sorl = time_pair(vanilla, sorl, reps, device)
    rewards, values = inp.gae_rewards.to(device), inp.values.to(device)

    def gae() -> object:
        return compute_gae_advantage_return(rewards, values, mask.float(), gamma=1.0, lam=0.95)

    def turn_gae() -> object:
        return compute_turn_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)

    t_gae, t_turn = time_pair(gae, turn_gae, gae_reps, device, warmup=1)
    syncs = {k: count_syncs(f, device) for k, f in (("vanilla", vanilla), ("so_grpo", sorl), ("gae", gae),
                                                     ("so_ppo_turn_gae", turn_gae))}  # fmt: skip
    return {
        "loss_fwd_bwd": {
            "vanilla_s": t_vanilla,
            "so_grpo_s": t_sorl,
            "target": 1.3,
            "ratio": {c: t_sorl[c] / t_vanilla[c] for c in t_vanilla},
        },  # fmt: skip
        "estimator": {
            "gae_s": t_gae,
            "so_ppo_turn_gae_s": t_turn,
            "target": 1.0,
            "ratio": {c: t_turn[c] / t_gae[c] for c in t_gae},
        },  # fmt: skip
        "host_syncs_per_call": syncs,
        "reps": {"loss": reps, "estimator": gae_reps},
    }


# --- main -------------------------------------------------------------------------------------


def _finite_json(x: Any) -> Any:
    """``x`` with non-finite floats as strings (strict JSON has no inf/nan)."""
    if isinstance(x, dict):
        return {k: _finite_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite_json(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def parse_shape(text: str) -> tuple[int, int]:
    rows, length = text.lower().split("x")
    return int(rows), int(length)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda | cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes and few reps (a CPU smoke run)")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=None, help="ROWSxLENGTH ...")
    parser.add_argument("--turns", type=int, default=None, help="turns per row (default 8, --small 3)")
    parser.add_argument("--reps", type=int, default=None, help="loss timing reps (default 41, --small 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    out_dir = os.environ.get("OUT")
    default_json = str(Path(out_dir) / "loss_cuda_results.json") if out_dir else None
    parser.add_argument("--json-out", default=default_json, help="default $OUT/loss_cuda_results.json if $OUT is set")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False")
    shapes = args.shapes or ([(8, 192), (16, 96)] if args.small else [(64, 8192), (256, 4096)])
    turns = args.turns or (3 if args.small else 8)
    reps = args.reps or (3 if args.small else 41)
    gae_reps = max(3, reps // 5)
    group = 4 if args.small else 8
    if optim.LEDGER.consumers == 0:  # an update-scaled optimizer in this process, as in verl's actor worker
        _KEEP.append(optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))

    env: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else f"main({argv})",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "verl": getattr(verl, "__version__", "?"),
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch_threads": torch.get_num_threads(),
        "shapes": [list(s) for s in shapes],
        "turns_per_row": turns,
        "group_size": group,
        "bounds": {"u32": U32, "u64": U64, "u_bf16": U_BF16, "exp_ulps": EXP_ULPS, "higher_order": HIGHER_ORDER},
    }
    print(json.dumps({k: env[k] for k in ("python", "torch", "torch_cuda", "verl", "device", "device_name")}))
    rep = Report()
    results: list[dict[str, Any]] = []
    for rows, length in shapes:
        tag = f"{rows}x{length}"
        shape_start = time.perf_counter()
        inp = make_inputs(rows, length, (turns, turns), group, args.seed, torch.float32)
        first = len(rep.checks)
        adv = check_estimators(rep, tag, inp, device).float()
        check_losses(rep, tag, inp, adv, device, torch.float32)
        bf = make_inputs(rows, length, (turns, turns), group, args.seed, torch.bfloat16)
        check_losses(rep, f"{tag}/bf16-inputs", bf, adv.to(torch.bfloat16), device, torch.bfloat16)
        check_identities(rep, tag, inp, adv, device)
        checked = time.perf_counter() - shape_start
        timed = timing(inp, adv, device, reps, gae_reps)
        n_tok = int(inp.mask.sum())
        results.append({"shape": [rows, length], "policy_tokens": n_tok, "turns": int(turn_ids(inp.mask).amax(-1).sum()),
                        "checks_s": checked, "timing": timed})  # fmt: skip
        fails = [c for c in rep.checks[first:] if not c.passed]
        worst = max((c for c in rep.checks[first:] if math.isfinite(c.err_over_bound)), key=lambda c: c.err_over_bound)
        print(f"[{tag}] {len(rep.checks) - first} checks, {len(fails)} failed; policy tokens {n_tok}; "
              f"worst err/bound {worst.err_over_bound:.3g} ({worst.name}); {checked:.1f} s")  # fmt: skip
        for c in fails:
            print(f"  FAIL {c.name}: max abs err {c.max_abs_err:.3g} > bound {c.max_bound:.3g} "
                  f"(err/bound {c.err_over_bound:.3g}) {c.note}")  # fmt: skip
        lf, es = timed["loss_fwd_bwd"], timed["estimator"]
        for label, part, na, nb in (("loss fwd+bwd", lf, "vanilla_s", "so_grpo_s"),
                                    ("estimator   ", es, "gae_s", "so_ppo_turn_gae_s")):  # fmt: skip
            cols = "  ".join(f"{c} {part[nb][c] * 1e3:.3f} vs {part[na][c] * 1e3:.3f} ms = {part['ratio'][c]:.3f}"
                             for c in part[na])  # fmt: skip
            met = "met" if all(v <= part["target"] for k, v in part["ratio"].items() if k != "cpu") else "NOT met"
            print(
                f"  {label} {nb[:-2]} vs {na[:-2]} (ratio {nb[:-2]}/{na[:-2]}): {cols}  (target <= {part['target']}: {met})"
            )
        print(f"  host-synchronizing calls per call: {timed['host_syncs_per_call']}")

    summary = _finite_json(
        {
            **env,
            "passed": rep.passed,
            "num_checks": len(rep.checks),
            "num_failed": sum(not c.passed for c in rep.checks),
            "results": results,
            "checks": [asdict(c) for c in rep.checks],
            "wall_s": time.perf_counter() - started,
        }
    )
    print(f"{'PASS' if rep.passed else 'FAIL'}: {summary['num_checks'] - summary['num_failed']} of "
          f"{summary['num_checks']} checks passed in {summary['wall_s']:.1f} s")  # fmt: skip
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(summary, indent=1, default=float) + "\n")
        print(f"wrote {args.json_out}")
    return 0 if rep.passed else 1


if __name__ == "__main__":
    sys.exit(main())
