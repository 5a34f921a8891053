"""The recipe's variables and their checks, for :mod:`sorl_verl.cli.recipe_plan`.

:func:`resolve_settings` reads every variable of ``recipe/sorl/README.md`` from the environment
(empty counts as unset) with its default; :func:`validate` is the one place that checks them, in
the order the run scripts always have, raising :class:`RecipeError` that names the variable, and
returns the :class:`GpuPlan`: the trainer pool ``NNODES x GPUS_PER_NODE`` and, in
``separate_async``, the rollout pool ``ROLLOUT_NNODES x ROLLOUT_GPUS_PER_NODE`` on the cluster
``CLUSTER_NODES x CLUSTER_GPUS_PER_NODE``, checked against verl's placement and divisibility rules.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class RecipeError(ValueError):
    """A misconfiguration, reported as ``sorl recipe: <message>`` with exit status 2."""


# --- settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Algo:
    """One ``ALGO`` row: verl's advantage estimator and policy loss, critic, clip range, loss mode."""

    adv_estimator: str
    loss_mode: str
    critic: bool
    clip_low: str = "0.2"
    clip_high: str = "0.2"
    loss_agg_mode: str = "token-mean"


ALGORITHMS: dict[str, Algo] = {
    "so_grpo": Algo("so_grpo", "so_grpo", critic=False),
    "grpo": Algo("grpo", "vanilla", critic=False),
    "gspo": Algo(
        "grpo", "gspo", critic=False, clip_low="0.0003", clip_high="0.0004", loss_agg_mode="seq-mean-token-mean"
    ),
    "so_ppo": Algo("so_ppo", "so_ppo", critic=True),
    "ppo": Algo("gae", "vanilla", critic=True),
    "turn_ppo": Algo("so_ppo", "turn_ppo", critic=True),
    "s_ppo": Algo("gae", "s_ppo", critic=True),
}
TASKS = {"search": ("search_qa", "nq_hotpotqa"), "medical": ("medical_mcq", "medical")}
TRAINER_MODES = ("sync", "colocate_async", "separate_async")

#: the fixed defaults; the ones that depend on other settings are set in :func:`resolve_settings`
DEFAULTS: dict[str, str] = {
    "PLATFORM": "gpu", "TASK": "search", "ALGO": "so_grpo", "MODEL_PATH": "Qwen/Qwen2.5-3B", "RETRIEVAL_TOPK": "3",
    "NNODES": "1", "CLUSTER_GPUS_PER_NODE": "8", "ROLLOUT_ENGINE": "vllm", "STRATEGY": "fsdp", "ROLLOUT_TP": "1",
    "TRAIN_TP": "1", "TRAIN_PP": "1", "GPU_MEMORY_UTILIZATION": "0.6", "OFFLOAD": "True", "TRAIN_BATCH_SIZE": "512",
    "MAX_TURNS": "4", "MAX_PROMPT_LENGTH": "2048", "TURN_RESPONSE_LENGTH": "500", "MAX_OBS_LENGTH": "500",
    "MICRO_BATCH_SIZE": "8", "LOG_PROB_MICRO_BATCH_SIZE": "16", "TEMPERATURE": "1.0", "ACTOR_LR": "1e-6",
    "CRITIC_LR": "1e-5", "CRITIC_WARMUP_RATIO": "0.015", "KL_COEF": "0.001", "GAMMA": "1.0", "LAM": "1.0",
    "ENTROPY_COEFF": "0", "NUM_MINI_BATCHES": "2", "PPO_EPOCHS": "1", "TRAINER_MODE": "sync", "STALENESS": "4",
    "STALENESS_STRATEGY": "drop", "WARMUP_BATCHES": "1", "ROLLOUT_NNODES": "1", "CHECKPOINT_ENGINE": "nccl",
    "PROJECT_NAME": "sorl", "TOTAL_STEPS": "1005", "TOTAL_EPOCHS": "15", "SAVE_FREQ": "100", "TEST_FREQ": "50",
    "LOGGER": "[console,tensorboard,file]", "PYTHON": "python3", "VAL_ONLY": "0", "EVAL_STEP": "last", "GUARD": "1",
}  # fmt: skip
#: variables without a fixed default (derived, optional, or read as set)
OTHER_VARIABLES = (
    "MODEL_TAG", "TASK_CONFIG", "DATA_DIR", "TRAIN_FILES", "VAL_FILES", "RETRIEVAL_URL", "SORL_RETRIEVAL_URL",
    "CLUSTER_NODES", "GPUS_PER_NODE", "ROLLOUT_GPUS_PER_NODE", "MAX_RESPONSE_LENGTH", "OUTPUT_DIR",
    "SORL_LAUNCH_ID", "ADV_ESTIMATOR", "LOSS_MODE", "GROUP_SIZE", "CLIP_RATIO_LOW", "CLIP_RATIO_HIGH",
    "LOSS_AGG_MODE", "ACTOR_WARMUP_RATIO", "CLIP_NORM_MODE", "CLIP_NORM_TAU", "CLIP_NORM_SCOPE", "LOG_RATIO_CLAMP",
    "VAL_MAX_SAMPLES", "SORL_TRAINER_PREFIX", "RUN_NAME", "RUN_DIR", "EXPERIMENT_NAME", "CKPT_DIR",
    "VAL_BEFORE_TRAIN", "TENSORBOARD_DIR", "VERL_FILE_LOGGER_PATH", "DRY_RUN",
)  # fmt: skip
#: every environment variable the recipe reads
VARIABLES: tuple[str, ...] = tuple(DEFAULTS) + tuple(OTHER_VARIABLES)


def resolve_settings(env: Mapping[str, str]) -> dict[str, str]:
    """Every recipe variable from ``env`` or its default; an empty value counts as unset (bash's
    ``${VAR:=default}``), except ``SORL_TRAINER_PREFIX``, where empty means no prefix. Derived
    defaults that need arithmetic (``MAX_RESPONSE_LENGTH``, the GPU split) are left unset here
    and filled by :func:`validate` once their inputs are checked."""
    s = {name: env[name] for name in VARIABLES if env.get(name)}
    for name, value in DEFAULTS.items():
        s.setdefault(name, value)
    s.setdefault("MODEL_TAG", basename(s["MODEL_PATH"]).lower())
    task_config, data = TASKS.get(s["TASK"], ("", ""))
    s.setdefault("TASK_CONFIG", task_config)
    s.setdefault("DATA_DIR", f"{env.get('HOME') or os.path.expanduser('~')}/data/sorl/{data}")
    s.setdefault("TRAIN_FILES", f"{s['DATA_DIR']}/train.parquet")
    s.setdefault("VAL_FILES", f"{s['DATA_DIR']}/test.parquet")
    s.setdefault("RETRIEVAL_URL", s.get("SORL_RETRIEVAL_URL", "http://127.0.0.1:8000/retrieve"))
    s.setdefault("CLUSTER_NODES", s["NNODES"])
    s.setdefault("OUTPUT_DIR", f"{_cwd(env)}/outputs/sorl")
    s.setdefault("SORL_LAUNCH_ID", f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    if "SORL_TRAINER_PREFIX" in env:
        s["SORL_TRAINER_PREFIX"] = env["SORL_TRAINER_PREFIX"]
    return s


def basename(path: str) -> str:
    """What ``basename`` prints: the last component, trailing slashes ignored."""
    return os.path.basename(path.rstrip("/")) or path[:1]


def _cwd(env: Mapping[str, str]) -> str:
    """``$PWD`` when it names the working directory (it keeps symlinks), else the resolved one."""
    pwd = env.get("PWD", "")
    try:
        if pwd and os.path.samefile(pwd, "."):
            return pwd
    except OSError:
        pass
    return os.getcwd()


# --- validation ----------------------------------------------------------------------------------


def _choice(s: Mapping[str, str], name: str, allowed: Sequence[str], message: str) -> None:
    if s[name] not in allowed:
        raise RecipeError(f"{name} must be {message}, got '{s[name]}'")


#: decimal integers as the scripts always accepted them (no sign, no leading zero: bash reads 010 as octal)
_KINDS = {1: (r"[1-9][0-9]*", "a positive integer"), 0: (r"0|[1-9][0-9]*", "a non-negative integer")}


def _int(s: Mapping[str, str], name: str, minimum: int | None = 1) -> int:
    """``s[name]`` as a decimal integer: positive (``minimum=1``), non-negative (0) or of any sign
    (``None``); else RecipeError naming ``name``."""
    pattern, kind = _KINDS.get(minimum, (r"-?(0|[1-9][0-9]*)", "an integer"))
    if not re.fullmatch(pattern, s[name]):
        raise RecipeError(f"{name} must be {kind}, got '{s[name]}'")
    return int(s[name])


@dataclass(frozen=True)
class GpuPlan:
    """The trainer pool ``nnodes x gpus_per_node`` and, in ``separate_async``, the rollout pool
    ``rollout_nnodes x rollout_gpus_per_node``, on a cluster ``cluster_nodes x
    cluster_gpus_per_node``; other modes share the trainer's GPUs with the rollout."""

    nnodes: int
    gpus_per_node: int
    cluster_nodes: int
    cluster_gpus_per_node: int
    rollout_nnodes: int
    rollout_gpus_per_node: int
    rollout_tp: int
    train_tp: int
    train_pp: int
    train_batch_size: int
    group_size: int
    micro_batch_size: int
    trainer_mode: str = "sync"
    strategy: str = "fsdp"
    engine: str = "vllm"

    @property
    def separate(self) -> bool:
        return self.trainer_mode == "separate_async"

    @property
    def trainer_gpus(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_nnodes * self.rollout_gpus_per_node if self.separate else self.trainer_gpus

    @property
    def used_gpus(self) -> int:
        return self.trainer_gpus + (self.rollout_gpus if self.separate else 0)

    def fits(self) -> bool:
        """Whether every pool's per-node group fits on one cluster node, placed first-fit with the
        largest first (verl places one placement group per node)."""
        pools = [self.gpus_per_node] * self.nnodes
        if self.separate:
            pools += [self.rollout_gpus_per_node] * self.rollout_nnodes
        free = [self.cluster_gpus_per_node] * self.cluster_nodes
        for size in sorted(pools, reverse=True):
            node = next((i for i, left in enumerate(free) if left >= size), None)
            if node is None:
                return False
            free[node] -= size
        return True

    def describe(self) -> str:
        """The one-line plan the scripts print (``gpu plan: ...``)."""
        cluster = f"{self.used_gpus} GPUs of {self.cluster_nodes} x {self.cluster_gpus_per_node}"
        tp = f"{self.engine}, TP {self.rollout_tp}: {self.rollout_gpus // self.rollout_tp} replicas"
        if self.separate:
            return (
                f"gpu plan: trainer {self.nnodes} x {self.gpus_per_node} ({self.strategy}) + rollout "
                f"{self.rollout_nnodes} x {self.rollout_gpus_per_node} ({tp}) = {cluster}"
            )
        return (
            f"gpu plan: {self.nnodes} x {self.gpus_per_node} GPUs shared by training ({self.strategy}) and "
            f"rollout ({tp}, {self.trainer_mode}) = {cluster}"
        )

    def check(self) -> None:
        """Raise RecipeError (with the plan) unless the pools fit, ``ROLLOUT_TP`` divides the rollout
        GPUs within a node, Megatron's ``TRAIN_TP x TRAIN_PP`` divides the trainer GPUs, and
        ``TRAIN_BATCH_SIZE x GROUP_SIZE`` episodes divide over the trainer's data-parallel ranks
        (times the micro-batch with Megatron): verl's ``validate_config`` rule."""
        plan = self.describe()
        if not self.fits():
            raise RecipeError(
                f"the GPU plan does not fit: {plan}. Each pool's per-node share must fit on one node: lower "
                "GPUS_PER_NODE / ROLLOUT_GPUS_PER_NODE, or set CLUSTER_NODES / CLUSTER_GPUS_PER_NODE to the "
                "machines you have"
            )
        per_node = self.rollout_gpus_per_node if self.separate else self.gpus_per_node
        if self.rollout_tp > per_node or self.rollout_gpus % self.rollout_tp:
            raise RecipeError(
                f"ROLLOUT_TP={self.rollout_tp} must divide the {self.rollout_gpus} rollout GPUs and fit in one "
                f"node ({per_node} GPUs): {plan}"
            )
        unit, what = self.trainer_gpus, "trainer GPUs"
        if self.strategy == "megatron":
            model_parallel = self.train_tp * self.train_pp
            if self.trainer_gpus % model_parallel:
                raise RecipeError(
                    f"TRAIN_TP x TRAIN_PP = {model_parallel} must divide the {self.trainer_gpus} trainer GPUs: {plan}"
                )
            dp = self.trainer_gpus // model_parallel
            unit, what = dp * self.micro_batch_size, f"data-parallel {dp} x micro-batch {self.micro_batch_size}"
        episodes = self.train_batch_size * self.group_size
        if episodes % unit:
            raise RecipeError(
                f"TRAIN_BATCH_SIZE x GROUP_SIZE = {self.train_batch_size} x {self.group_size} = {episodes} "
                f"episodes must divide evenly over {unit} ({what}): {plan}"
            )


def default_gpu_split(cluster_gpus_per_node: int, separate: bool) -> tuple[int, int]:
    """(trainer GPUs per node, rollout GPUs per node) when unset: the rollout pool gets half a node
    (at least 1); the trainer gets the whole node, or in ``separate_async`` what the rollout pool
    leaves of it (the whole node when that is nothing)."""
    rollout = cluster_gpus_per_node // 2 if cluster_gpus_per_node > 1 else 1
    trainer = cluster_gpus_per_node
    if separate and cluster_gpus_per_node - rollout > 0:
        trainer = cluster_gpus_per_node - rollout
    return trainer, rollout


#: loss modes with a SORL normalizer whose ``clip_norm_tau`` the guard can lower: the guard's own
#: ``sorl_verl.trainer.guard.TAU_LOSSES`` (not imported: that module loads torch and Ray; a test ties them)
TAU_LOSS_MODES = ("so_grpo", "so_ppo", "s_ppo")


def guard_backoff_target(s: Mapping[str, str]) -> str:
    """What ``GUARD=1`` backs off: the learning rate, or ``clip_norm_tau`` with ``STRATEGY=megatron``,
    whose scheduler (Megatron's own) the guard cannot scale (``guard_worker.scale_learning_rate``)."""
    return "clip_norm_tau" if s["PLATFORM"] == "gpu" and s["STRATEGY"] == "megatron" else "lr"


def _check_guard(s: Mapping[str, str], test_freq: int) -> None:
    """``GUARD``: 0 or 1. The guard (``sorl_verl/trainer/guard.py``) picks its best checkpoint by
    validation, so training with it needs ``TEST_FREQ > 0`` (a validation-only launch trains
    nothing and runs without it). With Megatron it backs off ``clip_norm_tau``
    (:func:`guard_backoff_target`), which needs a loss with a SORL normalizer."""
    _choice(s, "GUARD", ("0", "1"), "0 (off) or 1 (the collapse guard, docs/guard.md)")
    if s["GUARD"] == "0":
        return
    if test_freq <= 0 and s["VAL_ONLY"] != "1":
        raise RecipeError(
            f"GUARD=1 (the collapse guard) chooses its best checkpoint by validation, but TEST_FREQ={test_freq} "
            "runs none during training: set TEST_FREQ > 0 (validate every TEST_FREQ steps), or GUARD=0 to train "
            "without the guard"
        )
    if guard_backoff_target(s) == "clip_norm_tau" and (
        s["LOSS_MODE"] not in TAU_LOSS_MODES or s.get("CLIP_NORM_MODE") == "none"
    ):
        raise RecipeError(
            "GUARD=1 (the collapse guard) with STRATEGY=megatron backs off the SORL normalizer's clip_norm_tau "
            "(it cannot scale the learning rate of Megatron's scheduler), but "
            f"ALGO={s['ALGO']} (CLIP_NORM_MODE={s.get('CLIP_NORM_MODE', 'max')}) has no normalizer: use ALGO "
            "so_grpo, so_ppo or s_ppo with CLIP_NORM_MODE max or add, STRATEGY=fsdp, or GUARD=0"
        )


def validate(s: dict[str, str]) -> GpuPlan | None:
    """Check the settings in the order the scripts always have (the first bad variable is named),
    fill the arithmetic defaults (``MAX_RESPONSE_LENGTH``, the GPU split, the ``ALGO`` row), and
    return the checked GPU plan (``None`` with ``PLATFORM=cpu``). Raises RecipeError."""
    _choice(s, "PLATFORM", ("gpu", "cpu"), "gpu or cpu")
    _choice(s, "TASK", tuple(TASKS), "search or medical")
    _choice(s, "ALGO", tuple(ALGORITHMS), "one of " + " ".join(ALGORITHMS))
    gpu = s["PLATFORM"] == "gpu"
    if "MAX_RESPONSE_LENGTH" not in s:
        turns, turn, obs = (_int(s, n, 0) for n in ("MAX_TURNS", "TURN_RESPONSE_LENGTH", "MAX_OBS_LENGTH"))
        s["MAX_RESPONSE_LENGTH"] = str(turns * turn + (turns - 1) * obs)
    algo = ALGORITHMS[s["ALGO"]]
    for name, value in (
        ("ADV_ESTIMATOR", algo.adv_estimator),
        ("LOSS_MODE", algo.loss_mode),
        ("GROUP_SIZE", "1" if algo.critic else "5"),
        ("CLIP_RATIO_LOW", algo.clip_low),
        ("CLIP_RATIO_HIGH", algo.clip_high),
        ("LOSS_AGG_MODE", algo.loss_agg_mode),
        ("ACTOR_WARMUP_RATIO", "0.95" if algo.critic else "0.285"),
    ):
        s.setdefault(name, value)
    if gpu:
        _choice(s, "ROLLOUT_ENGINE", ("vllm", "sglang"), "vllm or sglang")
        _choice(s, "STRATEGY", ("fsdp", "megatron"), "fsdp or megatron")
    batch, minis = _int(s, "TRAIN_BATCH_SIZE"), _int(s, "NUM_MINI_BATCHES")
    if batch % minis:
        raise RecipeError(f"TRAIN_BATCH_SIZE ({batch}) must be divisible by NUM_MINI_BATCHES ({minis})")
    if s["STALENESS"] != "null" and not re.fullmatch(_KINDS[1][0], s["STALENESS"]):
        raise RecipeError(
            f"STALENESS must be a positive integer (model versions) or null (no limit), got '{s['STALENESS']}'"
        )
    _choice(s, "TRAINER_MODE", TRAINER_MODES, "sync, colocate_async or separate_async")
    _check_guard(s, _int(s, "TEST_FREQ", None))
    separate = s["TRAINER_MODE"] == "separate_async"
    if (gpu or separate) and not {"GPUS_PER_NODE", "ROLLOUT_GPUS_PER_NODE"} <= s.keys():
        trainer, rollout = default_gpu_split(_int(s, "CLUSTER_GPUS_PER_NODE"), separate)
        s.setdefault("ROLLOUT_GPUS_PER_NODE", str(rollout))
        s.setdefault("GPUS_PER_NODE", str(trainer))
    if not gpu:
        return None
    ints = {
        n: _int(s, n)
        for n in (
            "NNODES", "GPUS_PER_NODE", "CLUSTER_NODES", "CLUSTER_GPUS_PER_NODE", "ROLLOUT_TP", "TRAIN_TP",
            "TRAIN_PP", "ROLLOUT_NNODES", "ROLLOUT_GPUS_PER_NODE", "GROUP_SIZE",
        )
    }  # fmt: skip
    plan = GpuPlan(
        nnodes=ints["NNODES"],
        gpus_per_node=ints["GPUS_PER_NODE"],
        cluster_nodes=ints["CLUSTER_NODES"],
        cluster_gpus_per_node=ints["CLUSTER_GPUS_PER_NODE"],
        rollout_nnodes=ints["ROLLOUT_NNODES"],
        rollout_gpus_per_node=ints["ROLLOUT_GPUS_PER_NODE"],
        rollout_tp=ints["ROLLOUT_TP"],
        train_tp=ints["TRAIN_TP"],
        train_pp=ints["TRAIN_PP"],
        train_batch_size=batch,
        group_size=ints["GROUP_SIZE"],
        micro_batch_size=_int(s, "MICRO_BATCH_SIZE") if s["STRATEGY"] == "megatron" else 1,
        trainer_mode=s["TRAINER_MODE"],
        strategy=s["STRATEGY"],
        engine=s["ROLLOUT_ENGINE"],
    )
    plan.check()
    return plan
