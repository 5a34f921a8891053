"""scripts/bench/loss_cuda.py on the CPU with tiny shapes: its checks pass and its JSON has every field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture(scope="module")
def loss_cuda(bench_script: Callable[[str], ModuleType]) -> ModuleType:
    return bench_script("loss_cuda")


def test_small_cpu_run_passes_and_writes_the_json(loss_cuda: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "loss_cuda_results.json"
    # one thread: on a shared 2-core machine OpenMP regions can stall for a scheduler tick each
    argv = ["--device", "cpu", "--small", "--shapes", "8x160", "--reps", "2", "--threads", "1", "--json-out", str(out)]
    threads = torch.get_num_threads()
    try:
        rc = loss_cuda.main(argv)
    finally:
        torch.set_num_threads(threads)  # main() sets it process-wide
    data = json.loads(out.read_text())
    failed = [c["name"] for c in data["checks"] if not c["passed"]]
    assert rc == 0 and data["passed"] and not failed, failed[:10]
    for key in ("command", "python", "torch", "verl", "device", "device_name", "shapes", "turns_per_row", "bounds"):
        assert key in data, key
    assert data["device"] == "cpu" and data["shapes"] == [[8, 160]]
    names = [c["name"] for c in data["checks"]]
    for part in ("/so_grpo/default/cpu-float32/grad", "/so_ppo/loss_abs_max/cpu-float64/sorl/norm_factor",
                 "/vanilla/default/cpu-float32/loss", "/bf16-inputs/so_grpo/default/cpu-bfloat16/grad",
                 "/so_grpo_adv/cpu-float32", "/turn_gae_adv/cpu-float32", "/identity/on_policy/so_grpo/grad",
                 "/identity/single_token_turns_none_equals_vanilla/so_grpo/token-mean",
                 "/identity/heavy_clipping/grad_over_z", "/identity/so_grpo_equals_verl_grpo"):  # fmt: skip
        assert any(name.endswith(part) for name in names), part
    (result,) = data["results"]
    timing = result["timing"]
    assert timing["loss_fwd_bwd"]["ratio"]["wall"] > 0 and timing["estimator"]["ratio"]["wall"] > 0
    assert set(timing["host_syncs_per_call"]) == {"vanilla", "so_grpo", "gae", "so_ppo_turn_gae"}
    json.dumps(data, allow_nan=False)  # strict JSON


def test_a_wrong_gradient_fails_its_check(loss_cuda: ModuleType) -> None:
    """The bounds are not vacuous: the float32 gradient scaled by 1 + 1e-4 is outside them."""
    inp = loss_cuda.make_inputs(8, 160, (3, 3), 4, 0, torch.float32)
    adv, _, _ = loss_cuda.grpo_reference(inp.rewards, inp.mask, inp.index, loss_cuda.U32)
    config = loss_cuda.actor_config(clip_norm_apply="loss")
    knobs = loss_cuda.knob_dict(config)
    ref = loss_cuda.loss_reference("so_grpo", inp.old, inp.new_turn, adv.float(), inp.mask, knobs, loss_cuda.U32, 0.0)
    _, grad, _ = loss_cuda.run_loss(
        loss_cuda.compute_policy_loss_so_grpo, inp.old, inp.new_turn, adv.float(), inp.mask, config
    )
    report = loss_cuda.Report()
    assert report.compare("ok", grad, ref.grad, ref.grad_bound).passed
    assert not report.compare("scaled", grad * (1 + 1e-4), ref.grad, ref.grad_bound).passed
