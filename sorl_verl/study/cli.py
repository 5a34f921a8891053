"""``python -m sorl_verl.study`` / ``sorl-verl study``: run, inspect and aggregate a study grid.

    python -m sorl_verl.study [run] --grid recipe/sorl/study/stress.yaml [--out DIR] [--only PAT ...]
                                    [--retry-failed] [--rerun-changed] [--lock PATH|none]
                                    [--cell-timeout S] [--dry-run]
    python -m sorl_verl.study status --grid G [--out DIR] [--only PAT ...]
    python -m sorl_verl.study aggregate --grid G [--out DIR | --from-archive] [--only PAT ...] [--results docs/results]
    python -m sorl_verl.study archive --grid G [--out DIR] [--only PAT ...] [--archive PATH]

``--out`` defaults to ``$SORL_HOME/study/<grid name>``. ``--only`` (repeatable, union) selects
cells by key ``<regime>/<algorithm>/seed<k>``: a plain string is a substring of the key, a glob
(``* ? [``) must match the whole key (``many_updates/grpo/*``). ``run`` takes the heavy-job lock
per cell (default ``/tmp/sorl-heavy.lock``; ``--lock none`` when the whole study already runs
under ``flock``). ``aggregate`` writes ``stability.json``, ``stability_<regime>.png``,
``stability_table.md``, the per-run ``stability_runs.md`` and, for a study with a guarded algorithm
(``*_guard``), ``stability_guard.md`` (the guard's comparison and the GUARD-default verdict,
:mod:`sorl_verl.study.guard_table`) and, for a grid with ``guard_controls``, ``stability_rules.md`` (each
run's first fire under the guard's drop and stderr rules, replayed: :mod:`sorl_verl.study.rule_table`)
and, for a grid with ``grpo`` and ``so_grpo_grad`` variants in one regime, ``stability_dose.md`` and
``stability_dose.png`` (issue 49's dose-response and its reading rule, :mod:`sorl_verl.study.dose_table`)
(names from ``--name``) into ``--results`` (default: the repository's
``docs/results``) and prints the table and the per-regime lr for ``grpo_lowlr``; with
``--from-archive`` it reads the runs from the grid's archive instead of the run directory.
``archive`` writes every finished cell's ``cell.json`` and ``metrics.jsonl`` (and a guarded run's
``checkpoints/sorl_guard/events.jsonl``) into one ``.tar.xz``
(``--archive``, default ``docs/results/study/<grid name>.tar.xz``): what the repository keeps of a
study (train logs, checkpoints and per-update records stay in the run directory); ``tar -xJf`` of it into
``--out`` restores the cells.
A finished cell whose overrides the grid has changed since is ``changed``: ``run`` skips it
(``--rerun-changed`` re-runs it), ``status`` names the keys, ``aggregate`` warns and records them.
Exit status: 0 ok, 1 a selected cell failed or is changed (run) or none finished (aggregate),
2 bad input (the grid file and line named).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sorl_verl.study.grid import Grid, GridError, load_grid

COMMANDS = ("run", "status", "aggregate", "archive")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sorl-verl study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--grid", required=True, help="grid YAML file (recipe/sorl/study/*.yaml)")
        sp.add_argument("--out", help="study directory (default $SORL_HOME/study/<grid name>)")
        sp.add_argument("--only", action="append", default=[], metavar="PAT", help="select cells (repeatable)")

    run = sub.add_parser("run", help="run the grid's cells (default command)")
    common(run)
    run.add_argument("--retry-failed", action="store_true", help="re-run cells recorded as failed")
    run.add_argument(
        "--rerun-changed", action="store_true", help="re-run finished cells whose overrides the grid has changed"
    )
    run.add_argument("--lock", default="/tmp/sorl-heavy.lock", help="flock file taken per cell, or 'none'")
    run.add_argument(
        "--cell-timeout", type=float, help="wall limit of one cell in s (default from the cell's steps and test_freq)"
    )
    run.add_argument("--dry-run", action="store_true", help="list the selected cells and their overrides")

    status = sub.add_parser("status", help="which cells are done / failed / pending")
    common(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")

    agg = sub.add_parser("aggregate", help="metrics files -> stability.json, PNGs, markdown table")
    common(agg)
    agg.add_argument("--results", help="output directory (default: <repository>/docs/results)")
    agg.add_argument("--name", default="stability", help="file name stem (default: stability)")
    agg.add_argument("--no-plots", action="store_true")
    agg.add_argument(
        "--from-archive", action="store_true", help="read the runs from the grid's archive, not from --out"
    )
    agg.add_argument("--archive", help="archive file (default: <repository>/docs/results/study/<grid name>.tar.xz)")

    arc = sub.add_parser("archive", help="finished cells' cell.json + metrics.jsonl -> one .tar.xz")
    common(arc)
    arc.add_argument("--archive", help="archive file (default: <repository>/docs/results/study/<grid name>.tar.xz)")
    return p


def _out_dir(grid: Grid, out: str | None) -> Path:
    if out:
        return Path(out).expanduser().resolve()
    from sorl_verl.paths import data_home

    return data_home() / "study" / grid.name


def _repo_root(grid: Grid) -> Path | None:
    """The repository holding the grid's config dir (``<repo>/recipe/sorl/config``), if it is one."""
    root = grid.config_dir.parents[2] if len(grid.config_dir.parents) > 2 else None
    return root if root is not None and (root / "pyproject.toml").is_file() else None


def _cmd_run(a: argparse.Namespace, grid: Grid) -> int:
    from sorl_verl.study.runner import StudyBusy, cell_state, run_grid

    out = _out_dir(grid, a.out)
    cells = grid.select(a.only)
    if not cells:
        print(f"no cell of {grid.path} matches {a.only}", file=sys.stderr)
        return 2
    if a.dry_run:
        for c in cells:
            print(f"{c.key}  [{cell_state(out, c)}]  {' '.join(c.hydra_args())}")
        return 0
    lock = None if a.lock.lower() in ("", "none") else a.lock
    print(f"[study] {grid.name}: {len(cells)} cells -> {out}", flush=True)
    try:
        counts = run_grid(
            grid,
            out,
            cells,
            lock=lock,
            retry_failed=a.retry_failed,
            rerun_changed=a.rerun_changed,
            timeout_s=a.cell_timeout,
        )
    except StudyBusy as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit) as exc:
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 130
        print(f"[study] {grid.name}: interrupted; the cut-off cell restarts from scratch next time", flush=True)
        return code
    print(
        f"[study] {grid.name}: {counts['ran']} run now; {counts['done']} done, {counts['failed']} failed, "
        f"{counts['unfilled']} unfilled, {counts['changed']} changed of {len(cells)} selected",
        flush=True,
    )
    return 1 if counts["failed"] or counts["changed"] else 0


def _cmd_status(a: argparse.Namespace, grid: Grid) -> int:
    from sorl_verl.study.metrics import read_trace
    from sorl_verl.study.runner import METRICS, cell_dir, cell_state, changed_keys, read_record, study_running

    out = _out_dir(grid, a.out)
    live = study_running(out)
    rows = []
    for c in grid.select(a.only):
        d = cell_dir(out, c)
        rec = read_record(d)
        state = cell_state(out, c, live=live)
        trace = read_trace(d / METRICS) if state not in ("pending", "unfilled") else None
        vals = trace.val_scores if trace else []
        rows.append(
            {
                "key": c.key,
                "state": state,
                "steps": trace.last_step if trace else 0,
                "steps_planned": grid.steps_of(c),
                "test_freq": grid.test_freq_of(c),
                "val_max_samples": grid.val_max_samples_of(c),
                "wall_s": rec.get("wall_s"),
                "final_val_score": vals[-1][1] if vals else None,
                "exit_code": rec.get("exit_code"),
                "reason": _status_reason(state, rec, c, changed_keys(rec, c)),
            }
        )
    if a.json:
        print(json.dumps({"study": grid.name, "out": str(out), "running": live, "cells": rows}, indent=1))
        return 0
    width = max((len(r["key"]) for r in rows), default=10)
    print(f"study {grid.name} in {out}{'  (a study process is running)' if live else ''}")
    for r in rows:
        wall = f"{r['wall_s']:.0f} s" if r["wall_s"] is not None else "-"
        val = f"{r['final_val_score']:.3f}" if r["final_val_score"] is not None else "-"
        print(
            f"{r['key']:<{width}}  {r['state']:<11} step {r['steps']:>3}/{r['steps_planned']:<3} "
            f"{wall:>7}  val {val:>5}  {r['reason']}"
        )
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    print(", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f" of {len(rows)}")
    return 0


def _status_reason(state: str, rec: dict, cell, changed: list[str]) -> str:
    if state == "changed":
        return "grid changed since the run: " + ", ".join(changed)
    if state == "unfilled":
        return ", ".join(cell.unfilled) + " = ???"
    return rec.get("reason", "")


def _cmd_aggregate(a: argparse.Namespace, grid: Grid) -> int:
    from sorl_verl.study.aggregate import collect, markdown_table, runs_table, stability, write_stability
    from sorl_verl.study.archive import ArchiveError, read_archive
    from sorl_verl.study.report import headline_table
    from sorl_verl.study.runner import changed_keys

    out = _out_dir(grid, a.out)
    root = _repo_root(grid)
    if a.results:
        results = Path(a.results).expanduser().resolve()
    elif root is not None:
        results = root / "docs" / "results"
    else:
        print(f"{grid.path} is not inside the repository: give --results DIR", file=sys.stderr)
        return 2
    cells = grid.select(a.only)
    if a.from_archive:
        source = _archive_path(a, grid, root)
        if source is None:
            return 2
        try:
            found = read_archive(source, {c.key for c in cells})
        except (ArchiveError, OSError) as exc:
            print(str(exc), file=sys.stderr)
            return 2
    else:
        source = out
        found = collect(out, {c.key for c in cells})
    if not found:
        print(f"no finished cell of {grid.name} in {source} (run it first)", file=sys.stderr)
        return 1
    finished = {rec["key"] for rec, _ in found}
    inside = root is not None and grid.path.is_relative_to(root)
    grid_arg = str(grid.path.relative_to(root)) if inside else str(grid.path)
    command = f"python -m sorl_verl.study --grid {grid_arg}" + "".join(f" --only {p}" for p in a.only)
    by_key = {c.key: c for c in cells}
    changed = {rec["key"]: keys for rec, _ in found if (keys := changed_keys(rec, by_key[rec["key"]]))}
    for key, keys in changed.items():
        print(f"warning: {key} ran with other {', '.join(keys)} than the grid has now", file=sys.stderr)
    data = stability(
        found, grid.name, command, pending=[c.key for c in cells if c.key not in finished], changed=changed
    )
    try:
        warnings_md = _warnings(found, data["runs"], fall_rule=grid.warning_fall_rule)
    except ValueError as exc:  # a run whose record lacks what the fall rule needs; nothing written yet
        print(str(exc), file=sys.stderr)
        return 2
    path = write_stability(data, results / f"{a.name}.json")
    table = markdown_table(data["runs"])
    (results / f"{a.name}_table.md").write_text(table)
    (results / f"{a.name}_runs.md").write_text(runs_table(data["runs"]))
    (results / f"{a.name}_headline.md").write_text(headline_table(data["runs"]))
    (results / f"{a.name}_warnings.md").write_text(warnings_md)
    guard_md = _guard(found, data["runs"], grid, cells)
    if guard_md is not None:
        (results / f"{a.name}_guard.md").write_text(guard_md)
    from sorl_verl.study.rule_table import write_rule_table

    rules = write_rule_table(grid, found, data["runs"], results, a.name)
    if rules is not None:
        print(f"wrote {rules}")
    from sorl_verl.study.dose_table import write_dose_table

    dose = write_dose_table(grid, cells, found, data["runs"], results, a.name, plots=not a.no_plots)
    print(table)
    print(f"wrote {path} ({len(data['runs'])} runs, {len(data['not_run'])} cells not run)")
    if not a.no_plots:
        from sorl_verl.study.plots import plot_study

        runs = [(rec["regime"], rec["algorithm"], rec["seed"], trace) for rec, trace in found]
        for p in plot_study(runs, results, a.name):
            print(f"wrote {p}")
    for regime, m in data["lr_match"].items():
        matched = f"{m['matched_lr']:.3g}" if m["matched_lr"] is not None else "- (several lr)"
        print(
            f"lr for grpo_lowlr in {regime}: {matched} "
            f"(= lr {m['lr']} x mean update scale {m['mean_update_scale']:.3f} of {m['runs']} {m['reference']} runs)"
        )
    if dose is not None:
        paths, matched = dose
        print("\n".join(f"wrote {p}" for p in paths))
        for m in matched:
            print(m.text())
    return 0


def _warnings(found: list, runs: list[dict], fall_rule: bool = False) -> str:
    """The warning-signal table over the judged runs (:mod:`sorl_verl.study.warning_signals`) and,
    with ``fall_rule``, below it the second analysis's table (fall below the best)."""
    from functools import partial

    from sorl_verl.study.warning_signals import (
        FALL_RULE,
        RULE,
        fall_step,
        markdown,
        run_signals,
        score_signals,
        validation_size,
    )

    cells = {(rec["regime"], rec["algorithm"], rec["seed"]): (rec, trace) for rec, trace in found}
    judged = [(r, *cells[(r["regime"], r["algorithm"], r["seed"])]) for r in runs if r["judged"]]
    signals = [run_signals(r, trace) for r, _, trace in judged]
    text = f"{RULE}\n\n{markdown(score_signals(signals), signals)}"
    if not fall_rule:
        return text
    fell = [run_signals(r, trace, partial(fall_step, n=validation_size(rec))) for r, rec, trace in judged]
    return f"{text}\n{FALL_RULE}\n\n{markdown(score_signals(fell), fell, rule='fall')}"


def _guard(found: list, runs: list[dict], grid: Grid, cells: list) -> str | None:
    """The guard comparison and the GUARD-default verdict (:mod:`sorl_verl.study.guard_table`) for runs
    that include a guarded algorithm (None otherwise): run records with their checkpoint and validation
    seconds, the grid's control regimes, its planned seeds per (regime, algorithm) and its protocol twins."""
    from sorl_verl.study.guard_table import guard_report, has_guarded, run_timing

    if not has_guarded(runs):
        return None
    traces = {(rec["regime"], rec["algorithm"], rec["seed"]): trace for rec, trace in found}
    timed = [r | run_timing(traces[(r["regime"], r["algorithm"], r["seed"])]) for r in runs]
    planned: dict[tuple[str, str], set[int]] = {}
    for c in cells:
        planned.setdefault((c.regime, c.algorithm), set()).add(c.seed)
    return guard_report(timed, grid.guard_controls, planned, twins=grid.protocol_twins)


def _archive_path(a: argparse.Namespace, grid: Grid, root: Path | None) -> Path | None:
    """``--archive``, else the repository's ``docs/results/study/<grid>.tar.xz`` (None, with a message, when neither)."""
    from sorl_verl.study.archive import default_archive

    if a.archive:
        return Path(a.archive).expanduser().resolve()
    if root is not None:
        return default_archive(root / "docs" / "results", grid.name)
    print(f"{grid.path} is not inside the repository: give --archive FILE", file=sys.stderr)
    return None


def _cmd_archive(a: argparse.Namespace, grid: Grid) -> int:
    from sorl_verl.study.archive import ArchiveError, write_archive

    out = _out_dir(grid, a.out)
    path = _archive_path(a, grid, _repo_root(grid))
    if path is None:
        return 2
    cells = grid.select(a.only)
    try:
        keys = write_archive(out, path, {c.key for c in cells})
    except ArchiveError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    left = len(cells) - len(keys)
    print(
        f"wrote {path} ({len(keys)} runs, {path.stat().st_size / 1024:.0f} KiB)"
        + (f"; {left} selected cells not finished, not archived" if left else "")
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = ["run", *argv]
    a = _parser().parse_args(argv)
    try:
        grid = load_grid(a.grid)
    except GridError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if a.command == "run":
        return _cmd_run(a, grid)
    if a.command == "status":
        return _cmd_status(a, grid)
    if a.command == "archive":
        return _cmd_archive(a, grid)
    return _cmd_aggregate(a, grid)


if __name__ == "__main__":
    sys.exit(main())
