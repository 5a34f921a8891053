"""The CPU platform class and its selection rule; import it through :mod:`sorl_verl.cpu.platform`.

That package imports verl before this module, so that the plugin's CPU section (run by verl's
plugin loading, which imports this module) never finds it half-defined.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase

#: names a user may give in ``VERL_PLATFORM`` to select this platform
CPU_PLATFORM_NAMES = ("cpu",)


def accelerator_present() -> bool:
    """True when torch sees a CUDA/ROCm GPU or an Ascend NPU in this process."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:  # noqa: BLE001 - a broken torch_npu install means "no NPU"
        return False


def cpu_platform_selected() -> bool:
    """True when this process runs (or will run) verl on the CPU platform: only when asked for, by
    ``VERL_PLATFORM=cpu`` (what every CPU launcher sets: scripts/demo.sh, the study runner, the run
    scripts' ``PLATFORM=cpu``, the e2e tests). Never by the absence of an accelerator: a GPU
    cluster's CPU-only driver or head node keeps verl's own platform and a Ray open to the cluster.
    """
    return os.environ.get("VERL_PLATFORM", "").strip().lower() in CPU_PLATFORM_NAMES


def check_cpu_device_selected(device: object) -> None:
    """Refuse ``trainer.device=cpu`` (what the CPU overlay ``+platform=cpu`` sets) in a process not on
    the CPU platform: verl would take its CUDA paths without the CPU wrappers. ``ValueError`` naming the fix."""
    if str(device).strip().lower() == "cpu" and not cpu_platform_selected():
        raise ValueError(
            "trainer.device=cpu (the CPU overlay, +platform=cpu) runs only on sorl_verl's CPU platform, which is "
            "selected by VERL_PLATFORM=cpu in the environment of the launching process (scripts/demo.sh sets it); "
            f"VERL_PLATFORM is {os.environ.get('VERL_PLATFORM')!r}. Export VERL_PLATFORM=cpu, or drop the CPU "
            "overlay on a machine with an accelerator"
        )


class _CPUDeviceModule:
    """Stand-in for ``torch.cuda`` where verl calls device-module functions on the CPU.

    verl calls e.g. ``get_torch_device().current_device()``, ``.empty_cache()``,
    ``.memory_allocated()``, ``.max_memory_reserved()``, ``.synchronize()``,
    ``.manual_seed()``, ``.get_rng_state()``; ``torch.cpu`` lacks several of them. Memory
    queries return 0 (no device memory exists); RNG calls go to torch's CPU generator.
    """

    def __getattr__(self, name: str) -> Any:
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        raise AttributeError(f"sorl_verl CPU platform: torch device module has no attribute {name!r}")

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return 0

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        return 0

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        return 0, 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"


CPU_DEVICE_MODULE = _CPUDeviceModule()


class PlatformCPU(PlatformBase):
    """CPU-only platform: device ``cpu``, backend ``gloo``, Ray resource ``GPU`` (logical slots)."""

    #: its public name (the package re-exports it): what the doctor reports and pickles refer to
    __module__ = "sorl_verl.cpu.platform"

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return CPU_DEVICE_MODULE  # type: ignore[return-value]

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """Only when asked for (:func:`cpu_platform_selected`): verl's auto-detection never picks it."""
        return cpu_platform_selected()

    def current_device(self) -> str:  # type: ignore[override]
        """``"cpu"``, not ``0``: verl passes this to ``.to(device=...)``, where an int means ``cuda:<int>``."""
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
