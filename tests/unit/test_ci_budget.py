"""scripts/ci_budget.py reads a saved ``bash scripts/test.sh`` log: seconds per stage, pytest's
result lines and the slowest tests (each test's phases summed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ci_budget.py"
_spec = importlib.util.spec_from_file_location("ci_budget", SCRIPT)
ci_budget = sys.modules["ci_budget"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ci_budget)

#: a test.sh log cut down to the lines that matter, in the formats test.sh and pytest 8 print them
LOG = """\
[setup] .venv -> /root/.cache/sorl_verl/venvs/test-0123456789abcdef (cached: same pyproject, ...)
[test] stage setup .venv: 9 s
[test] .venv-vllm ready in 14 s
[test] stage setup .venv-vllm: 14 s
All checks passed!
[test] stage ruff: 3 s
============================= test session starts ==============================
........s..........F                                                     [100%]
============================= slowest 25 durations =============================
343.21s setup    tests/e2e/test_e2e_cpu_guard.py::test_guard_restores_best_checkpoint_and_survives_kill_and_resume
305.02s call     tests/integration/test_recipe_val_only_cpu.py::test_recipe_val_only_cpu
12.50s call     tests/e2e/test_e2e_cpu_guard.py::test_guard_restores_best_checkpoint_and_survives_kill_and_resume
0.75s teardown tests/e2e/test_e2e_cpu_guard.py::test_guard_restores_best_checkpoint_and_survives_kill_and_resume
20.00s setup    tests/unit/test_a.py::test_b[x-1]
(3 durations < 0.005s hidden.  Use -vv to show these durations.)
=========================== short test summary info ============================
FAILED tests/unit/test_a.py::test_c - assert 1 == 2
============ 1 failed, 17 passed, 1 skipped in 2967.12s (0:49:27) =============
[test] verl's vLLM rollout in .venv-vllm: tests/e2e/test_e2e_cpu_vllm.py
1 passed in 194.05s (0:03:14)
[test] stage suite: 2968 s
[test] stage vLLM stage: 196 s
"""


def test_stages_results_and_slowest_tests_of_a_log():
    budget = ci_budget.read_budget(LOG.splitlines(keepends=True))
    assert budget.stages == [
        ("setup .venv", 9), ("setup .venv-vllm", 14), ("ruff", 3), ("suite", 2968), ("vLLM stage", 196),
    ]  # fmt: skip
    assert budget.total == 9 + 14 + 3 + 2968 + 196
    assert budget.results == ["1 failed, 17 passed, 1 skipped in 2967.12s (0:49:27)", "1 passed in 194.05s (0:03:14)"]
    guard = "tests/e2e/test_e2e_cpu_guard.py::test_guard_restores_best_checkpoint_and_survives_kill_and_resume"
    (first, seconds, phases), *rest = budget.slowest(2)
    assert first == guard and phases == {"setup": 343.21, "call": 12.50, "teardown": 0.75}
    assert seconds == sum(phases.values())
    assert [test for test, _, _ in rest] == ["tests/integration/test_recipe_val_only_cpu.py::test_recipe_val_only_cpu"]
    assert [test for test, _, _ in budget.slowest(10)][-1] == "tests/unit/test_a.py::test_b[x-1]"  # the 3 tests


def test_the_script_prints_the_budget_from_a_path_or_stdin(tmp_path):
    log = tmp_path / "test.log"
    log.write_text(LOG)
    from_path = subprocess.run([sys.executable, str(SCRIPT), str(log), "--top", "1"], capture_output=True, text=True)
    from_stdin = subprocess.run([sys.executable, str(SCRIPT), "--top", "1"], input=LOG, capture_output=True, text=True)
    assert from_path.returncode == 0 and from_path.stdout == from_stdin.stdout
    lines = from_path.stdout.splitlines()
    assert lines[:7] == [  # the stage names padded to the longest, the seconds right-aligned in 7 columns
        "stage             seconds",
        "setup .venv             9",
        "setup .venv-vllm       14",
        "ruff                    3",
        "suite                2968",
        "vLLM stage            196",
        "total                3190",
    ]
    assert "  1 failed, 17 passed, 1 skipped in 2967.12s (0:49:27)" in lines
    assert lines[-2:] == [
        "slowest 1 tests (setup + call + teardown, s):",
        "     356.5  tests/e2e/test_e2e_cpu_guard.py::test_guard_restores_best_checkpoint_and_survives_kill_and_resume"
        "  (setup 343.2 + call 12.5 + teardown 0.8)",
    ]


def test_a_log_without_stage_lines_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT)], input="pytest output only\n", capture_output=True, text=True)
    assert proc.returncode == 1 and "no '[test] stage <name>: <seconds> s' line in stdin" in proc.stderr
