"""The verdict of scripts/gpu/run_gpu_smoke.sh: per-step metrics of each run and one ``[smoke] RESULT:`` line.

    python smoke_verdict.py --out OUT --steps 2 --device cuda plain stressed

A run passes when main_ppo exited 0, logged training steps 1..steps with finite SORL metrics, and the
SORL optimizer logged at least one update per step; ``plain`` also validated at step 0 and at the
last step; on ``cuda`` the actor allocated GPU memory. Exit status 0 on PASS, 1 on FAIL.
Standard library only (it runs beside whatever python the smoke found).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

SHOWN = (
    "critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/sorl/norm_factor", "actor/sorl/turn_ratio_mean",
    "actor/sorl/turn_clipfrac", "training/rollout_probs_diff_max", "actor/perf/max_memory_allocated_gb",
    "timing_s/gen", "timing_s/update_actor", "timing_s/step",
)  # fmt: skip
FINITE = ("actor/pg_loss", "actor/grad_norm", "actor/sorl/norm_factor", "actor/sorl/turn_ratio_mean")


def check_run(run_dir: Path, name: str, steps: int, device: str) -> list[str]:
    """Print the run's metrics; return its problems (empty when it passed)."""
    problems = []
    code = (run_dir / "exit_code").read_text().strip() if (run_dir / "exit_code").exists() else "missing"
    if code != "0":
        problems.append(f"main_ppo exit {code}" + (" (timeout)" if code in ("124", "137") else ""))
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    train = {r["step"]: r["data"] for r in rows if "actor/pg_loss" in r["data"]}
    val = {r["step"]: r["data"] for r in rows if any(k.startswith("val-core/") for k in r["data"])}
    for s in sorted(train):
        shown = "  ".join(f"{k.split('/', 1)[1]}={float(train[s][k]):.4g}" for k in SHOWN if k in train[s])
        print(f"[smoke] {name} step {s}: {shown}")
        bad = [k for k in FINITE if not math.isfinite(float(train[s].get(k, math.nan)))]
        if bad:
            problems.append(f"step {s}: not finite or missing {bad}")
    for s in sorted(val):
        shown = "  ".join(f"{k[9:]}={float(v):.3g}" for k, v in sorted(val[s].items()) if k.startswith("val-core/"))
        print(f"[smoke] {name} validation @ step {s}: {shown}")
    if sorted(train) != list(range(1, steps + 1)):
        problems.append(f"training steps logged {sorted(train)}, want 1..{steps}")
    if name == "plain" and (0 not in val or steps not in val):
        problems.append(f"validation logged at steps {sorted(val)}, want 0 and {steps}")
    updates = run_dir / "sorl_updates.jsonl"
    n_updates = sum(1 for _ in updates.open()) if updates.exists() else 0
    if n_updates < steps:
        problems.append(f"sorl_updates.jsonl has {n_updates} records, want >= {steps}")
    z = max((float(d.get("actor/sorl/norm_factor", 0.0)) for d in train.values()), default=0.0)
    mem = max((float(d.get("actor/perf/max_memory_allocated_gb", 0.0)) for d in train.values()), default=0.0)
    print(f"[smoke] {name}: {n_updates} optimizer steps; normalizer Z max {z:.3g}; actor peak GPU memory {mem:.3f} GB")
    if device != "cpu" and not mem > 0:
        problems.append("actor/perf/max_memory_allocated_gb is 0: the actor did not allocate GPU memory")
    return [f"{name}: {p}" for p in problems]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args(argv)
    problems = [p for run in args.runs for p in check_run(args.out / run, run, args.steps, args.device)]
    print("[smoke] RESULT: " + ("PASS" if not problems else "FAIL: " + "; ".join(problems)))
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
