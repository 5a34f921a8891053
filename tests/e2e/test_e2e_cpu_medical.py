"""verl's own ``main_ppo`` on CPU with ``+task=medical_mcq``: the embedded medical default end to end.

A real ``python -m verl.trainer.main_ppo`` subprocess (Ray, FSDP2 over gloo, the ``hf`` rollout, the
search_r1 agent loop against a live BM25 server over the medical corpus, the project's MCQ reward)
on the warm-started tiny model: a greedy validation over questions of every type, then two SO-GRPO
steps. Assertions read verl's file-logger metrics. Run it under the shared lock:
``flock /tmp/sorl-heavy.lock python -m pytest tests/e2e/test_e2e_cpu_medical.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sorl_verl.embedded.medical_world import QUESTION_TYPES, data_source

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 1200
SO_GRPO = ["algorithm.adv_estimator=so_grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo"]
#: validation before training over 27 shuffled val questions (every type is among them)
VALIDATION = ["trainer.val_before_train=True", "data.val_max_samples=27", "data.val_batch_size=27"]
#: SMALL: 4 prompts x 2 samples a training step
ROWS = 8
#: the last <answer> block of an episode (the loop stops at the first, so it is the one it accepted)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def chosen_option(output: str, options: dict[str, str]) -> str | None:
    """The option an episode's answer names plainly: its letter alone or an option's text alone
    (case and surrounding blanks or a trailing period aside); None for no answer or anything else."""
    answers = ANSWER.findall(output)
    if not answers:
        return None
    text = answers[-1].strip().rstrip(".").strip()
    if text.upper() in options:
        return text.upper()
    named = [letter for letter, option in options.items() if option.strip().lower() == text.lower()]
    return named[0] if len(named) == 1 else None


@pytest.fixture(scope="module")
def medical():
    from sorl_verl.embedded.demo_paths import embedded_task

    return embedded_task("medical", progress=False)


@pytest.fixture(scope="module")
def medical_retrieval(medical):
    from sorl_verl.retrieval.server import serve_in_background

    server = serve_in_background(medical.index_dir, subprocess_mode=True)
    yield server
    server.stop()


def run_main_ppo(run_dir: Path, task, url: str, overrides: list[str]) -> list[dict]:
    """One main_ppo run on the medical task; verl's metric records (asserts exit code 0)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    cmd = [
        sys.executable, "-m", "verl.trainer.main_ppo",
        "--config-path", str(REPO / "recipe" / "sorl" / "config"), "--config-name", "sorl_trainer",
        f"+task={task.overlay}", "+platform=cpu",
        f"data.train_files={task.train}", f"data.val_files={task.val}",
        f"actor_rollout_ref.model.path={task.model}",
        f"sorl.agent.retrieval_url={url}",
        f"trainer.default_local_dir={run_dir / 'ckpt'}",
        "trainer.logger=[console,file]",
        *overrides,
    ]  # fmt: skip
    env = {
        **os.environ,
        "VERL_PLATFORM": "cpu",
        "VERL_FILE_LOGGER_PATH": str(metrics),
        "TOKENIZERS_PARALLELISM": "false",
    }
    log = run_dir / "train.log"
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=run_dir, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    tail = "\n".join(log.read_text().splitlines()[-40:])
    assert proc.returncode == 0, f"main_ppo exited {proc.returncode}; log {log}:\n{tail}"
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def test_so_grpo_two_steps_on_the_medical_task(tmp_path, medical, medical_retrieval, small_overrides) -> None:
    assert medical.overlay == "medical_mcq"
    small = [o for o in small_overrides if not o.startswith("trainer.val_before_train")]
    records = run_main_ppo(
        tmp_path,
        medical,
        medical_retrieval.retrieve_url,
        [*small, *SO_GRPO, *VALIDATION, "trainer.total_training_steps=2", "trainer.save_freq=-1",
         "trainer.resume_mode=disable", f"trainer.validation_data_dir={tmp_path / 'val'}"],
    )  # fmt: skip
    steps = {r["step"]: r["data"] for r in records if "timing_s/step" in r["data"]}
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        for key in ("actor/pg_loss", "actor/loss", "actor/grad_norm", "actor/sorl/norm_factor"):
            assert math.isfinite(float(m[key])), (key, m[key])
        # the MCQ reward: 1 for the clearly chosen gold option, else 0 (format_score 0): binary scores,
        # their mean over the step's 8 episodes a multiple of 1/8
        assert float(m["critic/score/min"]) in (0.0, 1.0) and float(m["critic/score/max"]) in (0.0, 1.0), m
        assert float(m["critic/score/mean"]) * ROWS == round(float(m["critic/score/mean"]) * ROWS), m
    assert max(float(m["agent/searches_mean"]) for m in steps.values()) > 0.0

    val = next(r["data"] for r in records if any(k.startswith("val-core/") for k in r["data"]))
    means = {k.split("/")[1]: float(v) for k, v in val.items() if k.startswith("val-core/") and "/reward/mean@" in k}
    assert set(means) <= {data_source(t) for t in QUESTION_TYPES} and len(means) >= 5, sorted(val)

    # verl's dump of that validation (trainer.validation_data_dir): each episode's output, gold and
    # score. Where the episode's answer names one option plainly (its letter or its text), the
    # reward paid 1 exactly when that option is the gold one; an episode without an answer got 0
    rows = [json.loads(line) for line in (tmp_path / "val" / "0.jsonl").read_text().splitlines()]
    assert len(rows) == 27
    named = {True: 0, False: 0}
    for row in rows:
        gold = row["gts"]  # the row's ground truth; verl writes its numpy target array with str()
        target = gold["target"] if isinstance(gold["target"], list) else re.findall(r"[A-Z]", gold["target"])
        options = {k: v for k, v in gold["options"].items() if v}  # a 4-option question has no E
        target = {t.strip().upper() for t in target}
        choice = chosen_option(row["output"], options)
        if choice is not None:
            named[choice in target] += 1
            assert float(row["score"]) == float(choice in target), (choice, target, row["score"], row["output"][-300:])
        elif not ANSWER.search(row["output"]):
            assert float(row["score"]) == 0.0, row["output"][-300:]
    # the warm-started model answers some questions with the gold option (its own evaluation: 0.95 of
    # 225 greedy), so the scoring path from generation to a reward of 1 is exercised
    assert named[True] >= 1, (named, [r["output"][-200:] for r in rows[:3]])
