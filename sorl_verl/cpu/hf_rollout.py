"""verl rollout replica ``hf``: Hugging Face transformers generation on CPU behind verl's async API.

Three parts, mirroring verl's vLLM replica:

- :class:`HFServer` — the Ray actor verl's ``LLMServerClient`` calls:
  ``generate(prompt_ids, sampling_params, request_id, ...) -> TokenOutput`` (token ids, log-probs
  of the sampled tokens when ``sampling_params["logprobs"]`` is true, stop reason ``completed`` /
  ``aborted``, ``extra_fields["global_steps"]`` = weight version), plus the control methods verl
  calls on a server (``wake_up``, ``sleep``, ``abort_all_requests``, ``resume_generation``,
  ``clear_kv_cache``, ``set_global_steps``, ...). It holds one :class:`HFGenerationEngine`.
- :class:`HFReplica` — the ``RolloutReplica`` verl's ``LLMServerManager`` creates for
  ``rollout.name=hf``: one server actor per replica (named ``hf_server_<replica>_0``), placed on
  the node of the replica's first worker, needing no CPU/GPU slot of its own.
- :class:`HFServerAdapter` — the ``BaseRollout`` verl's hybrid trainer worker builds in its own
  process (``get_rollout_class("hf", "async")``): after every update the worker calls
  ``update_weights(per_tensor_param)``; the replica's leader rank ships the tensors to its server
  in buckets through Ray's object store, the other ranks drain the generator (it may all-gather).

Seeds: a request whose ``sampling_params`` carry ``seed`` samples from a generator seeded with
``turn_seed(seed, len(prompt_ids))`` (an agent loop resends its episode's seed every turn, with a
longer prompt each time); without one, from ``rollout.seed + replica rank`` and the request count.

Budget per request as vLLM's server: ``max_tokens`` (or ``max_new_tokens``) if given, else
``min(response_length, prompt_length + response_length - len(prompt))``; always clamped to
``[1, max_model_len - len(prompt)]`` (``max_model_len`` defaults to the model's
``max_position_embeddings``).

Engine options: ``actor_rollout_ref.rollout.engine_kwargs.hf.{num_threads,max_batch_size,batch_wait_s,device}``.
``device`` (default ``cpu``) is where the model's forward passes run: ``cuda`` puts the replica's
model on the GPU of the replica's first trainer worker (the server actor then keeps that GPU
visible, as verl's vLLM servers do); sampling stays on the CPU (:class:`HFGenerationEngine`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import ray
import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator, get_max_position_embeddings

from sorl_verl.cpu.hf_engine import HFGenerationEngine, SamplingOptions, default_eos_token_ids
from sorl_verl.trainer.reproducible import turn_seed

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"
#: fully qualified name of the in-worker adapter, for verl's ``(name, mode) -> class`` rollout table
SERVER_ADAPTER_FQN = "sorl_verl.cpu.hf_rollout.HFServerAdapter"
SERVER_NAME_PREFIX = "hf_"


def server_actor_name(replica_rank: int, node_rank: int = 0, kind: str = "", suffix: str = "") -> str:
    """Ray name of a replica's server actor: ``hf_server[_reward|_teacher]_<replica>_<node><suffix>``."""
    kind_part = f"_{kind}" if kind else ""
    return f"{SERVER_NAME_PREFIX}server{kind_part}_{replica_rank}_{node_rank}{suffix}"


def _hf_engine_kwargs(config: RolloutConfig) -> dict[str, Any]:
    kwargs = (config.engine_kwargs or {}).get(ROLLOUT_NAME) or {}
    return dict(kwargs)


def engine_device(config: RolloutConfig) -> str:
    """``engine_kwargs.hf.device``: ``cpu`` (default) or a CUDA device; anything else raises, naming it."""
    device = str(_hf_engine_kwargs(config).get("device") or "cpu")
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.hf.device must be cpu or cuda[:N], got {device!r}")
    return device


class HFServer:
    """Ray actor body serving one replica with an :class:`HFGenerationEngine` (see module docstring)."""

    def __init__(
        self,
        config: RolloutConfig,
        model_config: HFModelConfig,
        rollout_mode: RolloutMode,
        workers: list | None = None,
        replica_rank: int = 0,
        node_rank: int = 0,
        gpus_per_node: int = 1,
        nnodes: int = 1,
        cuda_visible_devices: str | None = None,
    ) -> None:
        if cuda_visible_devices is not None:  # before this process touches CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.rollout_mode = rollout_mode
        self.workers = workers or []
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.global_steps: int | None = None
        self.engine: HFGenerationEngine | None = None
        self.max_model_len = self._resolve_max_model_len()
        kwargs = _hf_engine_kwargs(self.config)
        # 1 thread by default: tiny models gain little from more, and on a busy machine torch's
        # spinning OpenMP threads slow decoding down by an order of magnitude or more
        self.num_threads = int(kwargs.get("num_threads") or 1)
        self.device = engine_device(self.config)
        self._address = f"{ray.util.get_node_ip_address().strip('[]')}:hf-{replica_rank}-{node_rank}"

    def _resolve_max_model_len(self) -> int:
        limit = get_max_position_embeddings(self.model_config.hf_config)
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ValueError(f"max_model_len ({wanted}) exceeds max_position_embeddings ({limit})")
        return int(wanted)

    async def launch_server(self) -> None:
        """Load the model (random init for ``load_format=dummy``: the first weight sync fills it)."""
        if self.engine is not None:
            return
        torch.set_num_threads(self.num_threads)
        if self.device != "cpu" and not torch.cuda.is_available():
            raise RuntimeError(
                f"hf rollout: engine_kwargs.hf.device={self.device!r} but this server process sees no CUDA device "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )
        if self.config.dtype not in ("float32", "fp32"):
            logger.warning(
                "hf rollout runs in %s (verl's default rollout.dtype): its log-probs will differ from an fp32 "
                "actor's (on the embedded model by 5e-4 in probability per token on average, 0.035 at a step's worst "
                "token on average, up to 0.13: the natural study's demo_bf16_rollout); set "
                "actor_rollout_ref.rollout.dtype=float32 on CPU",
                self.config.dtype,
            )
        kwargs = _hf_engine_kwargs(self.config)
        mc = self.model_config
        path = mc.local_path or mc.path
        self.engine = await asyncio.to_thread(
            HFGenerationEngine.from_pretrained,
            path,
            dtype=self.config.dtype,
            random_init=self.config.load_format == "dummy",
            tokenizer=mc.tokenizer,
            trust_remote_code=mc.trust_remote_code,
            max_model_len=self.max_model_len,
            max_batch_size=int(kwargs.get("max_batch_size") or min(self.config.max_num_seqs, 256)),
            batch_wait_s=float(kwargs.get("batch_wait_s", 0.005)),
            logprobs_mode=self.config.logprobs_mode or "processed_logprobs",
            seed=self.config.seed + self.replica_rank,
            device=self.device,
        )
        # verl's view of the generation config counts too (vLLM merges its eos ids the same way)
        self.engine.eos_token_ids = frozenset(self.engine.eos_token_ids | default_eos_token_ids(mc.generation_config))
        logger.info(
            "hf rollout server %s: model %s on %s, dtype %s, %d threads, max_model_len %d",
            self._address,
            path,
            self.device,
            self.config.dtype,
            self.num_threads,
            self.max_model_len,
        )

    def get_server_address(self) -> tuple[str, str]:
        """(node ip, replica tag): the key verl's router files this server under (no HTTP endpoint)."""
        host, tag = self._address.split(":", 1)
        return host, tag

    def get_rollout_config(self) -> RolloutConfig:
        return self.config

    # --- generation ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> TokenOutput:
        """Token-in-token-out generation, the contract of verl's vLLM server ``generate``."""
        if image_data is not None or video_data is not None or audio_data is not None:
            raise NotImplementedError("the hf rollout serves text-only models")
        assert self.engine is not None, "launch_server() was not called"
        prompt_ids = [int(t) for t in prompt_ids]
        params = dict(sampling_params)
        requested = params.pop("max_tokens", None)
        if requested is None:
            requested = params.pop("max_new_tokens", None)
        if requested is None:
            requested = min(
                self.config.response_length,
                self.config.prompt_length + self.config.response_length - len(prompt_ids),
            )
        want_logprobs = bool(params.pop("logprobs", False))
        params.setdefault("repetition_penalty", self.config.repetition_penalty)
        params.setdefault("ignore_eos", self.config.ignore_eos)
        if params.get("seed") is not None:  # an episode's seed: each turn (longer prompt) gets its own stream
            params["seed"] = turn_seed(int(params["seed"]), len(prompt_ids))
        options = SamplingOptions.from_vllm_params(
            params, max_tokens=self.engine.max_new_tokens(len(prompt_ids), requested)
        )
        out = await self.engine.generate(prompt_ids, options)
        return TokenOutput(
            token_ids=out.token_ids,
            log_probs=out.log_probs if want_logprobs else None,
            stop_reason="aborted" if out.finish_reason == "abort" else "completed",
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps, "finish_reason": out.finish_reason},
        )

    # --- weights ------------------------------------------------------------------------------

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy one bucket of ``(hf_name, tensor)`` into the model (after a running batch ends)."""
        assert self.engine is not None, "launch_server() was not called"
        return await asyncio.to_thread(self.engine.load_weights, named_tensors)

    async def set_global_steps(self, global_steps: int) -> None:
        """Record the weight version that ``TokenOutput.extra_fields['global_steps']`` reports."""
        self.global_steps = global_steps

    # --- control methods verl calls on every server ----------------------------------------------

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Nothing to restore: weights stay in host memory between rollouts."""

    async def sleep(self) -> None:
        """Nothing to free: the KV cache lives only while a batch decodes."""

    async def clear_kv_cache(self) -> None:
        """No cache outlives a batch, so there is nothing stale after a weight update."""

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        if self.engine is not None:
            await self.engine.wait_idle()

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """End running/queued requests (``stop_reason='aborted'``, partial tokens kept); later ones wait for resume."""
        aborted = await self.engine.abort_all(keep_closed=True) if self.engine is not None else 0
        return {"aborted_count": aborted, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id, "error": "the hf rollout aborts only all requests"}

    async def resume_engine_generation(self) -> None:
        return None

    async def open_submission_gate(self) -> None:
        if self.engine is not None:
            self.engine.resume()

    async def resume_generation(self) -> None:
        await self.open_submission_gate()

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def get_stats(self) -> dict[str, Any]:
        """Batches decoded so far, their sizes, and the weight version."""
        sizes = list(self.engine.batch_sizes) if self.engine is not None else []
        return {"batch_sizes": sizes, "global_steps": self.global_steps, "num_threads": self.num_threads}


class HFReplica(RolloutReplica):
    """``RolloutReplica`` for ``rollout.name=hf``: one :class:`HFServer` actor per replica.

    Works in every mode verl launches replicas in (hybrid: next to the FSDP workers that push
    weights through :class:`HFServerAdapter`; colocated/standalone: next to verl's
    ``CheckpointEngineWorker``, which builds the same adapter). One process serves the whole
    replica: tensor/data parallel sizes only decide how many trainer ranks share it.
    """

    def __init__(
        self,
        replica_rank: int,
        config: RolloutConfig,
        model_config: HFModelConfig,
        gpus_per_node: int = 8,
        is_reward_model: bool = False,
        is_teacher_model: bool = False,
        name_suffix: str = "",
    ) -> None:
        super().__init__(
            replica_rank, config, model_config, gpus_per_node, is_reward_model, is_teacher_model, name_suffix
        )
        self.server_class = ray.remote(HFServer)

    def _kind(self) -> str:
        return "reward" if self.is_reward_model else "teacher" if self.is_teacher_model else ""

    async def launch_servers(self) -> None:
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
        else:
            node_id = ray.get_runtime_context().get_node_id()
        options: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        if engine_device(self.config) != "cpu":
            # the server takes no GPU slot, so Ray would hide every GPU from it: keep the first
            # trainer worker's GPU visible instead (verl's vLLM replica does the same)
            if not self.workers:
                raise ValueError("engine_kwargs.hf.device=cuda needs trainer workers to take a GPU from")
            gpu = await self.workers[0].__ray_call__.remote(
                lambda self: ray.get_runtime_context().get_accelerator_ids()["GPU"][0]
            )
            options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
            extra["cuda_visible_devices"] = str(gpu)
        server = self.server_class.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False
            ),
            name=server_actor_name(self.replica_rank, 0, self._kind(), self.name_suffix),
            max_concurrency=self.max_concurrency,
            num_cpus=0,
            **options,
        ).remote(
            **extra,
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode,
            workers=self.workers,
            replica_rank=self.replica_rank,
            node_rank=0,
            gpus_per_node=self.gpus_per_replica_node,
            nnodes=self.nnodes,
        )
        self.servers = [server]
        await server.launch_server.remote()
        host, tag = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{host}:{tag}"


class HFServerAdapter(BaseRollout):
    """The ``hf`` rollout as seen from a trainer worker process: pushes weights to its server.

    ``RANK`` (set by verl's worker group) gives the replica (``RANK // rollout world size``) and
    whether this rank leads it (``RANK % rollout world size == 0``); only the leader talks to
    the server. Weight tensors travel in buckets of
    ``checkpoint_engine.update_weights_bucket_megabytes``.
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_config: HFModelConfig,
        device_mesh: Any = None,
        replica_rank: int = -1,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.server_handle: ray.actor.ActorHandle | None = None
        self.bucket_bytes = max(1, int(self.config.checkpoint_engine.update_weights_bucket_megabytes)) << 20

    @property
    def is_leader_rank(self) -> bool:
        return self.rollout_rank == 0

    def _server(self) -> ray.actor.ActorHandle | None:
        if not self.is_leader_rank:
            return None
        if self.server_handle is None:  # launched after the trainer workers, so looked up lazily
            self.server_handle = ray.get_actor(server_actor_name(self.replica_rank, 0))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        server = self._server()
        if server is not None:
            await server.wake_up.remote(tags=tags)

    async def release(self) -> None:
        server = self._server()
        if server is not None:
            await server.sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        """Send every ``(hf_name, full tensor)`` to the replica's server; non-leaders only drain.

        Returns after the server has loaded the last bucket and recorded ``global_steps``.
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout takes full tensors only, not wire_format={wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError(
                "the hf rollout needs merged weights: set actor_rollout_ref.model.lora.merge=True"
            )
        server = self._server()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        loaded = 0
        async for name, tensor in ensure_async_iterator(weights):
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if server is None:
                continue
            tensor = tensor.detach().to("cpu").contiguous()
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                loaded += await server.update_weights.remote(bucket)
                bucket, size = [], 0
        if server is None:
            return
        if bucket:
            loaded += await server.update_weights.remote(bucket)
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)
        logger.info(
            "hf rollout replica %d: loaded %d weight tensors (step %s)", self.replica_rank, loaded, global_steps
        )

    def generate_sequences(self, prompts: Any) -> Any:
        raise NotImplementedError("the hf rollout is served through HFReplica / LLMServerClient, not in-worker")
