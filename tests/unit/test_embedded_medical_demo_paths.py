"""demo_paths: shell variables a launch script can eval, and one clear error for an unknown task."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_unknown_warmstart_exits_2_before_building_anything(tmp_path: Path) -> None:
    """A misspelled warm-start (or one the medical task lacks) is refused before any build step."""
    import os

    env = {**os.environ, "SORL_HOME": str(tmp_path)}
    for task, name, names in (("qa", "earlystop", "['early-stop', 'early-stop-50', 'expert']"), ("medical", "earlystop", "['early-stop', 'expert']")):
        proc = subprocess.run([sys.executable, "-m", "sorl_verl.embedded.demo_paths", task, "--warmstart", name],
                              capture_output=True, text=True, env=env)  # fmt: skip
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.strip().splitlines() == [
            f"demo_paths: unknown warm-start {name!r} of task {task!r}; choose from {names}"
        ]
    assert list(tmp_path.iterdir()) == [], "nothing was built"


def test_named_warmstarts_build_under_their_own_root(tmp_path: Path, monkeypatch) -> None:
    from sorl_verl.embedded.qa_build import WARM_STARTS, default_root, warmstart_config

    monkeypatch.setenv("SORL_HOME", str(tmp_path))
    assert default_root("expert") == default_root() and default_root("expert").name == "embedded"
    assert default_root("early-stop").name == "embedded-early-stop"
    assert warmstart_config("expert").early_stop_rate == 0.0
    assert warmstart_config("early-stop").early_stop_rate == WARM_STARTS["early-stop"] == 0.6
    assert default_root("early-stop-50").name == "embedded-early-stop-50"
    assert warmstart_config("early-stop-50").early_stop_rate == 0.5
    with pytest.raises(ValueError, match="unknown warm-start"):
        default_root("greedy")


def test_medical_named_warmstarts_build_under_their_own_root(tmp_path: Path, monkeypatch) -> None:
    from dataclasses import replace

    from sorl_verl.embedded.medical_build import (
        MEDICAL_SFT_STEPS,
        WARM_STARTS,
        MedicalEmbeddedConfig,
        default_root,
        warmstart_config,
    )

    monkeypatch.setenv("SORL_HOME", str(tmp_path))
    assert default_root("expert") == default_root() == tmp_path / "embedded_medical"
    assert default_root("early-stop") == tmp_path / "embedded_medical-early-stop"
    assert warmstart_config("expert") == MedicalEmbeddedConfig(), "the expert warm-start is the default build"
    early = warmstart_config("early-stop")
    assert early.early_stop_rate == WARM_STARTS["early-stop"] == 0.6
    # both train past the CPU-dependent point where the copy skill appears (600 steps were short of it on AVX2)
    assert early.sft.steps == MedicalEmbeddedConfig().sft.steps == MEDICAL_SFT_STEPS == 1000
    assert replace(early, early_stop_rate=0.0) == MedicalEmbeddedConfig(), "nothing else differs"
    with pytest.raises(ValueError, match="unknown warm-start 'greedy'"):
        warmstart_config("greedy")
    with pytest.raises(ValueError, match=r"early_stop_rate must be in \[0, 1\]"):
        MedicalEmbeddedConfig(early_stop_rate=1.5)
