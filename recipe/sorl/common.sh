# shellcheck shell=bash
# Shared tail of every recipe/sorl/run_*.sh, sourced, never executed. The run scripts set defaults
# (ALGO, TASK, MODEL_PATH, sizes) and call `sorl_run "$@"`; extra arguments are hydra overrides
# appended last, so they win over everything. Every variable is documented in recipe/sorl/README.md.
#
# The planner, sorl_verl/cli/recipe_plan.py (`sorl-verl recipe-plan`), does the computing: defaults,
# checks (exit 2 naming the bad variable), the GPU plan, the run directory (one per configuration:
# the same one resumes, another never does) and the hydra overrides of verl's main_ppo. This file
# passes it the variables the script set, asks it for the command (DRY_RUN=1: prints it, one
# argument per line), and runs the command with this launch's log files.

SORL_RECIPE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

sorl_run() {
  : "${PYTHON:=python3}"
  local name names plan rc vars=() planner=("$PYTHON" -m sorl_verl.cli.recipe_plan --recipe-dir "$SORL_RECIPE_DIR")
  names=$("${planner[@]}" --variables) || {
    echo "sorl recipe: PYTHON=$PYTHON cannot run the planner (it and main_ppo need sorl-verl installed)" >&2
    exit 2
  }
  # the planner sees the variables this script set, not only the exported ones
  for name in $names; do
    if [[ -v $name ]]; then vars+=("$name=${!name}"); fi
  done
  planner=(env "${vars[@]}" "${planner[@]}")
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    "${planner[@]}" --print -- "$@" || exit
    return 0
  fi
  plan=$("${planner[@]}" --launch -- "$@") || exit
  eval "$plan"  # exports, SORL_CMD, SORL_AFTER, SORL_LOG, SORL_TRAIN_LOG
  set +e
  "${SORL_CMD[@]}" 2>&1 | tee "$SORL_LOG" | tee -a "$SORL_TRAIN_LOG"
  rc=${PIPESTATUS[0]}
  set -e
  # a validation-only launch tabulates what it validated (sorl-verl eval)
  if [[ $rc == 0 && ${#SORL_AFTER[@]} -gt 0 ]]; then "${SORL_AFTER[@]}" || rc=$?; fi
  return "$rc"
}
