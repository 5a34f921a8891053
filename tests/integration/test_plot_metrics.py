"""``sorl-verl plot`` (sorl_verl/cli/plot.py) on metrics
written by verl's own Tracking loggers (file, tensorboard, console), two runs overlaid, through the
command line a user types; validation never smoothed; nothing drawn over the data."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "sorl_verl", "plot"]  # what `sorl-verl plot` runs

from sorl_verl.cli import plot as plot_metrics  # noqa: E402


def _metrics(step: int, collapse: bool) -> dict[str, float]:
    """A healthy SO-GRPO-like run, or one whose clipping and gradient blow up after step 10 (keys as verl logs them)."""
    bad = collapse and step > 10
    return {
        "critic/score/mean": 0.2 + 0.02 * step - (0.03 * (step - 10) if bad else 0.0),
        "actor/pg_clipfrac": 0.01 + (0.02 * (step - 10) if bad else 0.0),
        "actor/sorl/turn_clipfrac": 0.02 + (0.03 * (step - 10) if bad else 0.0),
        "actor/sorl/clip_bias_norm": 0.1 + (0.4 * (step - 10) if bad else 0.0),
        "actor/sorl/norm_factor": max(1.0, 0.1 + (0.4 * (step - 10) if bad else 0.0)),
        "actor/grad_norm": 0.5 * (3.0 ** (step - 10) if bad else 1.0),
        "actor/entropy": 1.2 - 0.01 * step - (0.08 * (step - 10) if bad else 0.0),
        "val-core/nq/reward/mean@1": 0.1 + 0.01 * step,
        "val-core/hotpotqa/reward/mean@1": 0.3 + 0.01 * step,
        "val-aux/nq/em/mean@1": 0.1 + 0.01 * step,
        "val-aux/hotpotqa/em/mean@1": 0.2 + 0.01 * step,
    }


def _log_run(root: Path, name: str, collapse: bool, monkeypatch, capsys) -> Path:
    """Log 20 steps with verl's Tracking to <root>/<name>/{metrics.jsonl,tensorboard/,train.log}."""
    from verl.utils.tracking import Tracking

    run_dir = root / name
    run_dir.mkdir(parents=True)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(run_dir / "metrics.jsonl"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(run_dir / "tensorboard"))
    capsys.readouterr()
    tracker = Tracking(
        project_name="sorl_test", experiment_name=name, default_backend=["console", "file", "tensorboard"]
    )
    for step in range(1, 21):
        tracker.log(_metrics(step, collapse), step=step)
    tracker.finish()
    (run_dir / "train.log").write_text(capsys.readouterr().out)
    return run_dir


@pytest.fixture
def two_runs(tmp_path, monkeypatch, capsys):
    healthy = _log_run(tmp_path, "so_grpo", collapse=False, monkeypatch=monkeypatch, capsys=capsys)
    collapsing = _log_run(tmp_path, "grpo", collapse=True, monkeypatch=monkeypatch, capsys=capsys)
    return healthy, collapsing


def test_every_logger_format_reads_back_what_verl_logged(two_runs):
    _, collapsing = two_runs
    sources = {
        "file": collapsing / "metrics.jsonl",
        "tensorboard": collapsing / "tensorboard",
        "console": collapsing / "train.log",
    }
    for kind, path in sources.items():
        run = plot_metrics.load_run(path)
        for step in (1, 10, 20):
            for key, value in _metrics(step, collapse=True).items():
                got = run.series[key][step]
                # tensorboard stores float32; console prints the repr of the float
                assert math.isclose(got, value, rel_tol=1e-6 if kind == "tensorboard" else 1e-12), (kind, key, step)
        assert sorted(run.series["actor/sorl/norm_factor"]) == list(range(1, 21)), kind


def test_wildcard_panel_averages_data_sources_and_falls_back(two_runs):
    run = plot_metrics.load_run(two_runs[0] / "metrics.jsonl")
    em_panel = plot_metrics.DEFAULT_PANELS[1]
    key, points = plot_metrics.panel_series(run, em_panel)
    assert key == "val-aux/*/em/mean@*"
    assert math.isclose(points[5], ((0.1 + 0.05) + (0.2 + 0.05)) / 2)
    del run.series["val-aux/nq/em/mean@1"], run.series["val-aux/hotpotqa/em/mean@1"]
    key, points = plot_metrics.panel_series(run, em_panel)
    assert key == "val-core/*/reward/mean@*"
    assert math.isclose(points[5], ((0.1 + 0.05) + (0.3 + 0.05)) / 2)
    assert plot_metrics.panel_series(run, plot_metrics.Panel("absent", ("sorl/nothing",))) is None


def test_smoothing_is_a_trailing_mean():
    assert plot_metrics.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert plot_metrics.smooth([1.0, 3.0], 1) == [1.0, 3.0]


def test_cli_overlays_runs_into_a_png_and_csv(two_runs, tmp_path):
    healthy, collapsing = two_runs
    out, csv = tmp_path / "plots" / "curves.png", tmp_path / "plots" / "curves.csv"
    proc = subprocess.run(
        [
            *CLI,
            str(healthy),
            str(collapsing),
            "--labels",
            "SO-GRPO",
            "GRPO",
            "--out",
            str(out),
            "--csv",
            str(csv),
            "--smooth",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    from PIL import Image

    with Image.open(out) as image:
        width, height = image.size
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert width > 1500 and height > 600
    assert len(colours) > 50  # real curves and text, not a blank canvas
    rows = csv.read_text().splitlines()
    assert rows[0] == "run,step,metric,value"
    # a run dir holds the same metrics three times (jsonl, tensorboard, console); merged per step
    assert len(rows) == 1 + 2 * 20 * len(_metrics(1, False))
    assert any(r.startswith("GRPO,20,actor/grad_norm,") for r in rows)


def test_missing_run_and_empty_run_fail_with_a_message(tmp_path, capsys):
    with pytest.raises(FileNotFoundError):
        plot_metrics.load_run(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no verl metrics"):
        plot_metrics.load_run(tmp_path / "empty")
    assert plot_metrics.main([str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    assert "empty: no verl metrics found" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


#: validation EM of a run that peaks at 0.316 and collapses to 0.063 (every 5 steps)
COLLAPSE_VAL = {0: 0.12, 5: 0.2, 10: 0.316, 15: 0.18, 20: 0.063}


def _collapse_run() -> plot_metrics.Run:
    run = plot_metrics.Run("collapse")
    for step in range(1, 21):
        run.add(step, "critic/score/mean", 0.1 * (step % 3))
    for step, em in COLLAPSE_VAL.items():
        run.add(step, "val-aux/nq/em/mean@1", em)
    return run


def test_smoothing_never_touches_validation_series():
    import matplotlib.pyplot as plt

    panels = [plot_metrics.DEFAULT_PANELS[0], plot_metrics.DEFAULT_PANELS[1]]
    assert [p.validation for p in panels] == [False, True]
    fig = plot_metrics.draw_runs([_collapse_run()], panels, window=5)
    try:
        train_ax, val_ax = fig.axes[:2]
        (val_line,) = val_ax.lines
        # exactly the logged points, the collapse included (a 5-point mean would show 0.178 at step 20)
        assert list(val_line.get_xdata()) == list(COLLAPSE_VAL)
        assert list(val_line.get_ydata()) == list(COLLAPSE_VAL.values())
        assert max(val_line.get_ydata()) == 0.316 and val_line.get_marker() == "o"
        raw, smoothed = train_ax.lines  # training: the raw series, faint, under its trailing mean
        raw_y = [0.1 * (s % 3) for s in range(1, 21)]
        assert list(raw.get_ydata()) == raw_y and raw.get_alpha() < 0.5
        assert list(smoothed.get_ydata()) == plot_metrics.smooth(raw_y, 5) and smoothed.get_label() == "collapse"
        assert "smoothed, 5 pts" in train_ax.get_title() and "smoothed" not in val_ax.get_title()
    finally:
        plt.close(fig)


def test_labels_and_legend_do_not_overlap_the_plotted_data():
    """Rendered geometry: the run legend and every panel title (with its "not logged" line) lie
    outside every panel's plotting area; no text is drawn inside a panel."""
    import matplotlib.pyplot as plt

    partial = plot_metrics.Run("no sorl metrics")
    for step in range(1, 21):
        partial.add(step, "critic/score/mean", 0.05 * step)
    fig = plot_metrics.draw_runs([_collapse_run(), partial], plot_metrics.DEFAULT_PANELS, window=3)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
        # the optional ||C(theta)|| panel is left out: neither run logged it
        assert len(panels) == len([p for p in plot_metrics.DEFAULT_PANELS if not p.optional])
        boxes = [ax.get_window_extent(renderer) for ax in panels]
        (legend,) = fig.legends
        labels = [legend.get_window_extent(renderer)] + [ax.title.get_window_extent(renderer) for ax in panels]
        for label in labels:
            for box in boxes:
                assert not label.overlaps(box), (label, box)
        for ax in panels:
            assert not ax.texts  # nothing written over the curves
        z_panel = panels[5]
        assert z_panel.get_title().endswith("not logged: collapse, no sorl metrics")
        assert "not logged: collapse" in panels[2].get_title()  # actor/pg_clipfrac: neither logged it
        assert "not logged" not in panels[0].get_title()
    finally:
        plt.close(fig)


def test_panels_find_the_metric_names_verl_logs_for_the_sorl_loss(tmp_path, monkeypatch):
    """Real names: the so_grpo loss from verl's registry, prefixed by verl's rename_dict, logged by Tracking."""
    import torch
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.py_functional import rename_dict
    from verl.utils.tracking import Tracking

    overrides = ["+task=search_qa", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    with initialize_config_dir(config_dir=str(REPO / "recipe" / "sorl" / "config"), version_base=None):
        cfg = compose(config_name="sorl_trainer", overrides=overrides)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    if hasattr(actor.policy_loss, "clip_norm_apply"):  # the loss alone, outside an actor worker's optimizer
        object.__setattr__(actor.policy_loss, "clip_norm_apply", "loss")
    mask = torch.ones(2, 6, dtype=torch.bool)
    log_prob = torch.full((2, 6), 3.0, requires_grad=True)  # ratio e^3: every turn clipped
    _, metrics = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        torch.zeros(2, 6), log_prob, torch.ones(2, 6), mask, actor.loss_agg_mode, actor, None
    )
    logged = {k: float(v) for k, v in rename_dict(metrics, "actor/").items()}
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "m.jsonl"))
    tracker = Tracking(project_name="p", experiment_name="e", default_backend=["file"])
    tracker.log(logged, step=1)
    tracker.finish()
    run = plot_metrics.load_run(tmp_path / "m.jsonl")
    found = {}
    for panel in plot_metrics.DEFAULT_PANELS:
        hit = plot_metrics.panel_series(run, panel)
        if hit is not None:
            found[panel.title] = hit
    assert found["sorl/turn_clipfrac"] == ("actor/sorl/turn_clipfrac", {1: 1.0})
    assert found["sorl/norm_factor  Z"][0] == "actor/sorl/norm_factor" and found["sorl/norm_factor  Z"][1][1] > 1.0
    assert found["sorl/clip_bias_norm  ||C||"][0] == "actor/sorl/clip_bias_norm"
    assert found["actor/pg_clipfrac"] == ("actor/pg_clipfrac", {1: 1.0})


def test_the_clip_bias_grad_norm_panel_appears_only_when_a_run_logged_it():
    import matplotlib.pyplot as plt

    (optional,) = [p for p in plot_metrics.DEFAULT_PANELS if p.optional]
    logged = _collapse_run()
    for step in range(1, 21):
        logged.add(step, "actor/sorl/clip_bias_grad_norm", 0.01 * step)
    for runs, shown in (([_collapse_run()], False), ([_collapse_run(), logged], True)):
        fig = plot_metrics.draw_runs(runs, plot_metrics.DEFAULT_PANELS)
        try:
            titles = [ax.get_title() for ax in fig.axes if ax.axison]
            assert any(t.startswith(optional.title) for t in titles) is shown
            if shown:
                (ax,) = [ax for ax in fig.axes if ax.get_title().startswith(optional.title)]
                assert ax.get_title().endswith("not logged: collapse")
                assert [list(ln.get_ydata()) for ln in ax.lines] == [[0.01 * s for s in range(1, 21)]]
        finally:
            plt.close(fig)
