"""What ``clip_norm_reference=gradient`` and the ``sorl/clip_bias_grad_norm`` diagnostic cost per micro-batch step.

One micro-batch step = model forward, float32 response log-probs, ``so_grpo`` loss, backward through the model
(a randomly initialised Qwen2 from ``loss_in_step.py``; ``--model tiny`` by default). Off-policy inputs (log-ratio
spread ``--spread``) so that tokens are clipped and the extra vector-Jacobian products run. Contenders, alternating
step by step, medians of wall time:

    base       reference=relative, no diagnostic                   (what the loss cost before)
    gradient   reference=gradient: one extra backward of delta per micro-batch
    relative   reference=gradient_relative: two extra backwards per micro-batch
    diagnostic reference=relative with the diagnostic taken on this micro-batch (it is taken on one
               micro-batch per optimizer step, so a step of n micro-batches pays 1/n of this extra)

Prints each median and its ratio to ``base``. A ratio, not a timed test: run it niced and short::

    nice -n 19 .venv/bin/python scripts/bench/clip_bias_grad_cost.py --reps 7

On a GPU (``--device cuda``) the model is bfloat16 (as in ``loss_in_step.py``; the log-probs and the loss stay
float32) and every timed step is bracketed by ``torch.cuda.synchronize()``; the device command is
``scripts/bench/gpu_costs_device.sh``::

    python3 scripts/bench/clip_bias_grad_cost.py --device cuda --model 1.5b --rows 4 --length 4096 --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from verl.workers.config import ActorConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loss_in_step import MODELS, build_model, response_log_prob, sync  # noqa: E402
from loss_overhead import multi_turn_mask  # noqa: E402

from sorl_verl.algorithms import optim  # noqa: E402
from sorl_verl.algorithms.clip_bias_grad import DIAGNOSTIC  # noqa: E402
from sorl_verl.algorithms.config import SORLPolicyLossConfig  # noqa: E402
from sorl_verl.algorithms.losses import compute_policy_loss_so_grpo  # noqa: E402

#: contender -> (clip_norm_reference, take the diagnostic on this micro-batch)
CONTENDERS = {
    "base": ("relative", False),
    "gradient": ("gradient", False),
    "relative": ("gradient_relative", False),
    "diagnostic": ("relative", True),
}


def actor_config(reference: str) -> ActorConfig:
    policy_loss = SORLPolicyLossConfig(clip_norm_reference=reference, clip_norm_apply="loss", clip_norm_tau=0.2)
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (float32 model) | cuda (bfloat16 model)")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--spread", type=float, default=0.5, help="std of log_prob - old_log_prob")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = build_model(args.model, device, dtype)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.rows, args.length)).to(device)
    mask = multi_turn_mask(args.rows, args.length, 2, 4, seed=0).to(device)
    with torch.no_grad():
        old = response_log_prob(model, ids) + args.spread * torch.randn(args.rows, args.length).to(device)
    adv = torch.randn(args.rows, 1).expand(-1, args.length).contiguous().to(device)
    optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # a consumer of the loss's ledger, as in verl's worker
    configs = {name: actor_config(reference) for name, (reference, _) in CONTENDERS.items()}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    clipfrac = []
    logged: dict[str, float | None] = {}
    for rep in range(args.reps + 1):  # the first round warms up
        for name, (_, diagnostic) in CONTENDERS.items():
            DIAGNOSTIC.due = diagnostic
            model.zero_grad(set_to_none=True)
            sync(device)
            start = time.perf_counter()
            loss, metrics = compute_policy_loss_so_grpo(old, response_log_prob(model, ids), adv, mask, "token-mean",
                                                        configs[name])  # fmt: skip
            loss.backward()
            sync(device)
            elapsed = time.perf_counter() - start
            optim.LEDGER.clear()
            if rep > 0:
                times[name].append(elapsed)
                clipfrac.append(metrics["sorl/turn_clipfrac"])
                logged[name] = metrics.get("sorl/clip_bias_grad_norm")
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "args": vars(args),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "dtype": str(dtype),
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if device.startswith("cuda") else None,
        "turn_clipfrac_mean": statistics.fmean(clipfrac),
        "clip_bias_grad_norm": logged,
        "median_s": medians,
        "ratio_to_base": {name: medians[name] / medians["base"] for name in CONTENDERS},
    }
    for name in CONTENDERS:
        print(f"{name:11s} {medians[name] * 1e3:9.2f} ms   x{result['ratio_to_base'][name]:.2f}")
    print(f"turn clip fraction {result['turn_clipfrac_mean']:.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
