"""One PNG per regime: per algorithm, the mean over seeds and the min-max band, metric vs step.

Panels (a panel no run of the regime logged is left out): validation score (mean over data
sources; the collapse threshold is not drawn, it is relative to each run's own peak), training
reward, SORL and PPO clip fractions, Z, SORL update scale, ppo_kl, grad norm, entropy, response
length, rollout staleness (async regimes), rollout-vs-actor probability difference (mismatch
regime). At a step, the mean and band are over the seeds that logged it. Colours are fixed per
algorithm across the figures of one study.

A regime that compares algorithms (at least two of them with at least ``MIN_SEEDS`` seeds each) also
gets ``<prefix>_<regime>_validation.png``: the validation score alone, the mean over splits and each
split, for the algorithms with ``MIN_SEEDS`` seeds (the README's figure).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sorl_verl.study.metrics import Trace

#: seeds an algorithm needs in a regime to enter its validation figure (a band needs two)
MIN_SEEDS = 2

#: resolution of the PNGs (3 panels a row: 1200 px wide); the committed figures are regenerated at it
DPI = 80

#: (title, training metric keys (the first a run logged) or () for the validation score, log scale)
PANELS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("validation score (mean over splits)", (), False),
    ("training reward (critic/score/mean)", ("critic/score/mean",), False),
    ("SORL clip fraction (turns; tokens for s_ppo)", ("actor/sorl/turn_clipfrac", "actor/sorl/token_clipfrac"), False),
    ("PPO clip fraction (actor/pg_clipfrac)", ("actor/pg_clipfrac",), False),
    ("Z (sorl/norm_factor)", ("actor/sorl/norm_factor",), False),
    ("update scale (sorl/update_scale)", ("actor/sorl/update_scale",), False),
    ("ppo_kl", ("actor/ppo_kl",), False),
    ("grad norm (actor/grad_norm)", ("actor/grad_norm",), True),
    ("entropy (actor/entropy)", ("actor/entropy",), False),
    ("response length (mean tokens)", ("response_length/mean",), False),
    ("rollout staleness (model versions, mean)", ("training/off_policy/trajectory_staleness/mean",), False),
    ("rollout vs actor prob. diff (mean)", ("training/rollout_probs_diff_mean",), True),
)


def _points(trace: Trace, keys: tuple[str, ...]) -> list[tuple[int, float]]:
    """The validation scores (``keys`` empty) or the first of ``keys`` the run logged, finite only."""
    pts = trace.val_scores if not keys else next((p for p in (trace.series(k) for k in keys) if p), [])
    return [(s, v) for s, v in pts if math.isfinite(v)]


def band(series: Sequence[Sequence[tuple[int, float]]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, min, max) over the runs that logged each step."""
    at: dict[int, list[float]] = defaultdict(list)
    for pts in series:
        for s, v in pts:
            at[s].append(v)
    steps = sorted(at)
    return steps, [sum(at[s]) / len(at[s]) for s in steps], [min(at[s]) for s in steps], [max(at[s]) for s in steps]


def algorithm_colors(algorithms: Sequence[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20" if len(algorithms) > 10 else "tab10"]
    return {a: cmap(i % cmap.N) for i, a in enumerate(sorted(algorithms))}


def plot_regime(
    regime: str,
    runs: Sequence[tuple[str, int, Trace]],
    path: Path,
    colors: dict[str, Any] | None = None,
    title: str = "",
) -> Path | None:
    """Write ``path`` for one regime from (algorithm, seed, trace) triples; None when nothing is logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_alg: dict[str, list[Trace]] = defaultdict(list)
    for algorithm, _, trace in runs:
        by_alg[algorithm].append(trace)
    panels = [p for p in PANELS if any(_points(t, p[1]) for ts in by_alg.values() for t in ts)]
    if not panels:
        return None
    colors = colors or algorithm_colors(list(by_alg))
    from matplotlib.ticker import MaxNLocator

    ncols = 3
    nrows = math.ceil(len(panels) / ncols)
    legend_rows = math.ceil(len(by_alg) / 5)
    header_in = 0.45 + 0.22 * legend_rows
    height_in = header_in + 3.0 * nrows
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.0 * ncols, height_in), squeeze=False)
    for ax, (name, key, log_y) in zip(axes.flat, panels, strict=False):
        positive = True
        for algorithm in sorted(by_alg):
            traces = by_alg[algorithm]
            steps, mean, lo, hi = band([_points(t, key) for t in traces])
            if not steps:
                continue
            positive = positive and min(lo) > 0
            c = colors[algorithm]
            marker = "o" if not key or len(steps) == 1 else None
            ax.plot(steps, mean, color=c, marker=marker, ms=3, lw=1.4, label=f"{algorithm} (n={len(traces)})")
            if len(traces) > 1:
                ax.fill_between(steps, lo, hi, color=c, alpha=0.15, lw=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(which="both", labelsize=7)
        ax.grid(alpha=0.3)
        if log_y and positive:
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    labels_seen: dict[str, Any] = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            labels_seen.setdefault(lab, h)
    top = 1 - header_in / height_in
    fig.suptitle(
        title or f"regime: {regime}  (line: mean over seeds, band: min-max)", fontsize=10, y=1 - 0.12 / height_in
    )
    fig.legend(
        list(labels_seen.values()),
        list(labels_seen),
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.38 / height_in),
        ncol=min(5, len(labels_seen)),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, top))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def compared(runs: Sequence[tuple[str, int, Trace]]) -> dict[str, list[Trace]]:
    """Algorithm -> traces of the algorithms with ``MIN_SEEDS`` seeds that logged a validation; empty
    unless at least two algorithms qualify."""
    seeds: dict[str, set[int]] = defaultdict(set)
    by_alg: dict[str, list[Trace]] = defaultdict(list)
    for algorithm, seed, trace in runs:
        if trace.validations:
            seeds[algorithm].add(seed)
            by_alg[algorithm].append(trace)
    kept = {a: ts for a, ts in by_alg.items() if len(seeds[a]) >= MIN_SEEDS}
    return kept if len(kept) >= 2 else {}


def split_points(trace: Trace, source: str | None) -> list[tuple[int, float]]:
    """(step, score) of one data source's validations, or of their mean when ``source`` is None."""
    if source is None:
        return _points(trace, ())
    return [(s, v[source]) for s, v in trace.validations if source in v and math.isfinite(v[source])]


def plot_validation(
    regime: str,
    by_alg: dict[str, list[Trace]],
    path: Path,
    colors: dict[str, Any] | None = None,
) -> Path:
    """Write ``path``: per algorithm the mean over seeds and the min-max band of the validation score
    (mean over splits) and of each split's score, one panel each, 2 panels a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    sources = sorted({src for ts in by_alg.values() for t in ts for _, v in t.validations for src in v})
    panels: list[str | None] = [None, *sources]
    colors = colors or algorithm_colors(list(by_alg))
    ncols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 0.7 + 2.9 * nrows), squeeze=False)
    for ax, source in zip(axes.flat, panels, strict=False):
        for algorithm in sorted(by_alg):
            traces = by_alg[algorithm]
            steps, mean, lo, hi = band([split_points(t, source) for t in traces])
            if not steps:
                continue
            c = colors[algorithm]
            ax.plot(steps, mean, color=c, marker="o", ms=3, lw=1.4, label=f"{algorithm} (n={len(traces)})")
            ax.fill_between(steps, lo, hi, color=c, alpha=0.12, lw=0)
        ax.set_title("mean over splits" if source is None else source, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(which="both", labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    height_in = 0.7 + 2.9 * nrows
    fig.suptitle(
        f"validation score, regime {regime} (line: mean over seeds, band: min-max)", fontsize=10, y=1 - 0.1 / height_in
    )
    fig.legend(
        handles,
        labels,
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.28 / height_in),
        ncol=min(5, len(labels)),
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / height_in))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def plot_study(runs: Sequence[tuple[str, str, int, Trace]], out_dir: Path, prefix: str) -> list[Path]:
    """One ``<prefix>_<regime>.png`` per regime from (regime, algorithm, seed, trace), and
    ``<prefix>_<regime>_validation.png`` per regime that compares algorithms (:func:`compared`)."""
    colors = algorithm_colors(sorted({a for _, a, _, _ in runs}))
    by_regime: dict[str, list[tuple[str, int, Trace]]] = defaultdict(list)
    for regime, algorithm, seed, trace in runs:
        by_regime[regime].append((algorithm, seed, trace))
    written = []
    for regime in sorted(by_regime):
        p = plot_regime(regime, by_regime[regime], out_dir / f"{prefix}_{regime}.png", colors)
        if p is not None:
            written.append(p)
        if by_alg := compared(by_regime[regime]):
            written.append(plot_validation(regime, by_alg, out_dir / f"{prefix}_{regime}_validation.png", colors))
    return written
