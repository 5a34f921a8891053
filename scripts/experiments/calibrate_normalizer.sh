#!/usr/bin/env bash
# Calibration of the clipping-triggered normalizer: the distribution of ||C|| and rho per micro-batch
# in four off-policy regimes of the CPU main job, with the normalizer off (clip_norm_mode=none, so
# every regime follows plain Turn-PPO and the measurement does not steer the run).
#
#   bash scripts/experiments/calibrate_normalizer.sh [STEPS]      # resumable: a finished regime is skipped
#
# Each regime's update log (one record per optimizer step, each micro-batch's ||C||, rho, Z) lands
# in $OUT/<regime>/sorl_updates.jsonl (default $SORL_HOME/calibration); `python scripts/experiments/calibration_summary.py
# $OUT` summarizes them (quantiles, share of micro-batches above each tau). The repository keeps the
# measured runs as docs/results/calibration/runs.tar.xz (command, metrics and update log per regime).
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${1:-6}
OUT=${OUT:-${SORL_HOME:-$HOME/.cache/sorl_verl}/calibration}
COMMON=(trainer.test_freq=-1 trainer.val_before_train=false actor_rollout_ref.actor.policy_loss.clip_norm_mode=none)
declare -A REGIMES=(
  [on_policy]="actor_rollout_ref.actor.ppo_epochs=1 actor_rollout_ref.actor.ppo_mini_batch_size=8"
  [mild]=""
  [moderate]="actor_rollout_ref.actor.optim.lr=3e-4 actor_rollout_ref.actor.ppo_epochs=2 actor_rollout_ref.actor.ppo_mini_batch_size=2"
  [heavy]="actor_rollout_ref.actor.optim.lr=1e-3 actor_rollout_ref.actor.ppo_epochs=4 actor_rollout_ref.actor.ppo_mini_batch_size=2"
)
for regime in on_policy mild moderate heavy; do
  dir=$OUT/$regime
  if [ -f "$dir/done" ]; then echo "[calibrate] $regime: done, skipped"; continue; fi
  rm -rf "/tmp/sorl_calibrate/$regime"
  mkdir -p "$dir"
  # shellcheck disable=SC2086
  SORL_RUN_DIR=/tmp/sorl_calibrate/$regime flock /tmp/sorl-heavy.lock \
    bash scripts/demo.sh --steps "$STEPS" -- "${COMMON[@]}" ${REGIMES[$regime]} > "$dir/demo.log" 2>&1
  cp /tmp/sorl_calibrate/$regime/checkpoints/sorl_updates.jsonl /tmp/sorl_calibrate/$regime/metrics.jsonl "$dir/"
  echo "bash scripts/demo.sh --steps $STEPS -- ${COMMON[*]} ${REGIMES[$regime]}" > "$dir/command.txt"
  touch "$dir/done"
  echo "[calibrate] $regime: $(wc -l < "$dir/sorl_updates.jsonl") optimizer steps"
done
