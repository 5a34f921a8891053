"""The embedded default of a task, as the paths and task overlay a ``main_ppo`` launch needs.

``embedded_task("qa" | "medical")`` builds the task's embedded default on first use (progress on
stderr) and returns its train/val parquet, BM25 index, ChatML-checked model directory and the
hydra task overlay (``+task=search_qa`` or ``+task=medical_mcq``). For shell scripts::

    eval "$(python -m sorl_verl.embedded.demo_paths medical)"
    # -> TRAIN=... VAL=... INDEX=... MODEL=... TASK_OVERLAY=medical_mcq (only these lines on stdout)

``--warmstart NAME`` picks a named warm-start of the task (``WARM_STARTS`` of
:mod:`~sorl_verl.embedded.qa_build` or :mod:`~sorl_verl.embedded.medical_build`), built under its own root. An unknown task or
warm-start name prints one error line and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

#: task name -> hydra task overlay under recipe/sorl/config/task/
TASK_OVERLAYS = {"qa": "search_qa", "medical": "medical_mcq"}


@dataclass(frozen=True)
class EmbeddedTask:
    """What one task's ``main_ppo`` launch on the embedded default needs."""

    task: str
    overlay: str
    #: one parquet path, or a hydra list ``[a,b]`` of several (``data.train_files``)
    train: Path | str
    val: Path
    index_dir: Path
    model: Path

    def shell_lines(self) -> str:
        """``NAME=value`` lines (shell-quoted) for ``eval``."""
        values = {"TRAIN": self.train, "VAL": self.val, "INDEX": self.index_dir, "MODEL": self.model,
                  "TASK_OVERLAY": self.overlay}  # fmt: skip
        return "".join(f"{k}={shlex.quote(str(v))}\n" for k, v in values.items())


def warmstart_names(task: str) -> list[str]:
    """The named warm-starts of ``task``: ``WARM_STARTS`` of ``qa_build`` or ``medical_build``."""
    from sorl_verl.embedded import medical_build, qa_build

    return sorted((qa_build if task == "qa" else medical_build).WARM_STARTS)


def embedded_task(task: str, progress: bool = True, warmstart: str = "expert") -> EmbeddedTask:
    """Build (first use) or load the embedded default of ``task``; build output goes to stderr.

    ``warmstart``: a name of the task's ``WARM_STARTS`` (:func:`warmstart_names`), built under its own root.
    """
    from sorl_verl.cpu.chatml_alias import chatml_alias

    if task not in TASK_OVERLAYS:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(TASK_OVERLAYS)}")
    if warmstart not in warmstart_names(task):
        raise ValueError(f"unknown warm-start {warmstart!r} of task {task!r}; choose from {warmstart_names(task)}")
    with contextlib.redirect_stdout(sys.stderr):  # only the variables reach stdout
        if task == "qa":
            from sorl_verl.embedded.qa_build import default_root, ensure_embedded_default, warmstart_config

            paths = ensure_embedded_default(default_root(warmstart), config=warmstart_config(warmstart),
                                            progress=progress)  # fmt: skip
        else:
            from sorl_verl.embedded.medical_build import default_root, ensure_embedded_medical, warmstart_config

            paths = ensure_embedded_medical(default_root(warmstart), config=warmstart_config(warmstart),
                                            progress=progress)  # fmt: skip
        model = chatml_alias(paths.model_dir)
    return EmbeddedTask(task, TASK_OVERLAYS[task], train_files(task, warmstart, paths.parquet), paths.parquet["val"],
                        paths.index_dir, model)  # fmt: skip


def train_files(task: str, warmstart: str, parquet: dict[str, Path]) -> Path | str:
    """What a run from ``warmstart`` trains on: the early-stop QA warm-starts (``early-stop*``) on the
    1- and 2-hop questions only, the ones they have demonstrations for (3-hop stays in validation);
    every other warm-start on the whole ``train`` split."""
    if task == "qa" and warmstart.startswith("early-stop"):
        return f"[{parquet['train_1hop']},{parquet['train_2hop']}]"
    return parquet["train"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sorl_verl.embedded.demo_paths",
        description="Print TRAIN/VAL/INDEX/MODEL/TASK_OVERLAY of a task's embedded default (built on first use).",
    )
    parser.add_argument("task", help=f"one of {sorted(TASK_OVERLAYS)}")
    parser.add_argument("--quiet", action="store_true", help="no build progress bars")
    parser.add_argument("--warmstart", default="expert", help="named warm-start of the task (WARM_STARTS): expert, early-stop, ...")
    args = parser.parse_args(argv)
    if args.task not in TASK_OVERLAYS:
        print(f"demo_paths: unknown task {args.task!r}; choose from {sorted(TASK_OVERLAYS)}", file=sys.stderr)
        raise SystemExit(2)
    names = warmstart_names(args.task)
    if args.warmstart not in names:
        print(f"demo_paths: unknown warm-start {args.warmstart!r} of task {args.task!r}; choose from {names}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    sys.stdout.write(embedded_task(args.task, progress=not args.quiet, warmstart=args.warmstart).shell_lines())


if __name__ == "__main__":
    main()
