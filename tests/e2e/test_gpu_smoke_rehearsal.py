"""The GPU smoke (scripts/gpu/run_gpu_smoke.sh) rehearsed on CPU: the same script, runs and verdict with
``SMOKE_DEVICE=cpu``, one step of each run at the e2e tests' small sizes on the warm-start the other e2e
tests build (``expert``), so that the script a GPU machine runs stays working between GPU sessions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sorl_verl.paths import data_home

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu", "run_gpu_smoke.sh")
#: the e2e sizes less the keys the smoke's runs set themselves (validation, epochs, mini-batches)
SIZES = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "data.max_response_length=448",
    "sorl.agent.max_turns=3",
    "data.val_max_samples=8",
    "data.val_batch_size=8",
]


def test_cpu_rehearsal_of_the_gpu_smoke_passes(tmp_path, embedded):
    out = tmp_path / "out"
    env = {
        **os.environ, "SMOKE_DEVICE": "cpu", "SMOKE_WARMSTART": "expert", "STEPS": "1", "OUT": str(out),
        "SORL_GPU_WORK": str(tmp_path / "work"), "PYTHON": sys.executable, "SORL_HOME": str(data_home()),
    }  # fmt: skip
    proc = subprocess.run(["bash", SCRIPT, *SIZES], env=env, capture_output=True, text=True, timeout=1800)
    tail = "\n".join(proc.stdout.splitlines()[-30:])
    assert proc.returncode == 0, tail
    assert proc.stdout.splitlines()[-2].startswith("[smoke] RESULT: PASS"), tail
    # both runs trained and the plain one validated before and after; the stressed run's 4 epochs x 2
    # mini-batches gave the SORL optimizer 8 updates in its one step
    assert "[smoke] plain validation @ step 0" in proc.stdout and "[smoke] plain validation @ step 1" in proc.stdout
    assert "[smoke] stressed step 1:" in proc.stdout
    assert sum(1 for _ in (out / "stressed" / "sorl_updates.jsonl").open()) == 8
