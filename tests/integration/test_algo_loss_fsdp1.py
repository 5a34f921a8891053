"""The registered ``so_grpo`` loss under torch FSDP1 (``FullyShardedDataParallel``, verl's ``strategy=fsdp``)
on two gloo ranks (CPU ``device_id``), with verl's engine pattern (``no_sync`` on all but the last
micro-batch, ``global_batch_info`` scaling) and off-policy inputs that clip: the parameter-space
diagnostic, due at the step's first micro-batch, is left out with one warning naming FSDP1, the
parameter gradients are the single-process ones (``use_orig_params`` False and True), and
``clip_norm_reference=gradient`` is refused at the loss's first call naming ``strategy=fsdp2``."""

from __future__ import annotations

import pytest
import torch
from _fsdp_ranks import load, rank_script

FSDP2_CASE = load("integration/test_algo_clip_bias_grad_fsdp.py")
TinyLM, problem, shard, flat = FSDP2_CASE.TinyLM, FSDP2_CASE.problem, FSDP2_CASE.shard, FSDP2_CASE.flat
MICRO_BATCHES = FSDP2_CASE.MICRO_BATCHES


def so_grpo_step(model, data, rank: int, world: int, reference: str = "relative", no_sync=None) -> list[dict]:
    """verl's engine loop over the registered ``so_grpo`` loss at its defaults (the diagnostic due on the
    first micro-batch, as after an optimizer step); ``no_sync()`` around all but the last micro-batch."""
    import contextlib

    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig

    from sorl_verl.algorithms.clip_bias_grad import DIAGNOSTIC
    from sorl_verl.algorithms.config import SORLPolicyLossConfig

    ids, old, adv, mask = data
    cfg = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
        policy_loss=SORLPolicyLossConfig(loss_mode="so_grpo", clip_norm_reference=reference),
    )  # fmt: skip
    cfg.global_batch_info.update(dp_size=world, batch_num_tokens=int(mask.sum()))
    loss_fn = get_policy_loss_fn("so_grpo")
    DIAGNOSTIC.due = True
    metrics = []
    for i in range(MICRO_BATCHES):
        last = i == MICRO_BATCHES - 1
        part = [shard(t, i, rank, world) for t in (ids, old, adv, mask)]
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            loss, m = loss_fn(part[1], model(part[0]), part[2], part[3], "token-mean", cfg)
            loss.backward()
        metrics.append(m)
    return metrics


#: each rank (after the shared preamble: ``case`` is this file, ``data`` the saved problem)
RANK_SCRIPT = rank_script("""
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from sorl_verl.algorithms.clip_bias_grad import SecondBackwardUnsafe, is_fsdp1_graph, graph_leaves

def wrap(use_orig_params):
    return FSDP(case.TinyLM(seed=0), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                device_id=torch.device("cpu"), use_orig_params=use_orig_params)

def full_grads(model):
    # every FSDP unit's flat gradient shard gathered, unpadded and cut into its parameters
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDP) or module._handle is None:
            continue
        flat_param = module._handle.flat_param
        parts = [torch.zeros_like(flat_param.grad) for _ in range(world)]
        dist.all_gather(parts, flat_param.grad.contiguous())
        full, offset, fqns = torch.cat(parts), 0, iter(flat_param._fqns)
        padding = getattr(flat_param, "_is_padding_mask", [False] * len(flat_param._numels_with_padding))
        prefix = name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
        for numel, is_padding in zip(flat_param._numels_with_padding, padding):
            if not is_padding:
                out[".".join(filter(None, (prefix, next(fqns))))] = full[offset : offset + numel].tolist()
            offset += numel
    return out

out = {"warnings": []}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for use_orig_params in (False, True):
        model = wrap(use_orig_params)
        out[f"fsdp1_graph-{use_orig_params}"] = is_fsdp1_graph(graph_leaves(model(data[0][:2])))
        metrics = case.so_grpo_step(model, data, rank, world, no_sync=model.no_sync)
        out[f"grads-{use_orig_params}"] = full_grads(model)
        out[f"metrics-{use_orig_params}"] = metrics
out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
try:
    case.so_grpo_step(wrap(False), data, rank, world, reference="gradient", no_sync=None)
except SecondBackwardUnsafe as exc:
    out["refusal"] = str(exc)
finish("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory, gloo_ranks):
    _, ids, old, adv, mask = problem(seed=41, rows=FSDP2_CASE.ROWS, length=10)
    mask[3] = False  # a row without policy tokens on rank 1's first micro-batch
    data = (ids, old, adv, mask)
    path = str(tmp_path_factory.mktemp("fsdp1") / "data.pt")
    torch.save(data, path)
    return data, gloo_ranks(RANK_SCRIPT, 2, path, __file__)


def test_detection_sees_fsdp1_flat_parameters_in_a_real_fsdp1_graph(fsdp1):
    from sorl_verl.algorithms.clip_bias_grad import graph_leaves, is_fsdp1_graph

    _, ranks = fsdp1
    for result in ranks:
        assert result["fsdp1_graph-False"] is True and result["fsdp1_graph-True"] is True
    model, ids, *_ = problem()
    assert is_fsdp1_graph(graph_leaves(model(ids))) is False  # a plain module's parameters


def test_diagnostic_is_off_with_one_warning_naming_fsdp1(fsdp1):
    data, ranks = fsdp1
    for result in ranks:
        (warning,) = result["warnings"]  # two wrapped models, two steps: one warning per process
        assert "strategy=fsdp:" in warning and "strategy=fsdp2" in warning and "FSDP1" in warning
        for key in ("metrics-False", "metrics-True"):
            assert all("sorl/clip_bias_grad_norm" not in m for m in result[key])
            assert result[key][0]["sorl/turn_clipfrac"] > 0  # tokens clipped: the product would have run


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_two_fsdp1_ranks_leave_the_single_process_gradients(fsdp1, use_orig_params):
    from sorl_verl.algorithms import optim

    data, ranks = fsdp1
    model = TinyLM(seed=0)
    actor_optimizer = optim.AdamW(model.parameters())  # takes so_grpo's 1/Z (clip_norm_apply=update), never steps
    so_grpo_step(model, data, 0, 1)  # one process, every row, the diagnostic taken (plain module)
    del actor_optimizer
    names = [name for name, _ in model.named_parameters()]
    want = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    bound = FSDP2_CASE.gradient_bound(data, world=2)
    for result in ranks:
        grads = result[f"grads-{use_orig_params}"]
        assert sorted(grads) == sorted(names)
        got = flat([grads[name] for name in names])
        assert bool(((got - want).abs() <= bound).all()), float((got - want).abs().max())


def test_gradient_reference_is_refused_at_the_first_loss_call_naming_fsdp2(fsdp1):
    _, ranks = fsdp1
    for result in ranks:
        assert "clip_norm_reference=gradient" in result["refusal"]
        assert "strategy=fsdp2" in result["refusal"]
