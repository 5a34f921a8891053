"""Every cell of a study -> ``stability.json`` (criterion + one record per run) and the markdown table.

A run record (``runs[i]`` of stability.json)::

    algorithm, regime, seed, status (done|failed), collapsed, judged, reason, onset_step,
    initial_val_score, final_val_score, peak_val_score, val_scores [[step, score], ...],
    final_val_by_source {source: score}, steps (last step logged), steps_planned, wall_s,
    exit_code, grid_changed (override keys edited in the grid since the run), lr, mean_norm_factor, mean_update_scale, mean_loss_scale, max_sorl_clipfrac
    (turns; tokens for s_ppo), max_pg_clipfrac, max_ppo_kl, max_staleness (model versions), mean_rollout_probs_diff,
    and, only for a run that logged the collapse guard's metrics, guard_restores, guard_s (its restores and seconds)

``final_val_score`` is the validation score (mean over data sources) at the last validation;
``peak_val_score`` the maximum over all validations, step 0 included. ``lr_match`` gives, per
regime, what ``grpo_lowlr`` needs: the reference algorithm's lr times its mean effective step
scale ``1/Z`` (``actor/sorl/update_scale`` when logged, else ``1/actor/sorl/norm_factor``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sorl_verl.study.collapse import CRITERION, FRACTION, judge
from sorl_verl.study.grid import DEFAULT_WARMSTART
from sorl_verl.study.measures import GUARD_RESTORES, GUARD_SECONDS, guard_measures, measures
from sorl_verl.study.metrics import Trace, read_trace
from sorl_verl.study.report import by_regime_algorithm, episodes_per_step, spread
from sorl_verl.study.runner import METRICS, RECORD, read_record

LR_KEY = "actor_rollout_ref.actor.optim.lr"


def finite_mean(values: Iterable[float]) -> float | None:
    """The mean of the finite values (None when there is none)."""
    vals = [v for v in values if math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _max(values: Iterable[float]) -> float | None:
    vals = [v for v in values if math.isfinite(v)]
    return max(vals) if vals else None


def _float_or_none(text: Any) -> float | None:
    try:
        x = float(text)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def update_scale_series(trace: Trace) -> list[tuple[int, float]]:
    """``(step, factor)``: the factor SORL applied to the update at each step, ``update_scale`` if
    logged, else ``1/Z`` (steps with Z <= 0 left out)."""
    scale = trace.series("actor/sorl/update_scale")
    if scale:
        return list(scale)
    return [(s, 1.0 / z) for s, z in trace.series("actor/sorl/norm_factor") if z > 0]


def update_scales(trace: Trace) -> list[float]:
    """Per step, the factor SORL applied to the update (:func:`update_scale_series` without the steps)."""
    return [v for _, v in update_scale_series(trace)]


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every NaN/inf float replaced by None (stability.json is strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_none(v) for v in obj]
    return obj


#: this checkout's hydra config folder: the overlay of a cell whose recorded ``--config-path`` is gone
#: (a run made in another checkout or a removed worktree, aggregated from the archive)
CHECKOUT_CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config"


def _config_dir(cell: dict[str, Any]) -> Path | None:
    """The ``--config-path`` the cell's main_ppo command ran with, or this checkout's config folder when
    that path no longer exists (None when not recorded)."""
    cmd = cell.get("command") or []
    if "--config-path" not in cmd[:-1]:
        return None
    recorded = Path(cmd[cmd.index("--config-path") + 1])
    return recorded if recorded.is_dir() else CHECKOUT_CONFIG_DIR


def run_record(cell: dict[str, Any], trace: Trace) -> dict[str, Any]:
    """One run of stability.json from its ``cell.json`` and its metrics (NaN/inf as null), with the
    learning measures and the guard measures of :mod:`sorl_verl.study.measures`."""
    verdict = judge(trace.val_scores, trace.first_nonfinite(), cell.get("exit_code"), trace.last_step)
    vals = trace.val_scores
    finite = [s for _, s in vals if math.isfinite(s)]
    scales = update_scales(trace)
    learned = measures(vals, episodes_per_step(cell.get("overrides", {}), _config_dir(cell)))
    guard = guard_measures(trace.series(GUARD_RESTORES), trace.series(GUARD_SECONDS))
    return finite_or_none(
        {
            **learned.as_dict(),
            "warmstart": cell.get("warmstart", DEFAULT_WARMSTART),
            "algorithm": cell["algorithm"],
            "regime": cell["regime"],
            "seed": cell["seed"],
            "status": cell.get("status"),
            "collapsed": verdict.collapsed,
            "judged": verdict.judged,
            "reason": verdict.reason,
            "onset_step": verdict.onset_step,
            "initial_val_score": vals[0][1] if vals else None,
            "final_val_score": vals[-1][1] if vals else None,
            "peak_val_score": max(finite) if finite else None,
            "val_scores": [[s, v] for s, v in vals],
            "final_val_by_source": trace.validations[-1][1] if trace.validations else {},
            "steps": trace.last_step,
            "steps_planned": cell.get("steps"),
            "wall_s": cell.get("wall_s"),
            "exit_code": cell.get("exit_code"),
            "lr": _float_or_none(cell.get("overrides", {}).get(LR_KEY)),
            "mean_norm_factor": finite_mean(v for _, v in trace.series("actor/sorl/norm_factor")),
            "mean_update_scale": finite_mean(scales),
            "mean_loss_scale": finite_mean(v for _, v in trace.series("actor/sorl/loss_scale")),
            "max_sorl_clipfrac": _max(
                v for k in ("actor/sorl/turn_clipfrac", "actor/sorl/token_clipfrac") for _, v in trace.series(k)
            ),
            "max_pg_clipfrac": _max(v for _, v in trace.series("actor/pg_clipfrac")),
            "max_ppo_kl": _max(v for _, v in trace.series("actor/ppo_kl")),
            "max_staleness": _max(v for _, v in trace.series("training/off_policy/trajectory_staleness/max")),
            "mean_rollout_probs_diff": finite_mean(v for _, v in trace.series("training/rollout_probs_diff_mean")),
            "model_digest": cell.get("model_digest"),
            "cpu": cell.get("cpu"),
            **(guard.as_dict() if guard.logged else {}),
        }
    )


def cell_dirs(out: Path) -> list[Path]:
    """Run directories (``<regime>/<algorithm>/seed<k>``) under ``out`` that have a cell record."""
    return sorted(p.parent for p in out.glob(f"*/*/seed*/{RECORD}"))


def collect(out: Path, keys: set[str] | None = None) -> list[tuple[dict[str, Any], Trace]]:
    """(cell record, trace) of every finished cell (done or failed), optionally only ``keys``."""
    found = []
    for d in cell_dirs(out):
        rec = read_record(d)
        if rec.get("status") not in ("done", "failed"):
            continue
        if keys is not None and rec.get("key") not in keys:
            continue
        found.append((rec, read_trace(d / METRICS)))
    return found


def lr_match(runs: Sequence[dict[str, Any]], reference: str = "so_grpo") -> dict[str, dict[str, Any]]:
    """Per regime: lr of the ``reference`` runs x their mean update scale (the lr for grpo_lowlr)."""
    by_regime: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        if r["algorithm"] == reference and r["mean_update_scale"] is not None and r["lr"] is not None:
            by_regime[r["regime"]].append(r)
    out = {}
    for regime, rs in sorted(by_regime.items()):
        scale = sum(r["mean_update_scale"] for r in rs) / len(rs)
        lrs = sorted({r["lr"] for r in rs})
        out[regime] = {
            "reference": reference,
            "runs": len(rs),
            "lr": lrs[0] if len(lrs) == 1 else lrs,
            "mean_update_scale": scale,
            "matched_lr": lrs[0] * scale if len(lrs) == 1 else None,
        }
    return out


def stability(
    found: Sequence[tuple[dict[str, Any], Trace]],
    study: str,
    command: str,
    pending: Sequence[str] = (),
    changed: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """The content of stability.json; ``changed``: cell key -> overrides the grid has changed since the run."""
    runs = []
    for rec, trace in found:
        run = run_record(rec, trace)
        run["grid_changed"] = (changed or {}).get(rec.get("key", ""), [])
        runs.append(run)
    runs.sort(key=lambda r: (r["regime"], r["algorithm"], r["seed"]))
    return {
        "study": study,
        "criterion": CRITERION,
        "criterion_fraction": FRACTION,
        "validation_score": "mean over validation data sources of val-core/<source>/reward/mean@N",
        "command": command,
        "runs": runs,
        "not_run": list(pending),
        "lr_match": lr_match(runs),
    }


def write_stability(data: dict[str, Any], path: Path) -> Path:
    """Write stability.json atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False, default=_no_nan) + "\n")
    tmp.replace(path)
    return path


def _no_nan(obj: Any) -> Any:  # pragma: no cover - json's default hook only sees non-serializable objects
    raise TypeError(f"not JSON serializable: {obj!r}")


def markdown_table(runs: Sequence[dict[str, Any]]) -> str:
    """Per regime x algorithm: collapsed k/n, final score mean ± sd (n-1), peak, wall time."""
    lines = [
        "| regime | algorithm | seeds | collapsed | final val score | peak val score | wall s / run | not judged |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (regime, algorithm), rs in by_regime_algorithm(runs):
        judged = [r for r in rs if r["judged"]]
        finals = [r["final_val_score"] for r in judged if r["final_val_score"] is not None]
        peaks = [r["peak_val_score"] for r in judged if r["peak_val_score"] is not None]
        walls = [r["wall_s"] for r in rs if r["wall_s"] is not None]
        seeds = ",".join(str(r["seed"]) for r in sorted(rs, key=lambda r: r["seed"]))
        wall = f"{statistics.mean(walls):.0f}" if walls else "-"
        lines.append(
            f"| {regime} | {algorithm} | {seeds} | {sum(r['collapsed'] for r in judged)}/{len(judged)} "
            f"| {spread(finals)} | {spread(peaks)} | {wall} | {len(rs) - len(judged)} |"
        )
    return "\n".join(lines) + "\n"


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def runs_table(runs: Sequence[dict[str, Any]]) -> str:
    """One row per run: validation scores at each validation, mean step factor, max clip fraction
    (SORL's turn/token share, ``(sorl)``, where logged, else verl's ``pg_clipfrac``, ``(pg)``),
    max ``ppo_kl``, verdict."""
    lines = [
        "| regime | algorithm | seed | validation score at each validation | mean step factor "
        "| max clip fraction | max ppo_kl | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(runs, key=lambda r: (r["regime"], r["algorithm"], r["seed"])):
        vals = " / ".join(_fmt(v, 2) for _, v in r["val_scores"]) or "-"
        if r["max_sorl_clipfrac"] is not None:
            clip_text = f"{_fmt(r['max_sorl_clipfrac'])} (sorl)"
        elif r["max_pg_clipfrac"] is not None:
            clip_text = f"{_fmt(r['max_pg_clipfrac'])} (pg)"
        else:
            clip_text = "-"
        if not r["judged"]:
            verdict = f"not judged ({r['reason']})"
        elif r["collapsed"]:
            onset = r["onset_step"]
            verdict = "collapsed" + (f" (onset {onset})" if onset is not None else "")
        else:
            verdict = "held"
        if r["exit_code"] not in (0, None):
            verdict += f"; exit {r['exit_code']} at step {r['steps']}"
        lines.append(
            f"| {r['regime']} | {r['algorithm']} | {r['seed']} | {vals} | {_fmt(r['mean_update_scale'])} "
            f"| {clip_text} "
            f"| {_fmt(r['max_ppo_kl'])} | {verdict} |"
        )
    return "\n".join(lines) + "\n"
