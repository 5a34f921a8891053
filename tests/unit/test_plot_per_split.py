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


def with_restores(run: plot.Run, counts: dict[int, float]) -> plot.Run:
    for step in range(1, 51):
        run.add(step, plot.GUARD_RESTORES, max([c for s, c in counts.items() if s <= step], default=0.0))
    return run


def test_restore_steps_are_where_the_guard_count_rises():
    assert plot.restore_steps(run_with_splits("a")) == []  # no guard logged
    assert plot.restore_steps(with_restores(run_with_splits("a"), {30: 1.0, 40: 2.0})) == [30, 40]
    resumed = plot.Run("r")  # a run whose first logged step already counts a restore
    for step, count in ((21, 1.0), (22, 1.0), (23, float("nan")), (24, 1.0)):
        resumed.add(step, plot.GUARD_RESTORES, count)
    assert plot.restore_steps(resumed) == [21]


@pytest.mark.parametrize("labels", [["a"], ["a", "b"]])
def test_validation_panels_mark_each_guard_restore(labels):
    import matplotlib.pyplot as plt

    # one run restored twice; or two runs, of which the second restored once
    counts = [{30: 1.0, 40: 2.0}] if len(labels) == 1 else [{}, {30: 1.0}]
    runs = [with_restores(run_with_splits(x), c) for x, c in zip(labels, counts, strict=True)]
    panels = [plot.DEFAULT_PANELS[0], plot.DEFAULT_PANELS[1], per_split_panel()]
    fig = plot.draw_runs(runs, panels)
    try:
        train_ax, val_ax, split_ax = fig.axes[:3]
        restored = [s for r in runs for s in plot.restore_steps(r)]
        for ax, curves in ((val_ax, len(runs)), (split_ax, len(SPLITS) * len(runs))):
            marks = [ln for ln in ax.lines if ln.get_linestyle() == ":" and ln.get_label() == "_guard restore"]
            assert sorted(ln.get_xdata()[0] for ln in marks) == sorted(restored)
            assert len(ax.lines) == curves + len(restored)
        expected = "guard restore (dotted) at step 30, 40" if len(labels) == 1 else "guard restore (dotted): b at 30"
        assert val_ax.get_title().endswith(expected)
        assert "guard restore" not in train_ax.get_title() and all(ln.get_linestyle() != ":" for ln in train_ax.lines)
        (run_legend,) = fig.legends  # the marks add no entry to the run legend
        assert [t.get_text() for t in run_legend.get_texts()] == labels
    finally:
        plt.close(fig)
