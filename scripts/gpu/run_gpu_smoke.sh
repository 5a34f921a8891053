#!/usr/bin/env bash
# GPU smoke: verl's own `python -m verl.trainer.main_ppo` with the sorl-verl plugin on ONE GPU, SO-GRPO with
# the SORL optimizer on the embedded default (early-stop-50 warm-start, synthetic world, BM25 server on
# 127.0.0.1), STEPS training steps of two runs, then one PASS/FAIL line:
#   plain     the main job's recipe (scripts/demo.sh: +demo=early_stop), validation before and after
#   stressed  lr 1e-3 and 16 updates per rollout (4 epochs x 4 mini-batches), so that the turn ratios
#             drift and the clipping-triggered normalizer has work to do (its Z is reported)
# On `cuda`, verl's FSDP2 actor/reference run on the GPU (trainer.device=cuda) and so does generation
# (the `hf` rollout with engine_kwargs.hf.device=cuda).
#
#   bash scripts/gpu/run_gpu_smoke.sh                     # from a checkout, its venv's python (or PYTHON=...)
#   bash .gpu/run_gpu_smoke.sh                            # offline: the bundle of scripts/gpu/build_bundle.sh
#   SMOKE_DEVICE=cpu bash scripts/gpu/run_gpu_smoke.sh    # the CPU rehearsal of the same runs
#
# Knobs (environment): STEPS (2), RUNS ("plain stressed"), TRAIN_TIMEOUT (seconds per main_ppo, 420),
# SMOKE_DEVICE (cuda | cpu), SMOKE_WARMSTART (early-stop-50; `expert` drops the early-stop recipe as demo.sh
# does), PYTHON (python3), OUT (results, /tmp/sorl_gpu_out), SORL_GPU_WORK (/tmp/sorl_gpu), SORL_HOME (checkout).
# Extra arguments are appended to every run's hydra overrides. Results in $OUT: smoke.log, <run>/metrics.jsonl,
# <run>/train.log, <run>/sorl_updates.jsonl, retrieval.log, nvidia_smi.csv; the last line is "[smoke] RESULT: ...".
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-/tmp/sorl_gpu_out}
W=${SORL_GPU_WORK:-/tmp/sorl_gpu}
STEPS=${STEPS:-2}
RUNS=${RUNS:-plain stressed}
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-420}
DEVICE=${SMOKE_DEVICE:-cuda}
WARMSTART=${SMOKE_WARMSTART:-early-stop-50}
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$W"
LOG=$OUT/smoke.log
: >"$LOG"

say() { echo "[smoke $(date +%H:%M:%S)] $*"; }

unpack_or_checkout() {  # sets PROJECT and EMB (train/val/index/model of the early-stop-50 warm-start)
  if [ -f "$HERE/site.tar.xz" ]; then  # offline bundle: site-packages, project archive, embedded default
    (cd "$HERE" && sha256sum -c --quiet SHA256SUMS) || { say "FAILED: bundle does not match SHA256SUMS"; return 1; }
    rm -rf "$W/site" "$W/project" && mkdir -p "$W/site" "$W/project"
    tar -xJf "$HERE/site.tar.xz" -C "$W/site" && tar -xJf "$HERE/project.tar.xz" -C "$W/project" \
      && tar -xJf "$HERE/embedded.tar.xz" -C "$W" || { say "FAILED: unpacking the bundle"; return 1; }
    export PYTHONPATH="$W/site:$W/project${PYTHONPATH:+:$PYTHONPATH}" SORL_HOME=$W
    PROJECT=$W/project
  else  # a checkout: this script lives in <repo>/scripts/gpu
    PROJECT=$(cd "$HERE/../.." && pwd)
    export SORL_HOME=${SORL_HOME:-$PROJECT/.sorl_cache}
  fi
  eval "$(cd "$PROJECT" && "$PY" -m sorl_verl.embedded.demo_paths qa --warmstart "$WARMSTART")" || {
    say "FAILED: the embedded default"
    return 1
  }
}

run_main_ppo() {  # $1: run name; then hydra overrides
  local name=$1 dir=$OUT/$1 t1 pid rc recipe=()
  shift
  case "$WARMSTART" in early-stop*) recipe=(+demo=early_stop) ;; esac  # as scripts/demo.sh
  mkdir -p "$dir" && rm -f "$dir/metrics.jsonl"
  local args=(
    --config-path "$PROJECT/recipe/sorl/config" --config-name sorl_trainer
    +task=search_qa +platform=cpu "${recipe[@]}"
    "data.train_files=$TRAIN" "data.val_files=$VAL" "actor_rollout_ref.model.path=$MODEL"
    "sorl.agent.retrieval_url=$URL" "trainer.device=$DEVICE"
    "trainer.total_training_steps=$STEPS" "trainer.save_freq=$STEPS"
    trainer.project_name=sorl_gpu_smoke "trainer.experiment_name=so_grpo-qa-$DEVICE-$name"
    "trainer.default_local_dir=$dir/checkpoints"
    algorithm.adv_estimator=so_grpo actor_rollout_ref.actor.policy_loss.loss_mode=so_grpo
  )
  [ "$DEVICE" = cpu ] || args+=(+actor_rollout_ref.rollout.engine_kwargs.hf.device="$DEVICE")
  say "$name: python -m verl.trainer.main_ppo ${args[*]} $*"
  t1=$(date +%s)
  (cd "$dir" && VERL_FILE_LOGGER_PATH=$dir/metrics.jsonl timeout -k 20 "$TRAIN_TIMEOUT" \
    "$PY" -m verl.trainer.main_ppo "${args[@]}" "$@" >"$dir/train.log" 2>&1) &
  pid=$!
  wait "$pid"
  rc=$?
  echo "$rc" >"$dir/exit_code"
  [ -f "$dir/checkpoints/sorl_updates.jsonl" ] && cp "$dir/checkpoints/sorl_updates.jsonl" "$dir/"
  say "$name: main_ppo exit $rc after $(( $(date +%s) - t1 )) s$([ "$rc" = 124 ] && echo " (TIMEOUT)")"
  [ "$rc" = 0 ] || grep -v "^\s*$" "$dir/train.log" | tail -n 25
}

main() {
  local t0 server_pid smi_pid="" port_file
  t0=$(date +%s)
  say "start: device $DEVICE, warm-start $WARMSTART, runs '$RUNS', $STEPS steps each, timeout ${TRAIN_TIMEOUT}s, OUT $OUT"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "cores $(nproc); $(free -g | awk '/Mem:/{print "memory " $2 " GiB"}')"
  unpack_or_checkout || return 1
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export RAY_USAGE_STATS_ENABLED=0 WANDB_MODE=disabled HYDRA_FULL_ERROR=1
  if [ "$DEVICE" = cpu ]; then export VERL_PLATFORM=cpu; else export VERL_PLATFORM=nvidia; fi
  "$PY" - <<'PY' 2>&1 | grep -v -E "engine is not available|warnings.warn"
import importlib.metadata as md, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "(no GPU)")
print("|", " ".join(f"{d} {md.version(d)}" for d in ("verl", "ray", "transformers", "tokenizers", "sorl-verl")))
PY
  port_file=$W/retrieval.port
  rm -f "$port_file"
  "$PY" -m sorl_verl.retrieval.server --index "$INDEX" --host 127.0.0.1 --port 0 --port-file "$port_file" \
    >"$OUT/retrieval.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 240); do
    [ -s "$port_file" ] && break
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.5
  done
  [ -s "$port_file" ] || { say "FAILED: retrieval server did not start"; tail -n 20 "$OUT/retrieval.log"; return 1; }
  URL=http://127.0.0.1:$(cat "$port_file")/retrieve
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 2 >"$OUT/nvidia_smi.csv" 2>&1 &
    smi_pid=$!
  fi
  for run in $RUNS; do
    case "$run" in
      plain) run_main_ppo plain trainer.val_before_train=true "trainer.test_freq=$STEPS" "$@" ;;
      stressed) run_main_ppo stressed trainer.val_before_train=false trainer.test_freq=-1 \
        actor_rollout_ref.actor.optim.lr=1e-3 actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0 \
        actor_rollout_ref.actor.ppo_epochs=4 actor_rollout_ref.actor.ppo_mini_batch_size=2 "$@" ;;
      *) say "unknown run '$run' (plain | stressed)"; return 2 ;;
    esac
  done
  [ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null
  kill "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  "$PY" "$HERE/smoke_verdict.py" --out "$OUT" --steps "$STEPS" --device "$DEVICE" $RUNS
  local rc=$?
  say "done in $(( $(date +%s) - t0 )) s"
  return "$rc"
}

main "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
