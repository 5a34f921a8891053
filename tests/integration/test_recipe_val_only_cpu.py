"""The validation-only path end to end on CPU: a run script with PLATFORM=cpu trains the embedded
default for one step (verl main_ppo, hf rollout, search_r1 agent loop, live BM25 server; the
collapse guard on, GUARD=1, so step 1's validation is its best checkpoint), then
VAL_ONLY=1 evaluates that checkpoint through verl's own validation (``trainer.val_only=True``)
into ``<run>/eval/step_1/`` and tabulates it. Greedy validation (the CPU overlay's val_kwargs), so
the val-only EM of checkpoint 1 equals the EM the training launch validated at step 1."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "recipe" / "sorl" / "run_so_grpo_qwen2.5_3b_search.sh"
SMALL = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_epochs=1", "data.val_batch_size=8", "sorl.agent.max_turns=3",
         "data.max_response_length=448"]  # fmt: skip


def _records(run_dir: Path) -> list[dict]:
    return [
        json.loads(line) for f in sorted(run_dir.glob("metrics*.jsonl")) for line in f.read_text().splitlines() if line
    ]


def test_train_one_step_then_validation_only_of_its_checkpoint(tmp_path):
    from sorl_verl.cpu.chatml_alias import chatml_alias
    from sorl_verl.embedded.qa_build import ensure_embedded_default
    from sorl_verl.retrieval.server import serve_in_background

    paths = ensure_embedded_default(progress=False)
    server = serve_in_background(paths.index_dir, subprocess_mode=True)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DRY_RUN", "VAL_ONLY", "EVAL_STEP"))}
        env.update(PLATFORM="cpu", PYTHON=sys.executable, OUTPUT_DIR=str(tmp_path), LOGGER="[console,file]",
                   MODEL_PATH=str(chatml_alias(paths.model_dir)), TRAIN_FILES=str(paths.parquet["train"]),
                   VAL_FILES=str(paths.parquet["val"]), VAL_MAX_SAMPLES="8", RETRIEVAL_URL=server.retrieve_url,
                   TOTAL_STEPS="1", SAVE_FREQ="1", TEST_FREQ="1", GUARD="1")  # fmt: skip
        train = subprocess.run(
            ["bash", str(SCRIPT), *SMALL], env=env, capture_output=True, text=True, timeout=900, check=False
        )
        assert train.returncode == 0, train.stdout[-4000:] + train.stderr[-3000:]
        (run_dir,) = tmp_path.iterdir()
        assert (run_dir / "checkpoints" / "global_step_1").is_dir()
        trained_em = {r["step"]: r["data"]["val-aux/synthetic_1hop/em/mean@1"] for r in _records(run_dir)
                      if "val-aux/synthetic_1hop/em/mean@1" in r["data"]}  # fmt: skip
        assert sorted(trained_em) == [0, 1]
        guard_best = [r["data"]["sorl/guard/best_step"] for r in _records(run_dir) if r["step"] == 1]
        assert guard_best == [1.0] and (run_dir / "checkpoints" / "sorl_guard" / "best_step_1" / "actor").is_dir()

        val = subprocess.run(["bash", str(SCRIPT), *SMALL], env={**env, "VAL_ONLY": "1", "EVAL_STEP": "last"},
                             capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
        assert val.returncode == 0, val.stdout[-4000:] + val.stderr[-3000:]
    finally:
        server.stop()
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_dir.name]  # same configuration, same run dir
    work = run_dir / "eval" / "step_1"
    records = _records(work)
    assert [r["step"] for r in records] == [1]  # validated at the checkpoint's step, nothing trained
    assert records[0]["data"]["val-aux/synthetic_1hop/em/mean@1"] == pytest.approx(trained_em[1], abs=1e-12)
    with (work / "eval.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["which"], r["step"]) for r in rows} == {("last", "1"), ("best", "1")}
    assert not (work / "checkpoints").exists()  # the validation-only launch saved nothing
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("global_step_*")) == ["global_step_1"]
    # logs: one file per launch, and both launches appended to the run's train.log
    assert len(list(run_dir.glob("train.*.log"))) == 1 and len(list(work.glob("train.*.log"))) == 1
    assert (run_dir / "train.log").read_text().count("=== launch ") == 1
    assert "validation only of" in (work / "train.log").read_text()
