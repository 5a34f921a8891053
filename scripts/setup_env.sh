#!/usr/bin/env bash
# Create .venv (if missing) and install sorl-verl with its test extras on the CPU build of torch.
#
#   bash scripts/setup_env.sh
#   SORL_VENV=.venv-vllm SORL_EXTRAS=test,cpu-vllm bash scripts/setup_env.sh   # another venv, other extras
#
# SORL_VENV (default .venv) is the venv, SORL_EXTRAS (default test) the extras of sorl-verl installed
# into it; scripts/setup_cpu_vllm.sh uses both.
# Python: $PYTHON_BIN if set, else the first of python3.11, python3.12, python3.10, python3 on PATH
# whose version is 3.10-3.12 (pyproject's requires-python). An existing venv is reused.
# torch: the CPU build, torch==$TORCH_VERSION+cpu (default 2.13.0), pinned before anything else so
# that no dependency pulls PyPI's CUDA wheel (and its CUDA libraries). It comes from the first of
#   1. a wheel pip finds without an index (pip's find-links: PIP_FIND_LINKS=/folder/with/wheels),
#   2. PyTorch's CPU index, $TORCH_INDEX_URL (default https://download.pytorch.org/whl/cpu),
# and the script stops with an error naming both when neither has it. On macOS, PyPI's
# torch==$TORCH_VERSION is the CPU build and is used instead. Everything else comes from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
VENV=${SORL_VENV:-.venv}
EXTRAS=${SORL_EXTRAS:-test}

die() {
  echo "[setup] error: $*" >&2
  exit 1
}

# 0 if "$1" runs a Python 3.10-3.12
python_ok() {
  "$1" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else 1)' 2>/dev/null
}

find_python() {
  if [ -n "${PYTHON_BIN:-}" ]; then
    command -v "$PYTHON_BIN" >/dev/null 2>&1 || die "PYTHON_BIN=$PYTHON_BIN is not an executable"
    python_ok "$PYTHON_BIN" || die "PYTHON_BIN=$PYTHON_BIN does not run a Python 3.10-3.12 ('$PYTHON_BIN -V' says: $("$PYTHON_BIN" -V 2>&1 | head -n 1))"
    echo "$PYTHON_BIN"
    return
  fi
  local candidate
  for candidate in python3.11 python3.12 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then
      echo "$candidate"
      return
    fi
  done
  die "no Python 3.10-3.12 on PATH (tried python3.11, python3.12, python3.10, python3); install one or set PYTHON_BIN=/path/to/python3.X"
}

if [ ! -x "$VENV/bin/python" ]; then
  PYTHON=$(find_python)
  echo "[setup] creating $VENV with $PYTHON ($("$PYTHON" -V 2>&1))"
  "$PYTHON" -m venv "$VENV"
fi
python_ok "$VENV/bin/python" || die "$VENV does not run a Python 3.10-3.12 ($("$VENV/bin/python" -V 2>&1 | head -n 1)): remove $VENV and run again (PYTHON_BIN picks the interpreter)"
# shellcheck disable=SC1091
. "$VENV/bin/activate"

if [ "$(uname -s)" = Darwin ]; then
  TORCH_SPEC="torch==$TORCH_VERSION"
else
  TORCH_SPEC="torch==$TORCH_VERSION+cpu"
fi
PIP=(python -m pip install -q --disable-pip-version-check)

# install_torch: the CPU build of torch alone (its dependencies come with the project below)
install_torch() {
  if python -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != '${TORCH_SPEC#torch==}')" 2>/dev/null; then
    return
  fi
  if "${PIP[@]}" --no-index --no-deps "$TORCH_SPEC" >/dev/null 2>&1; then
    echo "[setup] $TORCH_SPEC from a local wheel (pip's find-links)"
  elif [ "$(uname -s)" = Darwin ] && "${PIP[@]}" --no-deps "$TORCH_SPEC"; then
    echo "[setup] $TORCH_SPEC from PyPI (the CPU build on macOS)"
  elif "${PIP[@]}" --no-deps --timeout 60 --retries 2 --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; then
    echo "[setup] $TORCH_SPEC from $TORCH_INDEX_URL"
  else
    local py
    py=$(python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    die "cannot install the CPU build $TORCH_SPEC for $py on $(uname -s) $(uname -m): no local wheel in pip's find-links (PIP_FIND_LINKS=${PIP_FIND_LINKS:-unset}) and $TORCH_INDEX_URL did not provide one (unreachable, or no wheel for this Python and platform). Fetch torch-$TORCH_VERSION+cpu-$py-...whl from that index on a connected machine and set PIP_FIND_LINKS to its folder, or set TORCH_INDEX_URL to a mirror of PyTorch's CPU index"
  fi
}

# The stamp: line 1 the torch pin, line 2 the extras installed (absent: test; an empty stamp, from
# before the pin was recorded, counts as this pin).
stamp=$VENV/.sorl_installed
# 0 if the stamp records this torch and every extra asked for
stamp_ok() {
  [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] || return 1
  local torch_line extras_line extra
  torch_line=$(sed -n 1p "$stamp")
  extras_line=$(sed -n 2p "$stamp")
  [ -z "$torch_line" ] || [ "$torch_line" = "$TORCH_SPEC" ] || return 1
  for extra in ${EXTRAS//,/ }; do
    case ",${extras_line:-test}," in *",$extra,"*) ;; *) return 1 ;; esac
  done
}
if ! stamp_ok; then
  echo "[setup] installing $TORCH_SPEC (CPU) and sorl-verl[$EXTRAS] into $VENV"
  install_torch
  # the pin again, so that the resolver keeps this torch while it adds torch's and the project's dependencies
  "${PIP[@]}" -e ".[$EXTRAS]" "$TORCH_SPEC"
  printf '%s\n%s\n' "$TORCH_SPEC" "$EXTRAS" >"$stamp"
fi
