"""The demo stops before Ray when the rollout engine its overrides name is not installed
(sorl_verl/cli/rollout_engine.py, called by scripts/demo.sh before the build and main_ppo)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from pathlib import Path

import pytest

from sorl_verl.cli import rollout_engine
from sorl_verl.cli.rollout_engine import main, missing_engine, requested_engine

ROOT = Path(__file__).resolve().parents[2]
NO_VLLM = importlib.util.find_spec("vllm") is None


def test_requested_engine_is_the_last_override_that_names_it():
    assert requested_engine([]) is None
    assert requested_engine(["data.train_batch_size=4"]) is None
    assert requested_engine(["actor_rollout_ref.rollout.name=vllm"]) == "vllm"
    assert requested_engine(["++actor_rollout_ref.rollout.name='vllm'", "x=1"]) == "vllm"
    assert requested_engine(["actor_rollout_ref.rollout.name=vllm", "+actor_rollout_ref.rollout.name=hf"]) == "hf"
    # another key that ends the same way is not the rollout's name
    assert requested_engine(["critic.actor_rollout_ref.rollout.name=vllm"]) is None


def test_missing_engine_names_the_setup_script_only_when_the_module_is_absent(monkeypatch, capsys):
    overrides = ["actor_rollout_ref.rollout.name=vllm"]
    _, fix = rollout_engine.ENGINES["vllm"]
    monkeypatch.setitem(rollout_engine.ENGINES, "vllm", ("sorl_verl_no_such_module", fix))
    error = missing_engine(overrides)
    assert error is not None and "bash scripts/setup_cpu_vllm.sh" in error and "'sorl_verl_no_such_module'" in error
    assert main(overrides) == 2
    assert capsys.readouterr().err.startswith("[demo] error: actor_rollout_ref.rollout.name=vllm needs")
    monkeypatch.setitem(rollout_engine.ENGINES, "vllm", ("json", fix))  # a module every Python has
    assert missing_engine(overrides) is None and main(overrides) == 0
    # the default engine (hf) and no override need nothing
    assert main(["actor_rollout_ref.rollout.name=hf"]) == 0 and main([]) == 0


@pytest.mark.skipif(not NO_VLLM, reason="vLLM is installed here: the demo would go on to train")
def test_demo_with_vllm_rollout_stops_before_the_build_and_ray(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "SORL_HOME": str(home), "SORL_RUN_DIR": str(tmp_path / "run")}
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", "scripts/demo.sh", "--", "actor_rollout_ref.rollout.name=vllm"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("[demo] error: actor_rollout_ref.rollout.name=vllm needs")
        and "bash scripts/setup_cpu_vllm.sh" in last
    )
    # nothing built, no run directory, main_ppo (and with it Ray) never started
    assert list(home.iterdir()) == [] and not (tmp_path / "run").exists()
    assert "main_ppo" not in proc.stdout
    assert wall < 60, wall  # setup_env.sh's check of an installed .venv and one Python start, not 48 s of verl
