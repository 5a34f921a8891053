"""recipe/sorl run scripts, DRY_RUN=1: one run directory per distinct configuration, resume of the
same configuration, validation-only runs in their own place, one metrics/log file per launch, and
the GPU plan checked before anything starts (exit 2 with the numbers)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sorl_verl.cli.recipe_plan import VARIABLES

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipe" / "sorl"
SCRIPTS = sorted(p.name for p in RECIPE.glob("run_*.sh"))
MAIN = "run_so_grpo_qwen2.5_3b_search.sh"
RECIPE_VARS = set(VARIABLES) | {
    "TENSORBOARD_DIR",
    "VERL_FILE_LOGGER_PATH",
    "DRY_RUN",
}


def run(script: str, *extra: str, dry: bool = True, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in RECIPE_VARS}
    clean.update({"PYTHON": sys.executable, **env})
    if dry:
        clean["DRY_RUN"] = "1"
    return subprocess.run(
        ["bash", str(RECIPE / script), *extra], env=clean, capture_output=True, text=True, timeout=120, check=False
    )


def plan(script: str, *extra: str, **env: str) -> dict[str, str]:
    """What a dry run announces: the argv as a dict of overrides, the run dir, exports, plan."""
    proc = run(script, *extra, **env)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    out = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv[5:]}
    out["run_dir"] = re.search(r"^run dir: (\S+) \((.*)\)$", proc.stderr, re.M)[1]
    out["state"] = re.search(r"^run dir: (\S+) \((.*)\)$", proc.stderr, re.M)[2]
    out["plan"] = re.search(r"^gpu plan: (.*)$", proc.stderr, re.M)[1]
    for name, value in re.findall(r"^export (\w+)=(.*)$", proc.stderr, re.M):
        out[name] = value
    return out


# --- run directories ---------------------------------------------------------------------------

#: knobs that change the experiment: each must give its own run directory
IDENTITY_KNOBS = {
    "CLIP_NORM_MODE": "add",
    "CLIP_NORM_TAU": "0.5",
    "CLIP_NORM_SCOPE": "global",
    "LOG_RATIO_CLAMP": "10",
    "NUM_MINI_BATCHES": "4",
    "PPO_EPOCHS": "2",
    "STALENESS": "2",
    "GROUP_SIZE": "8",
    "ACTOR_LR": "2e-6",
    "KL_COEF": "0.01",
    "MAX_TURNS": "3",
    "RETRIEVAL_TOPK": "5",
    "TEMPERATURE": "0.8",
    "TRAIN_FILES": "/data/other.parquet",
    "MODEL_PATH": "Qwen/Qwen2.5-3B-Instruct",
    "GPUS_PER_NODE": "4",  # FSDP checkpoints are sharded per trainer GPU
    "GUARD": "0",  # the collapse guard (on by default) restores and backs off: another training
}
#: knobs that only name, schedule, place or fit the run: same run directory (it continues)
BOOKKEEPING_KNOBS = {
    "TOTAL_STEPS": "2000",
    "SAVE_FREQ": "20",
    "TEST_FREQ": "10",
    "RETRIEVAL_URL": "http://10.0.0.7:8000/retrieve",
    "VAL_FILES": "[/data/a.parquet,/data/b.parquet]",
    "VAL_MAX_SAMPLES": "500",
    "MICRO_BATCH_SIZE": "4",
    "LOG_PROB_MICRO_BATCH_SIZE": "4",
    "GPU_MEMORY_UTILIZATION": "0.5",
    "OFFLOAD": "False",
    "LOGGER": "[console,wandb]",
    "ROLLOUT_TP": "2",
}


def test_every_identity_knob_gets_its_own_run_directory(tmp_path):
    base = plan(MAIN, OUTPUT_DIR=str(tmp_path))
    assert re.fullmatch(rf"{tmp_path}/so_grpo-search-qwen2.5-3b-sync-[0-9a-f]{{8}}", base["run_dir"])
    assert base["trainer.experiment_name"] == Path(base["run_dir"]).name
    assert base["trainer.default_local_dir"] == base["run_dir"] + "/checkpoints"
    dirs = {"base": base["run_dir"]}
    for knob, value in IDENTITY_KNOBS.items():
        dirs[knob] = plan(MAIN, OUTPUT_DIR=str(tmp_path), **{knob: value})["run_dir"]
    dirs["hydra"] = plan(MAIN, "actor_rollout_ref.actor.clip_ratio_high=0.28", OUTPUT_DIR=str(tmp_path))["run_dir"]
    dirs["offpolicy script"] = plan("run_so_grpo_qwen2.5_3b_search_offpolicy.sh", OUTPUT_DIR=str(tmp_path))["run_dir"]
    assert len(set(dirs.values())) == len(dirs), dirs
    assert plan(MAIN, OUTPUT_DIR=str(tmp_path))["run_dir"] == base["run_dir"]  # deterministic


def test_bookkeeping_knobs_keep_the_run_directory(tmp_path):
    base = plan(MAIN, OUTPUT_DIR=str(tmp_path))["run_dir"]
    for knob, value in BOOKKEEPING_KNOBS.items():
        assert plan(MAIN, OUTPUT_DIR=str(tmp_path), **{knob: value})["run_dir"] == base, knob
    extra = ("trainer.total_training_steps=7", "trainer.test_freq=5", "+trainer.max_actor_ckpt_to_keep=2")
    assert plan(MAIN, *extra, OUTPUT_DIR=str(tmp_path))["run_dir"] == base


@settings(max_examples=12, deadline=None)
@given(
    identity=st.dictionaries(st.sampled_from(sorted(IDENTITY_KNOBS)), st.just(""), max_size=3),
    bookkeeping=st.dictionaries(st.sampled_from(sorted(BOOKKEEPING_KNOBS)), st.just(""), max_size=3),
)
def test_run_directory_is_a_function_of_the_identity_knobs_only(identity, bookkeeping):
    env = {k: IDENTITY_KNOBS[k] for k in identity} | {k: BOOKKEEPING_KNOBS[k] for k in bookkeeping}
    with_bookkeeping = plan(MAIN, OUTPUT_DIR="/runs", **env)["run_dir"]
    without = plan(MAIN, OUTPUT_DIR="/runs", **{k: IDENTITY_KNOBS[k] for k in identity})["run_dir"]
    assert with_bookkeeping == without
    base = plan(MAIN, OUTPUT_DIR="/runs")["run_dir"]
    assert (without == base) is (not identity)


def test_run_name_prefixes_and_run_dir_overrides(tmp_path):
    base = plan(MAIN, OUTPUT_DIR=str(tmp_path))["run_dir"]
    named = plan(MAIN, OUTPUT_DIR=str(tmp_path), RUN_NAME="lr-sweep")["run_dir"]
    assert named == str(tmp_path / f"lr-sweep-{Path(base).name}")
    explicit = plan(MAIN, OUTPUT_DIR=str(tmp_path), RUN_DIR=str(tmp_path / "mine"))
    assert explicit["run_dir"] == str(tmp_path / "mine") and explicit["trainer.experiment_name"] == "mine"


def test_same_configuration_resumes_and_skips_a_repeated_validation(tmp_path):
    fresh = plan(MAIN, OUTPUT_DIR=str(tmp_path))
    assert fresh["state"] == "new run" and fresh["trainer.resume_mode"] == "auto"
    assert fresh["trainer.val_before_train"] == "True"
    ckpt = Path(fresh["trainer.default_local_dir"])
    (ckpt / "global_step_100").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("100")  # what verl writes after saving
    again = plan(MAIN, OUTPUT_DIR=str(tmp_path))
    assert again["run_dir"] == fresh["run_dir"] and again["trainer.resume_mode"] == "auto"
    assert (
        again["state"]
        == f"resumes from {ckpt}/global_step_100 (to start over: RUN_NAME=<new name>, or rm -r {fresh['run_dir']})"
    )
    assert again["trainer.val_before_train"] == "False"  # step 100 was validated (TEST_FREQ 50) before it was saved
    assert plan(MAIN, OUTPUT_DIR=str(tmp_path), TEST_FREQ="30")["trainer.val_before_train"] == "True"
    assert plan(MAIN, OUTPUT_DIR=str(tmp_path), VAL_BEFORE_TRAIN="True")["trainer.val_before_train"] == "True"
    other = plan(MAIN, OUTPUT_DIR=str(tmp_path), CLIP_NORM_TAU="0.1")
    assert other["state"] == "new run" and other["run_dir"] != fresh["run_dir"]


def test_every_launch_gets_its_own_metrics_and_log_file(tmp_path):
    first = run(MAIN, OUTPUT_DIR=str(tmp_path), SORL_LAUNCH_ID="20250101-000000-1")
    second = run(MAIN, OUTPUT_DIR=str(tmp_path))
    paths = [re.search(r"^export VERL_FILE_LOGGER_PATH=(.*)$", p.stderr, re.M)[1] for p in (first, second)]
    assert paths[0].endswith("/metrics.20250101-000000-1.jsonl")
    assert re.search(r"/metrics\.\d{8}-\d{6}-\d+\.jsonl$", paths[1]) and paths[0] != paths[1]
    assert Path(paths[0]).parent == Path(paths[1]).parent
    assert "train.20250101-000000-1.log (also appended to" in first.stderr


# --- validation-only runs ------------------------------------------------------------------------


def _trained(tmp_path: Path, steps: dict[int, float]) -> Path:
    """The run dir of the default configuration with checkpoints and validation metrics at ``steps``
    (validation metrics written by verl's own Tracking file logger)."""
    from verl.utils.tracking import Tracking

    run_dir = Path(plan(MAIN, OUTPUT_DIR=str(tmp_path))["run_dir"])
    for step in steps:
        (run_dir / "checkpoints" / f"global_step_{step}").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(max(steps)))
    os.environ["VERL_FILE_LOGGER_PATH"] = str(run_dir / "metrics.20250101-000000-1.jsonl")
    try:
        tracker = Tracking(project_name="sorl", experiment_name=run_dir.name, default_backend=["file"])
        for step, em in sorted(steps.items()):
            tracker.log({"val-aux/nq/em/mean@1": em, "val-aux/hotpotqa/em/mean@1": em / 2}, step=step)
        tracker.finish()
    finally:
        del os.environ["VERL_FILE_LOGGER_PATH"]
    return run_dir


def test_val_only_evaluates_a_checkpoint_of_this_configuration_in_its_own_directory(tmp_path):
    run_dir = _trained(tmp_path, {100: 0.2, 200: 0.4, 300: 0.1})
    for step_arg, step in (("last", 300), ("best", 200), ("100", 100)):
        got = plan(MAIN, OUTPUT_DIR=str(tmp_path), VAL_ONLY="1", EVAL_STEP=step_arg, VAL_FILES="[/t/nq.parquet]")
        work = run_dir / "eval" / f"step_{step}"
        assert (
            got["run_dir"] == str(run_dir)
            and got["state"] == f"validation only of {run_dir}/checkpoints/global_step_{step}"
        )
        assert got["trainer.val_only"] == "True" and got["trainer.val_before_train"] == "True"
        assert got["trainer.resume_mode"] == "resume_path"
        assert got["trainer.resume_from_path"] == f"{run_dir}/checkpoints/global_step_{step}"
        assert got["trainer.default_local_dir"] == f"{work}/checkpoints"  # never the training checkpoints
        assert got["sorl.guard.enable"] == "false"  # GUARD=1, the default: validation only has nothing to guard
        assert got["VERL_FILE_LOGGER_PATH"].startswith(f"{work}/metrics.")
        assert got["TENSORBOARD_DIR"] == f"{work}/tensorboard"
        assert "trainer.total_training_steps" not in got
    base = plan(MAIN, OUTPUT_DIR=str(tmp_path), VAL_ONLY="1", EVAL_STEP="base")
    assert (
        base["trainer.resume_mode"] == "disable"
        and base["trainer.default_local_dir"] == f"{run_dir}/eval/step_base/checkpoints"
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"EVAL_STEP": "last"}, "EVAL_STEP=last: no checkpoint of this configuration in"),
        ({"EVAL_STEP": "best"}, "EVAL_STEP=best: no validated step with a checkpoint"),
        ({"EVAL_STEP": "70"}, "EVAL_STEP must be last, best, base or a step with a checkpoint"),
    ],
)
def test_val_only_without_the_checkpoint_stops_with_a_message(tmp_path, env, message):
    proc = run(MAIN, OUTPUT_DIR=str(tmp_path), VAL_ONLY="1", **env)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


# --- GPU plan ------------------------------------------------------------------------------------


@pytest.mark.parametrize("script", SCRIPTS)
def test_defaults_fit_one_8_gpu_node(script):
    got = plan(script)
    used = re.search(r"= (\d+) GPUs of 1 x 8$", got["plan"])
    assert used and int(used[1]) == 8, got["plan"]
    trainer = int(got["trainer.nnodes"]) * int(got["trainer.n_gpus_per_node"])
    if "async" in script:
        rollout = int(got["actor_rollout_ref.rollout.nnodes"]) * int(got["actor_rollout_ref.rollout.n_gpus_per_node"])
        assert (trainer, rollout) == (4, 4) and got["plan"].startswith("trainer 1 x 4 (fsdp) + rollout 1 x 4 (vllm")
    else:
        assert trainer == 8 and "shared by training" in got["plan"]


def test_any_script_in_separate_async_splits_the_node():
    got = plan("run_so_ppo_qwen2.5_7b_search.sh", TRAINER_MODE="separate_async")
    assert got["trainer.n_gpus_per_node"] == "4" and got["actor_rollout_ref.rollout.n_gpus_per_node"] == "4"
    assert got["plan"] == "trainer 1 x 4 (fsdp) + rollout 1 x 4 (vllm, TP 2: 2 replicas) = 8 GPUs of 1 x 8"


def test_multi_node_plans():
    two = plan(MAIN, NNODES="2")
    assert (
        two["plan"]
        == "2 x 8 GPUs shared by training (fsdp) and rollout (vllm, TP 1: 16 replicas, sync) = 16 GPUs of 2 x 8"
    )
    dedicated = plan(
        "run_so_grpo_qwen2.5_3b_search_async.sh",
        NNODES="1",
        GPUS_PER_NODE="8",
        ROLLOUT_GPUS_PER_NODE="8",
        CLUSTER_NODES="2",
    )
    assert dedicated["plan"].endswith("= 16 GPUs of 2 x 8")


@pytest.mark.parametrize(
    ("script", "env", "message"),
    [
        ("run_so_grpo_qwen2.5_3b_search_async.sh", {"GPUS_PER_NODE": "8"},
         "the GPU plan does not fit: gpu plan: trainer 1 x 8 (fsdp) + rollout 1 x 4 (vllm, TP 1: 4 replicas) = 12 GPUs of 1 x 8"),
        # 16 GPUs on 2 x 8, but 6 + 6 leave 2 per node and the rollout's 4 must sit on one node
        ("run_so_grpo_qwen2.5_3b_search_async.sh", {"NNODES": "2", "GPUS_PER_NODE": "6", "CLUSTER_NODES": "2"},
         "= 16 GPUs of 2 x 8. Each pool's per-node share must fit on one node"),
        (MAIN, {"GPUS_PER_NODE": "16"}, "1 x 16 GPUs shared by training"),
        (MAIN, {"ROLLOUT_TP": "3"}, "ROLLOUT_TP=3 must divide the 8 rollout GPUs"),
        ("run_so_grpo_qwen2.5_7b_search.sh", {"ROLLOUT_TP": "16", "CLUSTER_GPUS_PER_NODE": "16", "GPUS_PER_NODE": "8", "NNODES": "2", "CLUSTER_NODES": "2"},
         "ROLLOUT_TP=16 must divide the 16 rollout GPUs and fit in one node (8 GPUs)"),
        (MAIN, {"TRAIN_BATCH_SIZE": "100", "GROUP_SIZE": "3"}, "TRAIN_BATCH_SIZE x GROUP_SIZE = 100 x 3 = 300 episodes must divide evenly over 8"),
        ("run_so_ppo_qwen2.5_7b_search.sh", {"STRATEGY": "megatron", "TRAIN_TP": "3", "GUARD": "0"}, "TRAIN_TP x TRAIN_PP = 3 must divide the 8 trainer GPUs"),
        (MAIN, {"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE must be a positive integer, got '0'"),
    ],
)  # fmt: skip
def test_impossible_gpu_plans_exit_2_with_the_numbers(script, env, message):
    proc = run(script, **env)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("algo", ["so_grpo", "grpo"])
def test_cpu_platform_command_passes_verl_s_checks(algo, tmp_path):
    """What main_ppo runs first (compose + validate_config), on the PLATFORM=cpu command; like the
    CPU main job it runs without a reference policy (no KL); with GUARD=1, so the guard's start-up
    checks run on it too."""
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    proc = run(MAIN, PLATFORM="cpu", ALGO=algo, OUTPUT_DIR=str(tmp_path), GUARD="1")
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()
    with initialize_config_dir(config_dir=argv[3].removeprefix("--config-path="), version_base=None):
        cfg = compose(config_name="sorl_trainer", overrides=argv[5:])
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.trainer.device == "cpu"
    assert not need_reference_policy(cfg)
    # the guard (GUARD=1) passes its start-up checks: the planner's TEST_FREQ (50) replaces the overlay's
    from omegaconf import OmegaConf

    from sorl_verl.trainer.guard import check_guard_against_trainer
    from sorl_verl.trainer.guard_rule import guard_settings

    guard, _ = guard_settings(OmegaConf.to_container(cfg.sorl, resolve=True))
    check_guard_against_trainer(cfg, guard)
    assert guard.enable and guard.rule == "drop" and guard.patience == 1 and cfg.trainer.test_freq == 50


def test_cpu_platform_has_no_gpu_plan_and_leaves_sizes_to_the_overlay():
    got = plan(MAIN, PLATFORM="cpu")
    assert got["plan"].startswith("none (PLATFORM=cpu")
    assert got["+platform"] == "cpu"
    for key in ("data.train_batch_size", "trainer.n_gpus_per_node", "actor_rollout_ref.rollout.name",
                "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.n"):  # fmt: skip
        assert key not in got, key
    proc = run(MAIN, PLATFORM="tpu")
    assert proc.returncode == 2 and "PLATFORM must be gpu or cpu" in proc.stderr


#: stand-in for the interpreter of a GPU run (main_ppo cannot run here): writes one validation at
#: step $STAND_IN_STEP where verl's file logger would (its format: {"step": N, "data": {...}}),
#: prints a line, exits $STAND_IN_RC; any other command (``-m sorl_verl eval``) goes to the real
#: interpreter
STAND_IN_PYTHON = """#!/usr/bin/env bash
if [[ $2 == verl.trainer.main_ppo ]]; then
  echo "stand-in main_ppo launch $SORL_LAUNCH_ID"
  printf '{{"step": %d, "data": {{"val-aux/nq/em/mean@1": %s}}}}\\n' "$STAND_IN_STEP" "$STAND_IN_EM" > "$VERL_FILE_LOGGER_PATH"
  exit "${{STAND_IN_RC:-0}}"
fi
exec {real} "$@"
"""


def test_launches_append_logs_keep_metrics_and_return_the_trainer_s_status(tmp_path):
    python = tmp_path / "python"
    python.write_text(STAND_IN_PYTHON.format(real=sys.executable))
    python.chmod(0o755)
    env = {"OUTPUT_DIR": str(tmp_path / "out"), "PYTHON": str(python)}
    for launch, (step, em) in enumerate(((0, 0.1), (50, 0.3))):
        proc = run(MAIN, dry=False, SORL_LAUNCH_ID=f"2025010{launch + 1}-000000-1", STAND_IN_STEP=str(step),
                   STAND_IN_EM=str(em), **env)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    (run_dir,) = (tmp_path / "out").iterdir()
    assert sorted(p.name for p in run_dir.glob("metrics.*.jsonl")) == [
        "metrics.20250101-000000-1.jsonl", "metrics.20250102-000000-1.jsonl"]  # fmt: skip
    log = (run_dir / "train.log").read_text()
    assert log.count("=== launch ") == 2 and "stand-in main_ppo launch 20250101-000000-1" in log
    assert "stand-in main_ppo launch 20250102-000000-1" in log
    launch_log = (run_dir / "train.20250102-000000-1.log").read_text()
    assert launch_log.startswith("stand-in main_ppo launch 20250102-000000-1\n") and "20250101" not in launch_log
    assert (run_dir / "overrides.txt").read_text().startswith("+task=search_qa\n")
    failed = run(MAIN, dry=False, STAND_IN_STEP="60", STAND_IN_EM="0.2", STAND_IN_RC="3", **env)
    assert failed.returncode == 3  # the trainer's status, not tee's
    # a validation-only launch tabulates what it validated, in its own directory
    ckpt = run_dir / "checkpoints"
    (ckpt / "global_step_50").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("50")
    val = run(MAIN, dry=False, VAL_ONLY="1", STAND_IN_STEP="50", STAND_IN_EM="0.25", **env)
    assert val.returncode == 0, val.stderr
    table = (run_dir / "eval" / "step_50" / "eval.csv").read_text().splitlines()
    assert table[1:] == ["last,50,nq,-,0.25,,", "best,50,nq,-,0.25,,"]
    assert len(list(run_dir.glob("metrics.*.jsonl"))) == 3  # the training run's metrics untouched
