"""Every recipe/sorl/run_*.sh, for every ALGO: the command its DRY_RUN=1 mode prints composes
against verl 0.9.1's real hydra config (recipe dir + verl's config dir on the search path, as
main_ppo does), passes verl's own ``validate_config``, and its actor / critic / rollout /
algorithm sections convert to verl's dataclasses, on CPU.

MODEL_PATH points at a tiny local model directory (config + tokenizer) because verl's
``HFModelConfig`` reads them when the critic config is built; the default model names are
checked on the printed command only.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from sorl_verl.cli.recipe_plan import VARIABLES
from sorl_verl.trainer.guard_rule import GuardConfig

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipe" / "sorl"
SCRIPTS = sorted(p.name for p in RECIPE.glob("run_*.sh"))
ALGOS = ("so_grpo", "grpo", "gspo", "so_ppo", "ppo", "turn_ppo", "s_ppo")
#: the collapse guard as GUARD=1, the default, configures it (the learning study's settings)
STUDY_GUARD = GuardConfig(
    enable=True, rule="drop", drop=0.3, patience=1, backoff=0.5, backoff_target="lr", max_restores=3
)
#: ALGO -> (algorithm.adv_estimator, policy_loss.loss_mode, critic on)
ALGO_TABLE = {
    "so_grpo": ("so_grpo", "so_grpo", False),
    "grpo": ("grpo", "vanilla", False),
    "gspo": ("grpo", "gspo", False),
    "so_ppo": ("so_ppo", "so_ppo", True),
    "ppo": ("gae", "vanilla", True),
    "turn_ppo": ("so_ppo", "turn_ppo", True),
    "s_ppo": ("gae", "s_ppo", True),
}
#: every knob the scripts read from the environment (parsed from the helper) is cleared for each run,
#: so the caller's shell can't leak in
RECIPE_VARS = set(VARIABLES) | {
    "TENSORBOARD_DIR",
    "VERL_FILE_LOGGER_PATH",
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A local model directory verl's HFModelConfig can read: Qwen2 config + fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    out = tmp_path_factory.mktemp("tiny_model")
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", "<answer>", "</answer>", "paris"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(out)
    Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=1,
        pad_token_id=0,
        architectures=["Qwen2ForCausalLM"],
    ).save_pretrained(out)
    return out


def dry_run(script: str, *extra: str, **env: str) -> tuple[list[str], str]:
    """Run ``script`` with DRY_RUN=1; return (printed argv, stderr)."""
    clean = {k: v for k, v in os.environ.items() if k not in RECIPE_VARS}
    clean.update(DRY_RUN="1", HOME=str(Path.home()), **env)
    proc = subprocess.run(
        ["bash", str(RECIPE / script), *extra], env=clean, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines(), proc.stderr


def compose_argv(argv: list[str]):
    """Compose main_ppo's config from a printed command, as ``python -m verl.trainer.main_ppo`` would."""
    from hydra import compose, initialize_config_dir

    assert argv[:3] == ["python3", "-m", "verl.trainer.main_ppo"], argv[:3]
    config_dir = argv[3].removeprefix("--config-path=")
    config_name = argv[4].removeprefix("--config-name=")
    assert Path(config_dir) == RECIPE / "config" and config_name == "sorl_trainer"
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name=config_name, overrides=argv[5:])


def check_with_verl(cfg) -> dict:
    """verl's start-up checks (what main_ppo runs) plus dataclass conversion of each section, and the
    collapse guard's start-up checks (what the SORL trainers run before any worker starts)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from sorl_verl.trainer.guard import check_guard_against_trainer
    from sorl_verl.trainer.guard_rule import guard_settings

    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    built = {
        "actor": omega_conf_to_dataclass(cfg.actor_rollout_ref.actor),
        "rollout": omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout),
        "algorithm": omega_conf_to_dataclass(cfg.algorithm),
    }
    if need_critic(cfg):
        built["critic"] = omega_conf_to_dataclass(cfg.critic)
    built["guard"], _ = guard_settings(OmegaConf.to_container(cfg.sorl, resolve=True))
    check_guard_against_trainer(cfg, built["guard"])
    return built


def test_the_issue_s_scripts_exist_and_share_one_helper():
    expected = {
        f"run_{algo}_qwen2.5_{size}_{task}.sh"
        for algo in ("so_grpo", "so_ppo")
        for size in ("3b", "7b")
        for task in ("search", "medical")
    }
    assert expected <= set(SCRIPTS)
    for script in SCRIPTS:
        text = (RECIPE / script).read_text()
        assert 'source "$(dirname "${BASH_SOURCE[0]}")/common.sh"' in text and "sorl_run" in text
        assert "main_ppo" not in text  # the command is built by the planner (sorl-verl recipe-plan) only


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("script", SCRIPTS)
def test_script_and_algo_compose_against_verl(script, algo, tiny_model):
    # every script composes with the guard on (the default) and off: GUARD=0 for every other ALGO
    guarded = ALGOS.index(algo) % 2 == 1
    argv, _ = dry_run(script, ALGO=algo, MODEL_PATH=str(tiny_model), **({} if guarded else {"GUARD": "0"}))
    cfg = compose_argv(argv)
    built = check_with_verl(cfg)
    adv, loss, critic = ALGO_TABLE[algo]
    assert built["algorithm"].adv_estimator == adv
    assert built["actor"].policy_loss.loss_mode == loss
    assert ("critic" in built) is critic and bool(cfg.critic.enable) is critic
    assert cfg.actor_rollout_ref.rollout.n == (1 if critic else 5)
    assert cfg.actor_rollout_ref.model.path == str(tiny_model)
    if critic:
        assert built["critic"].model.path == str(tiny_model)
    # KL: loss for the group family, in-reward for the critic family (Search-R1's choices)
    assert built["actor"].use_kl_loss is not critic and cfg.algorithm.use_kl_in_reward is critic
    assert cfg.trainer.v1.trainer_mode.startswith("sorl_")
    task = "medical_mcq" if "medical" in script else "search_qa"
    assert cfg.reward.custom_reward_function.path == "pkg://sorl_verl.rewards.score"
    assert str(cfg.data.train_files).endswith(
        "medical/train.parquet" if task == "medical_mcq" else "nq_hotpotqa/train.parquet"
    )
    assert cfg.sorl.agent.topk == 3 and cfg.sorl.agent.max_turns == 4
    assert cfg.data.max_response_length == 4 * 500 + 3 * 500
    if algo == "gspo":
        assert (built["actor"].clip_ratio_low, built["actor"].clip_ratio_high) == (0.0003, 0.0004)
    assert cfg.trainer.test_freq == 50
    if guarded:
        assert built["guard"] == STUDY_GUARD
        # GUARD=1 bounds verl's rotation; verl's checkpoint defaults pass the guard's start-up refusals
        assert (cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep) == (3, 3)
        assert built["actor"].checkpoint.async_save is False
    else:  # GUARD=0: no guard, verl's own rotation (keep all)
        assert not built["guard"].enable and not any(a.startswith("sorl.guard.") for a in argv)
        assert (cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep) == (None, None)


def test_default_models_and_sizes_on_the_printed_command():
    expect = {
        "run_so_grpo_qwen2.5_3b_search.sh": ("Qwen/Qwen2.5-3B", "1"),
        "run_so_ppo_qwen2.5_7b_search.sh": ("Qwen/Qwen2.5-7B", "2"),
        "run_so_grpo_qwen2.5_7b_medical.sh": ("Qwen/Qwen2.5-7B-Instruct", "2"),
    }
    for script, (model, tp) in expect.items():
        argv, _ = dry_run(script)
        assert f"actor_rollout_ref.model.path={model}" in argv
        assert f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}" in argv


def test_env_overrides_and_trailing_hydra_arguments_win(tiny_model, tmp_path):
    argv, stderr = dry_run(
        "run_so_grpo_qwen2.5_3b_search.sh",
        "trainer.total_training_steps=7",
        MODEL_PATH=str(tiny_model),
        DATA_DIR=str(tmp_path / "d"),
        TRAIN_BATCH_SIZE="64",
        NUM_MINI_BATCHES="4",
        PPO_EPOCHS="3",
        GROUP_SIZE="8",
        MAX_TURNS="3",
        RETRIEVAL_URL="http://10.0.0.5:9000/retrieve",
        RETRIEVAL_TOPK="5",
        CLIP_NORM_MODE="add",
        CLIP_NORM_TAU="0.5",
        GPUS_PER_NODE="4",
        OUTPUT_DIR=str(tmp_path),
    )
    cfg = compose_argv(argv)
    built = check_with_verl(cfg)
    assert cfg.data.train_files == str(tmp_path / "d" / "train.parquet")
    assert cfg.data.train_batch_size == 64 and built["actor"].ppo_mini_batch_size == 16
    assert built["actor"].ppo_epochs == 3 and cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.sorl.agent.retrieval_url == "http://10.0.0.5:9000/retrieve" and cfg.sorl.agent.topk == 5
    assert cfg.sorl.agent.max_turns == 3 and cfg.data.max_response_length == 3 * 500 + 2 * 500
    assert built["actor"].policy_loss.clip_norm_mode == "add" and built["actor"].policy_loss.clip_norm_tau == 0.5
    assert cfg.trainer.total_training_steps == 7 and cfg.trainer.n_gpus_per_node == 4
    run_dir = Path(cfg.trainer.default_local_dir).parent  # MODEL_TAG = model dir name, then the config hash
    assert run_dir.parent == tmp_path and re.fullmatch(
        rf"so_grpo-search-{tiny_model.name.lower()}-sync-[0-9a-f]{{8}}", run_dir.name
    )
    assert cfg.trainer.default_local_dir == str(run_dir / "checkpoints") and cfg.trainer.experiment_name == run_dir.name
    assert re.search(
        rf"^export VERL_FILE_LOGGER_PATH={run_dir}/metrics\.[0-9]{{8}}-[0-9]{{6}}-[0-9]+\.jsonl$", stderr, re.M
    )
    assert f"export TENSORBOARD_DIR={run_dir}/tensorboard" in stderr


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_async_trainer_modes_carry_staleness_and_satisfy_verl_s_asserts(mode, tiny_model):
    argv, _ = dry_run(
        "run_so_ppo_qwen2.5_3b_search.sh",
        MODEL_PATH=str(tiny_model),
        TRAINER_MODE=mode,
        STALENESS="2",
        NUM_MINI_BATCHES="4",
        WARMUP_BATCHES="2",
        GUARD="1",
    )
    cfg = compose_argv(argv)
    assert check_with_verl(cfg)["guard"] == STUDY_GUARD  # the guard runs in all three SORL trainers
    v1 = cfg.trainer.v1
    assert v1.trainer_mode == f"sorl_{mode}"
    assert v1.sampler.max_off_policy_threshold == 2
    assert v1[mode].num_warmup_batches == 2
    if mode == "separate_async":
        # the checks PPOTrainerSeparateAsync.__init__ makes before touching any GPU
        assert (
            cfg.data.train_batch_size
            == v1.separate_async.parameter_sync_step * cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        )
        assert cfg.actor_rollout_ref.rollout.nnodes > 0 and cfg.actor_rollout_ref.rollout.n_gpus_per_node > 0
        assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend != "naive"
        assert cfg.actor_rollout_ref.hybrid_engine is False


def test_async_script_defaults_to_separate_async():
    argv, _ = dry_run("run_so_grpo_qwen2.5_3b_search_async.sh")
    assert "trainer.v1.trainer_mode=sorl_separate_async" in argv
    argv, _ = dry_run("run_so_grpo_qwen2.5_3b_search_offpolicy.sh")
    assert {"actor_rollout_ref.actor.ppo_mini_batch_size=128", "actor_rollout_ref.actor.ppo_epochs=2"} <= set(argv)


@pytest.mark.parametrize(("strategy", "engine"), [("megatron", "vllm"), ("fsdp", "sglang")])
def test_megatron_and_sglang_engines_compose(strategy, engine, tiny_model):
    argv, _ = dry_run(
        "run_so_ppo_qwen2.5_7b_search.sh",
        MODEL_PATH=str(tiny_model),
        STRATEGY=strategy,
        ROLLOUT_ENGINE=engine,
        TRAIN_TP="2",
        TRAIN_PP="2",
        GUARD="1",
    )
    cfg = compose_argv(argv)
    built = check_with_verl(cfg)
    assert cfg.actor_rollout_ref.rollout.name == engine
    assert built["actor"].strategy == strategy and built["critic"].strategy == strategy
    if strategy == "megatron":
        assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 2
        assert cfg.critic.megatron.pipeline_model_parallel_size == 2
        # no optimizer plug point in Megatron: the normalizer acts on the loss there
        assert "optimizer_impl" not in cfg.actor_rollout_ref.actor.optim
        assert cfg.actor_rollout_ref.actor.policy_loss.clip_norm_apply == "loss"
        # Megatron's scheduler is not torch's: the guard backs off clip_norm_tau (checked above)
        assert built["guard"].enable and built["guard"].backoff_target == "clip_norm_tau"
    else:
        assert built["guard"].enable and built["guard"].backoff_target == "lr"
        assert cfg.actor_rollout_ref.actor.optim.optimizer_impl == "sorl_verl.algorithms.optim"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ALGO": "ppo2"}, "ALGO must be one of"),
        ({"TASK": "math"}, "TASK must be search or medical"),
        ({"TRAIN_BATCH_SIZE": "100", "NUM_MINI_BATCHES": "3"}, "must be divisible by NUM_MINI_BATCHES"),
        ({"TRAINER_MODE": "fully_async"}, "TRAINER_MODE must be"),
        ({"STRATEGY": "deepspeed"}, "STRATEGY must be fsdp or megatron"),
        ({"STALENESS": "0"}, "STALENESS must be a positive integer"),
        ({"ROLLOUT_ENGINE": "trtllm"}, "ROLLOUT_ENGINE must be vllm or sglang"),
        ({"GUARD": "true"}, "GUARD must be 0 (off) or 1 (the collapse guard, docs/guard.md), got 'true'"),
        (
            {"TEST_FREQ": "0", "GUARD": "1"},
            "GUARD=1 (the collapse guard) chooses its best checkpoint by validation, but TEST_FREQ=0",
        ),
        (
            {"STRATEGY": "megatron", "ALGO": "grpo", "GUARD": "1"},
            "GUARD=1 (the collapse guard) with STRATEGY=megatron backs off",
        ),
    ],
)
def test_bad_settings_fail_before_anything_starts(env, message):
    clean = {k: v for k, v in os.environ.items() if k not in RECIPE_VARS}
    proc = subprocess.run(
        ["bash", str(RECIPE / "run_so_grpo_qwen2.5_3b_search.sh")],
        env={**clean, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_the_planner_s_megatron_guard_matches_what_the_guard_can_do():
    """The planner's list of losses with a normalizer is the guard's own, and on a scheduler that is
    not torch's (Megatron's ``OptimizerParamScheduler`` has ``max_lr``/``min_lr``, no ``base_lrs``)
    the guard's learning-rate setter leaves scale 1 alone and cannot back off: why the recipes back
    off ``clip_norm_tau`` there."""
    import torch

    from sorl_verl.cli.recipe_settings import TAU_LOSS_MODES
    from sorl_verl.trainer.guard import TAU_LOSSES
    from sorl_verl.trainer.guard_worker import scale_learning_rate

    assert TAU_LOSS_MODES == TAU_LOSSES

    class MegatronLikeScheduler:  # the attributes verl's get_megatron_optimizer_param_scheduler sets
        max_lr, min_lr, num_steps = 1e-6, 0.0, 0

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-6)
    assert scale_learning_rate(optimizer, MegatronLikeScheduler(), 1.0) == [1e-6]
    with pytest.raises(NotImplementedError, match="backoff_target=clip_norm_tau or an FSDP engine"):
        scale_learning_rate(optimizer, MegatronLikeScheduler(), 0.5)


def test_misspelled_sorl_knob_value_fails_at_config_build(tiny_model):
    argv, _ = dry_run("run_so_grpo_qwen2.5_3b_search.sh", MODEL_PATH=str(tiny_model), CLIP_NORM_MODE="maxx")
    cfg = compose_argv(argv)
    with pytest.raises(Exception, match="clip_norm_mode"):
        check_with_verl(cfg)


def test_staleness_null_disables_version_control():
    argv, _ = dry_run("run_so_grpo_qwen2.5_3b_search_async.sh", STALENESS="null")
    cfg = compose_argv(argv)
    assert cfg.trainer.v1.sampler.max_off_policy_threshold is None
