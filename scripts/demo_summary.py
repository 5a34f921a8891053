"""Progress lines and the end-of-run summary of scripts/demo.sh, read from verl's file logger.

verl's ``trainer.logger=[..., file]`` writes one JSON line per logged step to
``$VERL_FILE_LOGGER_PATH``: ``{"step": N, "data": {metric: value, ...}}``. Validation metrics
(``val-core/...``, ``val-aux/...``) arrive in their own lines (before training and every
``trainer.test_freq`` steps).

The actor's update log (``sorl_updates.jsonl``, one record per optimizer step: the step factor
``scale`` and ``update_norm``, see ``sorl_verl.algorithms.optim``) adds the parameter-update norm
per training step: the records written since the previous training step belong to it.

    python scripts/demo_summary.py follow METRICS.jsonl --pid PID [--steps N] [--updates U]  # a line per step
    python scripts/demo_summary.py summary METRICS.jsonl [--log L] [--ckpt DIR] [--updates U]  # the table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

#: pseudo-metric: mean parameter-update norm of a training step, from the update log
UPDATE_NORM = "sorl/update_norm_mean"

#: (label, metric key or key prefix) rows of the summary table, training metrics
TRAIN_ROWS = (
    ("reward (score) mean", "critic/score/mean"),
    ("response length mean", "response_length/mean"),
    ("model turns / episode", "actor/sorl/num_turns_mean"),
    ("messages / episode (verl num_turns)", "num_turns/mean"),
    ("searches / episode", "agent/searches_mean"),
    ("valid action ratio", "agent/valid_action_ratio"),
    ("finished ratio (answered)", "agent/finished_ratio"),
    ("sorl/turn_ratio_mean", "actor/sorl/turn_ratio_mean"),
    ("sorl/turn_clipfrac", "actor/sorl/turn_clipfrac"),
    ("sorl/clip_bias_norm", "actor/sorl/clip_bias_norm"),
    ("sorl/clip_bias_rel", "actor/sorl/clip_bias_rel"),
    ("sorl/norm_factor", "actor/sorl/norm_factor"),
    ("sorl/update_scale (step factor)", "actor/sorl/update_scale"),
    ("update norm (L2, mean per update)", UPDATE_NORM),
    ("sorl/triggered", "actor/sorl/triggered"),
    ("actor/pg_clipfrac", "actor/pg_clipfrac"),
    ("actor/ppo_kl", "actor/ppo_kl"),
    ("actor/pg_loss", "actor/pg_loss"),
    ("critic/vf_loss", "critic/vf_loss"),
    ("step time (s)", "timing_s/step"),
)


def read_records(path: str | Path) -> list[dict]:
    """All complete JSON lines of the metrics file (a partly written last line is skipped)."""
    records = []
    p = Path(path)
    if not p.exists():
        return records
    for line in p.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def update_norms_per_step(updates: list[dict], steps: int) -> list[float | None]:
    """Mean ``update_norm`` per training step when the log splits evenly into ``steps`` (sync trainers)."""
    norms = [u.get("update_norm") for u in updates]
    if not steps or not norms or len(norms) % steps or any(n is None for n in norms):
        return [None] * steps
    k = len(norms) // steps
    return [sum(norms[i * k : (i + 1) * k]) / k for i in range(steps)]


def split_records(records: list[dict]) -> tuple[list[tuple[int, dict]], list[tuple[int, dict]]]:
    """(training steps, validation entries), each as (step, metrics) in file order."""
    train, val = [], []
    for r in records:
        data = r.get("data", {})
        v = {k: x for k, x in data.items() if k.startswith("val-")}
        t = {k: x for k, x in data.items() if not k.startswith("val-")}
        if v:
            val.append((r.get("step", 0), v))
        if "training/global_step" in t or "timing_s/step" in t:
            train.append((r.get("step", 0), t))
    return train, val


def _num(x) -> float | None:
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f


def window_mean(steps: list[tuple[int, dict]], key: str, first: bool, k: int) -> float | None:
    """Mean of ``key`` over the first (or last) ``k`` steps that log it."""
    vals = [_num(m[key]) for _, m in steps if key in m and _num(m[key]) is not None]
    vals = vals[:k] if first else vals[-k:]
    return sum(vals) / len(vals) if vals else None


def em_keys(val: list[tuple[int, dict]]) -> list[str]:
    """Validation accuracy keys: verl's ``val-core/<data_source>/<reward key>/mean@N`` (and aux em/acc)."""
    keys: list[str] = []
    for _, m in val:
        for k in m:
            if k not in keys and ("/acc/" in k or "/em/" in k or "/score/" in k or "/reward/" in k) and "mean@" in k:
                keys.append(k)
    return sorted(keys)


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    return f"{x:.4g}"


def progress_line(step: int, m: dict, total: int | None) -> str:
    of = f"/{total}" if total else ""
    parts = [f"step {step}{of}"]
    for label, key in (
        ("reward", "critic/score/mean"),
        ("turns", "actor/sorl/num_turns_mean"),
        ("searches", "agent/searches_mean"),
        ("Z", "actor/sorl/norm_factor"),
        ("scale", "actor/sorl/update_scale"),
        ("|dW|", UPDATE_NORM),
        ("clipfrac", "actor/sorl/turn_clipfrac"),
        ("pg_loss", "actor/pg_loss"),
        ("vf_loss", "critic/vf_loss"),
        ("s", "timing_s/step"),
    ):
        if key in m:
            parts.append(f"{label}={fmt(_num(m[key]))}")
    return "  ".join(parts)


def follow(path: str, pid: int, total: int | None, updates: str | None = None, poll_s: float = 2.0) -> None:
    """Print a progress line per new training step (and per validation) until ``pid`` exits."""
    seen = seen_updates = 0
    start = time.time()

    def alive() -> bool:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False

    while True:
        running = alive()
        records = read_records(path)
        for r in records[seen:]:
            data = r.get("data", {})
            step = r.get("step", 0)
            el = time.time() - start
            if any(k.startswith("val-") for k in data):
                ems = {k: data[k] for k in data if k.startswith("val-core/")}
                shown = "  ".join(f"{k.split('/', 1)[1]}={fmt(_num(v))}" for k, v in sorted(ems.items())[:4])
                print(f"[{el:6.0f}s] validation @ step {step}: {shown}", flush=True)
            if "timing_s/step" in data:
                if updates:
                    new = read_records(updates)[seen_updates:]
                    seen_updates += len(new)
                    norms = [u["update_norm"] for u in new if u.get("update_norm") is not None]
                    if norms:
                        data = {**data, UPDATE_NORM: sum(norms) / len(norms)}
                print(f"[{el:6.0f}s] {progress_line(step, data, total)}", flush=True)
        seen = len(records)
        if not running:
            return
        time.sleep(poll_s)


def mean_val_score(metrics: dict, keys: list[str]) -> float | None:
    """Mean of the per-split validation scores (the macro-average over data sources)."""
    vals = [_num(metrics[k]) for k in keys if k in metrics and _num(metrics[k]) is not None]
    return sum(vals) / len(vals) if vals else None


def summary(path: str, log: str | None, ckpt: str | None, updates: str | None = None, k: int = 3) -> int:
    records = read_records(path)
    train, val = split_records(records)
    if not train:
        print(f"no training steps logged in {path}", file=sys.stderr)
        return 1
    if updates:
        norms = update_norms_per_step(read_records(updates), len(train))
        train = [(s, {**m, UPDATE_NORM: n} if n is not None else m) for (s, m), n in zip(train, norms, strict=True)]
    n = min(k, max(1, len(train) // 2))
    w = 38
    print()
    print(f"{'metric':<{w}} {'start':>10} {'end':>10}   (mean of first/last {n} of {len(train)} steps)")
    print("-" * (w + 24))
    for label, key in TRAIN_ROWS:
        a, b = window_mean(train, key, True, n), window_mean(train, key, False, n)
        if a is None and b is None:
            continue
        print(f"{label:<{w}} {fmt(a):>10} {fmt(b):>10}")
    keys = em_keys(val)
    if keys:
        print("-" * (w + 24))
        print(f"validation (step {val[0][0]} -> step {val[-1][0]})")
        for key in keys:
            a = next((_num(m[key]) for _, m in val if key in m), None)
            b = next((_num(m[key]) for _, m in reversed(val) if key in m), None)
            print(f"{key.replace('val-core/', '').replace('val-aux/', ''):<{w}} {fmt(a):>10} {fmt(b):>10}")
        core = [key for key in keys if key.startswith("val-core/")] or keys
        first, last = mean_val_score(val[0][1], core), mean_val_score(val[-1][1], core)
        print(f"{'mean over the ' + str(len(core)) + ' splits':<{w}} {fmt(first):>10} {fmt(last):>10}")
        if first is not None and last is not None and len(val) > 1:
            print(f"validation gain: {last - first:+.3f} (mean score over the splits, step {val[0][0]} -> {val[-1][0]})")
    print("-" * (w + 24))
    print(f"metrics (verl file logger): {path}")
    if log:
        print(f"full log:                   {log}")
    if ckpt:
        print(f"checkpoints:                {ckpt}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("follow")
    f.add_argument("metrics")
    f.add_argument("--pid", type=int, required=True)
    f.add_argument("--steps", type=int)
    f.add_argument("--updates", help="the actor's update log (sorl_updates.jsonl)")
    s = sub.add_parser("summary")
    s.add_argument("metrics")
    s.add_argument("--log")
    s.add_argument("--ckpt")
    s.add_argument("--updates", help="the actor's update log (sorl_updates.jsonl)")
    a = p.parse_args(argv)
    if a.cmd == "follow":
        follow(a.metrics, a.pid, a.steps, a.updates)
        return 0
    return summary(a.metrics, a.log, a.ckpt, a.updates)


if __name__ == "__main__":
    sys.exit(main())
