"""torch's global optimizer-step hooks: the update-scaled step for any torch optimizer.

The hooked step multiplies the learning rate by ``s`` (the same float the SORL optimizer
computes) and runs the optimizer's own arithmetic, so it equals, bit for bit, the step of a twin
optimizer whose learning rate is ``lr * s``: the tests compare with ``torch.equal``.
"""

from __future__ import annotations

import math

import pytest
import torch

from sorl_verl.algorithms import optim

OPTIMIZERS = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
]


@pytest.fixture(autouse=True)
def hooks():
    installed_here = optim.install_step_hooks()  # False when the plugin already installed them
    optim.LEDGER.clear()
    yield
    optim.LEDGER.clear()
    if installed_here:
        optim.uninstall_step_hooks()


def model(seed: int) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    m = torch.nn.Linear(8, 8)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return m


def step(opt: torch.optim.Optimizer, m: torch.nn.Module, seed: int, z: list[float]) -> None:
    """zero_grad, gradients, the micro-batches' records (as the loss publishes them), step."""
    gen = torch.Generator().manual_seed(100 + seed)
    opt.zero_grad()
    for p in m.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    for value in z:
        optim.LEDGER.record(1.0 / value, value, 0.0, 0.0)
    opt.step()


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("cls,kwargs", OPTIMIZERS)
@pytest.mark.parametrize("z", [[3.0, 3.0], [1.0, 4.0, 2.0]])
def test_a_stock_optimizers_step_runs_at_lr_times_s(cls, kwargs, z):
    ours, twin = model(0), model(0)
    opt = cls(ours.parameters(), **kwargs)
    s = math.fsum(1.0 / v for v in z) / len(z)
    reference = cls(twin.parameters(), **{**kwargs, "lr": kwargs["lr"] * s})
    step(opt, ours, 0, z)
    step(reference, twin, 0, [])
    assert same(ours, twin)
    assert all(group["lr"] == kwargs["lr"] for group in opt.param_groups)  # restored after the step
    # the next step without clipping is the optimizer's own again (moments carried over)
    plain = cls(twin.parameters(), **kwargs)
    plain.load_state_dict(reference.state_dict())
    plain.param_groups[0]["lr"] = kwargs["lr"]
    step(opt, ours, 1, [1.0, 1.0])
    step(plain, twin, 1, [])
    assert same(ours, twin)


@pytest.mark.parametrize("cls,kwargs", OPTIMIZERS)
def test_z_one_or_no_record_leaves_the_step_bit_for_bit(cls, kwargs):
    ours, twin = model(1), model(1)
    opt, reference = cls(ours.parameters(), **kwargs), cls(twin.parameters(), **kwargs)
    for k in range(4):
        step(opt, ours, k, [1.0] * (k % 3))
        step(reference, twin, k, [])
    assert same(ours, twin)


def test_the_sorl_optimizer_is_scaled_once():
    """With the hooks installed the SORL optimizer still takes ``lr * s``, not ``lr * s * s``."""
    ours, twin = model(2), model(2)
    opt = optim.AdamW(ours.parameters(), lr=1e-2)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-2 * 0.25)
    step(opt, ours, 0, [4.0])
    step(reference, twin, 0, [])
    assert opt.last_update["scale"] == 0.25
    assert same(ours, twin)


def test_an_optimizer_stepped_while_nothing_was_published_is_untouched():
    """e.g. the critic's optimizer, in a process whose actor loss publishes after it steps."""
    actor, critic, twin = model(3), model(4), model(4)
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    reference = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    step(actor_opt, actor, 0, [2.0])  # takes the ledger
    step(critic_opt, critic, 0, [])
    step(reference, twin, 0, [])
    assert same(critic, twin)


def test_install_is_idempotent_and_counts_one_consumer():
    before = optim.LEDGER.consumers
    assert optim.install_step_hooks() is False
    assert optim.LEDGER.consumers == before
