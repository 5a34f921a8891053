"""Where a CI run's minutes went, from a saved ``bash scripts/test.sh`` log.

    bash scripts/test.sh 2>&1 | tee test.log; python scripts/ci_budget.py test.log   # or: ... < test.log

Prints the seconds of each stage (test.sh's lines ``[test] stage <name>: <seconds> s``: setup .venv,
setup .venv-vllm, ruff, suite, vLLM stage) and their total, pytest's result lines (the counts a
closing note quotes), and the slowest tests of ``--durations``, each test's setup + call + teardown
summed. Exit status 1 when the log has no stage line (not a test.sh log, or one cut short).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

STAGE = re.compile(r"^\[test\] stage (?P<name>.+): (?P<seconds>\d+) s$")
DURATIONS_HEADER = re.compile(r"^=+ slowest (\d+ )?durations =+$")
DURATION = re.compile(r"^(?P<seconds>\d+(\.\d+)?)s (?P<phase>setup|call|teardown)\s+(?P<test>\S.*)$")
#: pytest's last line, "==== 312 passed, 4 skipped, 2 warnings in 2967.12s (0:49:27) ====" (without the "=" under -q)
RESULT = re.compile(
    r"^(=+ )?(?P<summary>\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s( \(\S+\))?)( =+)?$"
)


@dataclass
class Budget:
    """What a test.sh log says about its time: stages in order, pytest's result lines, per-test seconds."""

    stages: list[tuple[str, int]] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    tests: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))

    @property
    def total(self) -> int:
        return sum(seconds for _, seconds in self.stages)

    def slowest(self, n: int) -> list[tuple[str, float, dict[str, float]]]:
        """The ``n`` tests with the most seconds (setup + call + teardown), slowest first."""
        ranked = sorted(self.tests.items(), key=lambda item: (-sum(item[1].values()), item[0]))
        return [(test, sum(phases.values()), phases) for test, phases in ranked[:n]]


def read_budget(lines: Iterable[str]) -> Budget:
    budget = Budget()
    in_durations = False
    for raw in lines:
        line = raw.rstrip("\n")
        if match := STAGE.match(line):
            budget.stages.append((match["name"], int(match["seconds"])))
        elif DURATIONS_HEADER.match(line):
            in_durations = True
        elif in_durations and (match := DURATION.match(line)):
            budget.tests[match["test"]][match["phase"]] = float(match["seconds"])
        elif match := RESULT.match(line):
            budget.results.append(match["summary"])
            in_durations = False
        elif in_durations and line.startswith("="):
            in_durations = False  # the next section (short test summary info)
    return budget


def report(budget: Budget, top: int) -> str:
    width = max([len(name) for name, _ in budget.stages] + [len("total")])
    out = ["stage".ljust(width) + "  seconds"]
    out += [f"{name.ljust(width)}  {seconds:7d}" for name, seconds in budget.stages]
    out.append(f"{'total'.ljust(width)}  {budget.total:7d}")
    if budget.results:
        out += ["", "pytest:", *(f"  {summary}" for summary in budget.results)]
    slowest = budget.slowest(top)
    if slowest:
        out += ["", f"slowest {len(slowest)} tests (setup + call + teardown, s):"]
        for test, seconds, phases in slowest:
            parts = " + ".join(
                f"{phase} {phases[phase]:.1f}" for phase in ("setup", "call", "teardown") if phase in phases
            )
            out.append(f"  {seconds:8.1f}  {test}  ({parts})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", nargs="?", help="a saved `bash scripts/test.sh` log (default: stdin)")
    parser.add_argument("--top", type=int, default=10, help="how many of the slowest tests to print (default 10)")
    args = parser.parse_args(argv)
    if args.log:
        with open(args.log, encoding="utf-8", errors="replace") as f:
            budget = read_budget(f)
    else:
        budget = read_budget(sys.stdin)
    if not budget.stages:
        print(f"[ci_budget] error: no '[test] stage <name>: <seconds> s' line in {args.log or 'stdin'}: "
              "not a log of `bash scripts/test.sh`, or one cut short", file=sys.stderr)  # fmt: skip
        return 1
    print(report(budget, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
