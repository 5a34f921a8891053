"""Update-scaled optimizers: the step of a normalized mini-batch shrinks by 1/Z, whatever Adam does.

Tolerances: the scaled and the plain step differ only in the learning rate they multiply the
same float32 Adam direction by, so their parameter changes agree to a few float32 ulps of the
parameters (|p| <= ~3 here): ``atol = 8 * eps32 * max|p|``.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from sorl_verl.algorithms import optim

EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def empty_ledger():
    optim.LEDGER.clear()
    yield
    optim.LEDGER.clear()


def model_and_grads(seed: int = 0, steps: int = 6) -> tuple[torch.nn.Linear, list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(16, 16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    grads = [[torch.randn(p.shape, generator=gen) * (1 + k) for p in model.parameters()] for k in range(steps)]
    return model, grads


def run(opt: torch.optim.Optimizer, model: torch.nn.Module, grads: list[torch.Tensor], z: list[float]) -> list:
    """One optimizer step as verl's engine takes it: zero_grad, micro-batch losses publish Z, step."""
    opt.zero_grad()
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    for value in z:
        optim.LEDGER.record(1.0 / value, value, 0.0, 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    return [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]


def atol_for(model: torch.nn.Module) -> float:
    return 8 * EPS32 * max(float(p.abs().max()) for p in model.parameters())


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        (torch.optim.Adam, {"lr": 1e-2}),
        (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    ],
)
def test_z_one_is_the_optimizers_own_step_bit_for_bit(cls, kwargs):
    model, grads = model_and_grads()
    reference = copy.deepcopy(model)
    ours = getattr(optim, cls.__name__)(model.parameters(), **kwargs)
    theirs = cls(reference.parameters(), **kwargs)
    for k, g in enumerate(grads):
        run(ours, model, g, z=[1.0] * (k % 3))  # no record, one or two micro-batches with Z = 1
        run(theirs, reference, g, z=[])
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
    assert ours.last_update["scale"] == 1.0


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("warm_steps", [0, 3])
def test_z_three_moves_parameters_by_a_third_of_the_same_states_step(name, warm_steps):
    model, grads = model_and_grads(seed=1)
    kwargs = {"lr": 1e-2, "weight_decay": 0.05} if name != "SGD" else {"lr": 1e-2, "momentum": 0.9}
    opt = getattr(optim, name)(model.parameters(), **kwargs)
    for g in grads[:warm_steps]:
        run(opt, model, g, z=[1.0])
    twin_model = copy.deepcopy(model)
    twin = getattr(optim, name)(twin_model.parameters(), **kwargs)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    plain = run(twin, twin_model, grads[warm_steps], z=[1.0, 1.0])
    scaled = run(opt, model, grads[warm_steps], z=[3.0, 3.0])
    assert opt.last_update["scale"] == pytest.approx(1 / 3, rel=1e-15)
    for s, p in zip(scaled, plain, strict=True):
        torch.testing.assert_close(s, p / 3, rtol=0, atol=atol_for(model))
    # the learning rate is restored: the next plain step is the optimizer's own again
    assert all(group["lr"] == 1e-2 for group in opt.param_groups)


def test_gradient_accumulation_scale_is_the_mean_of_the_micro_batch_factors():
    model, grads = model_and_grads(seed=2)
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    run(opt, model, grads[0], z=[1.0, 3.0, 2.0, 1.0])
    assert opt.last_update["scale"] == pytest.approx((1 + 1 / 3 + 1 / 2 + 1) / 4, rel=1e-15)
    assert opt.last_update["z"] == [1.0, 3.0, 2.0, 1.0]


def test_zero_grad_drops_records_of_a_skipped_step():
    """verl calls zero_grad instead of step when the gradient is not finite: those records must
    not shrink the next step."""
    model, grads = model_and_grads(seed=3)
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    optim.LEDGER.record(0.25, 4.0, 0.0, 0.0)
    opt.zero_grad()  # the skipped step
    run(opt, model, grads[0], z=[])
    assert opt.last_update["scale"] == 1.0


def test_loss_level_scale_is_cancelled_by_adam_and_update_level_is_not():
    """Why the default applies Z at the update: a loss divided by Z = 3 at every step leaves
    AdamW's update almost unchanged; the update-scaled step is exactly a third."""
    model, grads = model_and_grads(seed=4, steps=20)
    loss_level_model, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    update_level = optim.AdamW(model.parameters(), lr=1e-3)
    loss_level = torch.optim.AdamW(loss_level_model.parameters(), lr=1e-3)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3)
    ratios_loss, ratios_update = [], []
    for g in grads:
        d_plain = run(plain, plain_model, g, z=[])
        d_loss = run(loss_level, loss_level_model, [x / 3 for x in g], z=[])
        d_update = run(update_level, model, g, z=[3.0])
        norm = math.sqrt(sum(float(d.square().sum()) for d in d_plain))
        ratios_loss.append(math.sqrt(sum(float(d.square().sum()) for d in d_loss)) / norm)
        ratios_update.append(math.sqrt(sum(float(d.square().sum()) for d in d_update)) / norm)
    # the three runs drift apart in parameter space, but each update ratio stays what it was
    assert min(ratios_loss) > 0.99
    assert max(abs(r - 1 / 3) for r in ratios_update) < 1e-2


def test_update_log_and_update_norm(tmp_path):
    model, grads = model_and_grads(seed=5)
    log = tmp_path / "run" / "updates.jsonl"
    opt = optim.AdamW(model.parameters(), lr=1e-2, update_log=str(log), log_update_norm=True)
    deltas = run(opt, model, grads[0], z=[2.0])
    run(opt, model, grads[1], z=[])
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["scale"] == 0.5 and records[0]["z"] == [2.0] and records[1]["scale"] == 1.0
    expected = math.sqrt(sum(float(d.double().square().sum()) for d in deltas))
    # the test's deltas are float32 differences (one rounding each), the optimizer's float64 ones
    assert records[0]["update_norm"] == pytest.approx(expected, rel=2 * EPS32)
    assert records[0]["lr"] == 1e-2


def test_verl_builds_it_from_optimizer_impl():
    """verl's own build_optimizer resolves the class by module + name and passes the kwargs."""
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    config = FSDPOptimizerConfig(
        lr=1e-3,
        optimizer_impl="sorl_verl.algorithms.optim",
        optimizer="AdamW",
        override_optimizer_config={"log_update_norm": True},
    )
    opt = build_optimizer(torch.nn.Linear(2, 2).parameters(), config)
    assert isinstance(opt, torch.optim.AdamW) and isinstance(opt, optim.UpdateScaledOptimizer)
    assert opt.log_update_norm and opt.param_groups[0]["betas"] == tuple(config.betas)


def test_doctor_lists_the_plug_point():
    from sorl_verl.doctor import resolve_in_this_process

    resolved = resolve_in_this_process()["resolved"]["optimizer"]
    assert set(resolved) == {f"sorl_verl.algorithms.optim.{name}" for name in ("AdamW", "Adam", "SGD")}
    assert all(status.startswith("ok") for status in resolved.values())


def test_scaling_composes_with_verls_gradient_clipping():
    """verl clips the gradient norm before ``step``; the step factor then scales that clipped step."""
    model, grads = model_and_grads(seed=6)
    twin_model = copy.deepcopy(model)
    opt, twin = optim.AdamW(model.parameters(), lr=1e-2), optim.AdamW(twin_model.parameters(), lr=1e-2)
    deltas = []
    for o, m, z in ((twin, twin_model, [1.0]), (opt, model, [4.0])):
        o.zero_grad()
        for p, g in zip(m.parameters(), grads[0], strict=True):
            p.grad = g.clone() * 100
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1.0)
        assert total > 1.0  # clipping acted
        for value in z:
            optim.LEDGER.record(1.0 / value, value, 0.0, 0.0)
        before = [p.detach().clone() for p in m.parameters()]
        o.step()
        deltas.append([p.detach() - b for p, b in zip(m.parameters(), before, strict=True)])
    for s, p in zip(deltas[1], deltas[0], strict=True):
        torch.testing.assert_close(s, p / 4, rtol=0, atol=atol_for(model))
