"""Progress lines and the end-of-run summary of a run (scripts/demo.sh's), read from verl's file logger.

verl's ``trainer.logger=[..., file]`` writes one JSON line per logged step to
``$VERL_FILE_LOGGER_PATH``: ``{"step": N, "data": {metric: value, ...}}``. Validation metrics
(``val-core/...``, ``val-aux/...``) arrive in their own lines (before training and every
``trainer.test_freq`` steps).

The metrics file is read through the project's one reader, :mod:`sorl_verl.study.metrics`
(``read_records`` for the lines, ``parse_val_key`` for the validation keys). The actor's update log
(``sorl_updates.jsonl``, one record per optimizer step: the step factor ``scale`` and
``update_norm``, see ``sorl_verl.algorithms.optim``) adds the parameter-update norm per training
step: the records written since the previous training step belong to it.

    sorl-verl summary follow METRICS.jsonl --pid PID [--steps N] [--updates U]  # a line per step
    sorl-verl summary summary METRICS.jsonl [--log L] [--ckpt DIR] [--updates U] [--out-dir RUN]

(or ``python -m sorl_verl.cli.summary ...``).

The summary: training rows start at the first step with a non-zero update, validation has one row
per split (start = the validation before training); with ``--out-dir`` it is kept as
``summary.txt`` / ``summary.json`` with ``curves.png`` (``sorl-verl plot``'s panels, validation per
split) beside them, and the ``sorl-verl plot`` / ``sorl-verl eval`` commands to use next are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from sorl_verl.study.metrics import parse_val_key
from sorl_verl.study.metrics import read_records as read_metrics_file

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


def read_metrics(path: str | Path) -> list[tuple[int, dict]]:
    """``(step, data)`` of each complete line of verl's metrics file, through the project's reader
    (:func:`sorl_verl.study.metrics.read_records`: a partly written last line is skipped); ``[]``
    while the file does not exist yet."""
    p = Path(path)
    return list(read_metrics_file(p)) if p.exists() else []


def read_update_log(path: str | Path) -> list[dict]:
    """The actor's update log (``sorl_updates.jsonl``): one JSON object per optimizer step; a partly
    written last line is skipped, ``[]`` while the file does not exist yet."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def is_validation_key(key: str) -> bool:
    """A validation mean ``val-<core|aux>/<source>/<var>/mean@<n>`` (:func:`parse_val_key`)."""
    return parse_val_key(key) is not None


def update_norms_per_step(updates: list[dict], steps: int) -> list[float | None]:
    """Mean ``update_norm`` per training step when the log splits evenly into ``steps`` (sync trainers)."""
    norms = [u.get("update_norm") for u in updates]
    if not steps or not norms or len(norms) % steps or any(n is None for n in norms):
        return [None] * steps
    k = len(norms) // steps
    return [sum(norms[i * k : (i + 1) * k]) / k for i in range(steps)]


#: printed under the table when the normalizer never acted (the sorl/ rows at 0 or 1)
NEAR_ON_POLICY = (
    "(sorl/ rows at 0 or 1: in this recipe the updates stay close to the policy that rolled out (turn\n"
    " ratios ~1, almost nothing clipped), so the clipping-triggered normalization has nothing to act on\n"
    " and SO-GRPO trains as Turn-PPO; off-policy behaviour is the stability study's: docs/results.md)"
)


def split_records(records: list[tuple[int, dict]]) -> tuple[list[tuple[int, dict]], list[tuple[int, dict]]]:
    """(training steps, validation entries), each as (step, metrics) in file order: a line's validation
    means (:func:`is_validation_key`) form a validation entry; its other metrics a training step when
    it carries ``training/global_step`` or ``timing_s/step`` (as :func:`sorl_verl.study.metrics.parse_records`)."""
    train, val = [], []
    for step, data in records:
        v = {k: x for k, x in data.items() if is_validation_key(k)}
        t = {k: x for k, x in data.items() if not k.startswith("val-")}
        if v:
            val.append((step, v))
        if "training/global_step" in t or "timing_s/step" in t:
            train.append((step, t))
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


def split_keys(val: list[tuple[int, dict]]) -> dict[str, str]:
    """One validation key per data source (split), sorted by source: verl's core metric
    ``val-core/<source>/<var>/mean@N`` (the reward function's score); only when no core metric was
    logged, the auxiliary ``em`` / ``acc`` / ``score`` mean of each source."""
    found: dict[str, dict[str, str]] = {"core": {}, "aux": {}}
    for _, m in val:
        for k in m:
            parsed = parse_val_key(k)
            if parsed is not None and (parsed.kind == "core" or parsed.var in ("em", "acc", "score")):
                found[parsed.kind].setdefault(parsed.source, k)
    return dict(sorted((found["core"] or found["aux"]).items()))


def first_update_index(train: list[tuple[int, dict]]) -> int:
    """Index of the first training step whose update was non-zero: by the update log's norm when it
    is there, else by verl's ``actor/lr``; 0 when neither is logged (or none is non-zero)."""
    for key in (UPDATE_NORM, "actor/lr"):
        values = [_num(m.get(key)) for _, m in train]
        if any(v is not None for v in values):
            return next((i for i, v in enumerate(values) if v), 0)
    return 0


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
        records = read_metrics(path)
        for step, data in records[seen:]:
            el = time.time() - start
            parsed = {k: parse_val_key(k) for k in data}
            if any(parsed.values()):
                core = {k: data[k] for k, v in parsed.items() if v is not None and v.kind == "core"}
                shown = "  ".join(f"{k.split('/', 1)[1]}={fmt(_num(v))}" for k, v in sorted(core.items())[:4])
                print(f"[{el:6.0f}s] validation @ step {step}: {shown}", flush=True)
            if "timing_s/step" in data:
                if updates:
                    new = read_update_log(updates)[seen_updates:]
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


def build_summary(path: str, updates: str | None = None, k: int = 3) -> dict | None:
    """The start/end table as data; None when no training step was logged.

    Training rows: ``start`` = mean of the first ``k`` steps from the first step with a non-zero
    update (:func:`first_update_index`), ``end`` = mean of the last ``k`` steps. Validation rows (one
    per split, :func:`split_keys`): ``start`` = the first validation (step 0 when verl validates
    before training), ``end`` = the last one; their mean over the splits and its gain.
    """
    train, val = split_records(read_metrics(path))
    if not train:
        return None
    if updates:
        norms = update_norms_per_step(read_update_log(updates), len(train))
        train = [(s, {**m, UPDATE_NORM: n} if n is not None else m) for (s, m), n in zip(train, norms, strict=True)]
    n = min(k, max(1, len(train) // 2))
    first = first_update_index(train)
    head, tail = train[first : first + n], train[-n:]
    rows = []
    for label, key in TRAIN_ROWS:
        a, b = window_mean(head, key, True, n), window_mean(tail, key, False, n)
        if a is not None or b is not None:
            rows.append({"metric": label, "key": key, "start": a, "end": b})
    out: dict = {
        "metrics_file": str(path),
        "training_steps": len(train),
        "start_steps": [head[0][0], head[-1][0]],
        "end_steps": [tail[0][0], tail[-1][0]],
        "train": rows,
        "validation": None,
    }
    keys = split_keys(val)
    if keys:
        splits = []
        for source, key in keys.items():
            a = next((_num(m[key]) for _, m in val if key in m), None)
            b = next((_num(m[key]) for _, m in reversed(val) if key in m), None)
            splits.append({"split": source, "key": key, "start": a, "end": b})
        start, end = mean_val_score(val[0][1], list(keys.values())), mean_val_score(val[-1][1], list(keys.values()))
        out["validation"] = {
            "start_step": val[0][0],
            "end_step": val[-1][0],
            "splits": splits,
            "mean": {"start": start, "end": end},
            "gain": end - start if start is not None and end is not None and len(val) > 1 else None,
        }
    return out


def render(summary_data: dict) -> str:
    """The table as text (what the demo prints and keeps as summary.txt)."""
    w = 38
    rule = "-" * (w + 24)
    (a0, a1), (b0, b1) = summary_data["start_steps"], summary_data["end_steps"]
    lines = [
        f"{'metric':<{w}} {'start':>10} {'end':>10}",
        f"(start: mean of steps {a0}-{a1}, from the first step with a non-zero update; "
        f"end: of steps {b0}-{b1}; {summary_data['training_steps']} steps)",
        rule,
    ]
    lines += [f"{r['metric']:<{w}} {fmt(r['start']):>10} {fmt(r['end']):>10}" for r in summary_data["train"]]
    z = next((r for r in summary_data["train"] if r["key"] == "actor/sorl/norm_factor"), None)
    if z is not None and z["start"] == 1.0 and z["end"] == 1.0:
        lines.append(NEAR_ON_POLICY)
    val = summary_data["validation"]
    if val:
        var = sorted({parse_val_key(s["key"]).var for s in val["splits"]})
        before = " (before training)" if val["start_step"] == 0 else ""
        lines += [rule, f"validation {'/'.join(var)} per split: start = step {val['start_step']}{before}, "
                        f"end = step {val['end_step']}"]  # fmt: skip
        lines += [f"{s['split']:<{w}} {fmt(s['start']):>10} {fmt(s['end']):>10}" for s in val["splits"]]
        mean = val["mean"]
        label = f"mean over the {len(val['splits'])} splits"
        lines.append(f"{label:<{w}} {fmt(mean['start']):>10} {fmt(mean['end']):>10}")
        if val["gain"] is not None:
            lines.append(
                f"validation gain: {val['gain']:+.3f} (mean score over the splits, "
                f"step {val['start_step']} -> {val['end_step']})"
            )
    lines.append(rule)
    return "\n".join(lines)


def write_plot(metrics: str, out: Path, label: str) -> Path:
    """``sorl-verl plot``'s default panels (with validation per split) of this run, as a PNG."""
    from sorl_verl.cli.plot import load_run, plot_runs

    return plot_runs([load_run(metrics, label)], out)


def summary(
    path: str,
    log: str | None,
    ckpt: str | None,
    updates: str | None = None,
    k: int = 3,
    out_dir: str | None = None,
    cli: str = "sorl-verl",
) -> int:
    """Print the table; with ``out_dir`` also keep it there (summary.txt, summary.json, curves.png)
    and print those paths and the ``sorl-verl plot`` / ``sorl-verl eval`` commands to use next."""
    data = build_summary(path, updates, k)
    if data is None:
        print(f"no training steps logged in {path}", file=sys.stderr)
        return 1
    text = render(data)
    print()
    print(text)
    files = [("metrics (verl file logger):", path)]
    if log:
        files.append(("full log:", log))
    if ckpt:
        files.append(("checkpoints:", ckpt))
    if out_dir:
        run = Path(out_dir)
        txt, js, png = run / "summary.txt", run / "summary.json", run / "curves.png"
        data["files"] = {"log": log, "checkpoints": ckpt, "summary_txt": str(txt), "plot": str(png)}
        txt.write_text(text + "\n")
        js.write_text(json.dumps(data, indent=1) + "\n")
        files += [("summary:", f"{txt}  {js.name}")]
        try:
            files.append(("plot (validation per split):", str(write_plot(path, png, run.name))))
        except Exception as exc:  # noqa: BLE001 - the table is kept either way
            files.append(("plot:", f"not written ({type(exc).__name__}: {exc})"))
    for label, value in files:
        print(f"{label:<30}{value}")
    if out_dir:
        print("next:")
        print(f"  {cli} plot {out_dir} [OTHER_RUN_DIR ...] --out curves.png   # redraw, runs overlaid")
        print(
            f"  {cli} eval --metrics {out_dir} --out-dir {out_dir}/eval   # EM/F1 per split, best and last validation"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sorl-verl summary", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("follow", help="print a line per training step (and per validation) until PID exits")
    f.add_argument("metrics", help="verl's metrics file (VERL_FILE_LOGGER_PATH)")
    f.add_argument("--pid", type=int, required=True, help="the training process to follow")
    f.add_argument("--steps", type=int, help="total training steps (shown as step N/STEPS)")
    f.add_argument("--updates", help="the actor's update log (sorl_updates.jsonl)")
    s = sub.add_parser("summary", help="the start/end table; with --out-dir also summary.txt/json and curves.png")
    s.add_argument("metrics", help="verl's metrics file (VERL_FILE_LOGGER_PATH)")
    s.add_argument("--log", help="the run's full log (its path is printed with the table)")
    s.add_argument("--ckpt", help="the run's checkpoint directory (its path is printed with the table)")
    s.add_argument("--updates", help="the actor's update log (sorl_updates.jsonl)")
    s.add_argument("--out-dir", help="keep summary.txt, summary.json and curves.png here (the run directory)")
    s.add_argument("--cli", default="sorl-verl", help="how to call sorl-verl in the printed next commands")
    a = p.parse_args(argv)
    if a.cmd == "follow":
        follow(a.metrics, a.pid, a.steps, a.updates)
        return 0
    return summary(a.metrics, a.log, a.ckpt, a.updates, out_dir=a.out_dir, cli=a.cli)


if __name__ == "__main__":
    sys.exit(main())
