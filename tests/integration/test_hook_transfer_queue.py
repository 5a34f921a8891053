"""The SORL trainer's ``_compute_advantage`` against a real, local TransferQueue.

Rows are put into TransferQueue the way verl's agent loop and critic leave them (one ragged
1-D tensor per row and field), the trainer is built from ``sorl_trainer.yaml`` with its real
``__init__``, and ``_compute_advantage`` runs on a batch whose key order differs from the put
order. The advantages it writes back must equal so_ppo on the critic values padded in
``batch.keys`` order; verl's own ``sync`` trainer fails on the same batch.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "recipe" / "sorl" / "config")
LENGTHS = [9, 14, 5, 12, 7, 14]  # ragged responses; keys are read back in a shuffled order

pytestmark = pytest.mark.slow  # Ray + TransferQueue start-up: ~40 s on 2 cores


@pytest.fixture(scope="module")
def tq():
    import ray  # a declared dependency: a missing or broken Ray fails here, never skips
    import transfer_queue
    from omegaconf import OmegaConf

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    transfer_queue.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield transfer_queue
    transfer_queue.close()
    ray.shutdown()


def compose_sorl(*overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(
            config_name="sorl_trainer",
            overrides=["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides],
        )


def make_rows(seed: int, with_values: bool):
    """Per-row fields as verl leaves them in TransferQueue: multi-turn response_mask, rm_scores, values."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(LENGTHS):
        mask = (torch.arange(n) % 5 < 3).long()  # turns of 3 policy tokens, 2 observation tokens
        scores = torch.zeros(n)
        scores[-1] = float(torch.randn(1, generator=g))
        row = {"uid": f"prompt{i // 2}", "response_mask": mask, "rm_scores": scores}
        if with_values:
            row["values"] = torch.randn(n, generator=g)
        rows.append(row)
    return rows


def put_rows(tq, rows):
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    run = uuid.uuid4().hex[:8]
    keys = [f"{run}p{i}_0_0" for i in range(len(rows))]  # {uid}_{session}_{index}, as verl's agent loop
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows))
    return keys


def pad(rows, field, order):
    width = max(len(rows[i][field]) for i in order)
    out = torch.zeros(len(order), width, dtype=rows[0][field].dtype)
    for r, i in enumerate(order):
        out[r, : len(rows[i][field])] = rows[i][field]
    return out


def read_back(tq, keys):
    data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["advantages", "returns", "response_mask"])
    return data.to_padded_tensor()


def test_sorl_sync_hands_tq_values_in_batch_key_order_to_so_ppo(tq):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import get_trainer_cls

    from sorl_verl.algorithms.advantages import compute_so_ppo_advantage

    config = compose_sorl("algorithm.adv_estimator=so_ppo", "algorithm.gamma=0.95", "algorithm.lam=0.9")
    trainer = get_trainer_cls(config.trainer.v1.trainer_mode)(config)
    rows = make_rows(seed=0, with_values=True)
    keys = put_rows(tq, rows)
    order = [3, 0, 5, 2, 4, 1]
    batch = KVBatchMeta(keys=[keys[i] for i in order], tags=[{}] * len(order), partition_id="train")

    trainer._compute_advantage(batch, metrics={})

    got = read_back(tq, batch.keys)
    mask = pad(rows, "response_mask", order)
    expected_adv, expected_ret = compute_so_ppo_advantage(
        pad(rows, "rm_scores", order), mask, config=config.algorithm, values=pad(rows, "values", order)
    )
    assert torch.equal(got["response_mask"], mask)
    torch.testing.assert_close(got["advantages"], expected_adv * mask)
    torch.testing.assert_close(got["returns"], expected_ret * mask)
    # the same values in put order would give other numbers: the hook really follows batch.keys
    values_in_put_order = pad(rows, "values", range(len(rows)))
    wrong_adv, _ = compute_so_ppo_advantage(
        pad(rows, "rm_scores", order), mask, config=config.algorithm, values=values_in_put_order
    )
    assert not torch.allclose(got["advantages"], wrong_adv * mask)


def test_verl_sync_trainer_cannot_run_so_ppo_and_sorl_sync_needs_critic_values(tq):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = compose_sorl("algorithm.adv_estimator=so_ppo")
    with_values = put_rows(tq, make_rows(seed=1, with_values=True))
    without_values = put_rows(tq, make_rows(seed=2, with_values=False))

    def meta(keys):
        return KVBatchMeta(keys=keys, tags=[{}] * len(keys), partition_id="train")

    verl_sync = get_trainer_cls("sync")(config)  # verl's own trainer: values never reach the estimator
    with pytest.raises(ValueError, match=r"trainer_mode=sorl_sync"):
        verl_sync._compute_advantage(meta(with_values), metrics={})

    sorl_sync = get_trainer_cls("sorl_sync")(config)  # critic never wrote values: same clear failure
    with pytest.raises(ValueError, match=r"critic\.enable=True"):
        sorl_sync._compute_advantage(meta(without_values), metrics={})


def test_sorl_sync_passes_other_estimators_through_unchanged(tq):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = compose_sorl()  # so_grpo: no critic, no values in TransferQueue
    rows = make_rows(seed=3, with_values=False)
    keys = put_rows(tq, rows)
    trainer = get_trainer_cls("sorl_sync")(config)
    trainer._compute_advantage(KVBatchMeta(keys=keys, tags=[{}] * len(keys), partition_id="train"), metrics={})

    got = read_back(tq, keys)
    order = list(range(len(rows)))
    mask = pad(rows, "response_mask", order)
    expected, _ = compute_grpo_outcome_advantage(
        pad(rows, "rm_scores", order), mask, index=np.array([r["uid"] for r in rows], dtype=object)
    )
    torch.testing.assert_close(got["advantages"], expected * mask)


class CriticWorkerOutput:
    """What verl's critic worker group leaves behind: full-sequence values in TransferQueue.

    Stands in for ``critic_wg`` only; verl's own ``PPOTrainer._compute_values`` then turns them
    into response values (its left shift by one token) exactly as in a real run.
    """

    def __init__(self, tq, full_values: dict[str, torch.Tensor]):
        self.tq, self.full_values = tq, full_values

    def infer_batch(self, batch):
        from tensordict import TensorDict

        nested = torch.nested.as_nested_tensor([self.full_values[k] for k in batch.keys], layout=torch.jagged)
        self.tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict({"values": nested}, [len(batch.keys)])
        )

        class Done:
            futures: list = []

        return Done()


def test_verl_compute_values_then_sorl_compute_advantage_use_the_response_values(tq):
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import get_trainer_cls

    from sorl_verl.algorithms.advantages import compute_so_ppo_advantage

    config = compose_sorl("algorithm.adv_estimator=so_ppo", "algorithm.lam=0.5")
    trainer = get_trainer_cls("sorl_sync")(config)
    rows = make_rows(seed=4, with_values=False)
    keys = put_rows(tq, rows)
    g = torch.Generator().manual_seed(5)
    prompt_lens = [3, 6, 2, 4, 5, 3]
    full = {
        k: torch.randn(p + len(r["response_mask"]), generator=g)
        for k, p, r in zip(keys, prompt_lens, rows, strict=True)
    }
    trainer.critic_wg = CriticWorkerOutput(tq, full)
    batch = KVBatchMeta(keys=keys[::-1], tags=[{}] * len(keys), partition_id="train")

    trainer._compute_values(batch, metrics={})  # verl's own code: full-sequence -> response values
    trainer._compute_advantage(batch, metrics={})

    order = list(range(len(rows)))[::-1]
    for i, (p, row) in enumerate(
        zip(prompt_lens, rows, strict=True)
    ):  # value of response token t = output at position P+t-1
        row["values"] = full[keys[i]][p - 1 : p - 1 + len(row["response_mask"])]
    mask = pad(rows, "response_mask", order)
    expected_adv, expected_ret = compute_so_ppo_advantage(
        pad(rows, "rm_scores", order), mask, config=config.algorithm, values=pad(rows, "values", order)
    )
    got = read_back(tq, batch.keys)
    torch.testing.assert_close(got["advantages"], expected_adv * mask)
    torch.testing.assert_close(got["returns"], expected_ret * mask)


def test_episode_metrics_come_from_extra_fields_in_transfer_queue(tq):
    """search_r1's per-episode stats (extra_fields) become agent/* means; padding and other loops left out."""
    from sorl_verl.trainer.trainers import fetch_episode_metrics

    extra = [
        {"searches": 2, "valid_action_ratio": 1.0, "finished": 1, "agent_turns": 3, "truncated": 0},
        {"searches": 0, "valid_action_ratio": 0.5, "finished": 0, "agent_turns": 2, "truncated": 1},
        {"searches": 7, "valid_action_ratio": 0.0, "finished": 0, "agent_turns": 8, "truncated": 1},  # padding row
        {"min_global_steps": 1, "max_global_steps": 1},  # a row of another agent loop
    ]
    rows = [{"response_mask": torch.ones(3, dtype=torch.long), "extra_fields": e} for e in extra]
    keys = put_rows(tq, rows)
    tags = [{}, {}, {"is_padding": True}, {}]

    metrics = fetch_episode_metrics(keys, "train", tags)

    assert metrics == {
        "agent/searches_mean": 1.0,
        "agent/valid_action_ratio": 0.75,
        "agent/finished_ratio": 0.5,
        "agent/turns_mean": 2.5,
        "agent/truncated_ratio": 0.5,
    }
