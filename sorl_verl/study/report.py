"""The learning study's headline table: per regime and algorithm, the measures a user cares about.

Reads the run records of ``stability.json`` (:func:`sorl_verl.study.aggregate.run_record`, which
carries the :mod:`~sorl_verl.study.measures` of each run) and writes one row per regime x
algorithm: seeds, final and peak validation gain over step 0 (mean ± sd over seeds, sd with n - 1),
collapsed k/n (:mod:`~sorl_verl.study.collapse`), gained-then-lost k/n
(:data:`~sorl_verl.study.measures.LOST_GAIN_RULE`), mean gain over the run (area under the
validation curve), gain per 1,000 training episodes, wall time per run. When at least one run of the
table ran with the collapse guard (its ``guard_restores`` is not None), two more columns: restores
per run (mean ± sd over the judged guarded runs of the row) and the guard's share of wall time,
``sum(guard_s) / sum(wall_s)`` over the guarded runs of the row; ``-`` in rows without the guard.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


def episodes_per_step(overrides: Mapping[str, Any], config_dir: Path | None) -> int | None:
    """``data.train_batch_size * actor_rollout_ref.rollout.n`` of a cell: its overrides first, then
    the CPU platform overlay (``<config_dir>/platform/cpu.yaml``) the cell ran on."""
    keys = ("data.train_batch_size", "actor_rollout_ref.rollout.n")
    values: dict[str, Any] = {k: overrides[k] for k in keys if k in overrides}
    if len(values) < 2 and config_dir is not None and (config_dir / "platform" / "cpu.yaml").is_file():
        overlay = yaml.safe_load((config_dir / "platform" / "cpu.yaml").read_text()) or {}
        for k in keys:
            node: Any = overlay
            for part in k.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            values.setdefault(k, node)
    try:
        return int(values[keys[0]]) * int(values[keys[1]])
    except (KeyError, TypeError, ValueError):
        return None


def spread(values: Sequence[float], digits: int = 3, sign: str = "") -> str:
    """``mean ± sd`` (sd with n - 1) of the values, the value alone for one, ``-`` for none; ``sign="+"``
    writes the mean signed."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:{sign}.{digits}f}"
    return f"{statistics.mean(values):{sign}.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def by_regime_algorithm(runs: Sequence[Mapping[str, Any]]) -> list[tuple[tuple[str, str], list[Mapping[str, Any]]]]:
    """The runs grouped by (regime, algorithm), groups in sorted order."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[(r["regime"], r["algorithm"])].append(r)
    return sorted(groups.items())


def _gain(values: Sequence[float], digits: int = 3) -> str:
    return spread(values, digits, "+")


def judged(run: Mapping[str, Any]) -> bool:
    """True for a run the study's tables count: judged by the collapse rule and with a gain."""
    return bool(run.get("judged")) and run.get("gain") is not None


def guarded(run: Mapping[str, Any]) -> bool:
    """True for a run that logged the collapse guard's metrics."""
    return run.get("guard_restores") is not None


def guard_cells(rs: Sequence[Mapping[str, Any]], judged: Sequence[Mapping[str, Any]]) -> str:
    """The guard columns of one row: restores per run (judged guarded runs) and guard share of wall time."""
    restores = [float(r["guard_restores"]) for r in judged if guarded(r)]
    timed = [r for r in rs if guarded(r) and r.get("guard_s") is not None and r.get("wall_s")]
    wall = sum(r["wall_s"] for r in timed)
    share = f"{100.0 * sum(r['guard_s'] for r in timed) / wall:.2f}%" if timed else "-"
    return f" {spread(restores, 1)} | {share} |"


def headline_table(runs: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one row per regime x algorithm over the judged runs (unjudged ones counted apart);
    the guard columns only when some run had the guard on."""
    guard = any(guarded(r) for r in runs)
    lines = [
        "| regime | algorithm | seeds | final gain | peak gain | collapsed | gained, then lost | mean gain (AUC) "
        "| gain / 1k episodes | wall s / run |" + (" guard restores / run | guard time / wall |" if guard else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if guard else ""),
    ]
    for (regime, algorithm), rs in by_regime_algorithm(runs):
        row_runs = [r for r in rs if judged(r)]

        def vals(key: str, row_runs: list[Mapping[str, Any]] = row_runs) -> list[float]:
            return [r[key] for r in row_runs if r.get(key) is not None]

        walls = [r["wall_s"] for r in rs if r.get("wall_s") is not None]
        seeds = ",".join(str(r["seed"]) for r in sorted(rs, key=lambda r: r["seed"]))
        unjudged = len(rs) - len(row_runs)
        per_k = vals("gain_per_1k_episodes")
        wall = f"{statistics.mean(walls):.0f}" if walls else "-"
        lines.append(
            f"| {regime} | {algorithm} | {seeds}{f' ({unjudged} not judged)' if unjudged else ''} "
            f"| {_gain(vals('gain'))} | {_gain(vals('peak_gain'))} "
            f"| {sum(bool(r['collapsed']) for r in row_runs)}/{len(row_runs)} "
            f"| {sum(bool(r.get('lost_gain')) for r in row_runs)}/{len(row_runs)} "
            f"| {_gain(vals('auc_gain'))} | {_gain(per_k, 4)} | {wall} |" + (guard_cells(rs, row_runs) if guard else "")
        )
    return "\n".join(lines) + "\n"
