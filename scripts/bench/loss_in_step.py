"""The SORL loss inside a whole policy-gradient micro-batch step: model forward, log-probs, loss, backward.

``scripts/bench/loss_cuda.py`` times the loss alone, where ``so_grpo`` costs ~2x verl's ``vanilla`` on a GPU.
This script answers what that is worth in a training step: a randomly initialised Qwen2 causal LM (built from
a config, nothing downloaded; ``--model 1.5b`` has Qwen2.5-1.5B's shapes) runs forward on ``rows x length``
token ids in bfloat16, the response log-probs are taken in float32 (log-softmax, gather), the policy loss
(``so_grpo`` or verl ``vanilla``, the same inputs) is computed and backward runs through the model. The two
losses alternate step by step; each step ends with a device synchronize; medians are reported with the
step-time difference and its share of the step.

    # on the GPU machine (verl carried as for loss_cuda.py; see loss_cuda_device.sh)
    python3 scripts/bench/loss_in_step.py --device cuda --model 1.5b --rows 4 --length 4096 --json-out X.json
    # here, a tiny model (what tests/unit/test_loss_in_step_script.py runs)
    .venv/bin/python scripts/bench/loss_in_step.py --device cpu --model tiny --rows 2 --length 64 --reps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
from verl.workers.config import ActorConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loss_overhead import multi_turn_mask  # noqa: E402

from sorl_verl.algorithms import optim  # noqa: E402
from sorl_verl.algorithms.config import SORLPolicyLossConfig  # noqa: E402
from sorl_verl.algorithms.losses import compute_policy_loss_so_grpo  # noqa: E402

MODELS: dict[str, dict[str, int]] = {  # Qwen2 shapes; "1.5b" is Qwen2.5-1.5B's
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936},
}  # fmt: skip


def build_model(name: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised Qwen2 causal LM of the named shape, on ``device`` (no weights are read)."""
    config = transformers.Qwen2Config(**MODELS[name], max_position_embeddings=32768, tie_word_embeddings=False)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.train()


def response_log_prob(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``[rows, length]`` float32 log-prob of each token given the ones before it (position 0: of itself)."""
    logits = model(input_ids=input_ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([logp[:, :1], logp], dim=1)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", choices=sorted(MODELS), default="1.5b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json-out")
    a = ap.parse_args(argv)
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    model = build_model(a.model, a.device, dtype)
    vocab = MODELS[a.model]["vocab_size"]
    input_ids = torch.randint(0, vocab, (a.rows, a.length), device=a.device)
    mask = multi_turn_mask(a.rows, a.length, a.turns, a.turns).to(a.device)
    with torch.no_grad():  # the behaviour policy: this policy's log-probs moved per token, so ratios vary
        old_log_prob = response_log_prob(model, input_ids) + 0.2 * torch.randn(a.rows, a.length, device=a.device)
    advantages = (torch.randn(a.rows, 1, device=a.device) * mask).float()
    config = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=SORLPolicyLossConfig()
    )
    ledger_optimizer = optim.AdamW(model.parameters())  # takes so_grpo's 1/Z hand-off (clip_norm_apply=update)

    def step(loss_fn: Callable) -> Callable[[], None]:
        def run() -> None:
            log_prob = response_log_prob(model, input_ids)
            loss, _ = loss_fn(old_log_prob, log_prob, advantages, mask, "token-mean", config)
            loss.backward()
            ledger_optimizer.zero_grad(set_to_none=True)  # drops the gradients and this step's records

        return run

    fns = {"vanilla": step(compute_policy_loss_vanilla), "so_grpo": step(compute_policy_loss_so_grpo)}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(a.reps + 2):  # two warm-up rounds
        for name, fn in fns.items():
            sync(a.device)
            t0 = time.perf_counter()
            fn()
            sync(a.device)
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    out = {
        "command": " ".join(
            ["python3", "scripts/bench/loss_in_step.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": a.model,
        "parameters": sum(p.numel() for p in model.parameters()),
        "shape": [a.rows, a.length],
        "policy_tokens": int(mask.sum()),
        "dtype": str(dtype),
        "step_s_median": med,
        "step_s_all": times,
        "so_grpo_minus_vanilla_s": med["so_grpo"] - med["vanilla"],
        "ratio": med["so_grpo"] / med["vanilla"],
    }
    print(
        f"{a.model} ({out['parameters'] / 1e9:.2f}B params) {a.rows}x{a.length} on {out['device']}: step "
        f"so_grpo {med['so_grpo'] * 1e3:.1f} ms vs vanilla {med['vanilla'] * 1e3:.1f} ms, "
        f"difference {out['so_grpo_minus_vanilla_s'] * 1e3:+.2f} ms ({(out['ratio'] - 1) * 100:+.2f}% of the step)"
    )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
