"""``clip_norm_reference = gradient`` inside FSDP2 (``fully_shard``) on gloo ranks, with verl's
engine pattern (gradient sync only on the last micro-batch, ``global_batch_info`` scaling):
the extra vector-Jacobian product leaves the real gradients as they are, two ranks' parameter
gradients equal one process's, ``||C(theta)||`` of two ranks (scope ``global``) equals that of one
rank holding both ranks' rows, and q does not depend on how a mini-batch is split (one micro-batch
of 8 rows, two of 4, two ranks of 4)."""

from __future__ import annotations

import pytest
import torch
from _fsdp_ranks import load, rank_script
from verl.workers.config import ActorConfig

from sorl_verl.algorithms.clip_bias_grad import DIAGNOSTIC
from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.losses import compute_policy_loss_so_grpo

CASES = load("unit/test_algo_clip_bias_grad.py")
TinyLM, problem, per_token_jacobian = CASES.TinyLM, CASES.problem, CASES.per_token_jacobian

MICRO_BATCHES = 2
ROWS = 8  # 4 rows per micro-batch: 2 per rank with two ranks


def shard(t: torch.Tensor, micro_batch: int, rank: int, world: int) -> torch.Tensor:
    """Rows of ``micro_batch`` held by ``rank``: micro-batch i is the same rows whatever the world size."""
    rows = t.shape[0] // MICRO_BATCHES
    per_rank = rows // world
    start = micro_batch * rows + rank * per_rank
    return t[start : start + per_rank]


def run_step(model, data, rank, world, reference, tau, engine_hooks):
    """verl's engine loop: sync gradients on the last micro-batch only, backward each loss."""
    ids, old, adv, mask = data
    cfg = ActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=SORLPolicyLossConfig(
            clip_norm_reference=reference, clip_norm_tau=tau, clip_norm_scope="global", clip_norm_apply="loss"
        ),
    )
    cfg.global_batch_info.update(dp_size=world, batch_num_tokens=int(mask.sum()))
    metrics = []
    for i in range(MICRO_BATCHES):
        if engine_hooks:
            model.set_requires_gradient_sync(i == MICRO_BATCHES - 1)
        DIAGNOSTIC.due = False  # only the reference under test takes a product
        part = [shard(t, i, rank, world) for t in (ids, old, adv, mask)]
        loss, m = compute_policy_loss_so_grpo(part[1], model(part[0]), part[2], part[3], "token-mean", cfg)
        loss.backward()
        metrics.append([m.get("sorl/clip_bias_grad_norm"), m["sorl/norm_factor"]])
    return metrics


#: each rank (after the shared preamble: ``case`` is this file, ``data`` the saved problem)
RANK_SCRIPT = rank_script("""
from torch.distributed.fsdp import fully_shard
run_step, TinyLM = case.run_step, case.TinyLM
out = {}
for reference, tau in (("absolute", 1e30), ("gradient", 1e30), ("gradient", 1e-3)):
    model = TinyLM(seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    metrics = run_step(model, data, rank, world, reference, tau, engine_hooks=True)
    grads = [p.grad.full_tensor().reshape(-1).tolist() for p in model.parameters()]
    out[f"{reference}-{tau:g}"] = {"metrics": metrics, "grads": grads}
finish("RESULT" + json.dumps(out))
""")


def local_gradient_mass(data, world: int) -> torch.Tensor:
    """Sum over ranks and micro-batches of |local gradient| / world: what FSDP adds up per element."""
    model = TinyLM(seed=0)
    mass = [torch.zeros_like(p).reshape(-1) for p in model.parameters()]
    for rank in range(world):
        model.zero_grad(set_to_none=True)
        run_step(model, data, rank, world, "absolute", 1e30, engine_hooks=False)
        for m, p in zip(mass, model.parameters(), strict=True):
            m += p.grad.reshape(-1).abs() / world
    return torch.cat(mass)


def single_process_grads(data, loss_step, **kwargs) -> torch.Tensor:
    """Parameter gradients of ``loss_step`` on one process holding every rank's rows (plain TinyLM, world 1)."""
    model = TinyLM(seed=0)
    loss_step(model, data, 0, 1, engine_hooks=False, **kwargs)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def gradient_bound(data, world: int) -> torch.Tensor:
    """Per parameter element: how far two float64 evaluations of the mini-batch's gradient may be apart.

    The gradient is ``sum_t dl/dlogp_t * grad logp_t`` over the mini-batch's tokens (the loss with Z = 1;
    a Z > 1 only shrinks it). Any evaluation order of that sum (rows batched otherwise, ranks' gradients
    added, the mean over ``world``) is within ``n * eps`` of ``mass = sum_t |dl/dlogp_t| |grad logp_t|``
    with ``n`` = tokens + ranks, each ``grad logp_t`` within its chain's roundings; two evaluations twice that.
    """
    ids, old, adv, mask = data
    model = TinyLM(seed=0)
    jac = per_token_jacobian(model, ids)  # [B, T, P]
    cfg = ActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        policy_loss=SORLPolicyLossConfig(clip_norm_reference="absolute", clip_norm_tau=1e30, clip_norm_apply="loss"),
    )  # fmt: skip
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()))
    weights = torch.zeros(mask.shape, dtype=torch.float64)
    rows = ids.shape[0] // MICRO_BATCHES
    for i in range(MICRO_BATCHES):
        part = slice(i * rows, (i + 1) * rows)
        log_prob = model(ids[part]).detach().requires_grad_(True)
        loss, _ = compute_policy_loss_so_grpo(old[part], log_prob, adv[part], mask[part], "token-mean", cfg)
        (weights[part],) = torch.autograd.grad(loss, log_prob)
    mass = torch.einsum("bt,btp->p", weights.abs(), jac.abs())
    hidden, vocab = model.head.in_features, model.head.out_features
    chain = (len(model.blocks) + 1) * hidden + vocab  # blocks' and head's hidden sums, log-softmax's vocabulary sum
    return 2 * (int(mask.sum()) + world + chain) * torch.finfo(torch.float64).eps * mass


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, gloo_ranks):
    _, ids, old, adv, mask = problem(seed=41, rows=ROWS, length=10)
    mask[3] = False  # rank 1's first micro-batch: rows 2-3, one of them without policy tokens (row 7 too)
    data = (ids, old, adv, mask)
    path = str(tmp_path_factory.mktemp("fsdp") / "data.pt")
    torch.save(data, path)
    return data, {world: gloo_ranks(RANK_SCRIPT, world, path, __file__) for world in (1, 2)}


def flat(grads: list[list[float]]) -> torch.Tensor:
    return torch.tensor([g for p in grads for g in p], dtype=torch.float64)


def test_one_rank_extra_product_leaves_the_step_bit_for_bit(ranks):
    (result,) = ranks[1][1]
    base, with_c = result["absolute-1e+30"], result["gradient-1e+30"]
    assert all(m[0] is None for m in base["metrics"]) and all(m[0] > 0 and m[1] == 1.0 for m in with_c["metrics"])
    assert torch.equal(flat(base["grads"]), flat(with_c["grads"]))


def test_two_ranks_extra_product_leaves_the_step_within_the_reordered_sum(ranks):
    """With two ranks FSDP2 may reduce-scatter the earlier micro-batches' accumulated gradient in the
    product's backward and the last micro-batch's in the real one: the same float64 sums in another
    order, so each element differs by at most a few roundings of the summed magnitudes."""
    data, results = ranks
    bound = 4 * torch.finfo(torch.float64).eps * local_gradient_mass(data, 2)
    for result in results[2]:
        base, with_c = flat(result["absolute-1e+30"]["grads"]), flat(result["gradient-1e+30"]["grads"])
        assert bool(((base - with_c).abs() <= bound).all())


def test_two_ranks_equal_one_rank(ranks):
    _, results = ranks
    (one,) = results[1]
    for result in results[2]:
        for key in ("gradient-1e+30", "gradient-0.001"):
            for (norm_2, z_2), (norm_1, z_1) in zip(result[key]["metrics"], one[key]["metrics"], strict=True):
                assert norm_1 > 0
                # float64 sums of a few hundred terms in another order, then one all-reduce
                assert norm_2 == pytest.approx(norm_1, rel=1e-12)
                assert z_2 == pytest.approx(z_1, rel=1e-12)
    assert results[2][0]["gradient-0.001"]["metrics"] == results[2][1]["gradient-0.001"]["metrics"]


@pytest.mark.parametrize("key", ["absolute-1e+30", "gradient-0.001"])
def test_two_ranks_leave_the_single_process_parameter_gradients(ranks, key):
    """FSDP2 on two ranks (the product taken or not, Z = 1 or > 1) leaves one process's gradients."""
    data, results = ranks
    reference, tau = key.split("-", 1)
    want = single_process_grads(data, run_step, reference=reference, tau=float(tau))
    bound = gradient_bound(data, world=2)
    for result in results[2]:
        got = flat(result[key]["grads"])
        assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())


def split_qs(model, data, rank: int, world: int, micro_batches: int, scope: str) -> list[float]:
    """``||C(theta)||`` of each micro-batch when the mini-batch ``data`` is split into ``micro_batches``
    per rank over ``world`` ranks (rank r holds the r-th share of each micro-batch's rows)."""
    ids, old, adv, mask = data
    cfg = ActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        policy_loss=SORLPolicyLossConfig(clip_norm_reference="gradient", clip_norm_tau=1e30, clip_norm_scope=scope),
    )  # fmt: skip
    cfg.global_batch_info.update(dp_size=world, batch_num_tokens=int(mask.sum()))
    rows = ids.shape[0] // (micro_batches * world)
    qs = []
    for i in range(micro_batches):
        start = (i * world + rank) * rows
        part = [t[start : start + rows] for t in (ids, old, adv, mask)]
        _, metrics = compute_policy_loss_so_grpo(part[1], model(part[0]), part[2], part[3], "token-mean", cfg)
        qs.append(metrics["sorl/clip_bias_grad_norm"])
    return qs


#: world 1 splits 8 rows into 1 and 2 micro-batches, world 2 into 1 each (after the shared preamble)
SPLIT_SCRIPT = rank_script("""
from torch.distributed.fsdp import fully_shard
model = case.TinyLM(seed=0)
for block in model.blocks:
    fully_shard(block)
fully_shard(model)
out = {}
for scope in ("micro_batch", "global"):
    for micro_batches in ((1, 2) if world == 1 else (1,)):
        out[f"{scope}-{micro_batches}"] = case.split_qs(model, data, rank, world, micro_batches, scope)
finish("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def split(tmp_path_factory, gloo_ranks):
    """A mini-batch of 8 rows whose halves are the same 4 rows: each half's C(theta) is the whole's."""
    _, ids, old, adv, mask = problem(seed=43, rows=4, length=10)
    data = tuple(torch.cat([t, t]) for t in (ids, old, adv, mask))
    path = str(tmp_path_factory.mktemp("split") / "data.pt")
    torch.save(data, path)
    return {world: gloo_ranks(SPLIT_SCRIPT, world, path, __file__) for world in (1, 2)}


@pytest.mark.parametrize("scope", ["micro_batch", "global"])
def test_q_does_not_depend_on_how_the_mini_batch_is_split(split, scope):
    """One micro-batch of 8 rows, two of 4, and two ranks of 4 give the same q (SORL-SPEC)."""
    (one,) = split[1]
    (whole,) = one[f"{scope}-1"]
    assert whole > 0
    halves = one[f"{scope}-2"] + [q for rank in split[2] for q in rank[f"{scope}-1"]]
    assert len(halves) == 4
    for q in halves:
        assert q == pytest.approx(whole, rel=1e-12)  # float64 sums of a few hundred terms in another order
