"""scripts/bench/guard_checkpoint_cost.py on the CPU with a tiny Qwen2 (a subprocess: it opens its own gloo group):
verl's checkpoint of the FSDP2 actor holds 12 bytes per parameter plus pickling, the guard's snapshot is hard
links, and the load restores weights, Adam moments and steps bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_tiny_checkpoint_round_trip(tmp_path: Path):
    out, ckpt = tmp_path / "cost.json", tmp_path / "ckpt"
    cmd = [sys.executable, str(REPO_ROOT / "scripts/bench/guard_checkpoint_cost.py"), "--device", "cpu",
           "--model", "tiny", "--rows", "1", "--length", "16", "--no-cold", "--ckpt-dir", str(ckpt),
           "--json-out", str(out)]  # fmt: skip
    # as on the device image: verl without the plugin, so no CPU platform (tests/conftest.py sets
    # VERL_PLATFORM=cpu on a machine without CUDA; verl would refuse that unknown platform)
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"} | {"VERL_USE_EXTERNAL_PLUGINS": "none"}
    run = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    data = json.loads(out.read_text())
    params = data["parameters"]
    assert data["verified_bit_for_bit"] == {"load_warm": True}
    assert data["snapshot_hard_linked"] is True
    files = data["files"]
    model, optim = files["actor/model_world_size_1_rank_0.pt"], files["actor/optim_world_size_1_rank_0.pt"]
    assert 4 * params <= model < 4 * params + 64 * 1024  # fp32 weights + pickling of some 30 tensors
    assert 8 * params <= optim < 8 * params + 128 * 1024  # exp_avg and exp_avg_sq in fp32, steps, param groups
    assert data["bytes"] == sum(files.values()) and data["s_over_p"] == data["bytes"] / params
    assert set(data["seconds"]) >= {"save", "sync", "snapshot", "load_warm"}
    assert not ckpt.exists()  # removed without --keep
