"""Registration inside a real Ray worker, as the doctor reports it.

The doctor's Ray task starts with ``import verl`` in a fresh worker process and resolves every
registered name through verl's own getters: whatever resolves there was registered by verl's own
plugin loading, not by this test process or the doctor's driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sorl_verl.doctor import RESOLVERS  # stdlib-only at import time: loads neither verl nor the plugin

pytestmark = pytest.mark.slow  # Ray start-up and fresh interpreters: 30-60 s on 2 cores


def run_doctor(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "sorl_verl", "doctor", *args],
        cwd="/",
        env=full_env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_doctor_exits_0_and_every_registered_name_resolves_in_driver_and_ray_worker():
    proc = run_doctor("--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert report["versions"]["verl_supported"] is True
    registered = report["driver"]["registered"]
    assert {"so_grpo", "so_ppo", "turn_ppo", "s_ppo"} <= set(registered["policy_loss"])
    assert {"so_grpo", "so_ppo"} <= set(registered["adv_estimator"])
    assert {"sorl_sync", "sorl_colocate_async", "sorl_separate_async"} <= set(registered["trainer"])
    assert registered["verl_fixes"] == ["verl.trainer.ppo.v1.trainer_separate_async.logger"]
    assert [r for r in registered if r not in RESOLVERS] == [], "every registry the plugin fills has a getter"
    for where in ("driver", "ray_worker"):
        part = report[where]
        assert part["loaded_by_verl"] is True
        assert part["registered"] == registered  # the worker sees exactly what the driver sees
        assert {r: set(n) for r, n in part["resolved"].items()} == {r: set(n) for r, n in registered.items()}
        for registry, names in part["resolved"].items():
            # registries the doctor has a verl getter for must resolve; a registry added later without
            # a getter is reported as unchecked (never as ok)
            expected = "ok" if registry in RESOLVERS else "unchecked"
            assert all(s.startswith(expected) for s in names.values()), (where, registry, names)
    assert report["ray_worker"]["pid"] != report["driver"]["pid"]
    worker = report["ray_worker"]["resolved"]  # the SORL functions themselves, by qualified name
    assert worker["policy_loss"]["so_grpo"] == "ok: sorl_verl.algorithms.losses.compute_policy_loss_so_grpo"
    assert worker["adv_estimator"]["so_ppo"] == "ok: sorl_verl.algorithms.advantages.compute_so_ppo_advantage"
    assert worker["trainer"]["sorl_sync"] == "ok: sorl_verl.trainer.trainers.SORLTrainerSync"


def test_doctor_fails_and_says_why_when_verl_does_not_load_the_plugin():
    proc = run_doctor("--no-ray", VERL_USE_EXTERNAL_PLUGINS="none")
    assert proc.returncode == 1
    assert "did not load sorl_verl.plugin" in proc.stdout
    assert "[ray_worker] skipped" in proc.stdout


def test_console_script_and_module_entry_share_the_doctor_cli():
    script = os.path.join(os.path.dirname(sys.executable), "sorl-verl")
    assert os.path.exists(script), "sorl-verl console script missing: reinstall the package (pip install -e .)"
    proc = subprocess.run([script, "doctor", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--json" in proc.stdout and "--no-ray" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "sorl_verl", "no-such-command"], capture_output=True, text=True)
    assert bad.returncode == 2 and "doctor" in bad.stderr  # usage on stderr for a bad command
