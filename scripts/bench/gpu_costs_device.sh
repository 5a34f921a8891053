#!/usr/bin/env bash
# The GPU costs of issues 33 and 34 in one device command, from the repository root with .gpu/ carried
# (device command: `bash scripts/bench/gpu_costs_device.sh`, carry ['.gpu']; at most ~6 minutes):
#   (A) scripts/bench/clip_bias_grad_cost.py: what clip_norm_reference=gradient / gradient_relative and the
#       sorl/clip_bias_grad_norm diagnostic cost per micro-batch step (bf16 Qwen2.5-1.5B shape, 4 x 4096);
#   (B) scripts/bench/guard_checkpoint_cost.py: verl's FSDP2 checkpoint of a fp32 Qwen2.5-3B-shaped actor
#       with the SORL AdamW (save, os.sync, the guard's hard-link snapshot, warm and cold load, checked bit
#       for bit); if the 3B checkpoint (~37 GB) does not fit the disk or RAM (exit 3), the 1.5B shape instead.
# Logs and JSON go to $OUT (8 files at most). Every step has its own `timeout`; logs are tee'd, so what a
# step printed comes back even when it is cut short, and each JSON is rewritten as the step goes.
#
# .gpu/site.tar.xz (git-ignored through .git/info/exclude, ~12 MB) is a cp312 site-packages folder with
# exactly what the device image lacks of what (A) and (B) import, versions as in .venv: verl 0.9.1,
# ray 2.60.0 (import only), tensordict 0.10.0, pyvers 0.1.0, omegaconf 2.3.1, antlr4-python3-runtime 4.9.3,
# codetiming 1.4.0, nvtx 0.2.17, orjson 3.13.0, jsonschema 4.26.0, jsonschema-specifications 2025.9.1,
# referencing 0.37.0, rpds-py 2026.9.1, and for verl.utils.checkpoint (verl.utils.dataset imports datasets
# unconditionally) datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19. TransferQueue (with msgspec, pyzmq) is
# optional in verl (mocked when absent) and left out.
# Rebuild it: `bash scripts/bench/build_bench_bundle.sh` (versions: scripts/bench/bench-bundle-lock.txt).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_costs_out}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
# (A) at 4 x 4096 (as loss_in_step.py on the H200) needs more than an H100's 80 GB: 2 x 4096 there
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
CLIP_ROWS=$([ "${GPU_MIB:-0}" -ge 100000 ] && echo 4 || echo 2)
CLIP_ARGS=${CLIP_ARGS:---model 1.5b --rows $CLIP_ROWS --length 4096 --reps 5}
GUARD_MODEL=${GUARD_MODEL:-3b}
GUARD_FALLBACK=${GUARD_FALLBACK:-1.5b}
GUARD_ARGS=${GUARD_ARGS:-}
# the checkpoint goes to the disk-backed file system with the most free space (never tmpfs, never $OUT)
if [ -z "${CKPT_DIR:-}" ]; then
    best=0
    for d in "$PWD" /root /tmp /var/tmp; do
        fstype="" avail=0
        read -r fstype avail < <(df -P -T "$d" 2>/dev/null | awk 'NR == 2 {print $2, $5}')
        case "${fstype:-tmpfs}" in tmpfs | ramfs) continue ;; esac
        if [ "${avail:-0}" -gt "$best" ]; then best=$avail CKPT_DIR=$d/.guard_ckpt_bench; fi
    done
    CKPT_DIR=${CKPT_DIR:-$PWD/.guard_ckpt_bench}
fi
T_IMPORT=${T_IMPORT:-45}
T_CLIP=${T_CLIP:-75}
T_GUARD=${T_GUARD:-230}
mkdir -p "$OUT" "$SITE"
tar -xJf .gpu/site.tar.xz -C "$SITE" || { echo "gpu_costs: cannot unpack .gpu/site.tar.xz (carry ['.gpu'])"; exit 2; }
export PYTHONPATH="$SITE:$PWD"
export VERL_USE_EXTERNAL_PLUGINS=none  # sorl_verl is not pip-installed here; the scripts call it directly
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
{
    date -u
    nvidia-smi -L
    nproc
    free -g
    df -h -T / /tmp /root "$PWD"
    echo "GPU memory ${GPU_MIB:-?} MiB; clip_bias_grad_cost args: $CLIP_ARGS; checkpoint folder: $CKPT_DIR"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"

DEVICE=$DEVICE timeout "$T_IMPORT" "$PY" - <<'PY' 2>&1 | tee "$OUT/import.log"
import importlib.metadata as md
import os
import sys

import torch

mods = ("transformers", "verl.utils.checkpoint.fsdp_checkpoint_manager", "verl.utils.fsdp_utils",
        "verl.workers.config.optimizer", "verl.utils.torch_functional", "sorl_verl.trainer.guard",
        "sorl_verl.algorithms.losses", "sorl_verl.algorithms.clip_bias_grad", "sorl_verl.algorithms.optim")
failed = []
for name in mods:
    try:
        __import__(name)
    except Exception as e:  # report every failure at once
        failed.append(f"{name}: {type(e).__name__}: {e}")
vers = {}
for dist in ("torch", "transformers", "accelerate", "verl", "ray", "datasets", "omegaconf", "tensordict", "peft"):
    try:
        vers[dist] = md.version(dist)
    except md.PackageNotFoundError:
        vers[dist] = "absent"
print("python", sys.version.split()[0], vers, "cuda available:", torch.cuda.is_available())
if os.environ["DEVICE"].startswith("cuda") and not torch.cuda.is_available():
    failed.append("torch.cuda.is_available() is False")
if failed:
    print("IMPORT CHECK FAILED:\n  " + "\n  ".join(failed))
    sys.exit(2)
print("import check ok")
PY
rc=$?
if [ "$rc" -ne 0 ]; then
    echo "gpu_costs: import check failed (rc $rc); nothing measured"
    exit 2
fi

# shellcheck disable=SC2086  # the *_ARGS are word lists
timeout "$T_CLIP" "$PY" scripts/bench/clip_bias_grad_cost.py --device "$DEVICE" $CLIP_ARGS \
    --json-out "$OUT/clip_bias_grad_cost.json" 2>&1 | tee "$OUT/clip_bias_grad_cost.log"
rc_a=$?

rm -rf "$CKPT_DIR"
# shellcheck disable=SC2086
timeout "$T_GUARD" "$PY" scripts/bench/guard_checkpoint_cost.py --device "$DEVICE" --model "$GUARD_MODEL" \
    --ckpt-dir "$CKPT_DIR" $GUARD_ARGS --json-out "$OUT/guard_checkpoint_cost.json" 2>&1 |
    tee "$OUT/guard_checkpoint_cost.log"
rc_b=$?
if [ "$rc_b" -eq 3 ] && [ -n "$GUARD_FALLBACK" ]; then
    echo "gpu_costs: $GUARD_MODEL does not fit; measuring $GUARD_FALLBACK instead"
    rm -rf "$CKPT_DIR"
    # shellcheck disable=SC2086
    timeout "$T_GUARD" "$PY" scripts/bench/guard_checkpoint_cost.py --device "$DEVICE" --model "$GUARD_FALLBACK" \
        --ckpt-dir "$CKPT_DIR" $GUARD_ARGS --json-out "$OUT/guard_checkpoint_cost_$GUARD_FALLBACK.json" 2>&1 |
        tee "$OUT/guard_checkpoint_cost_$GUARD_FALLBACK.log"
    rc_b=$?
fi
rm -rf "$CKPT_DIR"
echo "gpu_costs: clip_bias_grad_cost rc $rc_a, guard_checkpoint_cost rc $rc_b (124: timed out)"
[ "$rc_a" -eq 0 ] && [ "$rc_b" -eq 0 ]
