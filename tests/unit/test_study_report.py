"""The learning study's headline table (sorl_verl/study/report.py)."""

from __future__ import annotations

from pathlib import Path

from sorl_verl.study.report import episodes_per_step, headline_table

REPO = Path(__file__).resolve().parents[2]


def test_episodes_per_step_from_overrides_then_the_cpu_overlay(tmp_path):
    assert episodes_per_step({"data.train_batch_size": "16", "actor_rollout_ref.rollout.n": "2"}, None) == 32
    # the committed CPU overlay: train_batch_size 8 x rollout.n 4
    assert episodes_per_step({}, REPO / "recipe" / "sorl" / "config") == 32
    assert episodes_per_step({"actor_rollout_ref.rollout.n": 8}, REPO / "recipe" / "sorl" / "config") == 64
    assert episodes_per_step({}, tmp_path) is None


def _run(alg: str, seed: int, gain: float, peak: float, lost: bool, collapsed: bool = False, wall: float = 600.0):
    return {"regime": "r", "algorithm": alg, "seed": seed, "judged": True, "collapsed": collapsed, "gain": gain,
            "peak_gain": peak, "lost_gain": lost, "auc_gain": gain / 2, "gain_per_1k_episodes": gain / 1.6,
            "wall_s": wall}  # fmt: skip


def test_headline_rows_carry_mean_sd_and_counts():
    runs = [_run("grpo", 1, 0.02, 0.10, True), _run("grpo", 2, 0.06, 0.08, False, wall=700.0),
            _run("so_grpo", 1, 0.09, 0.09, False), {**_run("so_grpo", 2, 0.0, 0.0, False), "judged": False}]  # fmt: skip
    table = headline_table(runs).splitlines()
    assert table[2] == (
        "| r | grpo | 1,2 | +0.040 ± 0.028 | +0.090 ± 0.014 | 0/2 | 1/2 | +0.020 ± 0.014 | +0.0250 ± 0.0177 | 650 |"
    )
    assert table[3].startswith("| r | so_grpo | 1,2 (1 not judged) | +0.090 | +0.090 | 0/1 | 0/1 |")


OLD_HEADER = (
    "| regime | algorithm | seeds | final gain | peak gain | collapsed | gained, then lost | mean gain (AUC) "
    "| gain / 1k episodes | wall s / run |"
)


def test_a_table_without_a_guarded_run_has_no_guard_columns():
    table = headline_table([_run("grpo", 1, 0.02, 0.10, True), _run("so_grpo", 1, 0.09, 0.09, False)]).splitlines()
    assert table[0] == OLD_HEADER and table[1] == "|---|---|---|---|---|---|---|---|---|---|"
    assert all(line.count("|") == 11 for line in table)


def test_guard_columns_restores_per_run_and_share_of_wall_time():
    guarded = [{**_run("grpo_guard", 1, 0.05, 0.08, False, wall=600.0), "guard_restores": 1, "guard_s": 3.0},
               {**_run("grpo_guard", 2, 0.04, 0.06, False, wall=400.0), "guard_restores": 0, "guard_s": 2.0},
               {**_run("grpo_guard", 3, 0.0, 0.0, False, wall=200.0), "guard_restores": 3, "guard_s": 1.0,
                "judged": False}]  # fmt: skip
    table = headline_table([*guarded, _run("grpo", 1, 0.02, 0.10, True)]).splitlines()
    assert table[0] == OLD_HEADER + " guard restores / run | guard time / wall |"
    assert table[1] == "|---|---|---|---|---|---|---|---|---|---|---|---|"
    rows = {line.split("|")[2].strip(): line for line in table[2:]}
    # restores over the judged guarded runs (1 and 0); time share over all guarded runs: 6 s of 1200 s
    assert rows["grpo_guard"].endswith("| 0.5 ± 0.7 | 0.50% |")
    assert rows["grpo"].endswith("| 600 | - | - |")
    assert all(line.count("|") == 13 for line in table)
