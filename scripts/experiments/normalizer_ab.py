"""Like-for-like A/B of the normalizer on the CPU main job: one seeded training step, two arms.

Both arms run ``bash scripts/demo.sh`` with the same seed in the stress regime (lr 1e-3, 16
updates per rollout); they differ in one knob only. After the step, the L2 distance of the actor's
weights from the initial model is read from verl's checkpoint, next to the sum of the update norms
and the step factors from the actor's update log.

    python scripts/experiments/normalizer_ab.py [--out docs/results/normalizer_ab.json] [--steps 1]

Arms (resumable: an arm whose result is in the output file is not run again):
  off           clip_norm_mode=none                       (Turn-PPO: the normalizer measured, never applied)
  update        clip_norm_tau=0.05, clip_norm_apply=update  (the default mechanism)
  loss          clip_norm_tau=0.05, clip_norm_apply=loss    (the loss-level variant)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KNOB = "actor_rollout_ref.actor.policy_loss"
STRESS = [
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.ppo_epochs=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
]
ARMS = {
    "off": [f"{KNOB}.clip_norm_mode=none"],
    "update": [f"{KNOB}.clip_norm_tau=0.05", f"{KNOB}.clip_norm_apply=update"],
    "loss": [f"{KNOB}.clip_norm_tau=0.05", f"{KNOB}.clip_norm_apply=loss"],
}


def weight_distance(checkpoint: Path, model_dir: Path) -> float:
    """L2 distance between an FSDP actor checkpoint (one rank) and the initial Hugging Face model."""
    import torch
    from transformers import AutoModelForCausalLM

    state = torch.load(checkpoint, weights_only=False, map_location="cpu")
    initial = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).state_dict()
    total = 0.0
    for key, value in state.items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        total += float((value.double() - initial[key].double()).square().sum())
    return math.sqrt(total)


def run_arm(name: str, steps: int, run_dir: Path) -> dict:
    command = ["bash", "scripts/demo.sh", "--steps", str(steps), "--", *STRESS, *ARMS[name]]
    checkpoint = run_dir / "checkpoints" / f"global_step_{steps}" / "actor" / "model_world_size_1_rank_0.pt"
    start = time.time()
    if not checkpoint.exists():  # a finished run whose summary was interrupted is reused
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        run_dir.mkdir(parents=True)
        print(f"[ab] {name}: running", flush=True)
        env = {**os.environ, "SORL_RUN_DIR": str(run_dir)}
        with open(run_dir.parent / f"{name}.log", "w") as log:
            proc = subprocess.run(
                ["flock", "/tmp/sorl-heavy.lock", *command], cwd=REPO, env=env, stdout=log, stderr=log
            )
        if proc.returncode != 0:
            raise SystemExit(f"error: arm {name} failed ({proc.returncode}); see {run_dir.parent / f'{name}.log'}")
    updates = [json.loads(x) for x in (run_dir / "checkpoints" / "sorl_updates.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(m["data"] for m in metrics if "timing_s/step" in m["data"])
    from sorl_verl.embedded.qa_build import ensure_embedded_default

    model_dir = ensure_embedded_default().model_dir  # demo.sh's model (same SORL_HOME, see main)
    return {
        "command": " ".join(command),
        "wall_s": round(time.time() - start, 1),
        "weight_distance_from_initial": weight_distance(checkpoint, model_dir),
        "sum_update_norms": sum(u.get("update_norm", 0.0) for u in updates),
        "optimizer_steps": len(updates),
        "mean_step_factor": sum(u["scale"] for u in updates) / len(updates),
        "step1": {
            k: first.get(k)
            for k in (
                "critic/score/mean",
                "response_length/mean",
                "actor/pg_loss",
                "actor/sorl/norm_factor",
                "actor/sorl/update_scale",
                "actor/sorl/loss_scale",
                "actor/sorl/clip_bias_rel",
                "actor/ppo_kl",
            )
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "normalizer_ab.json")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/sorl_normalizer_ab"))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = parser.parse_args(argv)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for name in args.arms:
        if name in results:
            print(f"[ab] {name}: done, skipped")
            continue
        results[name] = run_arm(name, args.steps, args.work / name)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        r = results[name]
        print(
            f"[ab] {name}: |W - W0| = {r['weight_distance_from_initial']:.4f}, "
            f"sum |dW| = {r['sum_update_norms']:.4f}, mean factor {r['mean_step_factor']:.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
