"""``python -m sorl_verl doctor``: is sorl_verl really registered into verl, here and in a Ray worker?

verl loads plugins inside ``import verl`` and swallows their errors at DEBUG level, so a broken
install looks like "unknown loss mode" deep inside a Ray worker. The doctor imports verl the way
every verl process does, then reports: verl's version against the supported range, torch and its
device, whether verl itself loaded ``sorl_verl.plugin`` (entry point or
``VERL_USE_EXTERNAL_MODULES``), what :data:`sorl_verl.plugin.REGISTERED` holds and
:data:`sorl_verl.plugin.ERRORS`, and whether each registered name resolves through verl's own
getters, in this process and in a fresh Ray worker. Exit status 0 only when everything resolves.

This module imports nothing from verl or sorl_verl at import time, so that a Ray worker that
unpickles :func:`resolve_in_this_process` sees exactly what ``import verl`` registers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

PLUGIN_MODULE = "sorl_verl.plugin"
OK = "ok"


def _resolve_policy_loss(name: str) -> Any:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    return get_policy_loss_fn(name)


def _resolve_adv_estimator(name: str) -> Any:
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    return get_adv_estimator_fn(name)


def _resolve_trainer(name: str) -> Any:
    from verl.trainer.ppo.v1 import get_trainer_cls  # the import TaskRunnerV1 does before its look-up

    return get_trainer_cls(name)


def _resolve_agent_loop(name: str) -> Any:
    from hydra.utils import get_class
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    if name not in _agent_loop_registry:
        raise KeyError(f"{name!r} not in verl's agent-loop registry ({sorted(_agent_loop_registry)})")
    return get_class(_agent_loop_registry[name]["_target_"])


def _resolve_rollout_replica(name: str) -> Any:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return RolloutReplicaRegistry.get(name)


def _resolve_platform(name: str) -> Any:
    from verl.plugin.platform.platform_manager import PlatformRegistry

    cls = PlatformRegistry.get(name)
    if cls is None:
        raise KeyError(f"platform {name!r} not registered ({PlatformRegistry.registered_names()})")
    return cls


def _resolve_omegaconf_resolver(name: str) -> Any:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(name):
        raise KeyError(f"OmegaConf resolver {name!r} not registered")
    return name


def _resolve_engine(name: str) -> Any:
    from verl.workers.engine import EngineRegistry

    model_type, backend = name.split("/", 1)
    return EngineRegistry.get_engine_cls(model_type, backend)  # for this process's device


def _resolve_wrapper(name: str) -> Any:
    """The module attribute ``name`` names, if it carries the mark of a sorl_verl CPU wrapper or verl fix."""
    import importlib

    from sorl_verl.trainer.verl_compat import FIX_MARK

    module_name, attr = name.rsplit(".", 1)
    fn = getattr(importlib.import_module(module_name), attr)
    if not (getattr(fn, "__sorl_cpu_wrapped__", False) or getattr(fn, FIX_MARK, False)):
        raise LookupError(f"{name} is not a sorl_verl CPU wrapper or verl fix")
    return fn


def _resolve_checkpoint_engine(name: str) -> Any:
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    return CheckpointEngineRegistry.get(name)


def _resolve_rollout_adapter(name: str) -> Any:
    from verl.workers.rollout.base import get_rollout_class

    rollout_name, mode = name.split("/", 1)
    return get_rollout_class(rollout_name, mode)


def _resolve_optimizer(name: str) -> Any:
    import torch
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    from sorl_verl.algorithms.optim import UpdateScaledOptimizer

    module_name, cls_name = name.rsplit(".", 1)
    config = FSDPOptimizerConfig(lr=1e-3, optimizer_impl=module_name, optimizer=cls_name)
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(1))], config)  # verl's own builder
    if not isinstance(optimizer, UpdateScaledOptimizer):
        raise LookupError(f"verl built {type(optimizer).__qualname__}, not an update-scaled optimizer")
    return type(optimizer)


#: plugin.REGISTERED key -> the verl getter that must find each name
RESOLVERS: dict[str, Callable[[str], Any]] = {
    "policy_loss": _resolve_policy_loss,
    "optimizer": _resolve_optimizer,
    "adv_estimator": _resolve_adv_estimator,
    "trainer": _resolve_trainer,
    "agent_loop": _resolve_agent_loop,
    "RolloutReplicaRegistry": _resolve_rollout_replica,
    "PlatformRegistry": _resolve_platform,
    "omegaconf_resolver": _resolve_omegaconf_resolver,
    "EngineRegistry": _resolve_engine,
    "cpu_wrappers": _resolve_wrapper,
    "cpu_wrappers_separate_async": _resolve_wrapper,
    "verl_fixes": _resolve_wrapper,
    "CheckpointEngineRegistry": _resolve_checkpoint_engine,
    "rollout_adapters": _resolve_rollout_adapter,
}


def _describe(obj: Any) -> str:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{OK}: {module}.{name}" if module and name else OK


def resolve_in_this_process() -> dict[str, Any]:
    """Import verl as any verl process does and resolve every name the plugin registered.

    Returns ``{"loaded_by_verl", "registered", "errors", "resolved": {registry: {name: status}}}``
    where a status starts with ``ok`` or is the error; registries the doctor has no getter for
    are reported as ``unchecked``.
    """
    already = PLUGIN_MODULE in sys.modules
    import verl  # noqa: F401 - loads plugins: the entry point or VERL_USE_EXTERNAL_MODULES

    loaded_by_verl = already or PLUGIN_MODULE in sys.modules
    report: dict[str, Any] = {"pid": os.getpid(), "loaded_by_verl": loaded_by_verl}
    try:
        import importlib

        plugin = importlib.import_module(PLUGIN_MODULE)
    except Exception:  # noqa: BLE001 - the reason verl swallowed
        report.update(registered={}, errors={"import": traceback.format_exc()}, resolved={})
        return report

    errors = dict(plugin.ERRORS)
    resolved: dict[str, dict[str, str]] = {}
    for registry, names in plugin.REGISTERED.items():
        resolver = RESOLVERS.get(registry)
        resolved[registry] = {}
        for name in names:
            if resolver is None:
                resolved[registry][name] = "unchecked: the doctor has no getter for this registry"
                continue
            try:
                resolved[registry][name] = _describe(resolver(name))
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                resolved[registry][name] = f"missing: {type(exc).__name__}: {exc}"
    errors.update(plugin.ERRORS)  # deferred registrations may have failed while resolving above
    report.update(registered={k: list(v) for k, v in plugin.REGISTERED.items()}, errors=errors, resolved=resolved)
    return report


def resolve_in_ray_worker(timeout_s: float = 300.0) -> dict[str, Any]:
    """Run :func:`resolve_in_this_process` as a task in a fresh Ray worker (``ray.init(num_cpus=1)``)."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        return ray.get(ray.remote(num_cpus=1)(resolve_in_this_process).remote(), timeout=timeout_s)
    finally:
        if started_here:
            ray.shutdown()


def _versions() -> dict[str, Any]:
    import torch

    from sorl_verl import __version__
    from sorl_verl.trainer.verl_compat import SUPPORTED_VERL_RANGE, installed_verl_version, verl_version_supported

    verl_version = installed_verl_version()
    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.device_count()}x {torch.cuda.get_device_name(0)})"
    else:
        device = "cpu (no CUDA device visible)"
    return {
        "sorl_verl": __version__,
        "python": sys.version.split()[0],
        "verl": verl_version,
        "verl_supported_range": SUPPORTED_VERL_RANGE,
        "verl_supported": verl_version_supported(verl_version),
        "torch": torch.__version__,
        "torch_device": device,
    }


def _problems(report: dict[str, Any]) -> list[str]:
    problems = []
    if not report["versions"]["verl_supported"]:
        problems.append(f"verl {report['versions']['verl']} is outside {report['versions']['verl_supported_range']}")
    for where in ("driver", "ray_worker"):
        part = report.get(where)
        if part is None or "skipped" in part:
            continue
        if "failed" in part:
            problems.append(f"{where}: {part['failed'].strip().splitlines()[-1]}")
            continue
        if not part["loaded_by_verl"]:
            problems.append(
                f"{where}: `import verl` did not load {PLUGIN_MODULE} (is sorl-verl pip-installed in this "
                "environment, or is VERL_USE_EXTERNAL_PLUGINS excluding it? "
                f"VERL_USE_EXTERNAL_MODULES={PLUGIN_MODULE} also works)"
            )
        for section, tb in part["errors"].items():
            problems.append(f"{where}: registering {section} failed: {tb.strip().splitlines()[-1]}")
        if not part["registered"] and not part["errors"]:
            problems.append(f"{where}: nothing registered")
        for registry, names in part["resolved"].items():
            for name, status in names.items():
                if status.startswith("missing"):
                    problems.append(f"{where}: {registry} {name!r} {status}")
    return problems


def run_doctor(ray_check: bool = True) -> dict[str, Any]:
    """Collect the whole report; ``report["ok"]`` is False when anything is missing."""
    driver = resolve_in_this_process()
    report: dict[str, Any] = {"versions": _versions(), "driver": driver}
    if ray_check:
        try:
            report["ray_worker"] = resolve_in_ray_worker()
        except Exception:  # noqa: BLE001 - reported as a problem
            report["ray_worker"] = {"failed": traceback.format_exc()}
    else:
        report["ray_worker"] = {"skipped": "--no-ray"}
    report["problems"] = _problems(report)
    report["ok"] = not report["problems"]
    return report


def format_report(report: dict[str, Any]) -> str:
    """Human-readable report."""
    v = report["versions"]
    lines = [
        f"sorl_verl {v['sorl_verl']}  python {v['python']}",
        f"verl      {v['verl']}  (supported {v['verl_supported_range']}: {'yes' if v['verl_supported'] else 'NO'})",
        f"torch     {v['torch']}  device {v['torch_device']}",
    ]
    for where in ("driver", "ray_worker"):
        part = report[where]
        lines.append("")
        if "skipped" in part or "failed" in part:
            lines.append(f"[{where}] {'skipped' if 'skipped' in part else 'FAILED'}: {part.get('skipped') or part['failed']}")
            continue
        lines.append(f"[{where}] pid {part['pid']}  plugin loaded by `import verl`: {part['loaded_by_verl']}")
        for registry, names in part["resolved"].items():
            for name, status in names.items():
                lines.append(f"  {registry:<24} {name:<22} {status}")
        for section, tb in part["errors"].items():
            lines.append(f"  ERROR registering {section}:\n{tb}")
    lines.append("")
    if report["ok"]:
        lines.append("OK: every registered name resolves")
    else:
        lines.append("PROBLEMS:")
        lines.extend(f"  - {p}" for p in report["problems"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sorl-verl doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray worker check")
    args = parser.parse_args(argv)
    report = run_doctor(ray_check=not args.no_ray)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["ok"] else 1
