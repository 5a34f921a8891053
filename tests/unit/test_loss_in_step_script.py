"""scripts/bench/loss_in_step.py on the CPU with a tiny Qwen2: both losses run through a whole model step."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def loss_in_step(bench_script: Callable[[str], ModuleType]) -> ModuleType:
    return bench_script("loss_in_step")


def test_tiny_cpu_step_times_both_losses(loss_in_step: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    argv = ["--device", "cpu", "--model", "tiny", "--rows", "2", "--length", "48", "--turns", "3", "--reps", "2"]
    result = loss_in_step.main([*argv, "--json-out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result))
    assert data["shape"] == [2, 48] and 0 < data["policy_tokens"] < 2 * 48
    assert all(len(v) == 2 and min(v) > 0 for v in data["step_s_all"].values())
    assert data["ratio"] == pytest.approx(data["step_s_median"]["so_grpo"] / data["step_s_median"]["vanilla"])


def test_the_model_is_a_causal_lm_whose_log_probs_are_normalized(loss_in_step: ModuleType) -> None:
    import torch

    model = loss_in_step.build_model("tiny", "cpu", torch.float32)
    ids = torch.randint(0, loss_in_step.MODELS["tiny"]["vocab_size"], (2, 10))
    logp = loss_in_step.response_log_prob(model, ids)
    assert logp.shape == (2, 10) and bool((logp < 0).all())
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % loss_in_step.MODELS["tiny"]["vocab_size"]
    # causal: changing the last token changes only its own log-prob
    assert torch.equal(loss_in_step.response_log_prob(model, changed)[:, :-1], logp[:, :-1])
