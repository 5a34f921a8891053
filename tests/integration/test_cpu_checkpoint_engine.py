"""The ``gloo`` checkpoint engine (``sorl_verl.cpu.checkpoint_engine``) across real processes.

The test process plays actor rank 0 (the sender); each rollout worker is a fresh interpreter that
joins the loopback group, receives, and saves what it got. verl's own ``CheckpointEngineRegistry``
builds the engines, and the set-up follows ``CheckpointEngineManager``: prepare -> build_topology ->
init_process_group -> send/receive -> finalize.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

pytestmark = pytest.mark.slow  # fresh interpreters importing verl: ~10 s each on a busy machine

LOOPBACK_ADDRESSES = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

#: one rollout worker: join the group named on the command line, receive, save (or report the error)
RECEIVER = r"""
import asyncio, json, sys, torch
from verl.checkpoint_engine import CheckpointEngineRegistry
from sorl_verl.cpu.checkpoint_engine import GlooRendezvous

rank, world_size, port, bucket_size, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
engine = CheckpointEngineRegistry.new("gloo", bucket_size=bucket_size)
assert engine.prepare() is None
engine.init_process_group(rank=rank, world_size=world_size, rendezvous=GlooRendezvous("127.0.0.1", port))

async def receive():
    return [(name, tensor) async for name, tensor in engine.receive_weights(global_steps=3)]

try:
    received = asyncio.run(receive())
except RuntimeError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(3)
torch.save({"names": [n for n, _ in received], "tensors": [t for _, t in received],
            "owned": [t.untyped_storage().nbytes() == t.nbytes for _, t in received]}, out)
print(json.dumps({"metrics": engine.last_sync}))
engine.finalize()
"""


def weights() -> list[tuple[str, torch.Tensor]]:
    """Tensors of several dtypes and shapes: one spans several buckets, one is a non-contiguous view."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 33, generator=g)  # 8448 bytes: chunked across buckets of 1000
    with_nan = torch.randn(5, 7, generator=g)
    with_nan[1, 2] = float("nan")
    with_nan[0, 0] = -0.0
    return [
        ("model.embed_tokens.weight", big),
        ("model.layers.0.mlp.up_proj.weight", with_nan),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(17, generator=g).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(9, generator=g).half()),
        ("transposed", torch.randn(6, 4, generator=g).t()),
        ("scalar", torch.tensor(3.25)),
        ("positions", torch.arange(11, dtype=torch.int64)),
    ]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.fixture
def started():
    """Receiver processes started by a test; any still running at teardown are killed."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start_receivers(started: list, tmp_path: Path, port: int, world_size: int, bucket_size: int) -> list[tuple]:
    procs = []
    env = {**os.environ, "VERL_LOGGING_LEVEL": "WARN"}
    for rank in range(1, world_size):
        out = tmp_path / f"received-{rank}.pt"
        cmd = [sys.executable, "-c", RECEIVER, str(rank), str(world_size), str(port), str(bucket_size), str(out)]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env), out))
        started.append(procs[-1][0])
    return procs


def finish(procs: list[tuple]) -> list[tuple[int, dict, Path]]:
    results = []
    for proc, out in procs:
        stdout, stderr = proc.communicate(timeout=300)
        last = stdout.strip().splitlines()[-1] if stdout.strip() else "{}"
        assert last.startswith("{"), f"receiver printed no result (rc {proc.returncode}):\n{stderr[-3000:]}"
        results.append((proc.returncode, json.loads(last), out))
    return results


def sender(bucket_size: int = 1000):
    from verl.checkpoint_engine import CheckpointEngineRegistry

    return CheckpointEngineRegistry.new("gloo", bucket_size=bucket_size, is_master=True)


def join(engine, world_size: int) -> None:
    """prepare + build_topology + init_process_group for the sender, as verl's manager runs them."""
    rendezvous = engine.prepare()
    metadata = [rendezvous] + [None] * (world_size - 1)
    actor_kwargs, rollout_kwargs = type(engine).build_topology(1, world_size - 1, metadata)
    assert rollout_kwargs["rank"] == list(range(1, world_size))
    return rendezvous, {k: v[0] for k, v in actor_kwargs.items()}


def test_weights_arrive_bit_for_bit_in_two_rollout_processes(tmp_path, started):
    engine = sender()
    rendezvous, kwargs = join(engine, world_size=3)
    assert rendezvous.host == "127.0.0.1"
    procs = start_receivers(started, tmp_path, rendezvous.port, 3, engine.bucket_size)
    engine.init_process_group(**kwargs)  # returns once both receivers have joined
    listeners = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert listeners <= LOOPBACK_ADDRESSES, listeners  # rendezvous store and gloo's pairs: loopback only
    sent = weights()
    metrics = asyncio.run(engine.send_weights(iter(sent), global_steps=3))
    engine.finalize()

    total = sum(t.nbytes for _, t in sent)
    assert metrics["checkpoint_engine/tensors"] == len(sent)
    assert metrics["checkpoint_engine/payload_mbytes"] == pytest.approx(total / 2**20)
    assert metrics["checkpoint_engine/buckets"] >= total // engine.bucket_size
    for returncode, result, out in finish(procs):
        assert returncode == 0, result
        assert result["metrics"]["checkpoint_engine/tensors"] == len(sent)
        got = torch.load(out)
        assert got["names"] == [name for name, _ in sent]
        assert all(got["owned"])  # tensors of their own, not views into a bucket
        for (name, want), have in zip(sent, got["tensors"], strict=True):
            assert have.dtype == want.dtype and have.shape == want.shape, name
            assert torch.equal(bits(have), bits(want)), name  # NaN and -0.0 included


def test_a_failing_weight_generator_fails_the_receiver_too(tmp_path, started):
    engine = sender()
    rendezvous, kwargs = join(engine, world_size=2)
    procs = start_receivers(started, tmp_path, rendezvous.port, 2, engine.bucket_size)
    engine.init_process_group(**kwargs)

    def broken():
        yield "model.norm.weight", torch.ones(300)  # 1200 bytes: a full bucket goes out first
        yield "model.lm_head.weight", torch.ones(10)
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        asyncio.run(engine.send_weights(broken()))
    engine.finalize()
    [(returncode, result, _)] = finish(procs)
    assert returncode == 3 and "sender failed mid-sync: OSError: disk gone" in result["error"]


def test_bad_input_is_refused_with_a_clear_error():
    from sorl_verl import plugin
    from sorl_verl.cpu.checkpoint_engine import BACKEND, GlooCheckpointEngine, GlooRendezvous

    assert plugin.CHECKPOINT_ENGINE_BACKEND == BACKEND
    with pytest.raises(ValueError, match="bucket_size must be > 0"):
        GlooCheckpointEngine(bucket_size=0)
    with pytest.raises(ValueError, match="must be the gloo checkpoint engine's master"):
        GlooCheckpointEngine.build_topology(1, 1, [None, None])
    with pytest.raises(ValueError, match="expected 2 prepare"):
        GlooCheckpointEngine.build_topology(1, 1, [GlooRendezvous("127.0.0.1", 1)])
    with pytest.raises(RuntimeError, match=r"init_process_group\(\) must run before send_weights"):
        asyncio.run(GlooCheckpointEngine(bucket_size=10, is_master=True).send_weights(iter([])))
    receiver = GlooCheckpointEngine(bucket_size=10)
    with pytest.raises(ValueError, match="only meets on 127.0.0.1"):
        receiver.init_process_group(rank=1, world_size=2, rendezvous=GlooRendezvous("10.0.0.1", 1))
    with pytest.raises(ValueError, match="group rank 0 must be the master"):
        receiver.init_process_group(rank=0, world_size=2, rendezvous=GlooRendezvous("127.0.0.1", 1))

    # a world of one: the sender alone, so its checks run without peers
    engine = GlooCheckpointEngine(bucket_size=10, is_master=True)
    engine.init_process_group(rank=0, world_size=1, rendezvous=engine.prepare())
    with pytest.raises(TypeError, match=r"\(str, torch.Tensor\), got \(str, list\)"):
        asyncio.run(engine.send_weights(iter([("w", [1.0, 2.0])])))

    async def receive_on_rank_0():
        return [x async for x in engine.receive_weights()]

    with pytest.raises(RuntimeError, match="rank 0 sends weights"):
        asyncio.run(receive_on_rank_0())
    engine.finalize()
