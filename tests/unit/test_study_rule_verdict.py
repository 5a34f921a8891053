"""Question 5's verdict, the recipes' default guard rule (sorl_verl/study/rule_table.py: tallies,
protocol_part, default_decision, default_rule_verdict), and the rule table's test_freq fallback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sorl_verl.study.grid import load_grid
from sorl_verl.study.guard_table import FAILS, HOLDS, RULE_GUARDED, RULE_UNGUARDED, UNDECIDED
from sorl_verl.study.metrics import parse_records
from sorl_verl.study.rule_replay import NO_RECORDS, Replay
from sorl_verl.study.rule_table import (
    CANDIDATE_RULE,
    CONTROL_FIRES_ALLOWED,
    DEFAULT_RULE,
    UNITS_TEXT,
    RuleRow,
    default_rule_text,
    default_rule_verdict,
    protocols,
    rule_report,
    rule_rows,
    tallies,
)

ROOT = Path(__file__).resolve().parents[2]

GRID = """\
    name: g
    steps: 40
    test_freq: 10
    val_max_samples: 300
    seed_keys: [data.seed]
    guard_controls: [demo]
    regimes:
      demo: {}
      hot: {}
      hot_p5: {protocol_of: hot, test_freq: 5, val_max_samples: 100}
      demo_p5: {protocol_of: demo, test_freq: 5, val_max_samples: 100}
    algorithms:
      grpo: {}
      grpo_guard: {overrides: {sorl.guard.enable: true, sorl.guard.drop: 0.3, sorl.guard.patience: 1}}
    cells:
      - {regimes: [demo, hot, hot_p5, demo_p5], algorithms: [grpo], seeds: [1, 2]}
      - {regimes: [demo, hot], algorithms: [grpo_guard], seeds: [1, 2]}
"""
ROLES = {"demo": "control", "hot": "admitted"}
NONE, NR = Replay(), Replay(cannot=NO_RECORDS)


def fire(step: int) -> Replay:
    return Replay(step=step)


def base_runs() -> dict[tuple[str, str, int], tuple[Replay, Replay]]:
    """(regime, algorithm, seed) -> (drop, stderr) replays. P10: unguarded grpo has no question records, so
    stderr falls back to grpo_guard: a fire at 20 in hot seed 1, censored at the restore at 40 in seed 2;
    drop fires at 30 and 40 (mean 35) in hot, nowhere in demo. P5: stderr at 15 and 20 in hot_p5, nowhere in
    demo_p5."""
    return {
        ("hot", "grpo", 1): (fire(30), NR),
        ("hot", "grpo", 2): (fire(40), NR),
        ("demo", "grpo", 1): (NONE, NR),
        ("demo", "grpo", 2): (NONE, NR),
        ("hot", "grpo_guard", 1): (fire(30), fire(20)),
        ("hot", "grpo_guard", 2): (fire(40), Replay(censored_at=40)),
        ("demo", "grpo_guard", 1): (NONE, NONE),
        ("demo", "grpo_guard", 2): (NONE, NONE),
        ("hot_p5", "grpo", 1): (fire(20), fire(15)),
        ("hot_p5", "grpo", 2): (fire(25), fire(20)),
        ("demo_p5", "grpo", 1): (NONE, NONE),
        ("demo_p5", "grpo", 2): (NONE, NONE),
    }


def rows(spec: dict[tuple[str, str, int], tuple[Replay, Replay]]) -> list[RuleRow]:
    return [RuleRow(regime=r, algorithm=a, seed=s, role="-", test_freq="-", questions="-", restored="-",
                    replays={"drop": d, "stderr": e}, validation_share=None)
            for (r, a, s), (d, e) in spec.items()]  # fmt: skip


@pytest.fixture
def grid(tmp_path, write_grid):
    return load_grid(write_grid(tmp_path, GRID))


def verdict_of(grid, spec) -> tuple[dict[str, tuple[str, str]], str]:
    """{protocol: (status, detail)} of the parts, and the verdict's text."""
    text = default_rule_verdict(grid, rows(spec), ROLES)
    parts = {m[0]: (m[1], m[2]) for m in re.findall(r"^- \((P\d+)\) \*\*(\w+)\*\*: (.*)$", text, re.M)}
    return parts, text


def decision_of(text: str) -> str:
    return text.rstrip().splitlines()[-1]


# --- the verdict ------------------------------------------------------------------------------


def test_stderr_wins_under_p5(grid):
    parts, text = verdict_of(grid, base_runs())
    # P10: stderr 1 fire of 2 units (the censored one is no fire) against drop's 2: fails on the count
    assert parts["P10"][0] == FAILS and parts["P10"][1].endswith("(fewer admitted-unit fires)")
    # P5: 2 of 2 at mean 17.5 <= 35, no control fire: holds
    assert parts["P5"] == (
        HOLDS,
        "stderr: admitted-regime units 2 of 2 (mean step 17.5), control units 0 of 2; "
        "drop under P10: admitted-regime units 2 of 2 (mean step 35.0), control units 0 of 2",
    )
    assert (
        decision_of(text)
        == "Decision: **sorl.guard.rule becomes stderr (the rule holds under P5, the protocol docs/guard.md states)**."
    )
    assert default_rule_text(["P5", "P10"], "P10") in text


def test_a_control_fire_loses_even_before_every_unit_is_in(grid):
    spec = base_runs() | {("demo_p5", "grpo", 2): (NONE, fire(10))}
    parts, text = verdict_of(grid, spec)
    assert parts["P5"][0] == FAILS and parts["P5"][1].endswith("(a control-unit fire)")
    assert parts["P5"][1].startswith("stderr: admitted-regime units 2 of 2 (mean step 17.5), control units 1 of 2;")
    assert decision_of(text) == "Decision: **sorl.guard.rule stays drop (the rule fails under every protocol)**."
    # the admitted P5 units not yet run cannot undo a control fire
    del spec[("hot_p5", "grpo", 1)], spec[("hot_p5", "grpo", 2)]
    parts, text = verdict_of(grid, spec)
    assert parts["P5"][0] == FAILS and decision_of(text).startswith("Decision: **sorl.guard.rule stays drop (")


def test_a_later_mean_first_fire_step_loses(grid):
    spec = base_runs() | {("hot_p5", "grpo", 1): (fire(35), fire(35)), ("hot_p5", "grpo", 2): (fire(40), fire(40))}
    parts, text = verdict_of(grid, spec)
    assert parts["P5"][0] == FAILS and parts["P5"][1].endswith("(a later mean first-fire step)")
    assert parts["P5"][1].startswith("stderr: admitted-regime units 2 of 2 (mean step 37.5),")
    assert "stays drop (the rule fails under every protocol)" in decision_of(text)
    # the same mean step is no later: holds
    spec |= {("hot_p5", "grpo", 1): (fire(30), fire(30))}
    assert verdict_of(grid, spec)[0]["P5"][0] == HOLDS


def test_undecided_while_a_unit_is_missing_and_the_missing_cells_are_named(grid):
    spec = base_runs()
    del spec[("hot_p5", "grpo", 2)]
    parts, text = verdict_of(grid, spec)
    assert parts["P5"][0] == UNDECIDED and parts["P5"][1].endswith("; missing hot_p5/grpo/seed2 (not run)")
    assert "| stderr | P5 | 1 of 1 (mean step 15.0) | 0 of 2 | grpo 3 | hot_p5/grpo/seed2 (not run) |" in text
    assert decision_of(text) == "Decision: **sorl.guard.rule stays drop for now (undecided: units missing under P5)**."
    # drop under P10 is every protocol's yardstick: one of its units missing leaves both undecided
    spec = base_runs()
    del spec[("hot", "grpo", 1)]
    parts, _ = verdict_of(grid, spec)
    assert parts["P5"][0] == parts["P10"][0] == UNDECIDED and "hot/grpo/seed1 (not run)" in parts["P5"][1]
    # too few fires whatever the missing unit gives: decided without it
    spec = base_runs() | {("hot_p5", "grpo", 1): (fire(20), NONE)}
    del spec[("hot_p5", "grpo", 2)]
    parts, _ = verdict_of(grid, spec)
    assert parts["P5"][0] == FAILS
    assert parts["P5"][1].endswith("(fewer admitted-unit fires, whatever the missing units give)")


def test_the_guarded_twin_stands_in_for_a_run_without_records_censored_at_its_restore(grid):
    ts = tallies(grid, rows(base_runs()), ROLES)
    p10 = protocols(grid)["demo"]
    stderr = ts[(CANDIDATE_RULE, p10)]
    assert [(u.regime, u.seed, u.source, u.replay) for u in stderr.units] == [
        ("demo", 1, RULE_GUARDED, NONE), ("demo", 2, RULE_GUARDED, NONE),
        ("hot", 1, RULE_GUARDED, fire(20)), ("hot", 2, RULE_GUARDED, Replay(censored_at=40)),
    ]  # fmt: skip
    # the censored unit is no fire, and out of the mean step
    assert stderr.text(False) == "1 of 2 (mean step 20.0), 1 censored" and stderr.mean_step() == 20.0
    assert stderr.sources() == "grpo_guard 4" and ts[(DEFAULT_RULE, p10)].sources() == "grpo 4"
    # the twin's fire before its restore makes P10 hold
    spec = base_runs() | {("hot", "grpo_guard", 2): (fire(40), fire(30))}
    assert verdict_of(grid, spec)[0]["P10"][0] == HOLDS
    # no records in the twin either, or no twin: the unit is missing, named with why
    spec = base_runs() | {("hot", "grpo_guard", 1): (fire(30), NR)}
    del spec[("hot", "grpo_guard", 2)]
    parts, _ = verdict_of(grid, spec)
    assert parts["P10"][0] == UNDECIDED and parts["P10"][1].endswith(
        "missing hot/grpo/seed1 (grpo: no question records; grpo_guard: no question records), "
        "hot/grpo/seed2 (grpo: no question records; no grpo_guard run)"
    )


def test_protocols_are_the_grids_own_and_each_twins():
    grid = load_grid(ROOT / "recipe/sorl/study/natural.yaml")
    proto = protocols(grid)
    assert (proto["demo"].name, proto["demo"].test_freq, proto["demo"].questions) == ("P10", 10, 300)
    assert proto["demo_const_lr1e-3"] == proto["demo"] == proto[""]
    assert (proto["demo_p5"].name, proto["demo_p5"].test_freq, proto["demo_p5"].questions) == ("P5", 5, 100)
    assert proto["demo_const_lr1e-3_p5"] == proto["demo_p5"]


def test_the_rule_text_and_the_grid_comment_agree():
    """natural.yaml's question 5 states the DEFAULT RULE word for word as the constants write it, and the
    protocols and units as the code reads them."""
    comment = "\n".join(line for line in (ROOT / "recipe/sorl/study/natural.yaml").read_text().splitlines()
                        if line.startswith("#"))  # fmt: skip
    comment = re.sub(r"\s*\n#\s*", " ", comment)
    proto = protocols(load_grid(ROOT / "recipe/sorl/study/natural.yaml"))
    p5, p10 = proto["demo_p5"], proto["demo"]
    assert default_rule_text([p5.name, p10.name], p10.name) in comment
    assert "and no control-run fire at all;" in default_rule_text(["P5"], "P10") and CONTROL_FIRES_ALLOWED == 0
    assert f"{p10.name} = validation every {p10.test_freq} steps on all {p10.questions} questions" in comment
    assert f"{p5.name} = every {p5.test_freq} steps on a fixed subset of {p5.questions}" in comment
    assert f"Two rules, both patience 1: {DEFAULT_RULE} (0.3" in comment
    assert f"and {CANDIDATE_RULE} (best - score > k x" in comment
    assert f"Cells: unguarded {RULE_UNGUARDED} in" in comment and "seeds 1-3" in comment
    # the guarded runs stand in for P10's stderr replay, censored at their first restore
    assert "P10's stderr replay uses the guarded P10 runs' records (censored at their first restore)" in comment
    assert f"else its guarded twin {RULE_GUARDED}'s, censored at its first restore" in UNITS_TEXT


# --- the table: the section, and the test_freq a record lacks ----------------------------------


def test_the_report_ends_with_the_verdict_and_a_record_without_test_freq_gets_its_cells(grid):
    lines = [json.dumps({"step": s, "data": {"training/global_step": s, "val-core/a/reward/mean@1": 0.3}})
             for s in range(1, 41) if s % 5 == 0]  # fmt: skip
    trace = parse_records(lines)
    found = [({"regime": r, "algorithm": "grpo", "seed": 1}, trace) for r in ("hot_p5", "hot", "demo")]
    got = {r.regime: r.test_freq for r in rule_rows(grid, found, [])}
    assert got == {"hot_p5": "5", "hot": "10", "demo": "10"}  # the cells' (the twin's own), not the grid's
    # a cell the grid no longer plans: its regime's
    assert rule_rows(grid, [({"regime": "demo_p5", "algorithm": "grpo", "seed": 9}, trace)], [])[0].test_freq == "5"
    text = rule_report(grid, found, [])
    assert "\n### Question 5: the default rule (rule: recipe/sorl/study/natural.yaml, question 5" in text
    assert (
        decision_of(text)
        == "Decision: **sorl.guard.rule stays drop for now (undecided: units missing under P5 and P10)**."
    )
