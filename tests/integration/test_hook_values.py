"""The critic-value hook: values_context, so_ppo through verl's compute_advantage, the SORL trainers.

so_ppo is called through ``verl.trainer.ppo.ray_trainer.compute_advantage`` — the function verl's
v1 ``_compute_advantage`` delegates to for every estimator except ``grpo`` — and checked against
a loop-based turn-level GAE written here. The trainers are built with their real ``__init__``
from the composed ``sorl_trainer.yaml``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import verl  # noqa: F401 - loads the sorl_verl plugin through verl's entry point
import verl.utils.torch_functional as verl_F
from omegaconf import OmegaConf
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import compute_advantage

from sorl_verl.trainer.values_context import current_values, provide_values

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config")


def turn_gae_reference(rewards, values, mask, gamma, lam):
    """Direct per-row, per-turn loop: turn k = k-th run of mask 1; reward at t owned by the last turn started <= t.

    Returns (whitened advantages, returns, raw advantages), float64.
    """
    batch, length = mask.shape
    adv = torch.zeros(batch, length, dtype=torch.float64)
    ret = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        turns, t = [], 0
        while t < length:
            if mask[b, t]:
                start = t
                while t < length and mask[b, t]:
                    t += 1
                turns.append((start, t))
            else:
                t += 1
        if not turns:
            continue
        turn_reward = [0.0] * len(turns)
        for t in range(length):
            owners = [k for k, (s, _) in enumerate(turns) if s <= t]
            if owners:
                turn_reward[owners[-1]] += float(rewards[b, t])
        turn_value = [float(values[b, s]) for s, _ in turns]
        gae = 0.0
        for k in reversed(range(len(turns))):
            next_value = turn_value[k + 1] if k + 1 < len(turns) else 0.0
            gae = turn_reward[k] + gamma * next_value - turn_value[k] + gamma * lam * gae
            s, e = turns[k]
            adv[b, s:e] = gae
            ret[b, s:e] = gae + turn_value[k]
    return verl_F.masked_whiten(adv, mask.to(torch.float64)) * mask, ret, adv


def random_multiturn_batch(seed: int, batch: int = 5, length: int = 24):
    """Ragged multi-turn rows: policy runs separated by observation runs, right padding, one empty row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, length, dtype=torch.int64)
    rewards = torch.zeros(batch, length)
    for b in range(batch - 1):
        t = 0
        used = int(torch.randint(length // 2, length + 1, (1,), generator=g))
        while t < used:
            run = int(torch.randint(1, 5, (1,), generator=g))
            mask[b, t : min(t + run, used)] = 1
            t += run + int(torch.randint(1, 4, (1,), generator=g))
        rewards[b, used - 1] = float(torch.randn(1, generator=g))  # outcome reward, last response position
        rewards[b] += torch.randn(length, generator=g) * 0.1 * mask[b]  # some per-token shaping
    values = torch.randn(batch, length, generator=g)
    return rewards, values, mask


def so_ppo_through_verl(rewards, values_or_none, mask, gamma, lam):
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask},
        non_tensors={"uid": np.array([f"u{i}" for i in range(len(mask))], dtype=object)},
    )
    config = OmegaConf.create({"gamma": gamma, "lam": lam})
    if values_or_none is None:
        out = compute_advantage(data, adv_estimator="so_ppo", gamma=gamma, lam=lam, config=config)
    else:
        with provide_values(values_or_none):
            out = compute_advantage(data, adv_estimator="so_ppo", gamma=gamma, lam=lam, config=config)
    return out.batch["advantages"], out.batch["returns"]


# --- values_context ----------------------------------------------------------------------------


def test_provide_values_nests_and_restores_even_on_error():
    a, b = torch.ones(2, 3), torch.zeros(2, 3)
    assert current_values() is None
    with provide_values(a):
        assert current_values() is a
        with pytest.raises(RuntimeError), provide_values(b):
            assert current_values() is b
            raise RuntimeError("boom")
        assert current_values() is a
        with provide_values(None):
            assert current_values() is None
        assert current_values() is a
    assert current_values() is None


def test_provided_values_are_invisible_to_other_threads():
    seen = []
    with provide_values(torch.ones(1)):
        worker = threading.Thread(target=lambda: seen.append(current_values()))
        worker.start()
        worker.join()
    assert seen == [None]


def test_provide_values_rejects_non_tensors():
    with pytest.raises(TypeError, match="torch.Tensor"), provide_values([[1.0, 2.0]]):  # type: ignore[arg-type]
        pass


# --- so_ppo through verl's compute_advantage ---------------------------------------------------


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.7), (0.99, 0.0), (0.0, 1.0)])
def test_so_ppo_through_verl_compute_advantage_is_turn_level_gae_of_provided_values(gamma, lam, fp32):
    rewards, values, mask = random_multiturn_batch(seed=int(gamma * 100 + lam * 10))
    assert int((mask.diff(dim=1) == 1).sum()) >= 4, "fixture must contain multi-turn rows"
    advantages, returns = so_ppo_through_verl(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret, raw_adv = turn_gae_reference(rewards.double(), values.double(), mask, gamma, lam)
    atol_adv, atol_ret = fp32.turn_gae(rewards, values, mask, raw_adv, ref_adv)  # float32 vs float64
    torch.testing.assert_close(advantages.double(), ref_adv, atol=atol_adv, rtol=0)
    torch.testing.assert_close(returns.double(), ref_ret, atol=atol_ret, rtol=0)
    assert torch.all(advantages[mask == 0] == 0) and torch.all(returns[mask == 0] == 0)


def test_so_ppo_result_depends_on_the_provided_values():
    rewards, values, mask = random_multiturn_batch(seed=3)
    _, returns_a = so_ppo_through_verl(rewards, values, mask, 0.9, 0.8)
    _, returns_b = so_ppo_through_verl(rewards, values + 1.0, mask, 0.9, 0.8)  # gamma*lam < 1: V does not telescope
    assert not torch.allclose(returns_a, returns_b)


def test_so_ppo_without_provided_values_fails_with_the_fix():
    rewards, _, mask = random_multiturn_batch(seed=4)
    with pytest.raises(ValueError, match=r"trainer_mode=sorl_sync.*critic\.enable=True"):
        so_ppo_through_verl(rewards, None, mask, 1.0, 1.0)


# --- the SORL trainers, built from the composed sorl_trainer.yaml ----------------------------


def compose_sorl(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(
            config_name="sorl_trainer",
            overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides],
        )


@pytest.mark.parametrize(
    ("mode", "base_mode", "buffer"),
    [("sorl_sync", "sync", "ReplayBuffer"), ("sorl_colocate_async", "colocate_async", "ReplayBufferAsync")],
)
def test_sorl_trainer_behaves_as_its_verl_base_mode(mode, base_mode, buffer):
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = compose_sorl(f"trainer.v1.trainer_mode={mode}", "algorithm.adv_estimator=so_ppo")
    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config)
    assert trainer.trainer_mode == base_mode
    assert trainer.requested_trainer_mode == mode
    # verl picks the buffer by trainer_mode == "sync"; the SORL trainer serves its batches in dispatch order
    assert type(trainer.replay_buffer).__name__ == "DispatchOrderedSampler"
    assert type(trainer.replay_buffer._buffer).__name__ == buffer
    assert trainer.use_critic is True  # sorl_trainer.yaml turns the critic on for so_ppo
    assert config.trainer.v1.trainer_mode == mode  # the user's config is left as given


def test_sorl_trainer_refuses_so_ppo_without_critic():
    from sorl_verl.trainer.trainers import SORLTrainerSync

    config = compose_sorl("algorithm.adv_estimator=so_ppo", "critic.enable=false")
    with pytest.raises(ValueError, match=r"critic\.enable=True"):
        SORLTrainerSync(config)


def test_so_grpo_config_leaves_the_critic_to_verl():
    config = compose_sorl()
    assert config.algorithm.adv_estimator == "so_grpo"
    assert config.critic.enable is None
    assert compose_sorl("algorithm.adv_estimator=gae").critic.enable is True
