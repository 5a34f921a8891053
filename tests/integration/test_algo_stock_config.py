"""verl's stock config: ``loss_mode=so_grpo`` with verl's own ``ppo_trainer``, plus the actor's optimizer.

verl's hydra config is composed as a user who keeps it would (only the SORL flags, the SORL optimizer
for the actor and the micro batch size verl itself requires), the actor config is built the way
verl's workers build it, the optimizer by verl's ``build_optimizer`` (the SORL AdamW from
``optim.optimizer_impl``), and the loss comes from verl's registry. The step of a clipped mini-batch
must be the step of AdamW at ``lr / Z`` and the step of an on-policy one (``Z = 1``) AdamW's own,
both bit for bit (same arithmetic, same float lr). With verl's own ``torch.optim`` and the default
``clip_norm_apply=update`` the first actor update fails naming the fixes (only the actor's optimizer
may scale its step; no global hook reaches every optimizer of the process).
"""

from __future__ import annotations

import pytest
import torch
import verl  # noqa: F401 - loads the sorl_verl plugin: losses and estimators
from hydra import compose, initialize_config_module
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config.optimizer import build_optimizer

from sorl_verl.algorithms import optim

SORL_FLAGS = {
    "so_grpo": ["algorithm.adv_estimator=so_grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo"],
    "so_ppo": ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.policy_loss.loss_mode=so_ppo"],
    "s_ppo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=s_ppo"],
}
#: verl's own ppo_trainer asserts a micro batch size (or dynamic batching) for any loss
VERL_REQUIRED = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
#: the actor's optimizer that takes the update-scaled step (clip_norm_apply=update, the default)
SORL_OPTIMIZER = "actor_rollout_ref.actor.optim.optimizer_impl=sorl_verl.algorithms.optim"


@pytest.fixture(autouse=True)
def empty_ledger():
    optim.LEDGER.clear()
    yield
    optim.LEDGER.clear()


def stock_actor(flags: list[str]):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[*flags, *VERL_REQUIRED])
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def batch(off_policy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(start log-probs, old log-probs, advantages, response mask) of 4 rows with two turns each.

    Off-policy, rows 0 and 1 sit outside the trust region on the side that clipping cuts (ratio
    ~e^0.8 with A > 0, ~e^-0.8 with A < 0) and rows 2 and 3 on the side it leaves alone, so the
    normalizer sees clipping by turn and by token alike; on-policy every ratio is 1.
    """
    gen = torch.Generator().manual_seed(11)
    start = -1.0 - torch.rand(4, 12, generator=gen)
    mask = torch.ones(4, 12, dtype=torch.bool)
    mask[:, 4:6] = False  # an observation between two turns
    mask[1, 10:] = False  # padding
    row_shift = torch.tensor([[-0.8], [0.8], [0.3], [-0.3]])
    noise = (torch.rand(4, 12, generator=gen) * 2 - 1) * 0.05
    shift = (row_shift + noise) if off_policy else torch.zeros(4, 12)
    advantages = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]).expand(4, 12).clone()
    return start, start + shift, advantages, mask


def update(actor, off_policy: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One actor update with verl's optimizer: (parameters after, parameters before, loss metrics)."""
    start, old, advantages, mask = batch(off_policy)
    weights = torch.nn.Parameter(start.clone())
    opt = build_optimizer([weights], actor.optim)
    assert type(opt) is optim.AdamW  # built by verl from the actor's optim section
    opt.zero_grad()
    loss, metrics = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old, weights * 1.0, advantages, mask, actor.loss_agg_mode, actor, None
    )
    loss.backward()
    opt.step()
    assert opt.param_groups[0]["lr"] == actor.optim.lr  # the step's scaled lr is restored
    return weights.detach(), start, metrics


def adamw_step(actor, start: torch.Tensor, lr: float, off_policy: bool) -> torch.Tensor:
    """torch's AdamW at ``lr`` on the same loss's gradient, its records dropped (no hook scaling)."""
    _, old, advantages, mask = batch(off_policy)
    weights = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([weights], lr=lr, weight_decay=actor.optim.weight_decay, betas=tuple(actor.optim.betas))
    reader = optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # the loss publishes to a live SORL optimizer
    loss, _ = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old, weights * 1.0, advantages, mask, actor.loss_agg_mode, actor, None
    )
    loss.backward()
    optim.LEDGER.clear()
    opt.step()
    del reader
    return weights.detach()


@pytest.mark.parametrize("name", sorted(SORL_FLAGS))
def test_the_clipped_update_is_adamws_at_lr_over_z_and_the_on_policy_one_adamws_own(name):
    actor = stock_actor([*SORL_FLAGS[name], SORL_OPTIMIZER])
    assert actor.policy_loss.loss_mode == name
    assert (actor.optim.optimizer_impl, actor.optim.optimizer) == ("sorl_verl.algorithms.optim", "AdamW")
    after, start, metrics = update(actor, off_policy=True)
    z = metrics["sorl/norm_factor"]
    assert z > 1.0  # clipped: the normalizer acts on the step
    assert metrics["sorl/update_scale"] == pytest.approx(1.0 / z, rel=1e-12)
    assert torch.equal(after, adamw_step(actor, start, actor.optim.lr * (1.0 / z), off_policy=True))
    assert not torch.equal(after, adamw_step(actor, start, actor.optim.lr, off_policy=True))
    after, start, metrics = update(actor, off_policy=False)
    assert metrics["sorl/norm_factor"] == 1.0
    assert torch.equal(after, adamw_step(actor, start, actor.optim.lr, off_policy=False))


@pytest.mark.parametrize("name", sorted(SORL_FLAGS))
def test_verls_own_optimizer_with_the_update_step_fails_at_the_first_update_naming_the_fixes(name):
    actor = stock_actor(SORL_FLAGS[name])
    assert (actor.optim.optimizer_impl, actor.optim.optimizer) == ("torch.optim", "AdamW")
    start, old, advantages, mask = batch(off_policy=True)
    weights = torch.nn.Parameter(start.clone())
    with pytest.raises(ValueError, match="optimizer_impl=sorl_verl.algorithms.optim.*clip_norm_apply=loss"):
        get_policy_loss_fn(name)(old, weights * 1.0, advantages, mask, actor.loss_agg_mode, actor, None)
