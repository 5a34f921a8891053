"""How sorl_verl gets into verl: entry point, VERL_USE_EXTERNAL_MODULES, re-imports.

Each loading path runs in a fresh interpreter (verl loads plugins inside ``import verl``), all
started at once to save wall time. The re-import tests run in this process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys
import verl
out = {"plugin_loaded": "sorl_verl.plugin" in sys.modules, "v1_imported": "verl.trainer.ppo.v1" in sys.modules}
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
def name_of(get, name):
    try:
        fn = get(name)
        return fn.__module__ + "." + fn.__qualname__
    except Exception as exc:
        return "missing: " + type(exc).__name__
out["policy_loss"] = name_of(get_policy_loss_fn, "so_grpo")
out["adv_estimator"] = name_of(get_adv_estimator_fn, "so_ppo")
from verl.trainer.ppo.v1 import get_trainer_cls
out["trainer"] = name_of(get_trainer_cls, "sorl_sync")
print("PROBE" + json.dumps(out))
"""

ENVS = {
    "entry_point": {},
    "named_entry_point": {"VERL_USE_EXTERNAL_PLUGINS": "sorl_verl"},
    "external_modules": {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "sorl_verl.plugin"},
    "disabled": {"VERL_USE_EXTERNAL_PLUGINS": "none"},
}


LATE_PLUGIN_PROBE = r"""
import json
import verl.trainer.ppo.v1  # verl's trainers first, plugins off
import sorl_verl.plugin  # then the plugin: registers at once instead of waiting for the import
from verl.trainer.ppo.v1 import get_trainer_cls
print("PROBE" + json.dumps({"trainer": get_trainer_cls("sorl_sync").__name__, "errors": sorted(sorl_verl.plugin.ERRORS)}))
"""


CPU_PLATFORM_FIRST_PROBE = """
import json
import sorl_verl.cpu.platform  # the first import of verl (the package imports it), which loads the plugin
import sorl_verl.plugin as plugin
from verl.plugin.platform import PlatformRegistry
print("PROBE" + json.dumps({"errors": sorted(plugin.ERRORS),
                            "platform": PlatformRegistry.get("cpu").__name__,
                            "cpu_wrappers": len(plugin.REGISTERED.get("cpu_wrappers", []))}))
"""


LOSSES_FIRST_PROBE = """
import json
import sorl_verl.algorithms.losses  # before verl: the package imports verl, which loads the plugin
import sorl_verl.plugin as plugin
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
print("PROBE" + json.dumps({"errors": sorted(plugin.ERRORS),
                            "policy_loss": get_policy_loss_fn("so_grpo").__qualname__,
                            "adv_estimator": get_adv_estimator_fn("so_grpo").__qualname__}))
"""


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    """Every probe in its own fresh interpreter, all started at once; label -> the probe's JSON."""
    # no inherited plugin switches, and no VERL_PLATFORM (tests/conftest.py sets cpu on a machine without
    # CUDA): a probe that needs the CPU platform says so, and with plugins off verl cannot know it
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL") and k != "VERL_PLATFORM"}
    runs = {"late_plugin": (LATE_PLUGIN_PROBE, {"VERL_USE_EXTERNAL_PLUGINS": "none"}),
            "cpu_platform_first": (CPU_PLATFORM_FIRST_PROBE, {"VERL_PLATFORM": "cpu"}),
            "losses_first": (LOSSES_FIRST_PROBE, {}),
            **{label: (PROBE, extra) for label, extra in ENVS.items()}}  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = {
        label: subprocess.Popen([sys.executable, "-c", code], cwd="/", env={**clean, **extra}, **pipes)
        for label, (code, extra) in runs.items()
    }
    results = {}
    for label, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{label}: {stderr[-3000:]}"
        line = next(line for line in stdout.splitlines() if line.startswith("PROBE"))
        results[label] = json.loads(line[len("PROBE") :])
    return results


@pytest.mark.slow  # seven fresh interpreters importing verl: ~20 s idle, minutes on a loaded machine
@pytest.mark.parametrize("label", ["entry_point", "named_entry_point", "external_modules"])
def test_every_loading_path_registers_losses_estimators_and_trainers(probes, label):
    got = probes[label]
    assert got["plugin_loaded"] is True
    assert got["policy_loss"] == "sorl_verl.algorithms.losses.compute_policy_loss_so_grpo"
    assert got["adv_estimator"] == "sorl_verl.algorithms.advantages.compute_so_ppo_advantage"
    assert got["trainer"] == "sorl_verl.trainer.trainers.SORLTrainerSync"


@pytest.mark.slow
def test_import_verl_does_not_pay_for_verl_v1_trainers(probes):
    # the trainers register when verl.trainer.ppo.v1 is imported, not inside `import verl`
    assert probes["entry_point"]["v1_imported"] is False


@pytest.mark.slow
def test_plugin_imported_after_verl_trainers_registers_them_at_once(probes):
    assert probes["late_plugin"] == {"trainer": "SORLTrainerSync", "errors": []}


@pytest.mark.slow
def test_without_any_loading_path_nothing_is_registered(probes):
    got = probes["disabled"]
    assert got["plugin_loaded"] is False
    assert got["policy_loss"].startswith("missing")
    assert got["adv_estimator"].startswith("missing")
    assert got["trainer"].startswith("missing")


def load_copy(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_plugin_imported_again_under_another_name_raises_nothing_and_changes_nothing():
    import verl  # noqa: F401
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
    from verl.trainer.ppo.v1 import get_trainer_cls

    from sorl_verl import plugin

    before = (get_policy_loss_fn("so_grpo"), get_adv_estimator_fn("so_ppo"), get_trainer_cls("sorl_sync"))
    copy = load_copy(REPO / "sorl_verl" / "plugin.py", "sorl_plugin_second_copy")
    assert copy.ERRORS == {}, copy.ERRORS
    assert copy.REGISTERED == plugin.REGISTERED
    assert {"sorl_sync", "sorl_colocate_async", "sorl_separate_async"} <= set(copy.REGISTERED["trainer"])
    assert (get_policy_loss_fn("so_grpo"), get_adv_estimator_fn("so_ppo"), get_trainer_cls("sorl_sync")) == before
    assert plugin.register_all() == plugin.REGISTERED and plugin.ERRORS == {}


def test_trainer_module_loaded_under_another_name_is_recognised_but_a_foreign_class_is_not(monkeypatch):
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from sorl_verl.plugin import register_trainers

    copy = load_copy(REPO / "sorl_verl" / "trainer" / "trainers.py", "sorl_trainers_second_copy")
    assert copy.SORLTrainerSync is not trainer_base.get_trainer_cls("sorl_sync")
    monkeypatch.setitem(trainer_base.TRAINER_REGISTRY, "sorl_sync", copy.SORLTrainerSync)
    with pytest.raises(ValueError, match="already registered"):  # what verl itself would do
        trainer_base.register_trainer("sorl_sync")(sys.modules["sorl_verl.trainer.trainers"].SORLTrainerSync)
    assert register_trainers() == ["sorl_sync", "sorl_colocate_async", "sorl_separate_async"]
    assert trainer_base.TRAINER_REGISTRY["sorl_sync"] is copy.SORLTrainerSync

    class Foreign(PPOTrainerSync):
        pass

    monkeypatch.setitem(trainer_base.TRAINER_REGISTRY, "sorl_sync", Foreign)
    with pytest.raises(ValueError, match="not a SORL trainer"):
        register_trainers()


def test_unsupported_verl_version_is_refused_with_the_range_and_the_override(monkeypatch):
    from sorl_verl.trainer.verl_compat import SKIP_CHECK_ENV, check_verl_version, verl_version_supported

    monkeypatch.delenv(SKIP_CHECK_ENV, raising=False)
    assert verl_version_supported("0.9.1") and verl_version_supported("0.9.7")
    assert not verl_version_supported("0.10.0") and not verl_version_supported("0.9.0")
    with pytest.raises(RuntimeError, match=r"<0\.10.*SORL_VERL_SKIP_VERSION_CHECK"):
        check_verl_version("0.10.0")
    monkeypatch.setenv(SKIP_CHECK_ENV, "1")
    assert check_verl_version("0.10.0") == "0.10.0"


def test_runtime_verl_range_matches_the_pyproject_pin():
    from packaging.requirements import Requirement

    from sorl_verl.trainer.verl_compat import SUPPORTED_VERL

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (verl_req,) = [Requirement(d) for d in deps if Requirement(d).name == "verl"]
    assert verl_req.specifier == SUPPORTED_VERL


@pytest.mark.slow
@pytest.mark.slow
def test_losses_imported_before_verl_are_still_registered(probes):
    # without the package's verl-first import the plugin found the losses module half-defined
    assert probes["losses_first"] == {
        "errors": [], "policy_loss": "compute_policy_loss_so_grpo", "adv_estimator": "compute_so_grpo_outcome_advantage"
    }  # fmt: skip


def test_cpu_platform_imported_before_verl_still_registers_the_cpu_section(probes):
    """The plugin's CPU section once failed with a circular ImportError (and nothing of it was
    registered) whenever ``sorl_verl.cpu.platform`` was the first module to import verl. 5 wrappers: the
    list test_cpu_platform.py pins."""
    assert probes["cpu_platform_first"] == {"errors": [], "platform": "PlatformCPU", "cpu_wrappers": 5}
