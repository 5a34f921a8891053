"""The ``sorl-verl`` command: its subcommands and their dispatch (``sorl-verl <command>``, or
``python -m sorl_verl <command>``).

Each command hands its arguments to a module's ``main(argv)`` (imported only when that command
runs, so ``sorl-verl doctor`` never imports matplotlib or the study); the module's own
``python -m`` form keeps working. ``sorl-verl <command> --help`` shows the command's options.
The commands that belong to no other subpackage live here: ``eval`` (EM/F1 tables from verl
validation metrics, generations, or a slow HF fallback), ``plot`` (training-health curves),
``demo`` (the CPU main job of a source checkout), ``build`` (the embedded QA default), ``summary``
(a run's progress lines and start/end table from verl's metrics file) and ``recipe-plan`` (what
``recipe/sorl/common.sh`` runs: the GPU recipe's checks, GPU plan, run directory and ``main_ppo``
command).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """A subcommand: ``target`` is ``module:function`` taking ``argv`` and returning an exit code
    (``None`` counts as 0)."""

    name: str
    target: str
    summary: str


COMMANDS: tuple[Command, ...] = (
    Command(
        "doctor", "sorl_verl.doctor:main", "check that sorl_verl is registered into verl (here and in a Ray worker)"
    ),
    Command(
        "build-index", "sorl_verl.retrieval.build:main", "build a BM25 or dense (e5) index from a JSON-lines corpus"
    ),
    Command("serve", "sorl_verl.retrieval.server:main", "serve an index over Search-R1's POST /retrieve API"),
    Command("convert", "sorl_verl.data.convert:main", "convert downloaded QA / MCQ files into verl parquet"),
    Command("eval", "sorl_verl.cli.eval:main", "EM/F1 tables (best and last step) from verl validation metrics"),
    Command("plot", "sorl_verl.cli.plot:main", "training-health curves of one or more runs"),
    Command("demo", "sorl_verl.cli.demo:main", "the CPU main job (scripts/demo.sh of a source checkout)"),
    Command(
        "build",
        "sorl_verl.cli.build:main",
        "build (or reuse) the embedded QA default: world, index, warm-started model",
    ),
    Command(
        "summary", "sorl_verl.cli.summary:main", "a run's progress lines (follow) or start/end table and plot (summary)"
    ),
    Command(
        "recipe-plan",
        "sorl_verl.cli.recipe_plan:main",
        "recipe/sorl/run_*.sh's planner: checks, GPU plan, run dir and main_ppo command from the environment",
    ),
    Command("study", "sorl_verl.study.cli:main", "the stability study: grid of runs, collapse rule, aggregation"),
)
BY_NAME = {command.name: command for command in COMMANDS}


def usage() -> str:
    width = max(len(c.name) for c in COMMANDS)
    lines = ["usage: sorl-verl <command> [options]   (sorl-verl <command> --help)", "", "commands:"]
    lines += [f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS]
    return "\n".join(lines)


def resolve(command: Command):
    """The command's ``main`` function, imported now; a missing module is an ImportError naming it."""
    module_name, _, function = command.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ImportError(f"`sorl-verl {command.name}` needs {module_name}, which this install lacks") from exc
        raise
    return getattr(module, function)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command = BY_NAME.get(argv[0])
    if command is None:
        print(f"sorl-verl: error: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        entry = resolve(command)
    except ImportError as exc:
        print(f"sorl-verl: error: {exc}", file=sys.stderr)
        return 2
    sys.argv[0] = f"sorl-verl {command.name}"
    result = entry(argv[1:])
    return 0 if result is None else int(result)
