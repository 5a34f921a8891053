"""Overhead of the SORL loss and estimator against verl's own, on realistic multi-turn shapes.

Prints median forward+backward time of ``so_grpo`` vs verl ``vanilla`` and of the ``so_ppo``
turn-level GAE estimator vs verl ``gae`` (targets: ratio <= 1.3 and <= 1.0).

    python scripts/bench/loss_overhead.py [--rows 32] [--length 8192] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from verl.trainer.ppo.core_algos import compute_gae_advantage_return, compute_policy_loss_vanilla
from verl.workers.config import ActorConfig

from sorl_verl.algorithms import optim
from sorl_verl.algorithms.advantages import compute_turn_gae_advantage_return
from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.losses import compute_policy_loss_so_grpo


def multi_turn_mask(rows: int, length: int, min_turns: int, max_turns: int, seed: int = 0) -> torch.Tensor:
    """``[rows, length]`` response mask: each row alternates policy turns and observation gaps,
    with 4-16 turns filling 60-100% of the row and padding after."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows):  # set-up only; the code under test has no per-row loop
        turns = int(torch.randint(min_turns, max_turns + 1, (1,), generator=gen))
        used = int(length * (0.6 + 0.4 * torch.rand(1, generator=gen).item()))
        cuts = torch.sort(torch.randperm(used - 1, generator=gen)[: 2 * turns - 1] + 1).values.tolist()
        bounds = [0, *cuts, used]
        for k in range(turns):
            mask[b, bounds[2 * k] : bounds[2 * k + 1]] = True
    return mask


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def paired_medians(a: Callable[[], object], b: Callable[[], object], reps: int, warmup: int = 2) -> tuple[float, float]:
    """Median seconds of ``a`` and ``b``, run alternately so both see the same machine load."""
    for _ in range(warmup):
        a()
        b()
    times_a, times_b = [], []
    for _ in range(reps):
        for fn, times in ((a, times_a), (b, times_b)):
            start = clock()
            fn()
            times.append(clock() - start)
    return statistics.median(times_a), statistics.median(times_b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall", help="cpu: process CPU time, steadier on a busy machine"
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    mask = multi_turn_mask(args.rows, args.length, 4, 16)
    old_log_prob = -torch.rand(args.rows, args.length) * 3
    log_prob_data = old_log_prob + 0.3 * torch.randn(args.rows, args.length)
    advantages = torch.randn(args.rows, 1).expand(-1, args.length).contiguous() * mask
    config = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=SORLPolicyLossConfig()
    )

    # the default clip_norm_apply=update publishes 1/Z to the actor's update-scaled optimizer, as in verl
    optimizer = optim.AdamW([torch.nn.Parameter(torch.zeros(1))])

    def step(loss_fn: Callable) -> Callable[[], None]:
        def run() -> None:
            log_prob = log_prob_data.clone().requires_grad_(True)
            loss, _ = loss_fn(old_log_prob, log_prob, advantages, mask, "token-mean", config)
            loss.backward()
            optimizer.zero_grad()  # drops this step's records

        return run

    t_vanilla, t_sorl = paired_medians(step(compute_policy_loss_vanilla), step(compute_policy_loss_so_grpo), args.reps)

    rewards = torch.zeros(args.rows, args.length)
    last = (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)) & mask
    rewards[last] = torch.randn(int(last.sum()))
    values = torch.randn(args.rows, args.length)
    t_gae, t_turn_gae = paired_medians(
        lambda: compute_gae_advantage_return(rewards, values, mask.float(), gamma=1.0, lam=0.95),
        lambda: compute_turn_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95),
        max(3, args.reps // 3),
        warmup=1,
    )

    print(
        f"shape {args.rows}x{args.length}, 4-16 turns per row, torch threads {torch.get_num_threads()}, "
        f"{args.clock} clock"
    )
    print(f"loss fwd+bwd  vanilla {t_vanilla * 1e3:8.2f} ms   so_grpo {t_sorl * 1e3:8.2f} ms")
    print(f"estimator     gae     {t_gae * 1e3:8.2f} ms   so_ppo  {t_turn_gae * 1e3:8.2f} ms")
    print(f"ratio so_grpo/vanilla = {t_sorl / t_vanilla:.3f}   (target <= 1.3)")
    print(f"ratio so_ppo/gae      = {t_turn_gae / t_gae:.3f}   (target <= 1.0)")


if __name__ == "__main__":
    main()
