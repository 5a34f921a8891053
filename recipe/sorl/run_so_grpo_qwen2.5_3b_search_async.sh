#!/usr/bin/env bash
# SO-GRPO with verl's asynchronous trainer (stale rollouts); TRAINER_MODE=colocate_async also works.
# GPU only. Every setting is an environment variable (see recipe/sorl/README.md); extra arguments
# are hydra overrides appended last. DRY_RUN=1 prints the command, one argument per line.
set -euo pipefail
: "${ALGO:=so_grpo}"
: "${TASK:=search}"
: "${MODEL_PATH:=Qwen/Qwen2.5-3B}"
# off-policy by asynchrony: verl separate_async trainer on one 8-GPU node, 4 training + 4 rollout
# GPUs (the planner splits the node), weights pushed every NUM_MINI_BATCHES updates, trajectories up
# to STALENESS versions old
: "${TRAINER_MODE:=separate_async}"
: "${NUM_MINI_BATCHES:=4}"
: "${STALENESS:=4}"
# shellcheck source=recipe/sorl/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
sorl_run "$@"
