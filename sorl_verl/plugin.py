"""The one place where sorl_verl registers itself into verl.

verl imports this module through the ``verl.plugins`` entry point (or
``VERL_USE_EXTERNAL_MODULES=sorl_verl.plugin``) in every process that imports verl:
the driver, the TaskRunner and every Ray worker. Registration is idempotent: importing
this module twice, or under two module names, re-registers nothing and raises nothing.

verl swallows plugin import errors at DEBUG level, so each section below records its
own failure in :data:`ERRORS` and logs it at WARNING; ``python -m sorl_verl doctor``
reports both :data:`REGISTERED` and :data:`ERRORS`.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

logger = logging.getLogger("sorl_verl.plugin")

#: registry name -> names this plugin registered into it
REGISTERED: dict[str, list[str]] = {}
#: section name -> formatted traceback of a failed registration
ERRORS: dict[str, str] = {}
#: sections put off because a module they import was itself importing verl (:func:`register_deferred`)
DEFERRED: list[str] = []


def _section(name: str, fn: Callable[[], dict[str, list[str]]]) -> None:
    try:
        for registry, names in fn().items():
            REGISTERED.setdefault(registry, [])
            REGISTERED[registry].extend(n for n in names if n not in REGISTERED[registry])
        ERRORS.pop(name, None)
    except Exception:  # noqa: BLE001 - made visible instead of verl's DEBUG-level swallow
        ERRORS[name] = traceback.format_exc()
        logger.warning("sorl_verl: registering %s failed:\n%s", name, ERRORS[name])


def register_all() -> dict[str, list[str]]:
    """Register every SORL component into verl; safe to call any number of times."""
    _section("algorithms", _register_algorithms)
    _section("optimizer", _register_optimizer)
    _section("trainers", _register_trainers)
    _section("agent", _register_agent)
    _section("cpu", _register_cpu)
    _section("checkpoint_engine", _register_checkpoint_engine)
    return REGISTERED


# --- algorithms: policy losses and advantage estimators -------------------------------


def _register_algorithms() -> dict[str, list[str]]:
    """Register ``POLICY_LOSSES`` (the 4 SORL losses and ``vanilla_diag``) and the 2 estimators into
    verl's registries, idempotently.

    An entry already holding the same function (or one with the same ``__module__`` and
    ``__qualname__``, as after a re-import under another module name) is left as it is; a
    foreign function under one of our names raises, naming both.
    """
    from verl.trainer.ppo import core_algos

    from sorl_verl.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from sorl_verl.algorithms.losses import POLICY_LOSSES

    def same_function(a: object, b: object) -> bool:
        key = ("__module__", "__qualname__")
        return a is b or all(getattr(a, k, None) == getattr(b, k, None) for k in key)

    def register(registry: dict, decorator: Callable, kind: str, functions: dict[str, Callable]) -> list[str]:
        for name, fn in functions.items():
            existing = registry.get(name)
            if existing is None:
                decorator(name)(fn)
            elif not same_function(existing, fn):
                raise ValueError(
                    f"verl {kind} {name!r} is already registered to {existing.__module__}.{existing.__qualname__}; "
                    f"sorl_verl would register {fn.__module__}.{fn.__qualname__}. Remove the other plugin or rename."
                )
        return list(functions)

    return {
        "policy_loss": register(
            core_algos.POLICY_LOSS_REGISTRY, core_algos.register_policy_loss, "policy loss", POLICY_LOSSES
        ),
        "adv_estimator": register(
            core_algos.ADV_ESTIMATOR_REGISTRY, core_algos.register_adv_est, "advantage estimator", ADVANTAGE_ESTIMATORS
        ),
    }


# --- optimizer: the plug point of update-level normalization ---------------------------


def _register_optimizer() -> dict[str, list[str]]:
    """The update-scaled optimizers verl builds from ``optim.optimizer_impl`` + ``optim.optimizer``.

    verl has no optimizer registry: its ``build_optimizer`` imports the module and takes the class
    by name, so nothing is written into verl here; the names are listed for the doctor. Also
    torch's global optimizer-step hooks that give verl's own optimizers the same update-scaled
    step (``optim.install_step_hooks``: ``loss_mode=so_grpo`` on verl's stock config).
    """
    from sorl_verl.algorithms import optim

    optim.install_step_hooks()
    return {"optimizer": [f"{optim.__name__}.{name}" for name in ("AdamW", "Adam", "SGD")],
            "optimizer_step_hooks": [f"{optim.__name__}.install_step_hooks"]}  # fmt: skip


# --- trainers: the hook that hands critic values to the turn-level GAE ------------------


def _register_trainers() -> dict[str, list[str]]:
    """``sorl_sync`` / ``sorl_colocate_async`` / ``sorl_separate_async`` into verl's TRAINER_REGISTRY.

    Deferred until ``verl.trainer.ppo.v1`` is imported (TaskRunnerV1 does so before its look-up);
    a deferred failure lands in ``ERRORS["trainers"]``. Also the OmegaConf resolver
    ``sorl_critic_enable`` that ``sorl_trainer.yaml`` uses to turn the critic on for so_ppo, and the
    fixes of verl bugs on the trainers' path (``trainer.verl_compat.apply_verl_fixes``, every platform).
    """
    from sorl_verl.trainer.config_resolvers import register_resolvers
    from sorl_verl.trainer.registration import install_trainer_registration
    from sorl_verl.trainer.verl_compat import apply_verl_fixes

    def record(tb: str) -> None:
        ERRORS["trainers"] = tb

    return {"omegaconf_resolver": register_resolvers(), "trainer": install_trainer_registration(on_error=record),
            "verl_fixes": apply_verl_fixes()}  # fmt: skip


# --- agent: search_r1 agent loop ---------------------------------------------------------


def _register_agent() -> dict[str, list[str]]:
    """Put ``search_r1`` (an FQN ``_target_``) into verl's agent-loop registry.

    verl's registry lives in a heavy module (``verl.experimental.agent_loop.agent_loop``, ~10 s
    to import); when it is not imported yet, a one-shot import hook adds the entry right after
    it loads, so importing verl stays cheap and every process that runs agent loops sees it.
    """
    from sorl_verl.agent import AGENT_LOOP_NAME, AGENT_LOOP_TARGET

    def install(module: object) -> None:
        module._agent_loop_registry[AGENT_LOOP_NAME] = {"_target_": AGENT_LOOP_TARGET}  # type: ignore[attr-defined]

    _after_import("verl.experimental.agent_loop.agent_loop", "_agent_loop_registry", install, hook="agent_loop")
    return {"agent_loop": [AGENT_LOOP_NAME]}


def _after_import(module_name: str, ready_attr: str, install: Callable[[object], None], hook: str) -> None:
    """Call ``install(module)`` now if ``module_name`` is loaded (has ``ready_attr``), else right after it loads.

    The deferred path is a one-shot ``sys.meta_path`` finder tagged ``hook`` (installed once per
    process, whatever the number of re-imports of this plugin).
    """
    import importlib.abc
    import importlib.machinery
    import sys

    module = sys.modules.get(module_name)
    if module is not None and hasattr(module, ready_attr):
        install(module)
        return

    class _RegisterAfterImport(importlib.abc.MetaPathFinder):
        sorl_verl_hook = hook

        def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - importlib protocol
            if fullname != module_name:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return None
            exec_module = spec.loader.exec_module

            def exec_then_register(mod: object) -> None:
                exec_module(mod)
                install(mod)

            spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
            return spec

    if not any(getattr(f, "sorl_verl_hook", None) == hook for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


# --- cpu: platform and rollout replica for machines without an accelerator ---------------


def register_deferred() -> dict[str, list[str]]:
    """Run the sections put off while a module they need was half-imported; safe to call any time."""
    sections = {"cpu": _register_cpu}
    while DEFERRED:
        name = DEFERRED.pop(0)
        _section(name, sections[name])
    return REGISTERED


def _register_cpu() -> dict[str, list[str]]:
    """CPU platform and ``hf`` replica always; FSDP engines for ``cpu`` and verl wrappers only on CPU.

    When ``sorl_verl.cpu.platform`` is imported before verl, its own ``import verl`` loads this plugin
    while the module is half-defined: the section is then put off, and that module calls
    :func:`register_deferred` once it is complete.
    """
    import sys

    platform = sys.modules.get("sorl_verl.cpu.platform")
    if platform is not None and not hasattr(platform, "register_cpu_platform"):
        if "cpu" not in DEFERRED:
            DEFERRED.append("cpu")
        return {}
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from sorl_verl.cpu.platform import cpu_platform_selected, register_cpu_platform

    def _load_hf():  # imported lazily: only a run with rollout.name=hf pays for it
        from sorl_verl.cpu.hf_rollout import HFReplica

        return HFReplica

    RolloutReplicaRegistry.register("hf", _load_hf)
    # verl's (name, mode) -> in-worker adapter table has no register function; it is a plain dict
    rollout_base._ROLLOUT_REGISTRY[("hf", "async")] = "sorl_verl.cpu.hf_rollout.HFServerAdapter"
    registered = {
        "PlatformRegistry": register_cpu_platform(),
        "RolloutReplicaRegistry": ["hf"],
        "rollout_adapters": ["hf/async"],
    }
    if cpu_platform_selected():  # never on a machine with an accelerator unless VERL_PLATFORM=cpu
        from sorl_verl.cpu.engines import register_cpu_engines
        from sorl_verl.cpu.verl_compat import apply_cpu_wrappers, apply_separate_async_wrappers

        registered["cpu_wrappers"] = apply_cpu_wrappers()
        registered["cpu_wrappers_separate_async"] = apply_separate_async_wrappers()
        registered["EngineRegistry"] = register_cpu_engines()
    return registered


# --- checkpoint engine: trainer -> standalone rollout weight sync without an accelerator -----

#: ``sorl_verl.cpu.checkpoint_engine.BACKEND``, named here so that registering imports nothing heavy
CHECKPOINT_ENGINE_BACKEND = "gloo"


def _register_checkpoint_engine() -> dict[str, list[str]]:
    """``gloo`` (:mod:`sorl_verl.cpu.checkpoint_engine`) into verl's ``CheckpointEngineRegistry``.

    Deferred until ``verl.checkpoint_engine.base`` is imported (every process that builds an engine
    imports it first), so importing verl does not pay for it. A run selects it with
    ``checkpoint_engine.backend=gloo`` and ``checkpoint_engine.custom_backend_module=sorl_verl.plugin``
    (verl imports that module before it looks the backend up). A foreign engine under the name raises.
    """

    def install(base: object) -> None:
        from sorl_verl.cpu.checkpoint_engine import BACKEND, GlooCheckpointEngine

        registry = base.CheckpointEngineRegistry  # type: ignore[attr-defined]
        existing = registry._registry.get(BACKEND)
        if existing is None:
            registry.register(BACKEND)(GlooCheckpointEngine)
        elif existing is not GlooCheckpointEngine:
            raise ValueError(
                f"verl checkpoint engine {BACKEND!r} is already registered to "
                f"{existing.__module__}.{existing.__qualname__}, not sorl_verl's"
            )

    def install_recording(base: object) -> None:  # the deferred path: failures go to ERRORS
        try:
            install(base)
        except Exception:  # noqa: BLE001 - made visible instead of swallowed by the import
            ERRORS["checkpoint_engine"] = traceback.format_exc()
            logger.warning("sorl_verl: registering the gloo checkpoint engine failed:\n%s", ERRORS["checkpoint_engine"])

    import sys

    base = sys.modules.get("verl.checkpoint_engine.base")
    if base is not None and hasattr(base, "CheckpointEngineRegistry"):
        install(base)
    else:
        _after_import(
            "verl.checkpoint_engine.base", "CheckpointEngineRegistry", install_recording, hook="checkpoint_engine"
        )
    return {"CheckpointEngineRegistry": [CHECKPOINT_ENGINE_BACKEND]}


register_all()
