"""The clipping-bias term in parameter space (``clip_norm_reference = gradient``) against explicit
per-token gradients of a tiny model in float64, the no-clipping identities, the once-per-step
diagnostic and ``vanilla_diag`` = verl's ``vanilla``."""

from __future__ import annotations

import math

import pytest
import torch
from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_vanilla, get_policy_loss_fn
from verl.workers.config import ActorConfig

from sorl_verl.algorithms import optim
from sorl_verl.algorithms.clip_bias_grad import DIAGNOSTIC, SecondBackwardUnsafe, graph_leaves
from sorl_verl.algorithms.config import SORLPolicyLossConfig
from sorl_verl.algorithms.losses import compute_policy_loss_vanilla_diag

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOW = HIGH = 0.2
CLIP_C = 3.0


@pytest.fixture(autouse=True)
def fresh_state():
    """A SORL optimizer in the process (as in verl's actor worker), an empty ledger, the diagnostic due."""
    opt = optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    optim.LEDGER.clear()
    DIAGNOSTIC.due = True
    yield opt
    optim.LEDGER.clear()


class TinyLM(torch.nn.Module):
    """Embedding, two residual tanh blocks and a head: log-probs of the next token (float64)."""

    def __init__(self, vocab: int = 11, hidden: int = 6, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, hidden).double()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden).double() for _ in range(2))
        self.head = torch.nn.Linear(hidden, vocab).double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids[:, :-1])
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return torch.log_softmax(self.head(h), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]


def ragged_mask(rows: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """1-3 turns per row with gaps, right padding, and a last row without policy tokens."""
    mask = torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows - 1):
        pos = int(torch.randint(0, 2, (1,), generator=gen))
        for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
            size = int(torch.randint(1, 5, (1,), generator=gen))
            mask[b, pos : pos + size] = True
            pos += size + int(torch.randint(1, 3, (1,), generator=gen))
    return mask


def problem(seed: int = 0, rows: int = 4, length: int = 12, spread: float = 0.8, negative_share: float = 0.5):
    """(model, ids, old_log_prob, advantages, mask): a tiny model and an off-policy micro-batch with
    clipping on both sides and in the dual-clip region (some A < 0 with large ratios)."""
    gen = torch.Generator().manual_seed(seed)
    model = TinyLM(seed=seed)
    ids = torch.randint(0, 11, (rows, length + 1), generator=gen)
    mask = ragged_mask(rows, length, gen)
    with torch.no_grad():
        old = model(ids) + spread * torch.randn(rows, length, generator=gen, dtype=torch.float64)
    old[: rows // 2, : length // 2] -= 2.0  # ratios far above 1 + clip_ratio_c
    sign = torch.where(torch.rand(rows, 1, generator=gen) < negative_share, -1.0, 1.0).double()
    adv = (sign * (0.5 + torch.rand(rows, length, generator=gen, dtype=torch.float64))).contiguous()
    return model, ids, old, adv, mask


def config(reference: str = "gradient", tau: float = 1e-3, batch_info: dict | None = None, **knobs) -> ActorConfig:
    policy_loss = SORLPolicyLossConfig(
        clip_norm_reference=reference, clip_norm_tau=tau, clip_norm_apply=knobs.pop("apply", "loss"), **knobs
    )
    cfg = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss)
    cfg.global_batch_info.update(batch_info or {})
    return cfg


def turn_mean(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``d`` over each token's turn (maximal run of ones), by a Python loop over positions."""
    out = torch.zeros_like(d)
    for b in range(mask.shape[0]):
        t = 0
        while t < mask.shape[1]:
            if not mask[b, t]:
                t += 1
                continue
            end = t
            while end < mask.shape[1] and mask[b, end]:
                end += 1
            out[b, t:end] = d[b, t:end].mean()
            t = end
    return out


def reference_cotangents(old, log_prob, adv, mask, turn_level, mode, batch_info, weights=None):
    """``(dl/dd, dl_u/dd)`` in float64 by autograd through a plain re-implementation of the spec's loss."""
    lp = log_prob.detach().clone().requires_grad_(True)
    d = torch.where(mask, lp - old, 0.0)
    r = torch.exp(turn_mean(d, mask) if turn_level else d)
    pg1 = -adv * r
    pg2 = -adv * torch.clamp(r, 1 - LOW, 1 + HIGH)
    clip1 = torch.maximum(pg1, pg2)
    L = torch.where(adv < 0, torch.minimum(clip1, -adv * CLIP_C), clip1)
    if weights is not None:
        L, pg1 = L * weights, pg1 * weights
    loss = agg_loss(loss_mat=L, loss_mask=mask, loss_agg_mode=mode, **batch_info)
    loss_u = agg_loss(loss_mat=pg1, loss_mask=mask, loss_agg_mode=mode, **batch_info)
    (g,) = torch.autograd.grad(loss, lp, retain_graph=True)
    (g_u,) = torch.autograd.grad(loss_u, lp)
    return g, g_u


def per_token_jacobian(model: TinyLM, ids: torch.Tensor) -> torch.Tensor:
    """``[B, T, P]``: the gradient of every token's log-prob w.r.t. all parameters, one backward each."""
    params = list(model.parameters())
    log_prob = model(ids)
    rows = []
    for index in range(log_prob.numel()):
        grads = torch.autograd.grad(log_prob.reshape(-1)[index], params, retain_graph=True)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows).reshape(*log_prob.shape, -1)


def explicit_norms(model, ids, old, adv, mask, turn_level, mode, batch_info, weights=None):
    """``(||C(theta)||, ||C(theta)|| / ||grad l_u||)`` from explicit per-token gradients."""
    jac = per_token_jacobian(model, ids)
    g, g_u = reference_cotangents(old, model(ids), adv, mask, turn_level, mode, batch_info, weights)
    c = torch.einsum("bt,btp->p", g_u - g, jac)
    grad_u = torch.einsum("bt,btp->p", g_u, jac)
    return float(c.norm()), float(c.norm() / grad_u.norm())


def copies_batch_info(mask: torch.Tensor, copies: int, dp_size: int) -> dict:
    """verl's ``global_batch_info`` for a mini-batch of ``copies`` identical copies of this micro-batch
    spread over ``dp_size`` ranks (``{}``, verl's local aggregation, for a single copy)."""
    if copies == 1:
        return {}
    rows = int((mask.sum(-1) > 0).sum())
    return {"dp_size": dp_size, "batch_num_tokens": copies * int(mask.sum()), "global_batch_size": copies * rows}


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode,turn_level", [("so_grpo", True), ("s_ppo", False)])
@pytest.mark.parametrize("copies", [1, 4], ids=["local", "one_of_4_copies_on_2_ranks"])
def test_gradient_reference_equals_explicit_per_token_gradients(mode, loss_mode, turn_level, copies):
    """q is ||C(theta)|| of the whole mini-batch: with verl's global aggregation a micro-batch that is one
    of 4 identical parts (2 ranks x 2 micro-batches) gives the q of the 4 copies taken as one batch."""
    model, ids, old, adv, mask = problem(seed=3)
    whole = [torch.cat([t] * copies) for t in (ids, old, adv, mask)]
    want_norm, want_rel = explicit_norms(model, *whole, turn_level, mode, {})
    assert want_norm > 0
    for reference in ("gradient", "gradient_relative"):
        cfg = config(reference, tau=1e-3, batch_info=copies_batch_info(mask, copies, dp_size=2))
        _, metrics = get_policy_loss_fn(loss_mode)(old, model(ids), adv, mask, mode, cfg)
        # float64 throughout: a few roundings of sums of O(100) terms of size O(1)
        assert metrics["sorl/clip_bias_grad_norm"] == pytest.approx(want_norm, rel=1e-10)
        q = want_rel if reference == "gradient_relative" else want_norm
        assert metrics["sorl/norm_factor"] == pytest.approx(max(1.0, q / 1e-3), rel=1e-10)
        if reference == "gradient_relative":
            assert metrics["sorl/clip_bias_grad_rel"] == pytest.approx(want_rel, rel=1e-10)


def test_rollout_is_weights_enter_the_cotangent_as_the_loss_applies_them():
    model, ids, old, adv, mask = problem(seed=5)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) + 0.5
    want, _ = explicit_norms(model, ids, old, adv, mask, True, "token-mean", {}, weights)
    _, metrics = get_policy_loss_fn("so_grpo")(old, model(ids), adv, mask, "token-mean", config(), weights)
    assert metrics["sorl/clip_bias_grad_norm"] == pytest.approx(want, rel=1e-10)


def test_dual_clip_region_is_part_of_the_removed_gradient():
    """All advantages negative with ratios above clip_ratio_c: only the dual clip removes gradient."""
    model, ids, old, adv, mask = problem(seed=7, negative_share=1.0)
    adv = -adv.abs()
    with torch.no_grad():
        old = model(ids) - 2.0  # r = e^2 > clip_ratio_c = 3 everywhere: dual-clip region
    want, _ = explicit_norms(model, ids, old, adv, mask, False, "token-mean", {})
    _, metrics = get_policy_loss_fn("s_ppo")(old, model(ids), adv, mask, "token-mean", config())
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/pg_clipfrac_lower"] > 0
    assert want > 0
    assert metrics["sorl/clip_bias_grad_norm"] == pytest.approx(want, rel=1e-10)


def grads_of_step(model, ids, old, adv, mask, cfg, loss_mode="so_grpo", mode="token-mean"):
    model.zero_grad(set_to_none=True)
    loss, metrics = get_policy_loss_fn(loss_mode)(old, model(ids), adv, mask, mode, cfg)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()], metrics


@pytest.mark.parametrize("reference", ["gradient", "gradient_relative"])
@pytest.mark.parametrize("loss_mode", ["so_grpo", "s_ppo"])
def test_nothing_clipped_means_z_one_and_the_step_unchanged_bit_for_bit(reference, loss_mode):
    model, ids, _, adv, mask = problem(seed=11)
    with torch.no_grad():
        old = model(ids)  # on-policy: every ratio is 1
    base, _ = grads_of_step(model, ids, old, adv, mask, config("absolute", tau=1e-3), loss_mode)
    got, metrics = grads_of_step(model, ids, old, adv, mask, config(reference, tau=1e-3), loss_mode)
    assert metrics["sorl/clip_bias_grad_norm"] == 0.0 and metrics["sorl/norm_factor"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(base, got, strict=True))


def test_the_extra_product_leaves_the_real_gradient_unchanged_bit_for_bit():
    """With clipping and Z forced to 1 (tau huge), the step with the gradient reference is the step without."""
    model, ids, old, adv, mask = problem(seed=13)
    base, _ = grads_of_step(model, ids, old, adv, mask, config("absolute", tau=1e30))
    got, metrics = grads_of_step(model, ids, old, adv, mask, config("gradient", tau=1e30))
    assert metrics["sorl/clip_bias_grad_norm"] > 0 and metrics["sorl/norm_factor"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(base, got, strict=True))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("reference", ["gradient", "gradient_relative"])
def test_empty_micro_batch_gives_zero_not_nan(mode, reference):
    model, ids, old, adv, mask = problem(seed=17)
    mask = torch.zeros_like(mask)
    loss, metrics = get_policy_loss_fn("so_grpo")(old, model(ids), adv, mask, mode, config(reference))
    assert metrics["sorl/clip_bias_grad_norm"] == 0.0 and metrics["sorl/norm_factor"] == 1.0
    assert all(math.isfinite(v) for v in metrics.values()) and float(loss.detach()) == 0.0


def test_gradient_reference_acts_on_the_update_through_the_ledger():
    model, ids, old, adv, mask = problem(seed=19)
    cfg = config("gradient", tau=1e-3, apply="update")
    loss, metrics = get_policy_loss_fn("so_grpo")(old, model(ids), adv, mask, "token-mean", cfg)
    z = metrics["sorl/norm_factor"]
    assert z == pytest.approx(metrics["sorl/clip_bias_grad_norm"] / 1e-3) and z > 1
    assert optim.LEDGER.take()["inv_z"] == [pytest.approx(1.0 / z)]
    unnormalized = get_policy_loss_fn("so_grpo")(old, model(ids), adv, mask, "token-mean", config("absolute", 1e30))[0]
    assert torch.equal(loss, unnormalized)  # the loss itself is left alone in update mode


@pytest.mark.parametrize("clip_norm_mode", ["add", "none"])
def test_add_and_none_modes(clip_norm_mode):
    model, ids, old, adv, mask = problem(seed=23)
    _, metrics = get_policy_loss_fn("so_grpo")(
        old, model(ids), adv, mask, "token-mean", config("gradient", tau=0.5, clip_norm_mode=clip_norm_mode)
    )
    q = metrics["sorl/clip_bias_grad_norm"]
    assert q > 0
    assert metrics["sorl/norm_factor"] == (pytest.approx(1.0 + q / 0.5) if clip_norm_mode == "add" else 1.0)


@pytest.mark.parametrize("loss_mode", ["turn_ppo", "so_grpo", "s_ppo"])
def test_diagnostic_is_taken_once_per_optimizer_step_whatever_the_reference(loss_mode, fresh_state):
    model, ids, old, adv, mask = problem(seed=29)
    cfg = config("relative", tau=0.2)
    want, _ = explicit_norms(model, ids, old, adv, mask, loss_mode != "s_ppo", "token-mean", {})
    fn = get_policy_loss_fn(loss_mode)
    first = fn(old, model(ids), adv, mask, "token-mean", cfg)[1]
    second = fn(old, model(ids), adv, mask, "token-mean", cfg)[1]
    assert first["sorl/clip_bias_grad_norm"] == pytest.approx(want, rel=1e-10)
    assert "sorl/clip_bias_grad_norm" not in second
    with torch.no_grad():  # forward-only calls (log-prob computation) neither take nor spend it
        assert "sorl/clip_bias_grad_norm" not in fn(old, model(ids), adv, mask, "token-mean", cfg)[1]
    fresh_state.step()
    assert "sorl/clip_bias_grad_norm" in fn(old, model(ids), adv, mask, "token-mean", cfg)[1]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_vanilla_diag_is_verl_vanilla_bit_for_bit_plus_the_diagnostic(mode):
    model, ids, old, adv, mask = problem(seed=31)
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.5
    outs = []
    for fn in (compute_policy_loss_vanilla, compute_policy_loss_vanilla_diag):
        DIAGNOSTIC.due = True
        model.zero_grad(set_to_none=True)
        loss, metrics = fn(old, model(ids), adv, mask, mode, cfg, weights)
        loss.backward()
        outs.append((loss.detach(), [p.grad.clone() for p in model.parameters()], metrics))
    (loss_v, grads_v, metrics_v), (loss_d, grads_d, metrics_d) = outs
    assert torch.equal(loss_v, loss_d)
    assert all(torch.equal(a, b) for a, b in zip(grads_v, grads_d, strict=True))
    added = {"sorl/clip_bias_grad_norm", "sorl/ess_token", "sorl/ess_turn"}
    assert {k: v for k, v in metrics_d.items() if k not in added} == metrics_v and added <= set(metrics_d)
    want, _ = explicit_norms(model, ids, old, adv, mask, False, mode, {}, weights)
    assert metrics_d["sorl/clip_bias_grad_norm"] == pytest.approx(want, rel=1e-10)


def test_vanilla_diag_is_registered_next_to_verl_vanilla():
    import sorl_verl.plugin  # noqa: F401 - registers

    assert get_policy_loss_fn("vanilla") is compute_policy_loss_vanilla
    assert get_policy_loss_fn("vanilla_diag") is compute_policy_loss_vanilla_diag


def test_graph_leaves_are_the_parameters_the_forward_used():
    model, ids, *_ = problem()
    leaves = graph_leaves(model(ids))
    assert {id(p) for p in leaves} == {id(p) for p in model.parameters()}


class _Inner:
    """An autograd node as some torch versions (2.11) expose it: every access of ``next_functions``
    builds fresh Python wrappers, freed when dropped, so their ids are reused by later wrappers."""

    def __init__(self, children: list) -> None:
        self._children = children

    @property
    def next_functions(self) -> tuple:
        return tuple((_node(child), 0) for child in self._children)


#: the leaf node, matched by graph_leaves through its type's name as torch's
_AccumulateGrad = type(
    "AccumulateGrad", (), {"next_functions": (), "__init__": lambda self, v: setattr(self, "variable", v)}
)


def _node(spec):
    return _AccumulateGrad(spec) if isinstance(spec, torch.Tensor) else _Inner(spec)


class _TransientOutput:
    """Duck-typed output tensor (graph_leaves reads ``grad_fn`` and ``requires_grad``) whose graph is transient."""

    requires_grad = True

    def __init__(self, spec: list) -> None:
        self._spec = spec

    @property
    def grad_fn(self):
        return _node(self._spec)


@pytest.mark.parametrize("depth", [1, 5, 60])
def test_graph_leaves_survives_transient_node_wrappers(depth):
    """Every leaf of a chain of ``depth`` blocks, each with two parameters, is found though no node
    wrapper outlives its visit (a set of bare ids lost the parameters of a whole Qwen2 on torch 2.11)."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2 * depth)]
    spec: list = []
    for i in reversed(range(depth)):
        spec = [params[2 * i], [params[2 * i + 1]], spec] if spec else [params[2 * i], [params[2 * i + 1]]]
    leaves = graph_leaves(_TransientOutput(spec))
    assert {id(p) for p in leaves} == {id(p) for p in params}


def test_a_graph_walk_that_finds_no_parameter_fails_loudly_not_with_zero(monkeypatch):
    """No leaves under a log_prob that requires grad is a broken walk: the reference raises, the
    diagnostic warns and logs nothing (never ||C(theta)|| = 0, which would read as 'nothing clipped')."""
    from sorl_verl.algorithms import clip_bias_grad

    monkeypatch.setattr(clip_bias_grad, "graph_leaves", lambda output: [])
    weight = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    log_prob = (weight * 2.0)[None]
    removed = torch.tensor([[0.5, 0.0, -1.0]], dtype=torch.float64)
    with pytest.raises(SecondBackwardUnsafe, match="found no parameter"):
        clip_bias_grad.clip_bias_gradient_norms(log_prob, removed, None, "micro_batch", strict=True)
    with pytest.warns(RuntimeWarning, match="found no parameter"):
        assert clip_bias_grad.clip_bias_gradient_norms(log_prob, removed, None, "micro_batch", strict=False) is None


@pytest.mark.parametrize("bad", ["gradients", "Gradient", ""])
def test_bad_reference_fails_naming_the_knob(bad):
    with pytest.raises(ValueError, match="clip_norm_reference"):
        SORLPolicyLossConfig(clip_norm_reference=bad)


class InplaceBackwardLike(torch.autograd.Function):
    """Stands in for flash-attn's cross-entropy: its node carries ``inplace_backward = True``."""

    @staticmethod
    def forward(ctx, x):
        ctx.inplace_backward = True
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_a_graph_that_cannot_be_differentiated_twice_fails_the_reference_and_skips_the_diagnostic():
    model, ids, old, adv, mask = problem(seed=37)
    with pytest.raises(SecondBackwardUnsafe, match="VERL_DISABLE_FLASH_ATTN_CE=1"):
        get_policy_loss_fn("so_grpo")(old, InplaceBackwardLike.apply(model(ids)), adv, mask, "token-mean", config())
    DIAGNOSTIC.due = True
    with pytest.warns(RuntimeWarning, match="not logged"):
        loss, metrics = get_policy_loss_fn("so_grpo")(
            old, InplaceBackwardLike.apply(model(ids)), adv, mask, "token-mean", config("relative", tau=0.2)
        )
    assert "sorl/clip_bias_grad_norm" not in metrics
    loss.backward()  # the run goes on


def test_the_product_holds_one_leaf_gradient_at_a_time_not_the_set():
    """Each leaf's gradient of the extra backward is reduced to its norm and dropped as it is produced:
    when a leaf's gradient arrives, no earlier leaf's gradient of the same pass is still alive."""
    import weakref

    model, ids, old, adv, mask = problem(seed=41)
    produced: list[weakref.ref] = []
    alive_before: list[int] = []

    def observe(grad: torch.Tensor) -> None:  # registered first: runs before the product's own hook
        alive_before.append(sum(ref() is not None for ref in produced))
        produced.append(weakref.ref(grad))

    handles = [p.register_hook(observe) for p in model.parameters()]
    try:
        _, metrics = get_policy_loss_fn("so_grpo")(old, model(ids), adv, mask, "token-mean", config())
    finally:
        for handle in handles:
            handle.remove()
    assert metrics["sorl/clip_bias_grad_norm"] > 0
    assert len(alive_before) == len(list(model.parameters()))
    assert max(alive_before) == 0


def test_megatron_refuses_the_gradient_reference_and_leaves_the_diagnostic_out_with_one_warning():
    """Megatron's kernels are not torch's (vocab_parallel_cross_entropy's in-place backward): the actor
    config's strategy decides, the graph cannot; the step itself is left as it is."""
    from sorl_verl.algorithms import clip_bias_grad

    model, ids, old, adv, mask = problem(seed=43)
    megatron = config()
    object.__setattr__(megatron, "strategy", "megatron")  # verl's McoreActorConfig needs Megatron installed
    with pytest.raises(SecondBackwardUnsafe, match="strategy=fsdp2") as err:
        get_policy_loss_fn("so_grpo")(old, model(ids), adv, mask, "token-mean", megatron)
    assert "actor_rollout_ref.actor.strategy=megatron" in str(err.value)
    base, _ = grads_of_step(model, ids, old, adv, mask, config("relative", tau=0.2))
    diag = config("relative", tau=0.2)
    object.__setattr__(diag, "strategy", "megatron")
    clip_bias_grad._WARNED.clear()
    with pytest.warns(RuntimeWarning, match="strategy=megatron") as caught:
        for _ in range(2):
            DIAGNOSTIC.due = True
            got, metrics = grads_of_step(model, ids, old, adv, mask, diag)
            assert "sorl/clip_bias_grad_norm" not in metrics
    assert sum("clip_bias_grad_norm is off" in str(w.message) for w in caught) == 1
    assert all(torch.equal(a, b) for a, b in zip(base, got, strict=True))


def test_the_product_trims_the_heap_as_each_leaf_gradient_arrives(monkeypatch):
    """On the CPU the freed gradients of the pass are holes between the forward's live activations that
    glibc does not reuse for torch's aligned allocations (the resident set grew by 6.7 parameter-sized
    buffers at 95.2M x 4 x 2048, scripts/bench/clip_bias_grad_memory.py): the pass gives them back to the
    system as it goes, once per leaf gradient and once after it, and never touches the math."""
    from sorl_verl.algorithms import clip_bias_grad

    calls: list[int] = []
    monkeypatch.setattr(clip_bias_grad, "_MALLOC_TRIM", lambda pad: calls.append(pad) or 1)
    model, ids, old, adv, mask = problem(seed=41)
    DIAGNOSTIC.due = False
    base, _ = grads_of_step(model, ids, old, adv, mask, config("relative", tau=0.2))
    assert calls == []
    DIAGNOSTIC.due = True
    got, metrics = grads_of_step(model, ids, old, adv, mask, config("relative", tau=0.2))
    assert metrics["sorl/clip_bias_grad_norm"] > 0
    assert calls == [0] * (len(list(model.parameters())) + 1)
    assert all(torch.equal(a, b) for a, b in zip(got, base, strict=True))
