#!/usr/bin/env bash
# Create .venv (if missing) and install sorl-verl with its test extras on the CPU build of torch.
#
#   bash scripts/setup_env.sh
#   SORL_VENV=.venv-vllm SORL_EXTRAS=test,cpu-vllm bash scripts/setup_env.sh   # another venv, other extras
#
# SORL_VENV (default .venv) is the venv, SORL_EXTRAS (default test) the extras of sorl-verl installed
# into it; scripts/setup_cpu_vllm.sh uses both.
# Python: $PYTHON_BIN if set, else the first of python3.11, python3.12, python3.10, python3 on PATH
# whose version is 3.10-3.12 (pyproject's requires-python).
# Built once per content: the venv lives in the project's cache, $SORL_HOME or ~/.cache/sorl_verl, as
# venvs/<extras>-<key>, the key a hash of what decides its contents (pyproject.toml, this script and
# setup_cpu_vllm.sh, the torch pin, the extras, the Python version and the platform), and $SORL_VENV is a
# symlink to it. A run with the same key (this checkout again, or another clone) reuses it and only
# reinstalls sorl-verl itself, editable, from this checkout when it points at another one (seconds); any
# change to the key builds a new venv. A build goes into a folder of its own (venvs/<extras>-<key>.build-*),
# the marker .sorl_venv_complete (the key) is written last, and only then is the folder published under
# its key by the atomic rename of a symlink (a venv cannot be moved: its scripts hold their own path).
# A killed build is never used, and the next build of its key removes it. An existing plain directory at
# $SORL_VENV is used as before (an install checked by its stamp); SORL_VENV_CACHE=0 makes one.
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
CACHE=${SORL_HOME:-$HOME/.cache/sorl_verl}/venvs

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

# install_project VENV: torch, then sorl-verl[$EXTRAS] (editable) into the active venv VENV, and its stamp
install_project() {
  echo "[setup] installing $TORCH_SPEC (CPU) and sorl-verl[$EXTRAS] into $1"
  install_torch
  # the pin again, so that the resolver keeps this torch while it adds torch's and the project's dependencies
  "${PIP[@]}" -e ".[$EXTRAS]" "$TORCH_SPEC"
  printf '%s\n%s\n' "$TORCH_SPEC" "$EXTRAS" >"$1/.sorl_installed"
}

# The stamp of a plain venv: line 1 the torch pin, line 2 the extras installed (absent: test; an empty
# stamp, from before the pin was recorded, counts as this pin).
# 0 if the stamp records this torch and every extra asked for
stamp_ok() {
  local stamp=$VENV/.sorl_installed torch_line extras_line
  [ -f "$stamp" ] && [ ! pyproject.toml -nt "$stamp" ] || return 1
  torch_line=$(sed -n 1p "$stamp")
  extras_line=$(sed -n 2p "$stamp")
  [ -z "$torch_line" ] || [ "$torch_line" = "$TORCH_SPEC" ] || return 1
  covers "${extras_line:-test}"
}

# plain_venv: a venv in the folder $VENV itself, installed where its stamp says it is not
plain_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    local python
    python=$(find_python)
    echo "[setup] creating $VENV with $python ($("$python" -V 2>&1))"
    "$python" -m venv "$VENV"
  fi
  python_ok "$VENV/bin/python" || die "$VENV does not run a Python 3.10-3.12 ($("$VENV/bin/python" -V 2>&1 | head -n 1)): remove $VENV and run again (PYTHON_BIN picks the interpreter)"
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  stamp_ok || install_project "$VENV"
}

# venv_key PYTHON EXTRAS: 16 hex digits of the sha256 of what decides the contents of a venv with EXTRAS
venv_key() {
  "$1" - "$TORCH_SPEC" "$2" pyproject.toml scripts/setup_env.sh scripts/setup_cpu_vllm.sh <<'PY'
import hashlib
import platform
import sys
from pathlib import Path

torch_spec, extras, *files = sys.argv[1:]
h = hashlib.sha256()
for part in (torch_spec, extras, sys.version, sys.implementation.cache_tag, platform.system(),
             platform.machine(), " ".join(platform.libc_ver())):
    h.update(part.encode() + b"\0")
for name in files:
    h.update(name.encode() + b"\0" + Path(name).read_bytes() + b"\0")
print(h.hexdigest()[:16])
PY
}

# complete DIR KEY: 0 if DIR is a finished venv of KEY (its marker, written last: the key, then the extras)
complete() {
  [ -x "$1/bin/python" ] && [ "$(sed -n 1p "$1/.sorl_venv_complete" 2>/dev/null)" = "$2" ]
}

# covers EXTRAS_INSTALLED: 0 if every extra of $EXTRAS is among EXTRAS_INSTALLED (comma-separated)
covers() {
  local extra
  for extra in ${EXTRAS//,/ }; do
    case ",$1," in *",$extra,"*) ;; *) return 1 ;; esac
  done
}

# build_venv PYTHON KEY PUBLISHED: build the venv of KEY in a folder of its own, then publish it as PUBLISHED
build_venv() {
  local python=$1 key=$2 published=$3 dir
  if command -v flock >/dev/null 2>&1; then
    # one builder per key: an unpublished folder of this key is then a killed build, removed here
    exec 9>"$published.lock"
    flock 9
    if complete "$published" "$key"; then
      return  # another run built it meanwhile
    fi
    rm -rf "$published".build-*
  fi
  dir=$(mktemp -d "$published.build-XXXXXX")
  chmod 755 "$dir"  # mktemp's 700: the venv is read as any venv is
  echo "[setup] creating $VENV with $python ($("$python" -V 2>&1)) in $dir"
  "$python" -m venv "$dir"
  (
    # shellcheck disable=SC1091
    . "$dir/bin/activate"
    install_project "$dir"
    case ",$EXTRAS," in *,cpu-vllm,*) bash scripts/setup_cpu_vllm.sh --install-into "$dir" ;; esac
  )
  printf '%s\n%s\n' "$key" "$EXTRAS" >"$dir/.sorl_venv_complete"
  ln -sfn "$(basename "$dir")" "$published.new"
  "$python" -c 'import os, sys; os.replace(sys.argv[1], sys.argv[2])' "$published.new" "$published"
}

# cached_venv: $VENV as a symlink to the cached venv of this content (reused, or built once)
cached_venv() {
  local python key published origin here linked
  python=$(find_python)
  key=$(venv_key "$python" "$EXTRAS")
  # a symlink to a finished venv with these extras or more stays (the cache may be under another
  # SORL_HOME; setup_cpu_vllm.sh into .venv links it to the venv with vLLM, which test.sh then keeps)
  linked=$(sed -n 2p "$VENV/.sorl_venv_complete" 2>/dev/null || true)
  if ! { [ -L "$VENV" ] && [ -n "$linked" ] && covers "$linked" && complete "$VENV" "$(venv_key "$python" "$linked")"; }; then
    mkdir -p "$CACHE"
    published=$(cd "$CACHE" && pwd -P)/${EXTRAS//,/+}-$key
    if complete "$published" "$key"; then
      echo "[setup] $VENV -> $published (cached: same pyproject, setup scripts, torch pin, Python and platform)"
    else
      build_venv "$python" "$key" "$published"
    fi
    ln -sfn "$published" "$VENV"
  fi
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  # sorl-verl from this checkout: a venv built for another clone imports that clone's code until reinstalled
  here=$(pwd -P)
  origin=$(cd / && python -I -c 'import importlib.util as u, os; s = u.find_spec("sorl_verl"); print(os.path.realpath(s.origin) if s else "")' 2>/dev/null || true)
  if [ "$origin" != "$here/sorl_verl/__init__.py" ]; then
    echo "[setup] sorl-verl in $VENV from this checkout ($here), editable, without reinstalling its dependencies"
    "${PIP[@]}" --no-deps -e .
  fi
}

if [ "${SORL_VENV_CACHE:-1}" = 0 ] || { [ -d "$VENV" ] && [ ! -L "$VENV" ]; }; then
  plain_venv
else
  cached_venv
fi
