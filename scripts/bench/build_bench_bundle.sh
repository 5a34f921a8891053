#!/usr/bin/env bash
# Build the GPU benchmark bundle .gpu/site.tar.xz that scripts/bench/loss_cuda_device.sh and
# scripts/bench/gpu_costs_device.sh unpack first on PYTHONPATH (device command carry ['.gpu']):
#
#   bash scripts/bench/build_bench_bundle.sh [OUT]     # default .gpu/site.tar.xz (git-ignored via .git/info/exclude)
#
# OUT is a cp312 site-packages folder with exactly what the GPU image (python 3.12 with torch, numpy,
# transformers, accelerate, requests, pyyaml, ...) lacks of what the bench scripts import, at the exact versions
# of scripts/bench/bench-bundle-lock.txt (as in .venv's pip freeze), each installed --no-deps:
#   - cp312 manylinux x86-64 (or pure-python) wheels from `pip download --only-binary=:all:`; antlr4-python3-runtime
#     4.9.3 has no wheel on PyPI, so it is built from its sdist with `pip wheel` (pure python);
#   - unzipped into a staging folder, then pruned: ray is import-only (no raylet / gcs_server binaries,
#     libjemalloc, jars, dashboard, rllib, tune, train, serve, data, llm, air, autoscaler, runtime-env agent
#     thirdparty files, includes; ray/dag stays: it is imported at exit); verl's top-level tests/ and scripts/,
#     every <dist>.data/ (dill's and antlr4's console scripts), __pycache__ removed; `strip --strip-debug` on .so;
#   - packed with sorted names, owner 0:0 and one fixed mtime, `xz -9 -T1`, so a rebuild gives the same member list.
# Needs pip access to PyPI, GNU tar, xz and strip. Knobs: PYTHON (default .venv/bin/python, else python3).
# This is not scripts/gpu/build_bundle.sh (the larger main_ppo smoke bundle with full ray).
set -euo pipefail
OUT=${1:-}
case "$OUT" in "" | /*) ;; *) OUT=$PWD/$OUT ;; esac # a relative OUT is relative to the caller's folder
cd "$(dirname "$0")/../.."
ROOT=$PWD
LOCK=$ROOT/scripts/bench/bench-bundle-lock.txt
OUT=${OUT:-$ROOT/.gpu/site.tar.xz}
[ -s "$LOCK" ] || { echo "build_bench_bundle: lock file $LOCK missing or empty" >&2; exit 2; }
mkdir -p "$(dirname "$OUT")"
OUT=$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
for tool in tar xz strip; do
  command -v "$tool" >/dev/null || { echo "build_bench_bundle: $tool not found" >&2; exit 2; }
done
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
PIP=("$PY" -m pip --disable-pip-version-check)

mapfile -t PKGS < <(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$LOCK")
[ "${#PKGS[@]}" -gt 0 ] || { echo "build_bench_bundle: no name==version line in $LOCK" >&2; exit 2; }
WHEEL_PKGS=() SDIST_PKGS=()
for p in "${PKGS[@]}"; do
  case "$p" in
    *==*) ;;
    *) echo "build_bench_bundle: $LOCK: '$p' is not name==version" >&2; exit 2 ;;
  esac
  case "${p%%==*}" in
    antlr4-python3-runtime | antlr4_python3_runtime) SDIST_PKGS+=("$p") ;;
    *) WHEEL_PKGS+=("$p") ;;
  esac
done

echo "[bench-bundle] ${#PKGS[@]} packages from $LOCK (cp312, manylinux x86-64)"
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$T/whl" "${WHEEL_PKGS[@]}"
if [ "${#SDIST_PKGS[@]}" -gt 0 ]; then
  # --no-binary names only these packages: their build dependencies (setuptools) still come as wheels
  names=$(printf '%s\n' "${SDIST_PKGS[@]%%==*}" | paste -sd,)
  "${PIP[@]}" wheel -q --no-deps --no-binary="$names" -w "$T/whl" "${SDIST_PKGS[@]}"
fi
n_whl=$(find "$T/whl" -name '*.whl' | wc -l)
if [ "$n_whl" -ne "${#PKGS[@]}" ]; then
  echo "build_bench_bundle: $n_whl wheels for ${#PKGS[@]} locked packages" >&2
  ls "$T/whl" >&2
  exit 2
fi

echo "[bench-bundle] unpacking $n_whl wheels"
"$PY" - "$T/whl" "$T/site" <<'PY'
"""Unzip every wheel into one folder, keeping the archived unix mode bits (zipfile drops them)."""
import pathlib
import sys
import zipfile

src, dst = map(pathlib.Path, sys.argv[1:])
for wheel in sorted(src.glob("*.whl")):
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            path = pathlib.Path(zf.extract(info, dst))
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                path.chmod(mode | 0o644)
PY

S=$T/site
for d in core/src/ray/gcs/gcs_server core/src/ray/raylet/raylet core/libjemalloc.so jars dashboard \
  _private/runtime_env/agent/thirdparty_files rllib tune train serve data llm air autoscaler includes; do
  rm -rf "${S:?}/ray/$d"
done
rm -rf "$S/tests" "$S/scripts" "$S/bin"
find "$S" -maxdepth 1 -name '*.data' -type d -exec rm -rf {} +
find "$S" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$S" -name '*.so' -type f -exec strip --strip-debug {} +
[ -f "$S/ray/dag/__init__.py" ] || { echo "build_bench_bundle: ray/dag missing after pruning" >&2; exit 2; }

echo "[bench-bundle] packing $OUT (xz -9 -T1)"
(cd "$S" && tar --sort=name --owner=0 --group=0 --numeric-owner --mtime='2020-02-02 00:00Z' \
  --format=gnu -cf - .) | xz -9 -T1 >"$OUT.tmp"
mv "$OUT.tmp" "$OUT"
echo "[bench-bundle] $OUT: $(stat -c %s "$OUT") bytes ($(du -h "$OUT" | cut -f1)), $(tar -tJf "$OUT" | wc -l) members"
