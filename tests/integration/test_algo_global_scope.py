"""clip_norm_scope=global: gloo ranks share one ||C||, equal to micro_batch scope over the union; the
reduction uses the data-parallel group (only the ranks that compute the loss), and the update-scaled
optimizer averages its step factor over that group."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from verl.workers.config import ActorConfig

from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.losses import compute_policy_loss_so_grpo
from sorl_verl.algorithms.parallel import data_parallel_group, set_data_parallel_group


def shards(seed: int = 0):
    """Two ranks' micro-batches with different clipping levels (rank 1 heavily off-policy)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rank, spread in enumerate((0.1, 1.5)):
        mask = torch.rand(4, 24, generator=gen) < 0.6
        mask[rank] = False  # each rank also has a row without policy tokens
        old = -torch.rand(4, 24, generator=gen)
        new = old + spread * torch.randn(4, 24, generator=gen)
        adv = torch.randn(4, 1, generator=gen).expand(-1, 24).contiguous()
        out.append((old, new, adv, mask))
    return out


def norm_tolerance(fp32, parts, norm: float) -> float:
    """Two float32 evaluations of ``||C|| = sqrt(S / N)`` whose sums run in different orders (each rank's
    partial sums all-reduced, or the union's one sum). ``S`` sums ``n`` terms ``c^2 = (r A)^2``, each
    within ``2 (T + 4) u max(1, |d|)`` relatively (the turn mean of ``d`` over <= ``T`` tokens and its exp
    set r's relative error; the product and the square add theirs), the sum within ``n u S``: two
    evaluations of ``S`` differ by twice each, relatively. ``|sqrt(S'/N) - sqrt(S/N)| <= ||C|| |S' - S| / S``."""
    n, length = sum(p[3].numel() for p in parts), parts[0][3].shape[1]
    d_max = max(float((new - old)[mask].abs().max()) for old, new, _, mask in parts)
    term = fp32.rounding(2 * max(1.0, d_max), length + 4)
    return norm * (fp32.between(1.0, n) + 2 * term)


def actor(scope: str) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=4,
        policy_loss=SORLPolicyLossConfig(clip_norm_scope=scope, clip_norm_tau=0.5, clip_norm_reference="absolute"),
    )


# Rank scripts run by the gloo_ranks fixture (tests/integration/conftest.py): argv = rank, world,
# port, shards path; they end with its finish().
# One launch of two gloo ranks serves both two-rank tests (each launch imports verl in every rank):
# the optimizer step first, on the empty ledger of a fresh interpreter, then both clipping scopes.
TWO_RANK_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from verl.workers.config import ActorConfig
from sorl_verl.algorithms import optim
from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.losses import compute_policy_loss_so_grpo
rank, port, path = int(sys.argv[1]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
# two data-parallel ranks with different normalizers in one optimizer step
param = torch.nn.Parameter(torch.ones(4))
opt = optim.SGD([param], lr=0.1)
opt.zero_grad()
param.grad = torch.ones(4)
for z in ([1.0, 1.0] if rank == 0 else [3.0, 2.0]):
    optim.LEDGER.record(1.0 / z, z, 0.0, 0.0)
opt.step()
out = {"optimizer": {"scale": opt.last_update["scale"], "param": param.tolist()}}
optim.LEDGER.clear()  # the losses below publish their normalizers to the ledger
old, new, adv, mask = torch.load(path)[rank]
def config_of(scope):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=4,
                       policy_loss=SORLPolicyLossConfig(clip_norm_scope=scope, clip_norm_tau=0.5, clip_norm_reference="absolute"))
for scope in ("global", "micro_batch"):
    _, metrics = compute_policy_loss_so_grpo(old, new, adv, mask, "token-mean", config_of(scope))
    out[scope] = [metrics["sorl/clip_bias_norm"], metrics["sorl/norm_factor"]]
# Megatron's branch of data_parallel_group(), on a STAND-IN for megatron.core.parallel_state (Megatron-Core
# is not installed here) that makes each rank its own data-parallel group of one
import types
from sorl_verl.algorithms.parallel import data_parallel_group
singles = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group
stand_in = types.ModuleType("megatron.core.parallel_state")
stand_in.initialized = False
stand_in.model_parallel_is_initialized = lambda: stand_in.initialized
stand_in.get_data_parallel_group = lambda: singles[rank]
sys.modules["megatron.core.parallel_state"] = stand_in
out["megatron_uninitialized_is_world"] = data_parallel_group() is dist.group.WORLD
stand_in.initialized = True
out["megatron_group_is_its"] = data_parallel_group() is singles[rank]
_, metrics = compute_policy_loss_so_grpo(old, new, adv, mask, "token-mean", config_of("global"))
out["megatron"] = [metrics["sorl/clip_bias_norm"], metrics["sorl/norm_factor"]]
del sys.modules["megatron.core.parallel_state"]
finish("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, gloo_ranks) -> list[dict]:
    """Each rank's results of :data:`TWO_RANK_SCRIPT` on :func:`shards` (seed 0)."""
    path = tmp_path_factory.mktemp("two_ranks") / "shards.pt"
    torch.save(shards(), path)
    return gloo_ranks(TWO_RANK_SCRIPT, 2, str(path))


def test_global_scope_equals_micro_batch_scope_over_the_union(two_ranks, fp32):
    parts, ranks = shards(), two_ranks
    # The union of both ranks' rows as one micro-batch, micro_batch scope, in this process.
    union = [torch.cat([p[i] for p in parts]) for i in range(4)]
    _, union_metrics = compute_policy_loss_so_grpo(*union, "token-mean", actor("micro_batch"))
    tol = norm_tolerance(fp32, parts, union_metrics["sorl/clip_bias_norm"])
    for result in ranks:
        norm, z = result["global"]
        assert abs(norm - union_metrics["sorl/clip_bias_norm"]) <= tol
        assert abs(z - union_metrics["sorl/norm_factor"]) <= tol / 0.5  # Z = ||C|| / tau above 1
    assert ranks[0]["global"][1] == ranks[1]["global"][1] > 1.0  # both ranks scale by the same Z
    assert ranks[0]["micro_batch"][1] != ranks[1]["micro_batch"][1]  # local scope would differ


# 4 ranks laid out like pipeline parallelism with 2 stages x 2 data-parallel ranks: only the last
# stage (ranks 2, 3) computes the loss, so the reduction must stay inside its data-parallel group.
PIPELINE_SCRIPT = """
import json, sys, torch, torch.distributed as dist
from verl.workers.config import ActorConfig
from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.losses import compute_policy_loss_so_grpo
from sorl_verl.algorithms.parallel import set_data_parallel_group
rank, port, path = int(sys.argv[1]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
out = {}
if rank >= 2:
    set_data_parallel_group(groups[1])
    old, new, adv, mask = torch.load(path)[rank - 2]
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=4,
                         policy_loss=SORLPolicyLossConfig(clip_norm_scope="global", clip_norm_tau=0.5, clip_norm_reference="absolute"))
    _, metrics = compute_policy_loss_so_grpo(old, new, adv, mask, "token-mean", config)
    out["global"] = [metrics["sorl/clip_bias_norm"], metrics["sorl/norm_factor"]]
dist.barrier()
finish("RESULT" + json.dumps(out))
"""


def test_global_scope_reduces_over_the_data_parallel_group_of_the_ranks_that_compute_the_loss(
    tmp_path, gloo_ranks, fp32
):
    parts = shards(seed=1)
    torch.save(parts, tmp_path / "shards.pt")
    ranks = gloo_ranks(PIPELINE_SCRIPT, 4, str(tmp_path / "shards.pt"))
    union = [torch.cat([p[i] for p in parts]) for i in range(4)]
    _, union_metrics = compute_policy_loss_so_grpo(*union, "token-mean", actor("micro_batch"))
    assert ranks[0] == ranks[1] == {}
    tol = norm_tolerance(fp32, parts, union_metrics["sorl/clip_bias_norm"])
    assert union_metrics["sorl/norm_factor"] > 1.0  # Z = ||C|| / tau: its tolerance is tol / tau
    for result in ranks[2:]:
        assert abs(result["global"][0] - union_metrics["sorl/clip_bias_norm"]) <= tol
        assert abs(result["global"][1] - union_metrics["sorl/norm_factor"]) <= tol / 0.5


# Two data-parallel ranks with different normalizers in one optimizer step (TWO_RANK_SCRIPT): the step
# factor is the mean of 1/Z over both ranks' micro-batches, so every rank (and every FSDP shard) scales alike.
def test_optimizer_step_factor_is_averaged_over_data_parallel_ranks(two_ranks):
    ranks = [result["optimizer"] for result in two_ranks]
    expected = (1 + 1 + 1 / 3 + 1 / 2) / 4
    for result in ranks:
        assert abs(result["scale"] - expected) < 1e-15
        assert result["param"] == ranks[0]["param"]


def test_global_scope_reduces_over_megatrons_data_parallel_group(two_ranks):
    """With ``megatron.core.parallel_state`` initialized (a stand-in in TWO_RANK_SCRIPT: Megatron-Core is
    not installed here), the sums are reduced over the group it names, not the world: with each rank its
    own group of one, each rank gets its micro_batch-scope result exactly, not the ranks' shared one.
    Before parallel_state is initialized the world group is used."""
    for result in two_ranks:
        assert result["megatron_uninitialized_is_world"] and result["megatron_group_is_its"]
        assert result["megatron"] == result["micro_batch"]  # a group of one: the all-reduce adds nothing
    assert two_ranks[0]["megatron"] != two_ranks[1]["megatron"]
    assert two_ranks[0]["global"] != two_ranks[0]["micro_batch"]  # the world's reduction would differ


def test_megatron_without_its_data_parallel_group_fails_naming_the_fixes(monkeypatch):
    """parallel_state (a stand-in) initialized but unable to give its data-parallel group: the error names
    clip_norm_scope=micro_batch and set_data_parallel_group; a group set explicitly takes precedence."""

    def no_group():
        raise AssertionError("data parallel group is not initialized")

    stand_in = types.ModuleType("megatron.core.parallel_state")
    stand_in.model_parallel_is_initialized = lambda: True
    stand_in.get_data_parallel_group = no_group
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", stand_in)
    with pytest.raises(RuntimeError, match=r"clip_norm_scope=micro_batch.*set_data_parallel_group\(group\)"):
        data_parallel_group()
    explicit = object()
    set_data_parallel_group(explicit)
    try:
        assert data_parallel_group() is explicit
    finally:
        set_data_parallel_group(None)
