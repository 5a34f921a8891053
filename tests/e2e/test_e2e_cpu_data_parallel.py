"""One data-parallel rank or two give the same step: verl's ``main_ppo`` on CPU (FSDP2 over gloo, the
CPU overlay's strategy) with one rank and with two (two logical GPUs), same seed and data, one SO-GRPO
step of one optimizer update (policy loss and an entropy bonus), and the actor's weights after it
compared element by element.

The two runs sample the same episodes (the seeded agent loop gives each episode a seed of its own,
whatever replica decodes it) and differ in how the gradient is summed: over two micro-batches on one
rank, or over each rank's rows and then across ranks (the loss's token-mean with verl's global batch
info, averaged by FSDP's reduce-scatter). The update is plain SGD without weight decay or gradient
clipping, so the weights after the step are ``w0 - lr * g`` and differ between the twins by ``lr``
times the reordered-sum difference of ``g`` plus the rounding of that one update.

What it can catch: the bound stands the step's gradient norm ``G`` in for each element's sum of term
magnitudes (unknown from a checkpoint), so it is loose by about the ratio of ``G`` to an element's
gradient. A run-two step off by a factor ``1 + e`` fails the test when ``e x moved > 1``, ``moved`` the
largest step in units of the bound (asserted > 10, printed), so any step error above 10 % fails it (a
dropped or doubled rank, a wrong data-parallel scale); a reweighting of a few per cent can pass.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SO_GRPO = ["algorithm.adv_estimator=so_grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo"]
LR = 1e-2
#: the small e2e sizes: 4 prompts x 2 samples, prompts up to 256 tokens (CPU overlay), responses up to 448
ROWS, SEQ_LEN = 8, 256 + 448
ONE_STEP = [
    *SO_GRPO,
    # w1 = w0 - lr * g: SGD without momentum (the SORL optimizer's SGD; s = 1 on this on-policy step),
    # no weight decay, and a clipping threshold no gradient reaches (verl's clip then multiplies by 1)
    "actor_rollout_ref.actor.optim.optimizer=SGD",
    f"actor_rollout_ref.actor.optim.lr={LR}",
    "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "actor_rollout_ref.actor.grad_clip=1.0e9",
    # a gradient whatever the rewards: with 4 prompts x 2 samples every group can score alike (GRPO
    # advantage 0; the first launch of this test had grad_norm 0 and nothing to compare), the entropy
    # bonus always has one
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    # 8 rows a step, 4 per rank on two: the log-prob micro-batches must divide a rank's share
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "trainer.total_training_steps=1",
    "trainer.save_freq=1",
    "trainer.resume_mode=disable",
]
TWO_RANKS = ["trainer.n_gpus_per_node=2", "ray_kwargs.ray_init.num_gpus=2"]


def full_actor_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The actor's weights after step 1 from verl's sharded checkpoint, each rank's FSDP2 shard joined."""
    folder = run_dir / "ckpt" / "global_step_1" / "actor"
    world = json.loads((folder / "fsdp_config.json").read_text())["world_size"]
    shards = [torch.load(folder / f"model_world_size_{world}_rank_{r}.pt", map_location="cpu", weights_only=False)
              for r in range(world)]  # fmt: skip
    full = {}
    for key, first in shards[0].items():
        if not hasattr(first, "to_local"):
            full[key] = first
            continue
        (placement,) = first.placements
        parts = [shard[key].to_local() for shard in shards]
        full[key] = torch.cat(parts, dim=placement.dim) if placement.is_shard() else parts[0]
    return full


def dumped_episodes(rollouts: Path) -> list[tuple[str, str]]:
    return sorted((r["input"], r["output"]) for r in map(json.loads, (rollouts / "1.jsonl").read_text().splitlines()))


def twin_bound(fp32, config, grad_norm: float, weight: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |w_1rank - w_2ranks| after one SGD step.

    Each gradient element is a sum over the batch's ``ROWS x SEQ_LEN`` positions of products along the
    network's chain (``Fp32Bounds.transformer_chain`` roundings); two float32 evaluations in different
    orders are within ``between(G, positions + chain)``, with ``G`` the step's gradient norm (>= every
    element; a stand-in for the sum of the terms' magnitudes). The update ``w - lr * g`` then rounds
    twice in each run.
    """
    terms = ROWS * SEQ_LEN + fp32.transformer_chain(config, SEQ_LEN)
    return LR * fp32.between(grad_norm, terms) + fp32.between(1.0, 2) * (weight.abs() + LR * grad_norm)


def test_two_data_parallel_ranks_make_the_one_rank_step(tmp_path, main_ppo, embedded, fp32):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    paths, model = embedded
    runs = {}
    for name, ranks in (("one", []), ("two", TWO_RANKS)):
        dump = f"trainer.rollout_data_dir={tmp_path / name / 'rollouts'}"
        runs[name] = main_ppo(tmp_path / name, [], [*ONE_STEP, *ranks, dump])
    steps = {name: run.train_steps() for name, run in runs.items()}
    assert sorted(steps["one"]) == sorted(steps["two"]) == [1]
    one, two = steps["one"][1], steps["two"][1]

    # the same episodes, token for token, and so the same rewards
    episodes = {name: dumped_episodes(tmp_path / name / "rollouts") for name in runs}
    assert len(episodes["one"]) == ROWS and episodes["one"] == episodes["two"]
    for key in ("critic/score/mean", "response_length/mean", "response_length/max"):
        assert float(one[key]) == float(two[key]), key
    # on-policy, one update: nothing clipped, the step unscaled
    assert float(one["actor/sorl/norm_factor"]) == float(two["actor/sorl/norm_factor"]) == 1.0

    w_one, w_two = full_actor_weights(tmp_path / "one"), full_actor_weights(tmp_path / "two")
    assert w_one.keys() == w_two.keys()
    config = AutoConfig.from_pretrained(paths.model_dir)
    grad_norm = max(float(one["actor/grad_norm"]), float(two["actor/grad_norm"]))
    assert math.isfinite(grad_norm) and grad_norm > 0
    worst = {}
    for key in w_one:
        bound = twin_bound(fp32, config, grad_norm, w_one[key])
        excess = ((w_one[key] - w_two[key]).abs() / bound).max().item()
        worst[key] = excess
    assert max(worst.values()) <= 1.0, sorted(worst.items(), key=lambda kv: -kv[1])[:5]

    # the step moved the weights well beyond that bound (else the comparison shows nothing)
    initial = load_file(str(Path(paths.model_dir) / "model.safetensors"))
    common = [k for k in w_one if k in initial]
    assert common
    moved = max(((w_one[k] - initial[k]) / twin_bound(fp32, config, grad_norm, w_one[k])).abs().max().item()
                for k in common)  # fmt: skip
    print(f"largest step / bound: {moved:.1f}; a step error above {1 / moved:.1%} fails the comparison")
    assert moved > 10, moved
