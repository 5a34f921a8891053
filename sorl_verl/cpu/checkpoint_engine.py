"""verl checkpoint engine ``gloo``: trainer -> standalone rollout weight sync on CPU, over loopback.

verl's ``separate_async`` trainer pushes weights from the actor worker group to the standalone
rollout replicas through a :class:`~verl.checkpoint_engine.base.CheckpointEngine` and refuses the
in-process ``naive`` one; every other engine verl 0.9.1 ships moves weights over CUDA. This one
broadcasts them over a torch ``gloo`` process group of its own, bound to ``127.0.0.1`` only
(the rendezvous TCPStore's socket and gloo's pair sockets alike): one machine, no accelerator.

Selected by ``actor_rollout_ref.rollout.checkpoint_engine.backend=gloo``, with
``checkpoint_engine.custom_backend_module=sorl_verl.plugin`` so that every process verl builds the
engine in registers it first (``recipe/sorl/config/platform/cpu/separate_async.yaml`` sets both).
Optional ``checkpoint_engine.engine_kwargs.gloo.timeout_s`` (default 600): how long any rank waits
for its peers in one collective.

The contract verl's ``CheckpointEngineManager`` drives, once per weight sync:

1. :meth:`~GlooCheckpointEngine.prepare` on every actor rank and rollout worker. Actor rank 0
   (``is_master``) binds the rendezvous socket on 127.0.0.1 and returns its address; the others
   return ``None``.
2. :meth:`~GlooCheckpointEngine.build_topology` (a classmethod, in the trainer process): actor
   rank 0 becomes group rank 0 (the only sender), rollout worker ``i`` group rank ``1 + i``,
   every other actor rank ``-1`` (outside the group).
3. :meth:`~GlooCheckpointEngine.init_process_group` on all of them at once (it blocks until the
   group is complete).
4. :meth:`~GlooCheckpointEngine.send_weights` on every actor rank (ranks outside the group only
   drain the generator: producing a full tensor is collective over the FSDP group) and
   :meth:`~GlooCheckpointEngine.receive_weights` on every rollout worker, concurrently.
5. :meth:`~GlooCheckpointEngine.finalize` everywhere: the group and its store are dropped; the
   next sync builds a new one.

On the wire, per bucket of at most ``bucket_size`` bytes (a tensor larger than that travels in
several chunks, verl's ``split_weight_chunks`` / ``merge_weight_chunks``): a 3-int64 header
(JSON length, payload length, status), the JSON list of chunk metadata, the uint8 payload. A
sender whose weight generator fails broadcasts an ``aborted`` header before re-raising, so the
receivers raise too instead of waiting out the timeout. Received tensors are fresh copies, owned
by the caller (no view keeps the bucket alive).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, TensorMeta, merge_weight_chunks, split_weight_chunks
from verl.utils.distributed import create_tcp_store
from verl.workers.rollout.utils import ensure_async_iterator

logger = logging.getLogger(__name__)

#: the name in verl's CheckpointEngineRegistry (``checkpoint_engine.backend``)
BACKEND = "gloo"
#: the only interface the engine listens on or connects to
LOOPBACK = "127.0.0.1"
#: header status values
_MORE, _LAST, _ABORTED = 0, 1, 2


@dataclass(frozen=True)
class GlooRendezvous:
    """Where the group meets: the TCPStore that actor rank 0 listens on (always loopback)."""

    host: str
    port: int


@dataclass
class _SyncCount:
    """What one sync moved, counted per chunk on either side: bytes, whole tensors, buckets."""

    payload_bytes: int = 0
    tensors: int = 0
    buckets: int = 0

    def add(self, meta: TensorMeta) -> None:
        self.payload_bytes += meta.chunk_size
        self.tensors += int(meta.chunk_offset == 0)  # a tensor's first chunk counts it once

    def metrics(self, seconds_key: str, seconds: float) -> dict[str, float]:
        return {
            "checkpoint_engine/payload_mbytes": self.payload_bytes / (1 << 20),
            "checkpoint_engine/tensors": float(self.tensors),
            "checkpoint_engine/buckets": float(self.buckets),
            f"checkpoint_engine/{seconds_key}": seconds,
        }


class GlooCheckpointEngine(CheckpointEngine):
    """Full-weight broadcast from actor rank 0 to every rollout worker over a loopback gloo group.

    Args:
        bucket_size: bytes per broadcast (verl passes ``update_weights_bucket_megabytes << 20``).
            Buckets are allocated at the size of their content, so a large setting costs nothing.
        is_master: True on actor rank 0, the sender (verl passes it to actor ranks only).
        timeout_s: how long a rank waits for its peers in one collective before raising.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0) -> None:
        if int(bucket_size) <= 0:
            raise ValueError(f"gloo checkpoint engine: bucket_size must be > 0 bytes, got {bucket_size}")
        if float(timeout_s) <= 0:
            raise ValueError(f"gloo checkpoint engine: timeout_s must be > 0, got {timeout_s}")
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.timeout = timedelta(seconds=float(timeout_s))
        self.rank: int | None = None
        self.world_size: int | None = None
        self._listen: socket.socket | None = None
        self._store: dist.Store | None = None
        self._group: dist.ProcessGroupGloo | None = None
        #: what the last send_weights / receive_weights moved (also the sender's returned metrics)
        self.last_sync: dict[str, float] = {}

    # --- set-up --------------------------------------------------------------------------------

    def prepare(self) -> GlooRendezvous | None:
        """Actor rank 0: bind the rendezvous socket on 127.0.0.1 (a free port) and return its address."""
        self._close_listen_socket()
        if not self.is_master:
            return None
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listen.bind((LOOPBACK, 0))
        listen.listen()
        self._listen = listen
        return GlooRendezvous(host=LOOPBACK, port=listen.getsockname()[1])

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Group ranks: actor rank 0 -> 0, rollout worker i -> 1 + i, other actor ranks -> -1.

        ``metadata`` is what :meth:`prepare` returned, actor ranks first (verl's order).
        """
        if actor_wg_world_size < 1 or rollout_world_size < 1:
            raise ValueError(
                f"gloo checkpoint engine needs at least one actor and one rollout worker, got "
                f"{actor_wg_world_size} and {rollout_world_size}"
            )
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(
                f"expected {actor_wg_world_size + rollout_world_size} prepare() results, got {len(metadata)}"
            )
        master = metadata[0]
        if not isinstance(master, GlooRendezvous):
            raise ValueError(
                f"actor rank 0 must be the gloo checkpoint engine's master (is_master=True); its prepare() "
                f"returned {master!r}"
            )
        world_size = 1 + rollout_world_size
        actor_kwargs = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "rendezvous": [master] * actor_wg_world_size,
        }
        rollout_kwargs = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "rendezvous": [master] * rollout_world_size,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, rendezvous: GlooRendezvous) -> None:
        """Join the group (blocks until all ``world_size`` ranks have joined); rank -1 stays out."""
        self.rank, self.world_size = int(rank), int(world_size)
        if self.rank < 0:
            return
        if rendezvous.host != LOOPBACK:
            raise ValueError(f"gloo checkpoint engine only meets on {LOOPBACK}, not {rendezvous.host!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")
        if (self.rank == 0) != self.is_master:
            raise ValueError(
                f"group rank 0 must be the master (actor rank 0); rank {self.rank}, is_master={self.is_master}"
            )
        if self.rank == 0:
            if self._listen is None:
                raise RuntimeError("gloo checkpoint engine: prepare() must run on the master before init_process_group")
            listen, self._listen = self._listen, None
            self._store = create_tcp_store(
                LOOPBACK, rendezvous.port, listen_socket=listen, world_size=self.world_size,
                is_master=True, timeout=self.timeout, wait_for_workers=False,
            )  # fmt: skip
        else:
            self._store = create_tcp_store(
                LOOPBACK, rendezvous.port, world_size=self.world_size, is_master=False, timeout=self.timeout
            )
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        options._timeout = self.timeout
        self._group = dist.ProcessGroupGloo(self._store, self.rank, self.world_size, options)

    def finalize(self) -> None:
        """Drop the group, its store and any unused rendezvous socket; the next sync starts afresh."""
        self._group = None
        self._store = None
        self._close_listen_socket()
        self.rank = self.world_size = None

    def _close_listen_socket(self) -> None:
        if self._listen is not None:
            self._listen.close()
            self._listen = None

    # --- transfer ------------------------------------------------------------------------------

    def _require_group(self, role: str) -> dist.ProcessGroupGloo:
        if self._group is None or self.rank is None:
            raise RuntimeError(f"gloo checkpoint engine: init_process_group() must run before {role}")
        return self._group

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._group.broadcast(tensor, 0).wait()  # type: ignore[union-attr]

    async def _send_bucket(self, status: int, meta: list[dict[str, Any]], payload: torch.Tensor) -> None:
        meta_bytes = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        header = torch.tensor([meta_bytes.numel(), payload.numel(), status], dtype=torch.int64)

        def send() -> None:
            self._broadcast(header)
            if meta_bytes.numel():
                self._broadcast(meta_bytes)
            if payload.numel():
                self._broadcast(payload)

        await asyncio.to_thread(send)

    @torch.no_grad()
    async def send_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
    ) -> dict[str, float]:
        """Broadcast every ``(name, tensor)`` from group rank 0; returns the sync's metrics there.

        Actor ranks outside the group (rank -1) only drain ``weights`` and return ``{}``.
        """
        if self.rank is not None and self.rank < 0:
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        self._require_group("send_weights")
        if self.rank != 0:
            raise RuntimeError(f"gloo checkpoint engine: rank {self.rank} receives weights, only rank 0 sends")
        start = time.perf_counter()
        meta: list[dict[str, Any]] = []
        chunks: list[torch.Tensor] = []
        size = 0
        count = _SyncCount()
        sending = False  # an error while broadcasting leaves the wire mid-bucket: no abort header then
        try:
            async for tensor_meta, chunk in split_weight_chunks(_host_tensors(weights), self.bucket_size):
                if size + tensor_meta.chunk_size > self.bucket_size and chunks:
                    sending = True
                    await self._send_bucket(_MORE, meta, torch.cat(chunks))
                    sending = False
                    count.buckets += 1
                    meta, chunks, size = [], [], 0
                meta.append(_meta_to_json(tensor_meta, offset=size))
                chunks.append(chunk)
                size += tensor_meta.chunk_size
                count.add(tensor_meta)
        except Exception as exc:
            if not sending:  # the weights generator failed: tell the receivers instead of leaving them waiting
                error = [{"error": f"{type(exc).__name__}: {exc}"}]
                await self._send_bucket(_ABORTED, error, torch.empty(0, dtype=torch.uint8))
            raise
        payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        await self._send_bucket(_LAST, meta, payload)
        count.buckets += 1
        seconds = time.perf_counter() - start
        self.last_sync = count.metrics("send_seconds", seconds)
        logger.info(
            "gloo checkpoint engine: sent %d tensors (%.2f MB, %d buckets) to %d rollout workers in %.2fs (step %s)",
            count.tensors, count.payload_bytes / (1 << 20), count.buckets, (self.world_size or 1) - 1, seconds,
            global_steps,
        )  # fmt: skip
        return dict(self.last_sync)

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield every ``(name, tensor)`` rank 0 sends, as tensors of their own (not views of a bucket)."""
        self._require_group("receive_weights")
        if self.rank == 0:
            raise RuntimeError("gloo checkpoint engine: rank 0 sends weights, it cannot receive them")
        async for name, tensor in merge_weight_chunks(self._receive_chunks(global_steps), self.bucket_size):
            yield name, tensor

    async def _receive_chunks(self, global_steps: int | None) -> AsyncIterator[tuple[TensorMeta, torch.Tensor]]:
        start = time.perf_counter()
        count = _SyncCount()
        status = _MORE
        while status == _MORE:
            meta, payload, status = await asyncio.to_thread(self._receive_bucket)
            if status == _ABORTED:
                raise RuntimeError(f"gloo checkpoint engine: the sender failed mid-sync: {meta[0].get('error')}")
            count.buckets += 1
            for entry in meta:
                tensor_meta = _meta_from_json(entry)
                count.add(tensor_meta)
                yield tensor_meta, payload[tensor_meta.offset : tensor_meta.offset + tensor_meta.chunk_size].clone()
        self.last_sync = count.metrics("receive_seconds", time.perf_counter() - start)
        logger.info(
            "gloo checkpoint engine: rank %s received %d tensors (%.2f MB, %d buckets) (step %s)",
            self.rank, count.tensors, count.payload_bytes / (1 << 20), count.buckets, global_steps,
        )  # fmt: skip

    def _receive_bucket(self) -> tuple[list[dict[str, Any]], torch.Tensor, int]:
        header = torch.empty(3, dtype=torch.int64)
        self._broadcast(header)
        meta_len, payload_len, status = (int(v) for v in header.tolist())
        meta_bytes = torch.empty(meta_len, dtype=torch.uint8)
        if meta_len:
            self._broadcast(meta_bytes)
        payload = torch.empty(payload_len, dtype=torch.uint8)
        if payload_len:
            self._broadcast(payload)
        meta = json.loads(meta_bytes.numpy().tobytes().decode()) if meta_len else []
        return meta, payload, status


async def _host_tensors(
    weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]],
) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Checked ``(name, contiguous host tensor)`` pairs, the form ``split_weight_chunks`` slices."""
    async for item in ensure_async_iterator(weights):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"weights must yield (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"weights must yield (str, torch.Tensor), got ({type(name).__name__}, {type(tensor).__name__})"
            )
        if hasattr(tensor, "full_tensor"):  # a DTensor shard: this rank alone cannot send it whole
            raise TypeError(f"{name}: a DTensor; the trainer must yield full tensors (verl's get_per_tensor_param)")
        yield name, tensor.detach().to("cpu").contiguous()


def _meta_to_json(meta: TensorMeta, offset: int) -> dict[str, Any]:
    return {
        "name": meta.name, "shape": list(meta.shape), "dtype": str(meta.dtype).removeprefix("torch."),
        "chunk_offset": meta.chunk_offset, "chunk_size": meta.chunk_size, "offset": offset,
    }  # fmt: skip


def _meta_from_json(entry: dict[str, Any]) -> TensorMeta:
    dtype = getattr(torch, entry["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"gloo checkpoint engine: unknown dtype {entry['dtype']!r} for {entry['name']!r}")
    return TensorMeta(
        name=entry["name"], shape=torch.Size(entry["shape"]), dtype=dtype,
        chunk_offset=int(entry["chunk_offset"]), chunk_size=int(entry["chunk_size"]), offset=int(entry["offset"]),
    )  # fmt: skip
