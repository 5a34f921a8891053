"""Keep a single-machine CPU run on the loopback interface: Ray's node on 127.0.0.1.

Ray (2.x) registers a node under the address of the interface that routes outwards, even when
``ray.init(_node_ip_address="127.0.0.1")`` is asked for: ``ray.init`` rewrites a loopback
address to that one (``services.resolve_ip_for_localhost``), so verl's ``ray_kwargs.ray_init``
cannot keep it local. Ray's own switch for a local-only instance is the environment variable
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` ("no cluster": node address, GCS, raylet and worker
ports on 127.0.0.1). Ray reads it into ``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` when it
is first imported, and verl's ``main_ppo`` imports Ray before verl loads this plugin, so
:func:`use_loopback_ray` sets the variable (inherited by every process Ray starts) and brings
the constant in line with it. An explicit ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` (a CPU cluster
over several machines) is left alone.
"""

from __future__ import annotations

import os

#: Ray's switch between a local-only instance ("0") and a cluster-capable one ("1")
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"


def use_loopback_ray() -> bool:
    """Make Ray started from this process use 127.0.0.1 unless the user opted into a cluster.

    Returns True when Ray is (now) local-only. Has no effect on a Ray instance already started.
    """
    value = os.environ.setdefault(RAY_CLUSTER_ENV, "0").strip().lower()
    local = value in ("0", "false", "no", "off", "")
    try:
        from ray._private import ray_constants
    except ImportError:  # Ray not installed: nothing to configure
        return local
    ray_constants.ENABLE_RAY_CLUSTER = not local
    return local
