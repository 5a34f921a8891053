"""Peak memory of one micro-batch step with and without the parameter-space clipping-bias term C(theta).

One step = forward of a randomly initialised Qwen2 (float32, built from a config, no download), float32
response log-probs, the registered ``so_grpo`` loss on off-policy inputs (tokens clip), ``loss.backward()``.
Each configuration runs in its own process, forked from a parent that has imported torch, transformers
and verl but computed nothing; the number is that process's RSS high-water mark
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``: the whole process, allocator caches and the pages shared
with the parent included, the same baseline for every configuration):

    base        reference=relative, no diagnostic               (the loss without any extra backward)
    diagnostic  reference=relative, the diagnostic due on this micro-batch (one extra backward)
    gradient    reference=gradient (one extra backward that drives Z)

Prints each peak, its ratio to ``base`` and the extra over ``base`` in parameter-sized buffers
(``(peak - base) / (4 P)``, P float32 parameters). The target: at most one. ``--live-tensors`` runs each
configuration once more, under ``torch.profiler`` (``profile_memory=True``), and adds the peak of the
bytes held by live tensors allocated during the step (the model's parameters excluded): what torch holds,
without the C library's heap (the RSS extra of the previous code was glibc's, docs/algorithms.md). The default model has about
100M parameters (``--model 100m``) at 4 x 2048 tokens; run it alone (both cores, minutes)::

    flock /tmp/sorl-heavy.lock .venv/bin/python scripts/bench/clip_bias_grad_memory.py

``--small`` runs a tiny Qwen2 at 2 x 64 tokens in seconds (the unit test's mode).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loss_overhead import multi_turn_mask  # noqa: E402

#: Qwen2 shapes: "100m" has 95.2M parameters (untied embeddings of a 8192-token vocabulary)
MODELS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
    "100m": {"hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "vocab_size": 8192},
}  # fmt: skip

#: configuration -> (clip_norm_reference, the diagnostic due on this micro-batch)
CONFIGURATIONS = {"base": ("relative", False), "diagnostic": ("relative", True), "gradient": ("gradient", False)}


def live_tensor_peak_mib(profiler: Any) -> float:
    """The peak of the bytes held by tensors allocated while ``profiler`` recorded (its memory events, in order)."""
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak / 2**20


def one_step(
    model_name: str, rows: int, length: int, threads: int, configuration: str, live: bool = False
) -> dict[str, Any]:
    """Run one step of ``configuration`` in this process; its peak RSS (MiB) and what the loss logged (with
    ``live``, the step runs under ``torch.profiler`` and the peak of live tensor bytes is returned instead)."""
    import contextlib

    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**MODELS[model_name], max_position_embeddings=length, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    params = sum(p.numel() for p in model.parameters())
    profiler = (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        if live
        else contextlib.nullcontext()
    )
    with profiler:
        metrics = _step(model, config, rows, length, configuration)
    if live:
        return {"peak_live_tensor_mib": live_tensor_peak_mib(profiler)}
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return {
        "peak_rss_mib": peak_mib,
        "parameters": params,
        "clip_bias_grad_norm": metrics.get("sorl/clip_bias_grad_norm"),
        "turn_clipfrac": metrics["sorl/turn_clipfrac"],
    }


def _step(model: Any, config: Any, rows: int, length: int, configuration: str) -> dict[str, Any]:
    """Forward, float32 log-probs, the ``so_grpo`` loss of ``configuration`` and its backward; the loss's metrics."""
    from verl.workers.config import ActorConfig

    from sorl_verl.algorithms.clip_bias_grad import DIAGNOSTIC
    from sorl_verl.algorithms.config import SORLPolicyLossConfig
    from sorl_verl.algorithms.losses import compute_policy_loss_so_grpo

    ids = torch.randint(0, config.vocab_size, (rows, length))
    mask = multi_turn_mask(rows, length - 1, 4, 8)  # the response: every token after the first
    gen = torch.Generator().manual_seed(1)
    row_advantage = torch.randn(rows, 1, generator=gen)
    advantages = (row_advantage * mask).float()
    logits = model(input_ids=ids).logits
    log_prob = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    del logits
    # off-policy per token, and per row towards the clipped side of its advantage's sign (ratio e^0.5 where
    # A > 0, e^-0.5 where A < 0), so that long turns, whose ratio averages the token noise out, clip too
    shift = 0.5 * torch.sign(row_advantage) - 0.5 * torch.randn(log_prob.shape, generator=gen)
    old_log_prob = log_prob.detach() - shift
    reference, diagnostic = CONFIGURATIONS[configuration]
    actor = ActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=rows,
        policy_loss=SORLPolicyLossConfig(clip_norm_reference=reference, clip_norm_apply="loss"),
    )  # fmt: skip
    DIAGNOSTIC.due = diagnostic
    loss, metrics = compute_policy_loss_so_grpo(old_log_prob, log_prob, advantages, mask, "token-mean", actor)
    loss.backward()
    return metrics


def cpu_model_name() -> str:
    """``lscpu``'s model name (the platform's processor string where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="100m")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--small", action="store_true", help="tiny model, 2 x 64 tokens (seconds)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--live-tensors", action="store_true", help="also the peak of live tensor bytes (profiler)")
    args = parser.parse_args(argv)
    if args.small:
        args.model, args.rows, args.length = "tiny", 2, 64
    import transformers  # noqa: F401 - imported once here, before the forks
    import verl.workers.config  # noqa: F401

    import sorl_verl.algorithms.losses  # noqa: F401

    steps = {}
    context = multiprocessing.get_context("fork")
    with context.Pool(
        1, maxtasksperchild=1
    ) as pool:  # a fresh child per configuration: a high-water mark is per process
        for name in CONFIGURATIONS:
            steps[name] = pool.apply(one_step, (args.model, args.rows, args.length, args.threads, name))
            if args.live_tensors:
                live = pool.apply(one_step, (args.model, args.rows, args.length, args.threads, name, True))
                steps[name].update(live)
    if not all(steps[name]["clip_bias_grad_norm"] for name in ("diagnostic", "gradient")):
        raise RuntimeError(f"nothing was clipped, so no extra backward ran: {steps}")
    base = steps["base"]["peak_rss_mib"]
    param_mib = 4 * steps["base"]["parameters"] / 2**20
    result = {
        "model": args.model,
        "parameters": steps["base"]["parameters"],
        "tokens": [args.rows, args.length],
        "measure": "RSS high-water mark per process (getrusage ru_maxrss)",
        "cpu": cpu_model_name(),
        "torch": torch.__version__,
        "peak_rss_mib": {name: step["peak_rss_mib"] for name, step in steps.items()},
        "ratio_to_base": {name: step["peak_rss_mib"] / base for name, step in steps.items()},
        "extra_in_parameter_buffers": {name: (step["peak_rss_mib"] - base) / param_mib for name, step in steps.items()},
        "clip_bias_grad_norm": {name: step["clip_bias_grad_norm"] for name, step in steps.items()},
        "turn_clipfrac": steps["base"]["turn_clipfrac"],
    }
    if args.live_tensors:
        live_base = steps["base"]["peak_live_tensor_mib"]
        result["peak_live_tensor_mib"] = {name: step["peak_live_tensor_mib"] for name, step in steps.items()}
        result["live_extra_in_parameter_buffers"] = {
            name: (step["peak_live_tensor_mib"] - live_base) / param_mib for name, step in steps.items()
        }
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
