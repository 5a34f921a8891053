"""Overhead of the SORL loss and estimator against verl's own, on realistic multi-turn shapes.

Prints median forward+backward time of ``so_grpo`` vs verl ``vanilla`` and of the ``so_ppo``
turn-level GAE estimator vs verl ``gae`` (targets: ratio <= 1.3 and <= 1.0), each call timed on
the wall clock and on this process's CPU time, the two contenders alternating call by call.

    python scripts/bench/loss_overhead.py [--rows 32] [--length 4096] [--turns 8 8] [--reps 41] [--threads N]
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
    with ``min_turns``-``max_turns`` turns filling 60-100% of the row and padding after."""
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


Timing = dict[str, float]  # clock name -> median seconds


def paired_medians(
    a: Callable[[], object], b: Callable[[], object], reps: int, warmup: int = 2
) -> tuple[Timing, Timing]:
    """Median wall and process-CPU seconds of ``a`` and ``b``, run alternately so both see the same machine load."""
    for _ in range(warmup):
        a()
        b()
    times: dict[int, dict[str, list[float]]] = {0: {"wall": [], "cpu": []}, 1: {"wall": [], "cpu": []}}
    for _ in range(reps):
        for key, fn in ((0, a), (1, b)):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[key]["cpu"].append(time.process_time() - cpu)
            times[key]["wall"].append(time.perf_counter() - wall)
    medians = [{clock: statistics.median(values) for clock, values in times[key].items()} for key in (0, 1)]
    return medians[0], medians[1]


def report(name_a: str, name_b: str, a: Timing, b: Timing, target: float) -> str:
    """Two lines: the medians of both contenders, then ``ratio b/a = wall (wall) cpu (cpu)``."""
    times = "   ".join(f"{clock} {name_a} {a[clock] * 1e3:8.2f} ms  {name_b} {b[clock] * 1e3:8.2f} ms" for clock in a)
    ratios = "  ".join(f"{b[clock] / a[clock]:.3f} ({clock})" for clock in a)
    return f"{name_b:7s} vs {name_a:7s} {times}\nratio {name_b}/{name_a} = {ratios}   (target <= {target})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--turns", type=int, nargs=2, default=(8, 8), metavar=("MIN", "MAX"), help="turns per row")
    parser.add_argument("--reps", type=int, default=41)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args()
    if not 1 <= args.turns[0] <= args.turns[1] or 2 * args.turns[1] > args.length:
        parser.error(f"--turns {args.turns[0]} {args.turns[1]}: need 1 <= MIN <= MAX <= length / 2")
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    mask = multi_turn_mask(args.rows, args.length, *args.turns)
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

    turns = f"{args.turns[0]}" if args.turns[0] == args.turns[1] else f"{args.turns[0]}-{args.turns[1]}"
    print(f"shape {args.rows}x{args.length}, {turns} turns per row, torch threads {torch.get_num_threads()}")
    print("loss fwd+bwd: " + report("vanilla", "so_grpo", t_vanilla, t_sorl, 1.3))
    print("estimator:    " + report("gae", "so_ppo", t_gae, t_turn_gae, 1.0))


if __name__ == "__main__":
    main()
