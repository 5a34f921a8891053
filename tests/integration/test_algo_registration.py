"""The SORL losses and estimators land in verl's registries on ``import verl``, idempotently."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

RESOLVE = """
import verl
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
for name in ("turn_ppo", "s_ppo", "so_ppo", "so_grpo", "vanilla_diag"):
    assert get_policy_loss_fn(name).__module__ == "sorl_verl.algorithms.losses", name
for name in ("so_grpo", "so_ppo"):
    assert get_adv_estimator_fn(name).__module__ == "sorl_verl.algorithms.advantages", name
import sorl_verl.plugin as plugin
assert not plugin.ERRORS.get("algorithms"), plugin.ERRORS
print("OK", sorted(plugin.REGISTERED["policy_loss"]), sorted(plugin.REGISTERED["adv_estimator"]))
"""


def run_python(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_plain_import_verl_registers_through_the_entry_point():
    out = run_python(RESOLVE)
    assert "OK ['s_ppo', 'so_grpo', 'so_ppo', 'turn_ppo', 'vanilla_diag'] ['so_grpo', 'so_ppo']" in out


def test_verl_use_external_modules_works_without_entry_points():
    out = run_python(RESOLVE, VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES="sorl_verl.plugin")
    assert out.startswith("OK")


def test_registering_again_and_under_a_second_module_name_does_not_raise():
    from verl.trainer.ppo import core_algos

    import sorl_verl.plugin as plugin

    before = dict(core_algos.ADV_ESTIMATOR_REGISTRY)
    assert plugin._register_algorithms()["adv_estimator"] == ["so_grpo", "so_ppo"]
    spec = importlib.util.spec_from_file_location("sorl_plugin_alias", plugin.__file__)
    alias = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(alias)  # the whole plugin module executed again under another name
    assert "algorithms" not in alias.ERRORS, alias.ERRORS.get("algorithms")
    assert before == core_algos.ADV_ESTIMATOR_REGISTRY


def test_a_foreign_function_under_our_name_is_reported(monkeypatch):
    from verl.trainer.ppo import core_algos

    import sorl_verl.plugin as plugin

    def so_ppo(**kwargs):  # someone else's estimator
        raise AssertionError

    monkeypatch.setitem(core_algos.ADV_ESTIMATOR_REGISTRY, "so_ppo", so_ppo)
    with pytest.raises(ValueError, match="'so_ppo' is already registered to .*test_algo_registration"):
        plugin._register_algorithms()
