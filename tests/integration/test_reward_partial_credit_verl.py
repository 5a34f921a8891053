"""``partial_credit`` through verl's own code: one Hydra override -> verl's reward loading -> the
reward manager -> verl's validation metrics -> the study's metrics reader and the guard's score.

The config is composed as main_ppo composes the demo recipe (sorl_trainer + task/search_qa +
platform/cpu + demo/early_stop) with the overrides of natural.yaml's ``demo_partial_f1`` cell;
verl's ``migrate_legacy_reward_impl`` and ``load_reward_manager`` (which calls
``get_custom_reward_fn``, the loader of ``custom_reward_function`` with its ``reward_kwargs``)
build the reward manager the agent-loop workers use, and its ``run_single`` scores an episode.
The validation metrics come from verl's ``PPOTrainer._val_metrics_update`` on the reward extras
laid out as verl's ``_validate`` lays them out.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import verl  # noqa: F401 - loads the sorl_verl plugin
from hydra import compose, initialize_config_dir
from verl import DataProto
from verl.experimental.reward_loop import migrate_legacy_reward_impl
from verl.trainer.ppo.reward import get_custom_reward_fn, load_reward_manager
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

from sorl_verl.study.grid import load_grid
from sorl_verl.study.metrics import parse_records, validation_by_source
from sorl_verl.trainer.guard_rule import GuardConfig, validation_score

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = str(REPO / "recipe" / "sorl" / "config")
PATHS = [
    "data.train_files=/x/train.parquet",
    "data.val_files=/x/val.parquet",
    "actor_rollout_ref.model.path=/x/model",
    "sorl.agent.retrieval_url=http://127.0.0.1:9/retrieve",
]
OVERRIDE = "+reward.custom_reward_function.reward_kwargs.partial_credit=1.0"
GOLD = {"target": ["Marie Curie"]}
#: (response, score at partial_credit 1, correctness): a hedge (token F1 4/7), a correct answer, a miss
EPISODES = [
    ("<think>t</think><answer>Marie Curie or Pierre Curie</answer>", 4 / 7, 0.0),
    ("<think>t</think><answer>Marie Curie</answer>", 1.0, 1.0),
    ("<think>t</think><answer>Lyon</answer>", 0.0, 0.0),
]


def regime_cell_args(regime: str = "demo_partial_f1") -> list[str]:
    """The hydra overrides the study passes main_ppo for the regime's grpo seed-1 cell."""
    grid = load_grid(REPO / "recipe" / "sorl" / "study" / "natural.yaml")
    (cell,) = [c for c in grid.cells if (c.regime, c.algorithm, c.seed) == (regime, "grpo", 1)]
    return cell.hydra_args()


def composed(*overrides: str):
    """The trainer config main_ppo would run, after verl's legacy-reward migration."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        cfg = compose(config_name="sorl_trainer", overrides=["+task=search_qa", "+platform=cpu", *PATHS, *overrides])
    return migrate_legacy_reward_impl(cfg)


class DecodeTable:
    """A tokenizer for verl's reward manager: token id i decodes to the i-th response text."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.texts[int(ids[0])]


def batch(i: int, searches: int | None = None) -> DataProto:
    """One validation row as the agent loop leaves it: response token ``i``, QA data source ``nq``;
    with ``searches`` the loop's per-episode statistics, which verl's reward manager merges into
    ``extra_info`` (``tool_extra_fields``)."""
    non_tensors = {
        "data_source": np.array(["nq"], dtype=object),
        "reward_model": np.array([{"ground_truth": GOLD}], dtype=object),
        "extra_info": np.array([{}], dtype=object),
    }
    if searches is not None:
        non_tensors["tool_extra_fields"] = np.array([{"searches": searches, "agent_turns": searches + 1}], dtype=object)
    return DataProto.from_dict(
        tensors={"responses": torch.tensor([[i]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)},
        non_tensors=non_tensors,
    )


def val_metrics(results: list[dict]) -> dict[str, float]:
    """verl's validation metrics of reward-manager results, laid out as verl's ``_validate`` does
    (``reward`` = the score, then every reward_extra_info key)."""
    extras: dict[str, list] = {"reward": [r["reward_score"] for r in results]}
    for r in results:
        for key, value in r["reward_extra_info"].items():
            extras.setdefault(key, []).append(value)
    n = len(results)
    return PPOTrainer._val_metrics_update(None, np.array(["nq"] * n, dtype=object), list(range(n)), extras, [])


def test_the_regime_override_is_one_plain_hydra_override() -> None:
    args = regime_cell_args()
    assert OVERRIDE in args
    assert "sorl.guard.val_metric=val-core/*/acc/mean@*" in args


@pytest.mark.parametrize("with_regime", [False, True], ids=["one_override", "regime_cell"])
def test_verl_loads_compute_score_with_the_kwarg(with_regime: bool) -> None:
    cfg = composed(*(regime_cell_args() if with_regime else [OVERRIDE]))
    assert cfg.reward.custom_reward_function.reward_kwargs.partial_credit == 1.0
    fn = get_custom_reward_fn(cfg)
    for text, shaped, correct in EPISODES:
        r = fn(data_source="nq", solution_str=text, ground_truth=GOLD, extra_info={})
        assert r["score"] == pytest.approx(shaped) and r["acc"] == correct


def test_without_the_override_verl_calls_it_as_before() -> None:
    fn = get_custom_reward_fn(composed())
    r = fn(data_source="nq", solution_str=EPISODES[0][0], ground_truth=GOLD, extra_info={})
    assert r["score"] == 0.0 and "acc" not in r


async def reward_manager_results(
    *overrides: str, searches: list[int] | None = None, texts: list[str] | None = None
) -> list[dict]:
    """Each episode (``texts``, EPISODES' by default) scored by the reward manager verl builds from
    the config (built in the running loop)."""
    texts = texts or [t for t, _, _ in EPISODES]
    manager = load_reward_manager(composed(*overrides), DecodeTable(texts))
    counts = searches or [None] * len(texts)
    return [await manager.run_single(batch(i, n)) for i, n in enumerate(counts)]


async def test_validation_core_metric_is_acc_with_partial_credit() -> None:
    results = await reward_manager_results(*regime_cell_args())
    assert [r["reward_score"] for r in results] == pytest.approx([s for _, s, _ in EPISODES])
    metrics = val_metrics(results)
    assert metrics["val-core/nq/acc/mean@1"] == pytest.approx(1 / 3)  # correctness
    assert metrics["val-aux/nq/reward/mean@1"] == pytest.approx((4 / 7 + 1) / 3)  # the shaped reward
    assert not any(k.startswith("val-core/nq/reward/") for k in metrics)
    # the study's reader takes the core metric, whatever its variable
    assert validation_by_source(metrics) == {"nq": pytest.approx(1 / 3)}
    # the guard: the regime's val_metric reads acc; the default would match nothing
    assert validation_score(metrics, "val-core/*/acc/mean@*") == pytest.approx(1 / 3)
    assert validation_score(metrics, GuardConfig().val_metric) is None


async def test_validation_core_metric_stays_reward_without_it() -> None:
    results = await reward_manager_results()
    metrics = val_metrics(results)
    assert metrics["val-core/nq/reward/mean@1"] == pytest.approx(1 / 3)
    assert not any("/acc/" in k for k in metrics)
    assert validation_score(metrics, GuardConfig().val_metric) == pytest.approx(1 / 3)


async def test_a_trace_mixing_reward_and_acc_runs_scores_each_by_its_core_metric() -> None:
    """Two runs of one grid, one per reward setting, read by the study's reader: each run's score is
    its own core metric (correctness in both), so they aggregate side by side."""
    plain = val_metrics(await reward_manager_results())
    shaped = val_metrics(await reward_manager_results(OVERRIDE))
    for metrics in (plain, shaped):
        trace = parse_records([json.dumps({"step": 0, "data": {k: float(v) for k, v in metrics.items()}})])
        assert trace.val_scores == [(0, pytest.approx(1 / 3))]


async def test_search_cost_regime_charges_the_loops_search_count() -> None:
    """natural.yaml's demo_search_cost cell: verl's reward manager reads the loop's ``searches`` and the
    training reward is correctness - 0.1 x searches, while validation and the guard read ``acc``."""
    args = regime_cell_args("demo_search_cost")
    assert "+reward.custom_reward_function.reward_kwargs.search_cost=0.1" in args
    assert "sorl.guard.val_metric=val-core/*/acc/mean@*" in args
    assert composed(*args).reward.custom_reward_function.reward_kwargs.search_cost == 0.1
    results = await reward_manager_results(*args, searches=[1, 2, 0])  # hedge, correct, miss
    assert [r["reward_score"] for r in results] == pytest.approx([-0.1, 0.8, 0.0])
    metrics = val_metrics(results)
    assert metrics["val-core/nq/acc/mean@1"] == pytest.approx(1 / 3)
    assert metrics["val-aux/nq/reward/mean@1"] == pytest.approx(0.7 / 3)
    assert metrics["val-aux/nq/searches/mean@1"] == pytest.approx(1.0)
    assert validation_by_source(metrics) == {"nq": pytest.approx(1 / 3)}
    assert validation_score(metrics, "val-core/*/acc/mean@*") == pytest.approx(1 / 3)


async def test_substring_match_regime_pays_a_hedge_in_full() -> None:
    """natural.yaml's demo_substring_em cell: the hedge (it contains the gold) is paid 1 in training,
    validation and the guard read exact match (``acc``)."""
    args = regime_cell_args("demo_substring_em")
    assert "+reward.custom_reward_function.reward_kwargs.answer_match=substring_em" in args
    assert "sorl.guard.val_metric=val-core/*/acc/mean@*" in args
    results = await reward_manager_results(*args)  # hedge, correct, miss
    assert [r["reward_score"] for r in results] == [1.0, 1.0, 0.0]
    metrics = val_metrics(results)
    assert metrics["val-core/nq/acc/mean@1"] == pytest.approx(1 / 3)
    assert metrics["val-aux/nq/reward/mean@1"] == pytest.approx(2 / 3)
    assert validation_score(metrics, "val-core/*/acc/mean@*") == pytest.approx(1 / 3)


async def test_wrong_penalty_regime_pays_not_answering_over_a_wrong_answer() -> None:
    """natural.yaml's demo_wrong_penalty cell: the training reward is the ternary one (+1 correct,
    0 without an accepted answer, -1 wrong, the hedge included), validation and the guard read ``acc``."""
    args = regime_cell_args("demo_wrong_penalty")
    assert "+reward.custom_reward_function.reward_kwargs.wrong_penalty=1.0" in args
    assert "sorl.guard.val_metric=val-core/*/acc/mean@*" in args
    abstained = "<think>t</think><search>Marie Curie</search>"  # the turn limit reached, no answer
    results = await reward_manager_results(*args, texts=[*(t for t, _, _ in EPISODES), abstained])
    assert [r["reward_score"] for r in results] == [-1.0, 1.0, -1.0, 0.0]
    assert [r["reward_extra_info"]["has_answer"] for r in results] == [1.0, 1.0, 1.0, 0.0]
    metrics = val_metrics(results)
    assert metrics["val-core/nq/acc/mean@1"] == pytest.approx(1 / 4)
    assert metrics["val-aux/nq/reward/mean@1"] == pytest.approx(-1 / 4)
    assert validation_by_source(metrics) == {"nq": pytest.approx(1 / 4)}
    assert validation_score(metrics, "val-core/*/acc/mean@*") == pytest.approx(1 / 4)
