# shellcheck shell=bash
# Shared logic of every recipe/sorl/run_*.sh: turns environment variables into the hydra
# overrides of `python -m verl.trainer.main_ppo`, then runs it (or, with DRY_RUN=1, prints the
# command line, one argument per line, and exits). Sourced, never executed.
#
# The run scripts only set defaults (ALGO, TASK, MODEL_PATH, sizes) and call `sorl_run "$@"`;
# extra arguments are appended as hydra overrides, so they win over everything here.
# Every variable is documented in recipe/sorl/README.md.
#
# Before anything starts it checks the GPU plan (exit 2 with the numbers when it cannot fit) and
# picks the run directory: one per distinct configuration (a hash of the overrides that define
# the experiment), so a different setting never resumes another run's checkpoint and re-running
# the same setting resumes it. Every launch writes its own metrics and log files (verl's file
# logger truncates the file it is given).

SORL_RECIPE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

sorl_die() {
  echo "sorl recipe: $*" >&2
  exit 2
}

# sorl_defaults: fill every unset variable with the paper's (Search-R1 / SORL) setting.
sorl_defaults() {
  : "${PLATFORM:=gpu}"              # gpu | cpu (recipe/sorl/config/platform/cpu.yaml, hf rollout)
  case "$PLATFORM" in gpu | cpu) ;; *) sorl_die "PLATFORM must be gpu or cpu, got '$PLATFORM'" ;; esac
  : "${TASK:=search}"
  : "${ALGO:=so_grpo}"
  : "${MODEL_PATH:=Qwen/Qwen2.5-3B}"
  : "${MODEL_TAG:=$(basename "$MODEL_PATH" | tr '[:upper:]' '[:lower:]')}"
  case "$TASK" in
    search)
      : "${TASK_CONFIG:=search_qa}"
      : "${DATA_DIR:=$HOME/data/sorl/nq_hotpotqa}" ;;
    medical)
      : "${TASK_CONFIG:=medical_mcq}"
      : "${DATA_DIR:=$HOME/data/sorl/medical}" ;;
    *) sorl_die "TASK must be search or medical, got '$TASK'" ;;
  esac
  : "${TRAIN_FILES:=$DATA_DIR/train.parquet}"
  : "${VAL_FILES:=$DATA_DIR/test.parquet}"

  # retrieval (Search-R1: top-3 passages from an e5 or BM25 server over wiki-18)
  : "${RETRIEVAL_URL:=${SORL_RETRIEVAL_URL:-http://127.0.0.1:8000/retrieve}}"
  : "${RETRIEVAL_TOPK:=3}"

  # cluster and engines
  : "${NNODES:=1}"
  : "${CLUSTER_NODES:=$NNODES}"     # the machines the run gets (checked before launch)
  : "${CLUSTER_GPUS_PER_NODE:=8}"
  : "${ROLLOUT_ENGINE:=vllm}"       # vllm | sglang
  : "${STRATEGY:=fsdp}"             # fsdp | megatron
  : "${ROLLOUT_TP:=1}"
  : "${TRAIN_TP:=1}"                # megatron only
  : "${TRAIN_PP:=1}"                # megatron only
  : "${GPU_MEMORY_UTILIZATION:=0.6}"
  : "${OFFLOAD:=True}"

  # batch, lengths and turns (Search-R1: 512 prompts, start 2048, 500 per turn / observation)
  : "${TRAIN_BATCH_SIZE:=512}"
  : "${MAX_TURNS:=4}"
  : "${MAX_PROMPT_LENGTH:=2048}"
  : "${TURN_RESPONSE_LENGTH:=500}"
  : "${MAX_OBS_LENGTH:=500}"
  : "${MAX_RESPONSE_LENGTH:=$((MAX_TURNS * TURN_RESPONSE_LENGTH + (MAX_TURNS - 1) * MAX_OBS_LENGTH))}"
  : "${MICRO_BATCH_SIZE:=8}"
  : "${LOG_PROB_MICRO_BATCH_SIZE:=16}"
  : "${TEMPERATURE:=1.0}"

  # optimisation
  : "${ACTOR_LR:=1e-6}"
  : "${CRITIC_LR:=1e-5}"
  : "${CRITIC_WARMUP_RATIO:=0.015}"
  : "${KL_COEF:=0.001}"
  : "${GAMMA:=1.0}"
  : "${LAM:=1.0}"
  : "${ENTROPY_COEFF:=0}"

  # off-policy degree: mini-batch updates per rollout, epochs, trainer mode and staleness
  : "${NUM_MINI_BATCHES:=2}"
  : "${PPO_EPOCHS:=1}"
  : "${TRAINER_MODE:=sync}"         # sync | colocate_async | separate_async
  : "${STALENESS:=4}"               # max model versions a trajectory may span (async modes)
  : "${STALENESS_STRATEGY:=drop}"   # drop | wait
  : "${WARMUP_BATCHES:=1}"
  : "${ROLLOUT_NNODES:=1}"          # separate_async: the rollout pool, ROLLOUT_NNODES x ROLLOUT_GPUS_PER_NODE
  : "${ROLLOUT_GPUS_PER_NODE:=$((CLUSTER_GPUS_PER_NODE > 1 ? CLUSTER_GPUS_PER_NODE / 2 : 1))}"
  # trainer GPUs per node: the whole node, except in separate_async where the rollout pool takes
  # its share of it (4 + 4 on one 8-GPU node)
  if [[ $TRAINER_MODE == separate_async ]]; then
    : "${GPUS_PER_NODE:=$((CLUSTER_GPUS_PER_NODE - ROLLOUT_GPUS_PER_NODE > 0 ? CLUSTER_GPUS_PER_NODE - ROLLOUT_GPUS_PER_NODE : CLUSTER_GPUS_PER_NODE))}"
  else
    : "${GPUS_PER_NODE:=$CLUSTER_GPUS_PER_NODE}"
  fi
  : "${CHECKPOINT_ENGINE:=nccl}"    # separate_async weight sync backend (naive is refused by verl)

  # bookkeeping
  : "${PROJECT_NAME:=sorl}"
  : "${TOTAL_STEPS:=1005}"
  : "${TOTAL_EPOCHS:=15}"
  : "${SAVE_FREQ:=100}"
  : "${TEST_FREQ:=50}"
  : "${LOGGER:=[console,tensorboard,file]}"
  : "${OUTPUT_DIR:=$PWD/outputs/sorl}"
  : "${PYTHON:=python3}"
  # validation-only run (verl's trainer.val_only) of this configuration's checkpoint EVAL_STEP
  : "${VAL_ONLY:=0}"
  : "${EVAL_STEP:=last}"            # last | best | base (the untrained MODEL_PATH) | N
  : "${SORL_LAUNCH_ID:=$(date +%Y%m%d-%H%M%S)-$$}"
}

# sorl_algo_args: ALGO -> advantage estimator, policy loss, critic, group size, KL placement.
sorl_algo_args() {
  local adv loss critic group_default clip_low=0.2 clip_high=0.2 agg=token-mean
  case "$ALGO" in
    so_grpo)  adv=so_grpo; loss=so_grpo;  critic=False ;;
    grpo)     adv=grpo;    loss=vanilla;  critic=False ;;
    gspo)     adv=grpo;    loss=gspo;     critic=False; clip_low=0.0003; clip_high=0.0004; agg=seq-mean-token-mean ;;
    so_ppo)   adv=so_ppo;  loss=so_ppo;   critic=True ;;
    ppo)      adv=gae;     loss=vanilla;  critic=True ;;
    turn_ppo) adv=so_ppo;  loss=turn_ppo; critic=True ;;
    s_ppo)    adv=gae;     loss=s_ppo;    critic=True ;;
    *) sorl_die "ALGO must be one of so_grpo grpo gspo so_ppo ppo turn_ppo s_ppo, got '$ALGO'" ;;
  esac
  if [[ $critic == True ]]; then group_default=1; else group_default=5; fi
  : "${ADV_ESTIMATOR:=$adv}"
  : "${LOSS_MODE:=$loss}"
  : "${GROUP_SIZE:=$group_default}"
  : "${CLIP_RATIO_LOW:=$clip_low}"
  : "${CLIP_RATIO_HIGH:=$clip_high}"
  : "${LOSS_AGG_MODE:=$agg}"
  SORL_ARGS+=(
    "algorithm.adv_estimator=$ADV_ESTIMATOR"
    "algorithm.gamma=$GAMMA"
    "algorithm.lam=$LAM"
    "actor_rollout_ref.actor.policy_loss.loss_mode=$LOSS_MODE"
    "actor_rollout_ref.actor.clip_ratio_low=$CLIP_RATIO_LOW"
    "actor_rollout_ref.actor.clip_ratio_high=$CLIP_RATIO_HIGH"
    "actor_rollout_ref.actor.loss_agg_mode=$LOSS_AGG_MODE"
    "critic.enable=$critic"
  )
  [[ $PLATFORM == gpu ]] && SORL_ARGS+=("actor_rollout_ref.rollout.n=$GROUP_SIZE")
  # SORL knobs: passed only when set, so the defaults of SORLPolicyLossConfig stay authoritative.
  [[ -n ${CLIP_NORM_MODE:-} ]] && SORL_ARGS+=("actor_rollout_ref.actor.policy_loss.clip_norm_mode=$CLIP_NORM_MODE")
  [[ -n ${CLIP_NORM_TAU:-} ]] && SORL_ARGS+=("actor_rollout_ref.actor.policy_loss.clip_norm_tau=$CLIP_NORM_TAU")
  [[ -n ${CLIP_NORM_SCOPE:-} ]] && SORL_ARGS+=("actor_rollout_ref.actor.policy_loss.clip_norm_scope=$CLIP_NORM_SCOPE")
  [[ -n ${LOG_RATIO_CLAMP:-} ]] && SORL_ARGS+=("actor_rollout_ref.actor.policy_loss.log_ratio_clamp=$LOG_RATIO_CLAMP")

  if [[ $PLATFORM == cpu ]]; then
    # the CPU overlay runs without a reference policy (no KL), as the CPU main job does
    [[ $critic == True ]] && SORL_ARGS+=("critic.model.path=$MODEL_PATH")
  elif [[ $critic == True ]]; then
    # Search-R1's PPO: KL penalty in the reward, critic from the same base model
    : "${ACTOR_WARMUP_RATIO:=0.95}"
    SORL_ARGS+=(
      "actor_rollout_ref.actor.use_kl_loss=False"
      "algorithm.use_kl_in_reward=True"
      "algorithm.kl_ctrl.kl_coef=$KL_COEF"
      "critic.model.path=$MODEL_PATH"
      "critic.model.enable_gradient_checkpointing=True"
      "critic.model.use_remove_padding=True"
      "critic.optim.lr=$CRITIC_LR"
      "critic.optim.lr_warmup_steps_ratio=$CRITIC_WARMUP_RATIO"
      "critic.ppo_micro_batch_size_per_gpu=$MICRO_BATCH_SIZE"
    )
  else
    # Search-R1's GRPO: low-variance KL loss against the reference policy
    : "${ACTOR_WARMUP_RATIO:=0.285}"
    SORL_ARGS+=(
      "actor_rollout_ref.actor.use_kl_loss=True"
      "actor_rollout_ref.actor.kl_loss_coef=$KL_COEF"
      "actor_rollout_ref.actor.kl_loss_type=low_var_kl"
      "algorithm.use_kl_in_reward=False"
      "algorithm.norm_adv_by_std_in_grpo=True"
    )
  fi
  [[ $PLATFORM == gpu ]] && SORL_ARGS+=("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=$ACTOR_WARMUP_RATIO")
  SORL_CRITIC=$critic
}

# sorl_engine_args: FSDP or Megatron training engine, vLLM or SGLang rollout.
sorl_engine_args() {
  case "$ROLLOUT_ENGINE" in vllm | sglang) ;; *) sorl_die "ROLLOUT_ENGINE must be vllm or sglang, got '$ROLLOUT_ENGINE'" ;; esac
  SORL_ARGS+=(
    "actor_rollout_ref.rollout.name=$ROLLOUT_ENGINE"
    "actor_rollout_ref.rollout.mode=async"
    "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
    "actor_rollout_ref.rollout.gpu_memory_utilization=$GPU_MEMORY_UTILIZATION"
    "actor_rollout_ref.rollout.temperature=$TEMPERATURE"
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$LOG_PROB_MICRO_BATCH_SIZE"
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=$LOG_PROB_MICRO_BATCH_SIZE"
  )
  case "$STRATEGY" in
    fsdp)
      SORL_ARGS+=(
        "actor_rollout_ref.actor.fsdp_config.param_offload=$OFFLOAD"
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=$OFFLOAD"
        "actor_rollout_ref.ref.fsdp_config.param_offload=$OFFLOAD"
      )
      [[ $SORL_CRITIC == True ]] && SORL_ARGS+=(
        "critic.fsdp.param_offload=$OFFLOAD"
        "critic.fsdp.optimizer_offload=$OFFLOAD"
      )
      ;;
    megatron)
      SORL_ARGS+=(
        "model_engine=megatron"
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=$TRAIN_TP"
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$TRAIN_PP"
        "actor_rollout_ref.actor.megatron.param_offload=$OFFLOAD"
        "actor_rollout_ref.actor.megatron.optimizer_offload=$OFFLOAD"
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=$TRAIN_TP"
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=$TRAIN_PP"
        "actor_rollout_ref.ref.megatron.param_offload=$OFFLOAD"
        # Megatron builds its own distributed optimizer (no optimizer_impl plug point): drop the
        # SORL optimizer of sorl_trainer.yaml and let the normalizer act on the loss instead
        "~actor_rollout_ref.actor.optim.optimizer_impl"
        "actor_rollout_ref.actor.optim.optimizer=adam"
        "actor_rollout_ref.actor.optim.override_optimizer_config=null"
        "actor_rollout_ref.actor.policy_loss.clip_norm_apply=loss"
      )
      [[ $SORL_CRITIC == True ]] && SORL_ARGS+=(
        "critic.megatron.tensor_model_parallel_size=$TRAIN_TP"
        "critic.megatron.pipeline_model_parallel_size=$TRAIN_PP"
        "critic.megatron.param_offload=$OFFLOAD"
        "critic.megatron.optimizer_offload=$OFFLOAD"
      )
      ;;
    *) sorl_die "STRATEGY must be fsdp or megatron, got '$STRATEGY'" ;;
  esac
  return 0
}

# sorl_offpolicy_args: mini-batches per rollout, epochs, and verl's v1 trainer mode + staleness.
sorl_offpolicy_args() {
  (( TRAIN_BATCH_SIZE % NUM_MINI_BATCHES == 0 )) ||
    sorl_die "TRAIN_BATCH_SIZE ($TRAIN_BATCH_SIZE) must be divisible by NUM_MINI_BATCHES ($NUM_MINI_BATCHES)"
  [[ $STALENESS == null || $STALENESS =~ ^[1-9][0-9]*$ ]] ||
    sorl_die "STALENESS must be a positive integer (model versions) or null (no limit), got '$STALENESS'"
  local mini=$((TRAIN_BATCH_SIZE / NUM_MINI_BATCHES))
  [[ $PLATFORM == gpu ]] && SORL_ARGS+=(
    "actor_rollout_ref.actor.ppo_mini_batch_size=$mini"
    "actor_rollout_ref.actor.ppo_epochs=$PPO_EPOCHS"
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$MICRO_BATCH_SIZE"
  )
  SORL_ARGS+=(
    "trainer.v1.trainer_mode=$(sorl_trainer_name "$TRAINER_MODE")"
    "trainer.v1.sampler.max_off_policy_threshold=$STALENESS"
    "trainer.v1.sampler.max_off_policy_strategy=$STALENESS_STRATEGY"
  )
  case "$TRAINER_MODE" in
    sync) ;;
    colocate_async)
      SORL_ARGS+=("trainer.v1.colocate_async.num_warmup_batches=$WARMUP_BATCHES") ;;
    separate_async)
      # verl: train_batch_size == parameter_sync_step * ppo_mini_batch_size, a dedicated rollout
      # pool, and a non-naive checkpoint engine for weight sync.
      SORL_ARGS+=(
        "trainer.v1.separate_async.num_warmup_batches=$WARMUP_BATCHES"
        "trainer.v1.separate_async.parameter_sync_step=$NUM_MINI_BATCHES"
        "actor_rollout_ref.hybrid_engine=False"
        "actor_rollout_ref.rollout.nnodes=$ROLLOUT_NNODES"
        "actor_rollout_ref.rollout.n_gpus_per_node=$ROLLOUT_GPUS_PER_NODE"
        "actor_rollout_ref.rollout.checkpoint_engine.backend=$CHECKPOINT_ENGINE"
      ) ;;
    *) sorl_die "TRAINER_MODE must be sync, colocate_async or separate_async, got '$TRAINER_MODE'" ;;
  esac
}

# sorl_trainer_name MODE: the registered v1 trainer for MODE (SORL's value-passing subclasses).
sorl_trainer_name() {
  echo "${SORL_TRAINER_PREFIX-sorl_}$1"
}

# sorl_build_args [extra overrides...]: the overrides that define the experiment, in SORL_ARGS
# (task overlay first, `+task=...`; PLATFORM=cpu adds `+platform=cpu` and leaves sizes, engines and
# GPU counts to that overlay).
sorl_build_args() {
  sorl_defaults
  SORL_ARGS=("+task=$TASK_CONFIG")
  [[ $PLATFORM == cpu ]] && SORL_ARGS+=("+platform=cpu")
  SORL_ARGS+=(
    "data.train_files=$TRAIN_FILES"
    "data.val_files=$VAL_FILES"
    "actor_rollout_ref.model.path=$MODEL_PATH"
    "sorl.agent.retrieval_url=$RETRIEVAL_URL"
    "sorl.agent.topk=$RETRIEVAL_TOPK"
    "sorl.agent.max_turns=$MAX_TURNS"
  )
  [[ -n ${VAL_MAX_SAMPLES:-} ]] && SORL_ARGS+=("data.val_max_samples=$VAL_MAX_SAMPLES")
  [[ $PLATFORM == gpu ]] && SORL_ARGS+=(
    "data.train_batch_size=$TRAIN_BATCH_SIZE"
    "data.max_prompt_length=$MAX_PROMPT_LENGTH"
    "data.max_response_length=$MAX_RESPONSE_LENGTH"
    "actor_rollout_ref.actor.optim.lr=$ACTOR_LR"
    "actor_rollout_ref.actor.entropy_coeff=$ENTROPY_COEFF"
    "sorl.agent.max_obs_tokens=$MAX_OBS_LENGTH"
  )
  sorl_algo_args
  [[ $PLATFORM == gpu ]] && sorl_engine_args
  sorl_offpolicy_args
  [[ $PLATFORM == gpu ]] && SORL_ARGS+=(
    "trainer.nnodes=$NNODES"
    "trainer.n_gpus_per_node=$GPUS_PER_NODE"
  )
  return 0
}

# sorl_need N NAME...: every NAME is a positive integer, else exit 2.
sorl_need_positive() {
  local name
  for name in "$@"; do
    [[ ${!name} =~ ^[1-9][0-9]*$ ]] || sorl_die "$name must be a positive integer, got '${!name}'"
  done
}

# sorl_gpu_plan: check that the trainer (and, for separate_async, the rollout pool) fits the
# cluster CLUSTER_NODES x CLUSTER_GPUS_PER_NODE and that verl's divisibility rules hold, before
# anything starts; the plan goes to SORL_GPU_PLAN (printed on stderr). Exit 2 with the numbers.
sorl_gpu_plan() {
  if [[ $PLATFORM == cpu ]]; then
    SORL_GPU_PLAN="gpu plan: none (PLATFORM=cpu: recipe/sorl/config/platform/cpu.yaml, hf rollout on CPU)"
    return 0
  fi
  sorl_need_positive NNODES GPUS_PER_NODE CLUSTER_NODES CLUSTER_GPUS_PER_NODE ROLLOUT_TP TRAIN_TP TRAIN_PP \
    ROLLOUT_NNODES ROLLOUT_GPUS_PER_NODE GROUP_SIZE
  local train=$((NNODES * GPUS_PER_NODE)) cluster=$((CLUSTER_NODES * CLUSTER_GPUS_PER_NODE))
  local rollout_gpus=$train rollout_per_node=$GPUS_PER_NODE pools=() used
  if [[ $TRAINER_MODE == separate_async ]]; then
    rollout_gpus=$((ROLLOUT_NNODES * ROLLOUT_GPUS_PER_NODE))
    rollout_per_node=$ROLLOUT_GPUS_PER_NODE
  fi
  # verl places each pool's per-node group on one node: pack them first-fit, largest first
  local i size free=() placed
  for ((i = 0; i < NNODES; i++)); do pools+=("$GPUS_PER_NODE"); done
  if [[ $TRAINER_MODE == separate_async ]]; then
    for ((i = 0; i < ROLLOUT_NNODES; i++)); do pools+=("$ROLLOUT_GPUS_PER_NODE"); done
  fi
  mapfile -t pools < <(printf '%s\n' "${pools[@]}" | sort -rn)
  for ((i = 0; i < CLUSTER_NODES; i++)); do free+=("$CLUSTER_GPUS_PER_NODE"); done
  for size in "${pools[@]}"; do
    placed=0
    for i in "${!free[@]}"; do
      if ((free[i] >= size)); then free[i]=$((free[i] - size)); placed=1; break; fi
    done
    ((placed)) || break
  done
  used=$((train + (${#pools[@]} > NNODES ? rollout_gpus : 0)))
  if [[ $TRAINER_MODE == separate_async ]]; then
    SORL_GPU_PLAN="gpu plan: trainer $NNODES x $GPUS_PER_NODE ($STRATEGY) + rollout $ROLLOUT_NNODES x $ROLLOUT_GPUS_PER_NODE ($ROLLOUT_ENGINE, TP $ROLLOUT_TP: $((rollout_gpus / ROLLOUT_TP)) replicas) = $used GPUs of $CLUSTER_NODES x $CLUSTER_GPUS_PER_NODE"
  else
    SORL_GPU_PLAN="gpu plan: $NNODES x $GPUS_PER_NODE GPUs shared by training ($STRATEGY) and rollout ($ROLLOUT_ENGINE, TP $ROLLOUT_TP: $((train / ROLLOUT_TP)) replicas, $TRAINER_MODE) = $used GPUs of $CLUSTER_NODES x $CLUSTER_GPUS_PER_NODE"
  fi
  ((placed)) || sorl_die "the GPU plan does not fit: $SORL_GPU_PLAN. Each pool's per-node share must fit on one node: lower GPUS_PER_NODE / ROLLOUT_GPUS_PER_NODE, or set CLUSTER_NODES / CLUSTER_GPUS_PER_NODE to the machines you have"
  ((ROLLOUT_TP <= rollout_per_node && rollout_gpus % ROLLOUT_TP == 0)) ||
    sorl_die "ROLLOUT_TP=$ROLLOUT_TP must divide the $rollout_gpus rollout GPUs and fit in one node ($rollout_per_node GPUs): $SORL_GPU_PLAN"
  local dp=$train minimal=$train
  if [[ $STRATEGY == megatron ]]; then
    ((train % (TRAIN_TP * TRAIN_PP) == 0)) ||
      sorl_die "TRAIN_TP x TRAIN_PP = $((TRAIN_TP * TRAIN_PP)) must divide the $train trainer GPUs: $SORL_GPU_PLAN"
    dp=$((train / (TRAIN_TP * TRAIN_PP)))
    minimal=$((dp * MICRO_BATCH_SIZE))
  fi
  (((TRAIN_BATCH_SIZE * GROUP_SIZE) % minimal == 0)) ||
    sorl_die "TRAIN_BATCH_SIZE x GROUP_SIZE = $TRAIN_BATCH_SIZE x $GROUP_SIZE = $((TRAIN_BATCH_SIZE * GROUP_SIZE)) episodes must divide evenly over $minimal ($([[ $STRATEGY == megatron ]] && echo "data-parallel $dp x micro-batch $MICRO_BATCH_SIZE" || echo "trainer GPUs")): $SORL_GPU_PLAN"
  return 0
}

# sorl_identity_args OVERRIDES...: the overrides that define the experiment, one per line; what
# only names, schedules, validates, locates or fits the run into memory is left out, so that
# changing it (more steps, another retrieval host, other test sets) continues the same run. The
# trainer's GPU count stays in: verl's FSDP checkpoints are sharded per trainer GPU.
sorl_identity_args() {
  local arg key
  for arg in "$@"; do
    key=${arg%%=*}
    key=${key#"${key%%[!+~]*}"}
    case "$key" in
      trainer.logger | trainer.project_name | trainer.experiment_name | trainer.default_local_dir | \
        trainer.total_training_steps | trainer.total_epochs | trainer.save_freq | trainer.test_freq | \
        trainer.val_before_train | trainer.val_only | trainer.resume_mode | trainer.resume_from_path | \
        trainer.max_actor_ckpt_to_keep | trainer.max_critic_ckpt_to_keep | trainer.log_val_generations | \
        data.val_files | data.val_max_samples | data.val_batch_size | sorl.agent.retrieval_url | \
        actor_rollout_ref.rollout.val_kwargs.* | actor_rollout_ref.rollout.tensor_model_parallel_size | \
        *micro_batch_size_per_gpu | *gpu_memory_utilization | *param_offload | *optimizer_offload) ;;
      *) printf '%s\n' "$arg" ;;
    esac
  done
}

# sorl_run_dir [extra overrides...]: RUN_DIR = OUTPUT_DIR/[RUN_NAME-]ALGO-TASK-MODEL-MODE-<hash>,
# the hash (8 hex digits of sha256) taken over sorl_identity_args of every override.
sorl_run_dir() {
  SORL_IDENTITY=$(sorl_identity_args "${SORL_ARGS[@]}" "$@")
  local hash
  hash=$(printf '%s\n' "$SORL_IDENTITY" | sha256sum | cut -c1-8)
  : "${RUN_DIR:=$OUTPUT_DIR/${RUN_NAME:+$RUN_NAME-}${ALGO}-${TASK}-${MODEL_TAG}-${TRAINER_MODE}-${hash}}"
  : "${EXPERIMENT_NAME:=$(basename "$RUN_DIR")}"
  : "${CKPT_DIR:=$RUN_DIR/checkpoints}"
  SORL_RESUME_STEP=
  if [[ -s $CKPT_DIR/latest_checkpointed_iteration.txt ]]; then
    SORL_RESUME_STEP=$(tr -dc '0-9' < "$CKPT_DIR/latest_checkpointed_iteration.txt")
  fi
}

# sorl_eval_step: the checkpoint step a VAL_ONLY run evaluates (EVAL_STEP), or exit 2 saying why.
sorl_eval_step() {
  case "$EVAL_STEP" in
    base) echo base ;;
    last)
      [[ -n $SORL_RESUME_STEP ]] || sorl_die "EVAL_STEP=last: no checkpoint of this configuration in $CKPT_DIR (train it first, or EVAL_STEP=base for MODEL_PATH as is)"
      echo "$SORL_RESUME_STEP" ;;
    best)
      "$PYTHON" -m sorl_verl eval --metrics "$RUN_DIR" --print-step best --checkpoints "$CKPT_DIR" ||
        sorl_die "EVAL_STEP=best: no validated step with a checkpoint in $RUN_DIR (see the message above)" ;;
    *)
      [[ $EVAL_STEP =~ ^[0-9]+$ && -d $CKPT_DIR/global_step_$EVAL_STEP ]] ||
        sorl_die "EVAL_STEP must be last, best, base or a step with a checkpoint; no $CKPT_DIR/global_step_$EVAL_STEP"
      echo "$EVAL_STEP" ;;
  esac
}

# sorl_bookkeeping_args: where this launch writes (WORK_DIR), trainer schedule, resume or val-only.
sorl_bookkeeping_args() {
  SORL_ARGS+=(
    "trainer.logger=$LOGGER"
    "trainer.project_name=$PROJECT_NAME"
    "trainer.experiment_name=$EXPERIMENT_NAME"
  )
  if [[ $VAL_ONLY == 1 ]]; then
    local step
    step=$(sorl_eval_step) || exit 2
    WORK_DIR=$RUN_DIR/eval/step_$step
    SORL_ARGS+=(
      "trainer.val_only=True"
      "trainer.val_before_train=True"
      "trainer.default_local_dir=$WORK_DIR/checkpoints"
    )
    if [[ $step == base ]]; then
      SORL_ARGS+=("trainer.resume_mode=disable")
      SORL_RUN_STATE="validation only of MODEL_PATH $MODEL_PATH (untrained)"
    else
      SORL_ARGS+=("trainer.resume_mode=resume_path" "trainer.resume_from_path=$CKPT_DIR/global_step_$step")
      SORL_RUN_STATE="validation only of $CKPT_DIR/global_step_$step"
    fi
    return 0
  fi
  WORK_DIR=$RUN_DIR
  # a resumed step that was validated before it was saved is not validated again (51.7k episodes
  # for the seven QA test sets); VAL_BEFORE_TRAIN=True forces it
  local val_before=True
  if [[ -n $SORL_RESUME_STEP ]]; then
    SORL_RUN_STATE="resumes from $CKPT_DIR/global_step_$SORL_RESUME_STEP (to start over: RUN_NAME=<new name>, or rm -r $RUN_DIR)"
    ((TEST_FREQ > 0 && SORL_RESUME_STEP % TEST_FREQ == 0)) && val_before=False
  else
    SORL_RUN_STATE="new run"
  fi
  SORL_ARGS+=(
    "trainer.default_local_dir=$CKPT_DIR"
    "trainer.resume_mode=auto"
    "trainer.total_training_steps=$TOTAL_STEPS"
    "trainer.total_epochs=$TOTAL_EPOCHS"
    "trainer.save_freq=$SAVE_FREQ"
    "trainer.test_freq=$TEST_FREQ"
    "trainer.val_before_train=${VAL_BEFORE_TRAIN:-$val_before}"
  )
}

# sorl_run [extra hydra overrides...]: build, check, then run main_ppo (or print it with DRY_RUN=1).
sorl_run() {
  sorl_build_args
  sorl_gpu_plan
  sorl_run_dir "$@"
  sorl_bookkeeping_args
  local cmd=(
    "$PYTHON" -m verl.trainer.main_ppo
    "--config-path=$SORL_RECIPE_DIR/config"
    "--config-name=sorl_trainer"
    "${SORL_ARGS[@]}"
    "$@"
  )
  export SORL_RETRIEVAL_URL="$RETRIEVAL_URL"
  [[ $PLATFORM == cpu ]] && export VERL_PLATFORM=cpu TOKENIZERS_PARALLELISM=false
  export TENSORBOARD_DIR="${TENSORBOARD_DIR:-$WORK_DIR/tensorboard}"
  # verl's file logger opens its file with "wb": one file per launch, read back in name order
  export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-$WORK_DIR/metrics.$SORL_LAUNCH_ID.jsonl}"
  export PYTHONUNBUFFERED=1
  local log=$WORK_DIR/train.$SORL_LAUNCH_ID.log
  {
    echo "$SORL_GPU_PLAN"
    echo "run dir: $RUN_DIR ($SORL_RUN_STATE)"
  } >&2
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf 'export %s=%s\n' SORL_RETRIEVAL_URL "$SORL_RETRIEVAL_URL" TENSORBOARD_DIR "$TENSORBOARD_DIR" VERL_FILE_LOGGER_PATH "$VERL_FILE_LOGGER_PATH" >&2
    echo "log: $log (also appended to $WORK_DIR/train.log)" >&2
    printf '%s\n' "${cmd[@]}"
    return 0
  fi
  mkdir -p "$WORK_DIR"
  [[ -e $RUN_DIR/overrides.txt ]] || printf '%s\n' "$SORL_IDENTITY" > "$RUN_DIR/overrides.txt"
  printf '%s\n' "${cmd[@]}" > "$WORK_DIR/command.$SORL_LAUNCH_ID.txt"
  echo "=== launch $SORL_LAUNCH_ID: $SORL_RUN_STATE" >> "$WORK_DIR/train.log"
  local rc
  set +e
  "${cmd[@]}" 2>&1 | tee "$log" | tee -a "$WORK_DIR/train.log"
  rc=${PIPESTATUS[0]}
  set -e
  if [[ $VAL_ONLY == 1 && $rc == 0 ]]; then
    "$PYTHON" -m sorl_verl eval --metrics "$WORK_DIR" --out-dir "$WORK_DIR" --title "$EXPERIMENT_NAME ($SORL_RUN_STATE)" || rc=$?
  fi
  return "$rc"
}
