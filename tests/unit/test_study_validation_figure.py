"""The study's validation figure (sorl_verl/study/plots.py): which regimes get it, what it plots."""

from __future__ import annotations

from pathlib import Path

from sorl_verl.study.metrics import Trace
from sorl_verl.study.plots import MIN_SEEDS, band, compared, plot_study, split_points

PNG = b"\x89PNG\r\n\x1a\n"


def trace(scores: dict[int, dict[str, float]], train_steps: int = 2) -> Trace:
    t = Trace(validations=sorted(scores.items()))
    t.train = {s: {"critic/score/mean": 0.1 * s} for s in range(1, train_steps + 1)}
    return t


def runs(algorithms: dict[str, list[int]]) -> list[tuple[str, int, Trace]]:
    """(algorithm, seed, trace): seed k scores 0.1 k on split a and 0.2 k on split b at steps 0 and 2."""
    return [
        (a, k, trace({0: {"a": 0.1 * k, "b": 0.2 * k}, 2: {"a": 0.1 * k + 0.05, "b": 0.2 * k}}))
        for a, seeds in algorithms.items()
        for k in seeds
    ]


def test_compared_keeps_algorithms_with_enough_seeds_and_needs_two_of_them():
    assert MIN_SEEDS == 2
    kept = compared(runs({"grpo": [1, 2, 3], "so_grpo": [1, 2], "gspo": [1]}))
    assert sorted(kept) == ["grpo", "so_grpo"] and len(kept["grpo"]) == 3
    assert compared(runs({"grpo": [1, 2, 3], "gspo": [1]})) == {}
    # a run that never validated does not count as a seed
    unvalidated = [("so_grpo", 2, trace({}))]
    assert compared(runs({"grpo": [1, 2], "so_grpo": [1]}) + unvalidated) == {}


def test_split_points_per_source_and_mean_over_sources():
    t = trace({0: {"a": 0.25, "b": 0.5}, 10: {"a": 0.75, "b": float("nan")}})
    assert split_points(t, "a") == [(0, 0.25), (10, 0.75)]
    assert split_points(t, "b") == [(0, 0.5)]  # the non-finite score is left out
    assert split_points(t, None) == [(0, 0.375)]  # the mean of step 10 is NaN and left out
    steps, mean, lo, hi = band([split_points(t, "a"), [(0, 0.5)]])
    assert steps == [0, 10] and mean == [0.375, 0.75] and lo == [0.25, 0.75] and hi == [0.5, 0.75]


def test_plot_study_writes_the_validation_figure_only_for_a_compared_regime(tmp_path: Path):
    study = [("cmp", a, k, t) for a, k, t in runs({"grpo": [1, 2], "so_grpo": [1, 2]})]
    study += [("alone", a, k, t) for a, k, t in runs({"grpo": [1, 2, 3]})]
    written = plot_study(study, tmp_path, "learning")
    names = sorted(p.name for p in written)
    assert names == ["learning_alone.png", "learning_cmp.png", "learning_cmp_validation.png"]
    figure = tmp_path / "learning_cmp_validation.png"
    assert figure.read_bytes()[:8] == PNG and figure.stat().st_size > 10_000
