"""Draw the curves that show SORL training health (and collapse coming), several runs overlaid
(``sorl-verl plot``).

Reads what verl's ``Tracking`` loggers write:

* ``file`` logger: JSON lines ``{"step": N, "data": {metric: value}}`` (``$VERL_FILE_LOGGER_PATH``,
  else ``<VERL_FILE_LOGGER_ROOT or .>/<project>/<experiment>.jsonl``);
* ``tensorboard`` logger: event files under ``$TENSORBOARD_DIR``
  (else ``tensorboard_log/<project>/<experiment>``);
* ``console`` logger output (e.g. ``train.log``): lines ``step:N - key:value - key:value``.

A RUN argument is any of these files, a tensorboard directory, or a run directory: its
``*.jsonl`` files (the run scripts write one ``metrics.<launch>.jsonl`` per launch; read in name
order, so a step logged again after a resume keeps its latest value), tensorboard event files and,
when neither exists, ``*.log``. Anything under an ``eval/`` subdirectory (validation-only runs)
is skipped. Usage::

    sorl-verl plot outputs/sorl/so_grpo-* outputs/sorl/grpo-* --out curves.png

``--smooth N`` averages training series over a trailing window of N logged points (the raw
series stays visible, faint). Validation series (``val-*`` keys: one point per validation,
``trainer.test_freq`` steps apart) are never smoothed: averaging them across validations hides a
collapse.

verl prefixes the loss's own metrics with ``actor/``, so the SORL metrics arrive as
``actor/sorl/<name>``; the panels also accept the bare ``sorl/<name>``.

Each panel is one metric (the first of its candidate keys that a run logged); the per-split
validation panel draws each data source of that metric as its own line (colour per split, line
style per run, its legend beside the panel); a run that never
logged a panel's metric is named under the panel's title ("not logged: ..."), outside the
plotting area so it never covers data. An ``optional`` panel (the parameter-space clipping-bias norm
``sorl/clip_bias_grad_norm``, logged by every SORL loss and by ``vanilla_diag``) is drawn only when
some run logged it. The validation panels mark each collapse-guard restore (a step where
``sorl/guard/restores`` went up) with a dotted vertical line, named in the panel's title. Writes a PNG and, with
``--csv``, the merged series as a long CSV (run, step, metric, value).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from sorl_verl.study import measures
from sorl_verl.study.metrics import parse_val_key, read_records

#: step -> value, per metric key
Series = dict[str, dict[int, float]]


@dataclass(frozen=True)
class Panel:
    """One subplot: a title and the metric keys tried in order (``*`` matches within one key)."""

    title: str
    keys: tuple[str, ...]
    log_y: bool = False
    #: one line per matched key (e.g. per validation split) instead of their mean
    per_key: bool = False
    #: drawn only when some run logged it
    optional: bool = False

    @property
    def validation(self) -> bool:
        """Validation panels (every key a ``val-*`` metric) are drawn point by point, never smoothed."""
        return all(key.startswith("val-") for key in self.keys)


DEFAULT_PANELS: tuple[Panel, ...] = (
    Panel("train reward (mean score)", ("critic/score/mean", "critic/rewards/mean")),
    Panel(
        "validation EM (mean over data sources)",
        ("val-aux/*/em/mean@*", "val-core/*/acc/mean@*", "val-core/*/reward/mean@*"),
    ),
    Panel("actor/pg_clipfrac", ("actor/pg_clipfrac",)),
    Panel("sorl/turn_clipfrac", ("actor/sorl/turn_clipfrac", "sorl/turn_clipfrac")),
    Panel("sorl/clip_bias_norm  ||C||", ("actor/sorl/clip_bias_norm", "sorl/clip_bias_norm")),
    Panel("sorl/norm_factor  Z", ("actor/sorl/norm_factor", "sorl/norm_factor")),
    Panel("gradient norm", ("actor/grad_norm",), log_y=True),
    Panel("entropy", ("actor/entropy",)),
    Panel(
        "validation EM per split",
        ("val-aux/*/em/mean@*", "val-core/*/acc/mean@*", "val-core/*/reward/mean@*"),
        per_key=True,
    ),
    Panel(
        "sorl/clip_bias_grad_norm  ||C(theta)||",
        ("actor/sorl/clip_bias_grad_norm", "sorl/clip_bias_grad_norm"),
        optional=True,
    ),
)

#: the collapse guard's restore count (sorl_verl.trainer.guard), logged every training step
GUARD_RESTORES = "sorl/guard/restores"

_CONSOLE_STEP = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf|nan)")


@dataclass
class Run:
    """Metrics of one run, merged from every source found for it."""

    label: str
    series: Series = field(default_factory=lambda: defaultdict(dict))

    def add(self, step: int, key: str, value: float) -> None:
        self.series[key][int(step)] = float(value)


def _as_float(value: object) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _NUMBER.search(value)
        return float(match.group()) if match else None
    return None


def read_jsonl(path: Path, run: Run) -> None:
    """verl ``file`` logger: one ``{"step": N, "data": {...}}`` object per line (read by
    :func:`sorl_verl.study.metrics.read_records`; a line that is not JSON fails naming it)."""
    for step, data in read_records(path, strict=True):
        for key, value in data.items():
            number = _as_float(value)
            if number is not None:
                run.add(step, key, number)


def read_console_log(path: Path, run: Run) -> None:
    """verl ``console`` logger: ``step:N - key:value - ...`` (other lines ignored)."""
    with path.open(errors="replace") as fh:
        for line in fh:
            match = _CONSOLE_STEP.search(line.rstrip("\n"))
            if not match:
                continue
            step = int(match.group(1))
            for item in match.group(2).split(" - "):
                key, sep, raw = item.rpartition(":")
                number = _as_float(raw) if sep else None
                if key and number is not None:
                    run.add(step, key.strip(), number)


def read_tensorboard(directory: Path, run: Run) -> None:
    """verl ``tensorboard`` logger: scalar summaries in the event files of ``directory``."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit(f"reading {directory} needs tensorboard: pip install 'sorl-verl[plot]'") from exc
    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    for tag in accumulator.Tags().get("scalars", []):
        for event in accumulator.Scalars(tag):
            run.add(event.step, tag, event.value)


def _outside_eval(root: Path, paths: Iterable[Path]) -> list[Path]:
    """``paths`` not under an ``eval/`` directory of ``root`` (validation-only runs live there)."""
    return sorted(p for p in paths if "eval" not in p.relative_to(root).parts[:-1])


def _event_dirs(root: Path) -> list[Path]:
    return sorted({p.parent for p in _outside_eval(root, root.rglob("events.out.tfevents.*"))})


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read every metrics source at ``path`` (file, tensorboard dir, or run dir) into one Run."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such run: {path}")
    run = Run(label or (path.stem if path.is_file() else path.name))
    if path.is_file():
        if path.name.startswith("events.out.tfevents."):
            read_tensorboard(path.parent, run)
        elif path.suffix == ".jsonl":
            read_jsonl(path, run)
        else:
            read_console_log(path, run)
    else:
        jsonl = sorted(path.glob("*.jsonl")) or _outside_eval(path, path.rglob("*.jsonl"))
        events = _event_dirs(path)
        for directory in events:  # float32; the exact JSON values below win on the same step
            read_tensorboard(directory, run)
        for file in jsonl:
            read_jsonl(file, run)
        if not jsonl and not events:
            for file in _outside_eval(path, path.rglob("*.log")):
                read_console_log(file, run)
    if not run.series:
        raise ValueError(f"{path}: no verl metrics found (expected *.jsonl, tensorboard events or a console log)")
    return run


def _matches(pattern: str, key: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"[^/]*"), key) is not None


def panel_series(run: Run, panel: Panel) -> tuple[str, dict[int, float]] | None:
    """The first candidate key the run logged; a wildcard key averages its matches per step."""
    for pattern in panel.keys:
        hits = sorted(k for k in run.series if _matches(pattern, k))
        if not hits:
            continue
        if len(hits) == 1 and "*" not in pattern:
            return hits[0], dict(run.series[hits[0]])
        per_step: dict[int, list[float]] = defaultdict(list)
        for key in hits:
            for step, value in run.series[key].items():
                per_step[step].append(value)
        return pattern, {step: sum(v) / len(v) for step, v in per_step.items()}
    return None


def panel_key_series(run: Run, panel: Panel) -> list[tuple[str, dict[int, float]]]:
    """Every key of the first candidate pattern the run logged, each with its own series
    (a ``per_key`` panel: e.g. one validation split per key)."""
    for pattern in panel.keys:
        hits = sorted(k for k in run.series if _matches(pattern, k))
        if hits:
            return [(key, dict(run.series[key])) for key in hits]
    return []


def split_label(key: str) -> str:
    """The data source of a validation key (``val-core/<source>/<var>/mean@N``), else the key."""
    parsed = parse_val_key(key)
    return parsed.source if parsed else key


def _draw_per_key(ax, runs: list[Run], panel: Panel, colours: list[str]) -> list[str]:
    """Lines of a ``per_key`` panel, its legend outside the plotting area; returns runs that logged none."""
    missing, handles, names, splits = [], [], [], []
    for i, run in enumerate(runs):
        found = panel_key_series(run, panel)
        if not found:
            missing.append(run.label)
        for key, series in found:
            split = split_label(key)
            if split not in splits:
                splits.append(split)
            steps = sorted(series)
            (line,) = ax.plot(steps, [series[s] for s in steps], linewidth=1.6, alpha=0.9, marker="o", markersize=3.5,
                              color=colours[splits.index(split) % len(colours)],
                              linestyle=("-", "--", "-.", ":")[i % 4], label="_" + split)  # fmt: skip
            handles.append(line)
            names.append(split if len(runs) == 1 else f"{run.label}: {split}")
    if handles:  # "_" labels keep these lines out of the figure's run legend
        ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    return missing


def restore_steps(run: Run) -> list[int]:
    """Steps at which the guard's restore count rose (:func:`sorl_verl.study.measures.restore_steps`)."""
    return measures.restore_steps(run.series.get(GUARD_RESTORES, {}).items())


def _mark_restores(ax, runs: list[Run], colours: list[str], per_key: bool) -> str:
    """Dotted vertical lines at each run's guard restores (the run's colour; grey in a per-split
    panel, whose colours are the splits'); returns the title line that names them ('' when none)."""
    named = []
    for i, run in enumerate(runs):
        steps = restore_steps(run)
        for step in steps:
            ax.axvline(step, color="0.4" if per_key else colours[i % len(colours)], linestyle=":", linewidth=1.3,
                       label="_guard restore")  # fmt: skip
        if steps:
            where = ", ".join(str(s) for s in steps)
            named.append(f"at step {where}" if len(runs) == 1 else f"{run.label} at {where}")
    if not named:
        return ""
    return "guard restore (dotted) " + named[0] if len(runs) == 1 else "guard restore (dotted): " + "; ".join(named)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (``window`` <= 1: unchanged)."""
    if window <= 1:
        return list(values)
    out, acc = [], []
    for value in values:
        acc.append(value)
        if len(acc) > window:
            acc.pop(0)
        finite = [v for v in acc if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


def draw_runs(runs: list[Run], panels: Iterable[Panel] = DEFAULT_PANELS, window: int = 1):
    """The figure: one subplot per panel, every run overlaid in its own colour, the run legend
    above the panels (laid out by ``tight_layout`` so titles, legend and axes do not overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [p for p in panels if not p.optional or any(panel_series(run, p) for run in runs)]
    ncols = 4 if len(panels) > 4 else len(panels)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.4 * nrows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels, strict=False):
        missing = _draw_per_key(ax, runs, panel, colours) if panel.per_key else []
        for i, run in enumerate(runs if not panel.per_key else []):
            found = panel_series(run, panel)
            if found is None:
                missing.append(run.label)
                continue
            steps = sorted(found[1])
            values = [found[1][s] for s in steps]
            style = {"color": colours[i % len(colours)], "linestyle": ("-", "--", "-.", ":")[i % 4]}
            if panel.validation or window <= 1:
                # validation: every point as logged, marked, so one bad validation shows as itself
                sparse = panel.validation or len(steps) < 15
                ax.plot(steps, values, label=run.label, linewidth=1.6, alpha=0.9, marker="o" if sparse else None,
                        markersize=3.5, **style)  # fmt: skip
            else:
                ax.plot(steps, values, linewidth=0.8, alpha=0.25, color=style["color"])
                ax.plot(steps, smooth(values, window), label=run.label, linewidth=1.6, alpha=0.9, **style)
        title = panel.title + (f" (smoothed, {window} pts)" if window > 1 and not panel.validation else "")
        restored = _mark_restores(ax, runs, colours, panel.per_key) if panel.validation else ""
        if restored:
            title += "\n" + restored
        if missing:
            title += "\nnot logged: " + ", ".join(missing)
        ax.set_title(title, fontsize=9 if missing or restored else 10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if panel.log_y and ax.lines:
            ax.set_yscale("symlog", linthresh=1e-2)  # log above 0.01, linear through 0 (grad_norm can be 0)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = [], []
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        fig.legend(
            handles, labels, loc="upper center", ncol=min(len(labels), 6), frameon=False, bbox_to_anchor=(0.5, 1.0)
        )
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def plot_runs(runs: list[Run], out: str | Path, panels: Iterable[Panel] = DEFAULT_PANELS, window: int = 1) -> Path:
    """:func:`draw_runs` saved as PNG at ``out``."""
    import matplotlib.pyplot as plt

    fig = draw_runs(runs, panels, window)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_csv(runs: list[Run], out: str | Path) -> Path:
    """Long table ``run,step,metric,value`` of every metric of every run."""
    import csv

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["run", "step", "metric", "value"])
        for run in runs:
            for key in sorted(run.series):
                for step in sorted(run.series[key]):
                    writer.writerow([run.label, step, key, run.series[key][step]])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sorl-verl plot", description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("runs", nargs="+", help="metrics .jsonl, console log, tensorboard dir, or run dir")
    parser.add_argument("--labels", nargs="*", help="legend label per run (default: file stem / dir name)")
    parser.add_argument("--out", default="sorl_metrics.png", help="PNG to write")
    parser.add_argument("--csv", help="also write the merged series as a long CSV")
    parser.add_argument(
        "--smooth",
        type=int,
        default=1,
        help="trailing moving-average window (points) for training series; validation is never smoothed",
    )
    parser.add_argument(
        "--metrics", nargs="*", help="plot these metric keys instead of the default panels ('*' matches within a key)"
    )
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"--labels needs {len(args.runs)} labels, got {len(args.labels)}")
    labels = args.labels or [None] * len(args.runs)
    try:
        runs = [load_run(path, label) for path, label in zip(args.runs, labels, strict=True)]
    except (FileNotFoundError, ValueError) as exc:
        print(f"sorl-verl plot: error: {exc}", file=sys.stderr)
        return 2
    panels = [Panel(key, (key,)) for key in args.metrics] if args.metrics else list(DEFAULT_PANELS)
    out = plot_runs(runs, args.out, panels, window=args.smooth)
    print(f"wrote {out}")
    if args.csv:
        print(f"wrote {write_csv(runs, args.csv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
