"""demo_paths: shell variables a launch script can eval, and one clear error for an unknown task."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sorl_verl.embedded.demo_paths import TASK_OVERLAYS, EmbeddedTask


def test_shell_lines_survive_eval_with_awkward_paths(tmp_path: Path) -> None:
    odd = tmp_path / "dir with space's $HOME"
    task = EmbeddedTask("medical", "medical_mcq", odd / "train.parquet", odd / "val.parquet", odd / "index", odd / "m")
    script = task.shell_lines() + 'printf "%s\\n" "$TRAIN" "$VAL" "$INDEX" "$MODEL" "$TASK_OVERLAY"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [str(odd / "train.parquet"), str(odd / "val.parquet"), str(odd / "index"), str(odd / "m"),
                   "medical_mcq"]  # fmt: skip


def test_task_overlays_exist_in_the_recipe() -> None:
    config = Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config" / "task"
    assert {name: (config / f"{overlay}.yaml").is_file() for name, overlay in TASK_OVERLAYS.items()} == {
        "qa": True,
        "medical": True,
    }


def test_unknown_task_exits_2_with_one_line_and_nothing_on_stdout() -> None:
    proc = subprocess.run([sys.executable, "-m", "sorl_verl.embedded.demo_paths", "surgery"], capture_output=True,
                          text=True)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["demo_paths: unknown task 'surgery'; choose from ['medical', 'qa']"]
