"""``sorl-verl recipe-plan``: the planner behind ``recipe/sorl/run_*.sh``.

The run scripts set a few defaults (``ALGO``, ``TASK``, ``MODEL_PATH``, sizes) and source
``recipe/sorl/common.sh``, which hands the environment to this module and runs what it returns.
The computing happens here and in :mod:`sorl_verl.cli.recipe_settings`:

1. ``resolve_settings`` / ``validate`` (recipe_settings): every variable with its default, checked
   in one place (a bad value exits 2 naming the variable), and the checked GPU plan.
2. :func:`experiment_overrides`: the hydra overrides that define the experiment.
3. :func:`plan_run_dir`: the run directory ``OUTPUT_DIR/[RUN_NAME-]ALGO-TASK-MODEL-MODE-<hash>``,
   the hash over :func:`identity_overrides`, and the checkpoint it resumes.
4. :func:`bookkeeping_overrides`: schedule and resume, or validation only of ``EVAL_STEP``.
5. :func:`build_launch`: the ``main_ppo`` command, its environment and this launch's files.

``--print`` (``DRY_RUN=1``) prints the command, one argument per line; ``--launch`` prepares the
work directory and prints bash assignments for ``common.sh`` to ``eval``; ``--variables`` lists the
variables read, for ``common.sh`` to export the ones its script set.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sorl_verl.cli.recipe_settings import (
    ALGORITHMS,
    VARIABLES,
    GpuPlan,
    RecipeError,
    basename,
    guard_backoff_target,
    resolve_settings,
    validate,
)

__all__ = ["VARIABLES", "GpuPlan", "RecipeError", "build_launch", "dry_run_text", "identity_overrides", "main"]


# --- hydra overrides -----------------------------------------------------------------------------


#: checkpoints verl's rotation keeps with ``GUARD=1``; the guard's best snapshot comes on top, so the
#: disk holds at most ``GUARD_CKPT_TO_KEEP + 1`` checkpoints. Not 2: a restore on a step verl already
#: saved registers that step twice in verl's rotation list, and with 2 the next save would first
#: delete that step, the latest checkpoint (docs/guard.md, "What the guard adds")
GUARD_CKPT_TO_KEEP = 3


def guard_overrides(s: Mapping[str, str]) -> list[str]:
    """``GUARD=1``: the collapse guard (docs/guard.md) with the settings of the learning study's guarded
    cells (``recipe/sorl/study/learning.yaml``), the only ones with evidence at the recipes' protocol, and
    the backoff target of :func:`guard_backoff_target`; written out in full so the command shows them and
    later changes of the config's defaults cannot change a recipe run (the rule ``drop``: the guard's
    default became ``stderr``, whose evidence is for 300 questions every 10 steps; on thousands of
    validation questions 2 standard errors are a small fall). Then verl's checkpoint rotation bounded to
    :data:`GUARD_CKPT_TO_KEEP` (every new best and every restore is a checkpoint; without a bound verl
    keeps them all); those two keys are not part of the run's identity."""
    return [
        "sorl.guard.enable=true",
        "sorl.guard.rule=drop",
        "sorl.guard.drop=0.3",
        "sorl.guard.patience=1",
        "sorl.guard.backoff=0.5",
        f"sorl.guard.backoff_target={guard_backoff_target(s)}",
        "sorl.guard.max_restores=3",
        f"trainer.max_actor_ckpt_to_keep={GUARD_CKPT_TO_KEEP}",
        f"trainer.max_critic_ckpt_to_keep={GUARD_CKPT_TO_KEEP}",
    ]


def experiment_overrides(s: Mapping[str, str]) -> list[str]:
    """The overrides that define the experiment (validated settings): task overlay first;
    ``PLATFORM=cpu`` adds ``+platform=cpu`` and leaves sizes, engines and GPU counts to it;
    ``GUARD=1`` ends them with :func:`guard_overrides`."""
    gpu = s["PLATFORM"] == "gpu"
    critic = ALGORITHMS[s["ALGO"]].critic
    args = [f"+task={s['TASK_CONFIG']}"] + (["+platform=cpu"] if not gpu else [])
    args += [
        f"data.train_files={s['TRAIN_FILES']}",
        f"data.val_files={s['VAL_FILES']}",
        f"actor_rollout_ref.model.path={s['MODEL_PATH']}",
        f"sorl.agent.retrieval_url={s['RETRIEVAL_URL']}",
        f"sorl.agent.topk={s['RETRIEVAL_TOPK']}",
        f"sorl.agent.max_turns={s['MAX_TURNS']}",
    ]
    if "VAL_MAX_SAMPLES" in s:
        args.append(f"data.val_max_samples={s['VAL_MAX_SAMPLES']}")
    if gpu:
        args += [
            f"data.train_batch_size={s['TRAIN_BATCH_SIZE']}",
            f"data.max_prompt_length={s['MAX_PROMPT_LENGTH']}",
            f"data.max_response_length={s['MAX_RESPONSE_LENGTH']}",
            f"actor_rollout_ref.actor.optim.lr={s['ACTOR_LR']}",
            f"actor_rollout_ref.actor.entropy_coeff={s['ENTROPY_COEFF']}",
            f"sorl.agent.max_obs_tokens={s['MAX_OBS_LENGTH']}",
        ]
    args += _algorithm_overrides(s, critic, gpu)
    if gpu:
        args += _engine_overrides(s, critic)
    args += _off_policy_overrides(s, gpu)
    if gpu:
        args += [f"trainer.nnodes={s['NNODES']}", f"trainer.n_gpus_per_node={s['GPUS_PER_NODE']}"]
    if s["GUARD"] == "1":  # it changes what is trained: part of the run's identity
        args += guard_overrides(s)
    return args


def _algorithm_overrides(s: Mapping[str, str], critic: bool, gpu: bool) -> list[str]:
    """ALGO -> estimator, loss, critic, group size, SORL knobs (only when set), KL placement."""
    args = [
        f"algorithm.adv_estimator={s['ADV_ESTIMATOR']}",
        f"algorithm.gamma={s['GAMMA']}",
        f"algorithm.lam={s['LAM']}",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={s['LOSS_MODE']}",
        f"actor_rollout_ref.actor.clip_ratio_low={s['CLIP_RATIO_LOW']}",
        f"actor_rollout_ref.actor.clip_ratio_high={s['CLIP_RATIO_HIGH']}",
        f"actor_rollout_ref.actor.loss_agg_mode={s['LOSS_AGG_MODE']}",
        f"critic.enable={critic}",
    ]
    if gpu:
        args.append(f"actor_rollout_ref.rollout.n={s['GROUP_SIZE']}")
    for name in ("CLIP_NORM_MODE", "CLIP_NORM_TAU", "CLIP_NORM_SCOPE", "LOG_RATIO_CLAMP"):
        if name in s:
            args.append(f"actor_rollout_ref.actor.policy_loss.{name.lower()}={s[name]}")
    if not gpu:  # the CPU overlay runs without a reference policy (no KL), as the CPU main job does
        return args + ([f"critic.model.path={s['MODEL_PATH']}"] if critic else [])
    if critic:  # Search-R1's PPO: KL penalty in the reward, critic from the same base model
        args += [
            "actor_rollout_ref.actor.use_kl_loss=False",
            "algorithm.use_kl_in_reward=True",
            f"algorithm.kl_ctrl.kl_coef={s['KL_COEF']}",
            f"critic.model.path={s['MODEL_PATH']}",
            "critic.model.enable_gradient_checkpointing=True",
            "critic.model.use_remove_padding=True",
            f"critic.optim.lr={s['CRITIC_LR']}",
            f"critic.optim.lr_warmup_steps_ratio={s['CRITIC_WARMUP_RATIO']}",
            f"critic.ppo_micro_batch_size_per_gpu={s['MICRO_BATCH_SIZE']}",
        ]
    else:  # Search-R1's GRPO: low-variance KL loss against the reference policy
        args += [
            "actor_rollout_ref.actor.use_kl_loss=True",
            f"actor_rollout_ref.actor.kl_loss_coef={s['KL_COEF']}",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "algorithm.use_kl_in_reward=False",
            "algorithm.norm_adv_by_std_in_grpo=True",
        ]
    return args + [f"actor_rollout_ref.actor.optim.lr_warmup_steps_ratio={s['ACTOR_WARMUP_RATIO']}"]


def _engine_overrides(s: Mapping[str, str], critic: bool) -> list[str]:
    """FSDP or Megatron training engine, vLLM or SGLang rollout (GPU only)."""
    off = s["OFFLOAD"]
    args = [
        f"actor_rollout_ref.rollout.name={s['ROLLOUT_ENGINE']}",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={s['ROLLOUT_TP']}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={s['GPU_MEMORY_UTILIZATION']}",
        f"actor_rollout_ref.rollout.temperature={s['TEMPERATURE']}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={s['LOG_PROB_MICRO_BATCH_SIZE']}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={s['LOG_PROB_MICRO_BATCH_SIZE']}",
    ]
    if s["STRATEGY"] == "fsdp":
        args += [
            f"actor_rollout_ref.actor.fsdp_config.param_offload={off}",
            f"actor_rollout_ref.actor.fsdp_config.optimizer_offload={off}",
            f"actor_rollout_ref.ref.fsdp_config.param_offload={off}",
        ]
        return args + ([f"critic.fsdp.param_offload={off}", f"critic.fsdp.optimizer_offload={off}"] if critic else [])
    tp, pp = s["TRAIN_TP"], s["TRAIN_PP"]
    args += [
        "model_engine=megatron",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        f"actor_rollout_ref.actor.megatron.param_offload={off}",
        f"actor_rollout_ref.actor.megatron.optimizer_offload={off}",
        f"actor_rollout_ref.ref.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.ref.megatron.pipeline_model_parallel_size={pp}",
        f"actor_rollout_ref.ref.megatron.param_offload={off}",
        # Megatron builds its own distributed optimizer (no optimizer_impl plug point): drop the
        # SORL optimizer of sorl_trainer.yaml and let the normalizer act on the loss instead
        "~actor_rollout_ref.actor.optim.optimizer_impl",
        "actor_rollout_ref.actor.optim.optimizer=adam",
        "actor_rollout_ref.actor.optim.override_optimizer_config=null",
        "actor_rollout_ref.actor.policy_loss.clip_norm_apply=loss",
    ]
    if critic:
        args += [
            f"critic.megatron.tensor_model_parallel_size={tp}",
            f"critic.megatron.pipeline_model_parallel_size={pp}",
            f"critic.megatron.param_offload={off}",
            f"critic.megatron.optimizer_offload={off}",
        ]
    return args


def _off_policy_overrides(s: Mapping[str, str], gpu: bool) -> list[str]:
    """Mini-batches per rollout, epochs, and verl's v1 trainer mode + staleness."""
    args = []
    if gpu:
        mini = int(s["TRAIN_BATCH_SIZE"]) // int(s["NUM_MINI_BATCHES"])
        args += [
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
            f"actor_rollout_ref.actor.ppo_epochs={s['PPO_EPOCHS']}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={s['MICRO_BATCH_SIZE']}",
        ]
    mode = s["TRAINER_MODE"]
    args += [
        f"trainer.v1.trainer_mode={s.get('SORL_TRAINER_PREFIX', 'sorl_')}{mode}",
        f"trainer.v1.sampler.max_off_policy_threshold={s['STALENESS']}",
        f"trainer.v1.sampler.max_off_policy_strategy={s['STALENESS_STRATEGY']}",
    ]
    if mode == "colocate_async":
        args.append(f"trainer.v1.colocate_async.num_warmup_batches={s['WARMUP_BATCHES']}")
    elif mode == "separate_async":
        # verl: train_batch_size == parameter_sync_step * ppo_mini_batch_size, a dedicated rollout
        # pool, and a non-naive checkpoint engine for weight sync
        args += [
            f"trainer.v1.separate_async.num_warmup_batches={s['WARMUP_BATCHES']}",
            f"trainer.v1.separate_async.parameter_sync_step={s['NUM_MINI_BATCHES']}",
            "actor_rollout_ref.hybrid_engine=False",
            f"actor_rollout_ref.rollout.nnodes={s['ROLLOUT_NNODES']}",
            f"actor_rollout_ref.rollout.n_gpus_per_node={s['ROLLOUT_GPUS_PER_NODE']}",
            f"actor_rollout_ref.rollout.checkpoint_engine.backend={s['CHECKPOINT_ENGINE']}",
        ]
    return args


# --- run directory -------------------------------------------------------------------------------

#: override keys that only name, schedule, validate, locate or fit the run into memory: left out of
#: the run directory's hash, so changing them continues the same run. The trainer's GPU count stays
#: in (verl's FSDP checkpoints are sharded per trainer GPU).
NON_IDENTITY_KEYS = (
    "trainer.logger", "trainer.project_name", "trainer.experiment_name", "trainer.default_local_dir",
    "trainer.total_training_steps", "trainer.total_epochs", "trainer.save_freq", "trainer.test_freq",
    "trainer.val_before_train", "trainer.val_only", "trainer.resume_mode", "trainer.resume_from_path",
    "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep", "trainer.log_val_generations",
    "data.val_files", "data.val_max_samples", "data.val_batch_size", "sorl.agent.retrieval_url",
    "actor_rollout_ref.rollout.val_kwargs.*", "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "*micro_batch_size_per_gpu", "*gpu_memory_utilization", "*param_offload", "*optimizer_offload",
)  # fmt: skip


def identity_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides that define the experiment: all but those whose key (``+``/``~`` stripped)
    matches :data:`NON_IDENTITY_KEYS`."""
    keep = []
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        if not any(fnmatch.fnmatchcase(key, pattern) for pattern in NON_IDENTITY_KEYS):
            keep.append(arg)
    return keep


@dataclass(frozen=True)
class RunDir:
    """Where a configuration's run lives; ``identity`` is what its hash covers, ``resume_step`` the
    latest checkpointed step (``None``: a new run)."""

    run_dir: str
    experiment_name: str
    ckpt_dir: str
    identity: list[str]
    resume_step: int | None


def plan_run_dir(s: Mapping[str, str], overrides: Sequence[str]) -> RunDir:
    """``RUN_DIR`` (default ``OUTPUT_DIR/[RUN_NAME-]ALGO-TASK-MODEL_TAG-TRAINER_MODE-<hash>``, the
    hash the first 8 hex digits of sha256 over the identity overrides one per line),
    ``EXPERIMENT_NAME`` (its name), ``CKPT_DIR`` (``RUN_DIR/checkpoints``) and the step verl's
    ``latest_checkpointed_iteration.txt`` there names."""
    identity = identity_overrides(overrides)
    digest = hashlib.sha256(("\n".join(identity) + "\n").encode()).hexdigest()[:8]
    prefix = f"{s['RUN_NAME']}-" if "RUN_NAME" in s else ""
    name = f"{prefix}{s['ALGO']}-{s['TASK']}-{s['MODEL_TAG']}-{s['TRAINER_MODE']}-{digest}"
    run_dir = s.get("RUN_DIR", f"{s['OUTPUT_DIR']}/{name}")
    ckpt_dir = s.get("CKPT_DIR", f"{run_dir}/checkpoints")
    latest = Path(ckpt_dir, "latest_checkpointed_iteration.txt")
    digits = "".join(c for c in latest.read_text(errors="replace") if c in "0123456789") if _nonempty(latest) else ""
    return RunDir(
        run_dir=run_dir,
        experiment_name=s.get("EXPERIMENT_NAME", basename(run_dir)),
        ckpt_dir=ckpt_dir,
        identity=identity,
        resume_step=int(digits) if digits else None,
    )


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def eval_step(s: Mapping[str, str], run: RunDir) -> str:
    """The checkpoint step a ``VAL_ONLY`` run evaluates (``EVAL_STEP``: ``base``, ``last``, ``best``
    via ``sorl-verl eval --print-step best``, or a step with a checkpoint). Raises RecipeError."""
    step = s["EVAL_STEP"]
    if step == "base":
        return step
    if step == "last":
        if run.resume_step is None:
            raise RecipeError(
                f"EVAL_STEP=last: no checkpoint of this configuration in {run.ckpt_dir} (train it first, or "
                "EVAL_STEP=base for MODEL_PATH as is)"
            )
        return str(run.resume_step)
    if step == "best":
        cmd = [sys.executable, "-m", "sorl_verl", "eval", "--metrics", run.run_dir, "--print-step", "best"]
        proc = subprocess.run([*cmd, "--checkpoints", run.ckpt_dir], stdout=subprocess.PIPE, text=True, check=False)
        if proc.returncode:
            raise RecipeError(
                f"EVAL_STEP=best: no validated step with a checkpoint in {run.run_dir} (see the message above)"
            )
        return proc.stdout.rstrip("\n")
    if not (step.isascii() and step.isdigit() and Path(run.ckpt_dir, f"global_step_{step}").is_dir()):
        raise RecipeError(
            f"EVAL_STEP must be last, best, base or a step with a checkpoint; no {run.ckpt_dir}/global_step_{step}"
        )
    return step


@dataclass(frozen=True)
class Bookkeeping:
    """This launch's overrides for names, schedule and resume, where it writes, and what it does."""

    overrides: list[str]
    work_dir: str
    state: str


def bookkeeping_overrides(s: Mapping[str, str], run: RunDir) -> Bookkeeping:
    """Tracker names; then either validation only of ``EVAL_STEP`` into ``RUN_DIR/eval/step_<N>``
    (the collapse guard off: it guards training) or training in ``RUN_DIR`` with auto-resume. A
    resumed step that was validated before it was saved (a multiple of ``TEST_FREQ``) is not
    validated again unless ``VAL_BEFORE_TRAIN`` says so."""
    args = [
        f"trainer.logger={s['LOGGER']}",
        f"trainer.project_name={s['PROJECT_NAME']}",
        f"trainer.experiment_name={run.experiment_name}",
    ]
    if s["VAL_ONLY"] == "1":
        step = eval_step(s, run)
        work = f"{run.run_dir}/eval/step_{step}"
        args += [
            "trainer.val_only=True",
            "trainer.val_before_train=True",
            f"trainer.default_local_dir={work}/checkpoints",
        ]
        if s["GUARD"] == "1":
            # nothing is trained, so nothing to guard; with it on, the trainer would look for the
            # training run's best snapshot under this launch's default_local_dir and stop
            args.append("sorl.guard.enable=false")
        if step == "base":
            return Bookkeeping(
                args + ["trainer.resume_mode=disable"],
                work,
                f"validation only of MODEL_PATH {s['MODEL_PATH']} (untrained)",
            )
        ckpt = f"{run.ckpt_dir}/global_step_{step}"
        return Bookkeeping(
            args + ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={ckpt}"],
            work,
            f"validation only of {ckpt}",
        )
    val_before = "True"
    state = "new run"
    if run.resume_step is not None:
        state = (
            f"resumes from {run.ckpt_dir}/global_step_{run.resume_step} (to start over: RUN_NAME=<new name>, "
            f"or rm -r {run.run_dir})"
        )
        test_freq = int(s["TEST_FREQ"])
        if test_freq > 0 and run.resume_step % test_freq == 0:
            val_before = "False"
    args += [
        f"trainer.default_local_dir={run.ckpt_dir}",
        "trainer.resume_mode=auto",
        f"trainer.total_training_steps={s['TOTAL_STEPS']}",
        f"trainer.total_epochs={s['TOTAL_EPOCHS']}",
        f"trainer.save_freq={s['SAVE_FREQ']}",
        f"trainer.test_freq={s['TEST_FREQ']}",
        f"trainer.val_before_train={s.get('VAL_BEFORE_TRAIN', val_before)}",
    ]
    return Bookkeeping(args, run.run_dir, state)


# --- the launch ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """Everything ``common.sh`` needs: the command, its exports, the files of this launch, the
    lines announced on stderr, and the command to run after a successful validation-only launch."""

    command: list[str]
    exports: dict[str, str]
    run: RunDir
    work_dir: str
    state: str
    launch_id: str
    announce: list[str]
    after: list[str]

    @property
    def log(self) -> str:
        return f"{self.work_dir}/train.{self.launch_id}.log"


def build_launch(env: Mapping[str, str], extra: Sequence[str], recipe_dir: str) -> Launch:
    """Settings -> checks -> overrides -> run directory -> bookkeeping -> the ``main_ppo`` command.
    ``extra`` (the script's arguments) are hydra overrides appended last. Raises RecipeError."""
    s = resolve_settings(env)
    plan = validate(s)
    overrides = experiment_overrides(s)
    run = plan_run_dir(s, [*overrides, *extra])
    books = bookkeeping_overrides(s, run)
    command = [
        s["PYTHON"], "-m", "verl.trainer.main_ppo", f"--config-path={recipe_dir}/config",
        "--config-name=sorl_trainer", *overrides, *books.overrides, *extra,
    ]  # fmt: skip
    work, launch_id = books.work_dir, s["SORL_LAUNCH_ID"]
    exports = {"SORL_RETRIEVAL_URL": s["RETRIEVAL_URL"]}
    if s["PLATFORM"] == "cpu":
        exports |= {"VERL_PLATFORM": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    exports |= {
        "TENSORBOARD_DIR": s.get("TENSORBOARD_DIR", f"{work}/tensorboard"),
        # verl's file logger opens its file with "wb": one file per launch, read back in name order
        "VERL_FILE_LOGGER_PATH": s.get("VERL_FILE_LOGGER_PATH", f"{work}/metrics.{launch_id}.jsonl"),
        "PYTHONUNBUFFERED": "1",
    }
    plan_line = plan.describe() if plan else (
        "gpu plan: none (PLATFORM=cpu: recipe/sorl/config/platform/cpu.yaml, hf rollout on CPU)"
    )  # fmt: skip
    after = []
    if s["VAL_ONLY"] == "1":
        title = f"{run.experiment_name} ({books.state})"
        after = [s["PYTHON"], "-m", "sorl_verl", "eval", "--metrics", work, "--out-dir", work, "--title", title]
    return Launch(
        command=command,
        exports=exports,
        run=run,
        work_dir=work,
        state=books.state,
        launch_id=launch_id,
        announce=[plan_line, f"run dir: {run.run_dir} ({books.state})"],
        after=after,
    )


def dry_run_text(launch: Launch) -> tuple[str, str]:
    """(stdout, stderr) of ``DRY_RUN=1``: the command one argument per line; the plan, the run
    directory, the exports and the log file."""
    err = list(launch.announce)
    err += [
        f"export {n}={launch.exports[n]}" for n in ("SORL_RETRIEVAL_URL", "TENSORBOARD_DIR", "VERL_FILE_LOGGER_PATH")
    ]
    err.append(f"log: {launch.log} (also appended to {launch.work_dir}/train.log)")
    return "".join(a + "\n" for a in launch.command), "".join(line + "\n" for line in err)


def prepare_launch(launch: Launch) -> str:
    """Create the work directory, write ``overrides.txt`` (first launch only), this launch's
    ``command.<id>.txt`` and its ``=== launch`` line in ``train.log``; return the bash assignments
    ``common.sh`` evaluates (exports, ``SORL_CMD``, ``SORL_AFTER``, ``SORL_LOG``, ``SORL_TRAIN_LOG``)."""
    work = Path(launch.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    overrides_txt = Path(launch.run.run_dir, "overrides.txt")
    if not overrides_txt.exists():
        overrides_txt.write_text("\n".join(launch.run.identity) + "\n")
    (work / f"command.{launch.launch_id}.txt").write_text("".join(a + "\n" for a in launch.command))
    with (work / "train.log").open("a") as fh:
        fh.write(f"=== launch {launch.launch_id}: {launch.state}\n")
    q = shlex.quote
    lines = [f"export {name}={q(value)}" for name, value in launch.exports.items()]
    lines += [
        f"SORL_CMD=({' '.join(map(q, launch.command))})",
        f"SORL_AFTER=({' '.join(map(q, launch.after))})",
        f"SORL_LOG={q(launch.log)}",
        f"SORL_TRAIN_LOG={q(str(work / 'train.log'))}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sorl-verl recipe-plan",
        description="Plan a recipe/sorl run from the environment variables of recipe/sorl/README.md: "
        "check them (exit 2 naming the bad one), then print the main_ppo command (--print) or prepare the "
        "launch for recipe/sorl/common.sh (--launch).",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--print", action="store_true", help="print the command, one argument per line (DRY_RUN=1)")
    mode.add_argument("--launch", action="store_true", help="create the work directory, print bash assignments")
    mode.add_argument("--variables", action="store_true", help="list the environment variables the recipe reads")
    parser.add_argument(
        "--recipe-dir",
        default=str(Path(__file__).resolve().parents[2] / "recipe" / "sorl"),
        help="recipe/sorl of a source checkout (its config/ is main_ppo's --config-path); default: the one "
        "beside this package",
    )
    parser.add_argument("overrides", nargs="*", help="hydra overrides appended last (after --)")
    args = parser.parse_args(argv)
    if args.variables:
        print(" ".join(VARIABLES))
        return 0
    if not Path(args.recipe_dir, "config", "sorl_trainer.yaml").is_file():
        parser.error(f"--recipe-dir {args.recipe_dir}: no config/sorl_trainer.yaml (the recipe/sorl of a checkout)")
    try:
        launch = build_launch(os.environ, args.overrides, args.recipe_dir)
    except RecipeError as exc:
        print(f"sorl recipe: {exc}", file=sys.stderr)
        return 2
    if args.print:
        out, err = dry_run_text(launch)
        sys.stderr.write(err)
        sys.stdout.write(out)
        return 0
    shell = prepare_launch(launch)
    sys.stderr.write("".join(line + "\n" for line in launch.announce))
    sys.stdout.write(shell)
    return 0


if __name__ == "__main__":
    sys.exit(main())
