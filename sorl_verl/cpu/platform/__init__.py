"""verl platform for machines without an accelerator: device ``cpu``, collectives over ``gloo``.

Selected only by ``VERL_PLATFORM=cpu`` (every CPU launcher of the project sets it): a process
without an accelerator and without that variable (a GPU cluster's CPU-only driver or head node)
keeps verl's own platform choice, no CPU wrappers and a Ray open to the cluster; verl's
auto-detection never picks this platform. ``trainer.device=cpu`` (the CPU overlay) without it is
refused at the SORL trainers' start-up (:func:`check_cpu_device_selected`).

Ray scheduling: verl's resource pools ask Ray for one ``GPU`` per worker and check
``ray.available_resources()['GPU']``. On CPU the platform keeps Ray's resource name ``GPU`` and
the run declares *logical* GPUs to Ray (``+ray_kwargs.ray_init.num_gpus=N``, set by
``recipe/sorl/config/cpu_demo.yaml``): Ray then only counts slots, and every FSDP process runs
on the CPU.

The class and the selection rule live in :mod:`sorl_verl.cpu.platform.cpu_platform`; the plugin
imports that module to register the class. This package imports verl first: verl loads the plugin,
so whichever of the two a process imports first, the plugin finds the class module complete (had
the class module imported verl itself, the plugin would run while it was half-defined).
"""

import verl  # noqa: F401 - first, see above

from sorl_verl.cpu.platform.cpu_platform import (
    CPU_DEVICE_MODULE,
    CPU_PLATFORM_NAMES,
    PlatformCPU,
    accelerator_present,
    check_cpu_device_selected,
    cpu_platform_selected,
)

__all__ = [
    "CPU_DEVICE_MODULE",
    "CPU_PLATFORM_NAMES",
    "PlatformCPU",
    "accelerator_present",
    "check_cpu_device_selected",
    "cpu_platform_selected",
]
