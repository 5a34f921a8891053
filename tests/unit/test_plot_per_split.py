"""``sorl-verl plot``'s per-split validation panel: one line per data source, its own legend."""

from __future__ import annotations

import pytest

from sorl_verl.cli import plot

SPLITS = {"synthetic_1hop": (0.58, 0.46), "synthetic_2hop": (0.0, 0.36), "synthetic_3hop": (0.01, 0.0)}


def run_with_splits(label: str) -> plot.Run:
    run = plot.Run(label)
    for split, (first, last) in SPLITS.items():
        for step, value in ((0, first), (50, last)):
            run.add(step, f"val-aux/{split}/em/mean@1", value)
            run.add(step, f"val-aux/{split}/f1/mean@1", value + 0.01)  # another variable: not drawn
            run.add(step, f"val-core/{split}/reward/mean@1", value)
    for step in range(1, 51):
        run.add(step, "critic/score/mean", step / 100)
    return run


def per_split_panel() -> plot.Panel:
    (panel,) = [p for p in plot.DEFAULT_PANELS if p.per_key]
    return panel


def test_each_split_is_its_own_series():
    found = plot.panel_key_series(run_with_splits("a"), per_split_panel())
    assert [plot.split_label(key) for key, _ in found] == sorted(SPLITS)
    for key, series in found:
        assert key.endswith("/em/mean@1")
        assert series == {0: SPLITS[plot.split_label(key)][0], 50: SPLITS[plot.split_label(key)][1]}


@pytest.mark.parametrize("labels", [["a"], ["a", "b"]])
def test_the_panel_draws_a_line_per_split_and_run_with_a_legend_of_its_own(labels):
    import matplotlib.pyplot as plt

    runs = [run_with_splits(label) for label in labels]
    panels = [plot.DEFAULT_PANELS[0], per_split_panel()]
    fig = plot.draw_runs(runs, panels)
    try:
        ax = fig.axes[1]
        assert len(ax.lines) == len(SPLITS) * len(runs)
        shown = [t.get_text() for t in ax.get_legend().get_texts()]
        expected = [s if len(runs) == 1 else f"{r}: {s}" for r in labels for s in sorted(SPLITS)]
        assert shown == expected
        (run_legend,) = fig.legends  # the figure's legend names runs only
        assert [t.get_text() for t in run_legend.get_texts()] == labels
        assert not ax.texts
    finally:
        plt.close(fig)


def test_a_run_without_validation_is_named_under_the_panel():
    import matplotlib.pyplot as plt

    bare = plot.Run("bare")
    bare.add(1, "critic/score/mean", 0.1)
    fig = plot.draw_runs([run_with_splits("a"), bare], [per_split_panel()])
    try:
        assert fig.axes[0].get_title().endswith("not logged: bare")
    finally:
        plt.close(fig)
