"""The one place where sorl_verl registers itself into verl.

verl imports this module through the ``verl.plugins`` entry point (or
``VERL_USE_EXTERNAL_MODULES=sorl_verl.plugin``) in every process that imports verl:
the driver, the TaskRunner and every Ray worker. Registration is idempotent: importing
this module twice, or under two module names, re-registers nothing and raises nothing.

Everything sorl_verl writes into verl (or torch, or OmegaConf), by :data:`REGISTERED` key; "here"
is this module, "after import" means when the process imports that verl module itself
(:func:`sorl_verl.after_import.after_import`, sorl_verl's one import hook):

==============================  =====================================================  ======================================
REGISTERED key                  what is written                                        by
==============================  =====================================================  ======================================
policy_loss, adv_estimator      ``core_algos`` POLICY_LOSS / ADV_ESTIMATOR registries  here (verl's register decorators)
optimizer                       nothing: verl imports ``optim.optimizer_impl`` by name  (listed for the doctor)
omegaconf_resolver              OmegaConf resolver ``sorl_critic_enable``              ``trainer.config_resolvers``
trainer                         ``v1.trainer_base.TRAINER_REGISTRY``, after import     here
verl_fixes                      an attribute of a verl logger (bug fix)                ``trainer.verl_compat.apply_verl_fixes``
agent_loop                      ``agent_loop._agent_loop_registry`` (a private dict),  here
                                after import
PlatformRegistry                ``PlatformRegistry["cpu"]``                            here
RolloutReplicaRegistry          ``RolloutReplicaRegistry["hf"]`` (lazy loader)         here
rollout_adapters                ``rollout.base._ROLLOUT_REGISTRY`` (a private dict)    here
cpu_wrappers(_separate_async)   verl module attributes wrapped, CPU platform only      ``cpu.verl_compat`` (+ ``cpu.vllm_compat``,
                                                                                       after import)
EngineRegistry                  FSDP engines for device ``cpu``, CPU platform only     ``cpu.engines.register_cpu_engines``
CheckpointEngineRegistry        ``CheckpointEngineRegistry["gloo"]``, after import     here
==============================  =====================================================  ======================================

verl swallows plugin import errors at DEBUG level, so each section below records its
own failure (also a deferred one) in :data:`ERRORS` and logs it at WARNING;
``python -m sorl_verl doctor`` reports both :data:`REGISTERED` and :data:`ERRORS`.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

from sorl_verl.after_import import after_import

logger = logging.getLogger("sorl_verl.plugin")

#: registry name -> names this plugin registered into it
REGISTERED: dict[str, list[str]] = {}
#: section name -> formatted traceback of a failed registration
ERRORS: dict[str, str] = {}


def _section(name: str, fn: Callable[[], dict[str, list[str]]]) -> None:
    try:
        for registry, names in fn().items():
            REGISTERED.setdefault(registry, [])
            REGISTERED[registry].extend(n for n in names if n not in REGISTERED[registry])
        ERRORS.pop(name, None)
    except Exception:  # noqa: BLE001 - made visible instead of verl's DEBUG-level swallow
        ERRORS[name] = traceback.format_exc()
        logger.warning("sorl_verl: registering %s failed:\n%s", name, ERRORS[name])


def _record_error(name: str) -> Callable[[str], None]:
    """The ``on_error`` of section ``name``'s after-import hooks (the hook has logged it already)."""

    def record(tb: str) -> None:
        ERRORS[name] = tb

    return record


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
    by name, so nothing is written into verl (or torch) here; the names are listed for the doctor.
    Only the optimizer built from the actor's ``optim`` section scales its step: no global hook
    reaches the critic's or any other optimizer of the process.
    """
    from sorl_verl.algorithms import optim

    return {"optimizer": [f"{optim.__name__}.{name}" for name in ("AdamW", "Adam", "SGD")]}


# --- trainers: the hook that hands critic values to the turn-level GAE ------------------

#: verl's package whose import triggers the trainers' registration (TaskRunnerV1 imports it before its look-up)
TRAINER_TRIGGER_MODULE = "verl.trainer.ppo.v1"
#: trainer names this project registers (``trainer.v1.trainer_mode=<name>``); ``trainers.SORL_TRAINERS``'s keys
TRAINER_NAMES: tuple[str, ...] = ("sorl_sync", "sorl_colocate_async", "sorl_separate_async")


def _register_trainers() -> dict[str, list[str]]:
    """``sorl_sync`` / ``sorl_colocate_async`` / ``sorl_separate_async`` into verl's TRAINER_REGISTRY.

    Deferred until ``verl.trainer.ppo.v1`` is imported: importing it costs seconds and hundreds of
    MB per process, and most verl processes (FSDP workers, reward workers) never need it. Also the
    OmegaConf resolver ``sorl_critic_enable`` that ``sorl_trainer.yaml`` uses to turn the critic on
    for so_ppo, and the fixes of verl bugs on the trainers' path
    (``trainer.verl_compat.apply_verl_fixes``, every platform).
    """
    from sorl_verl.trainer.config_resolvers import register_resolvers
    from sorl_verl.trainer.verl_compat import apply_verl_fixes

    resolvers = register_resolvers()
    after_import(TRAINER_TRIGGER_MODULE, "get_trainer_cls", lambda _v1: register_trainers(), hook="trainers",
                 on_error=_record_error("trainers"))  # fmt: skip
    return {"omegaconf_resolver": resolvers, "trainer": list(TRAINER_NAMES), "verl_fixes": apply_verl_fixes()}


def register_trainers() -> list[str]:
    """Import the SORL trainers and register them into verl now (verl's version checked first); idempotent.

    A name already held by the same SORL class loaded under another module name (same qualname and
    base mode) is left as is; a name held by a foreign class raises ``ValueError``.
    """
    from sorl_verl.trainer.verl_compat import check_verl_version

    check_verl_version()
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer

    from sorl_verl.trainer.trainers import SORL_TRAINERS

    def same_sorl_trainer(existing: type, cls: type) -> bool:
        key = ("__qualname__", "base_trainer_mode")
        return all(getattr(existing, k, None) == getattr(cls, k, None) for k in key)

    for name, cls in SORL_TRAINERS.items():
        existing = TRAINER_REGISTRY.get(name)
        if existing is None or existing is cls:
            register_trainer(name)(cls)
        elif not same_sorl_trainer(existing, cls):
            raise ValueError(f"verl trainer name {name!r} is already registered to {existing!r}, not a SORL trainer")
    return list(SORL_TRAINERS)


# --- agent: search_r1 agent loop ---------------------------------------------------------


def _register_agent() -> dict[str, list[str]]:
    """Put ``search_r1`` (an FQN ``_target_``) into verl's agent-loop registry.

    verl's registry lives in a heavy module (``verl.experimental.agent_loop.agent_loop``, ~10 s
    to import) and has no register function; the entry is added after that module is imported, so
    importing verl stays cheap and every process that runs agent loops sees it.
    """
    from sorl_verl.agent import AGENT_LOOP_NAME, AGENT_LOOP_TARGET

    def install(module: object) -> None:
        module._agent_loop_registry[AGENT_LOOP_NAME] = {"_target_": AGENT_LOOP_TARGET}  # type: ignore[attr-defined]

    after_import("verl.experimental.agent_loop.agent_loop", "_agent_loop_registry", install, hook="agent_loop",
                 on_error=_record_error("agent"))  # fmt: skip
    return {"agent_loop": [AGENT_LOOP_NAME]}


# --- cpu: platform and rollout replica for machines without an accelerator ---------------


def _register_cpu() -> dict[str, list[str]]:
    """CPU platform and ``hf`` replica always; FSDP engines for ``cpu`` and verl wrappers only with ``VERL_PLATFORM=cpu``.

    The platform class comes from its own module (not the ``sorl_verl.cpu.platform`` package, which
    may be the very import that is loading verl, and this plugin, right now).
    """
    from verl.plugin.platform import PlatformRegistry
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from sorl_verl.cpu.platform.cpu_platform import CPU_PLATFORM_NAMES, PlatformCPU, cpu_platform_selected

    for name in CPU_PLATFORM_NAMES:  # verl's auto-detection probes it last and finds it only with VERL_PLATFORM=cpu
        if PlatformRegistry.get(name) is not PlatformCPU:
            PlatformRegistry.register(platform=name)(PlatformCPU)

    def _load_hf():  # imported lazily: only a run with rollout.name=hf pays for it
        from sorl_verl.cpu.hf_rollout import HFReplica

        return HFReplica

    RolloutReplicaRegistry.register("hf", _load_hf)
    # verl's (name, mode) -> in-worker adapter table has no register function; it is a plain dict
    rollout_base._ROLLOUT_REGISTRY[("hf", "async")] = "sorl_verl.cpu.hf_rollout.HFServerAdapter"
    registered = {
        "PlatformRegistry": list(CPU_PLATFORM_NAMES),
        "RolloutReplicaRegistry": ["hf"],
        "rollout_adapters": ["hf/async"],
    }
    if cpu_platform_selected():  # only when asked for (VERL_PLATFORM=cpu), never for a missing accelerator
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

    after_import("verl.checkpoint_engine.base", "CheckpointEngineRegistry", install, hook="checkpoint_engine",
                 on_error=_record_error("checkpoint_engine"))  # fmt: skip
    return {"CheckpointEngineRegistry": [CHECKPOINT_ENGINE_BACKEND]}


register_all()
