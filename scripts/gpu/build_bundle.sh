#!/usr/bin/env bash
# Build the offline bundle of the GPU smoke (scripts/gpu/run_gpu_smoke.sh) for a GPU machine without network:
#
#   bash scripts/gpu/build_bundle.sh [DIR]     # default $SORL_HOME/gpu-bundle; on the GPU machine: bash DIR/run_gpu_smoke.sh
#
# DIR/site.tar.xz       cp312 manylinux x86-64 wheels of scripts/gpu/bundle-lock.txt (exact versions, --no-deps:
#                       the GPU image supplies torch and the rest), plus a sorl_verl dist-info declaring the
#                       verl.plugins entry point, pruned (ray's jars/rllib/tune/train/serve/data/llm/air/web UI,
#                       tests, __pycache__); put first on PYTHONPATH by the smoke
# DIR/project.tar.xz    git archive HEAD sorl_verl recipe scripts pyproject.toml README.md
# DIR/embedded.tar.xz   $SORL_HOME/embedded-early-stop-50 (built here first if missing)
# DIR/run_gpu_smoke.sh, smoke_verdict.py, SHA256SUMS, MANIFEST.txt
# Knobs: PY_TARGET (3.12), PLATFORM_TAG (manylinux_2_28_x86_64). Needs pip access to PyPI and the project's venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export SORL_HOME=${SORL_HOME:-$ROOT/.sorl_cache}
DIR=${1:-$SORL_HOME/gpu-bundle}
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
PY_TARGET=${PY_TARGET:-3.12}
PLATFORM_TAG=${PLATFORM_TAG:-manylinux_2_28_x86_64}
PY=${PYTHON:-$ROOT/.venv/bin/python}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

echo "[bundle] site-packages for python $PY_TARGET ($PLATFORM_TAG) from scripts/gpu/bundle-lock.txt"
"$PY" -m pip install -q --disable-pip-version-check --target "$T/site" --no-deps --prefer-binary \
  --python-version "$PY_TARGET" --platform "$PLATFORM_TAG" --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -r scripts/gpu/bundle-lock.txt
VERSION=$("$PY" -c "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))['project']['version'])")
INFO=$T/site/sorl_verl-$VERSION.dist-info
mkdir -p "$INFO"
printf 'Metadata-Version: 2.1\nName: sorl-verl\nVersion: %s\n' "$VERSION" >"$INFO/METADATA"
printf '[verl.plugins]\nsorl_verl = sorl_verl.plugin\n' >"$INFO/entry_points.txt"
: >"$INFO/RECORD"
for d in _private/runtime_env/agent/thirdparty_files jars rllib tune train serve data llm air dashboard/client; do
  rm -rf "$T/site/ray/$d"
done
rm -rf "$T/site/verl/tests" "$T/site/bin"
find "$T/site" -name __pycache__ -type d -prune -exec rm -rf {} +
tar -C "$T/site" -cJf "$DIR/site.tar.xz" .

echo "[bundle] project archive of HEAD $(git rev-parse --short HEAD)"
git archive HEAD sorl_verl recipe scripts pyproject.toml README.md | xz -T0 >"$DIR/project.tar.xz"

echo "[bundle] embedded default (early-stop-50) under $SORL_HOME"
"$PY" -m sorl_verl.embedded.demo_paths qa --warmstart early-stop-50 >/dev/null
tar -C "$SORL_HOME" -cJf "$DIR/embedded.tar.xz" embedded-early-stop-50

cp scripts/gpu/run_gpu_smoke.sh scripts/gpu/smoke_verdict.py "$DIR/"
{
  echo "GPU smoke bundle built $(date -u +%FT%TZ) from commit $(git rev-parse HEAD)"
  echo "python $PY_TARGET, $PLATFORM_TAG; site-packages (--no-deps) from scripts/gpu/bundle-lock.txt:"
  grep -v '^#' scripts/gpu/bundle-lock.txt | sed 's/^/  /'
  du -h "$DIR"/*.tar.xz | sed 's/^/  /'
} >"$DIR/MANIFEST.txt"
(cd "$DIR" && sha256sum site.tar.xz project.tar.xz embedded.tar.xz >SHA256SUMS)
echo "[bundle] $DIR: $(du -sh "$DIR" | cut -f1); run there: bash $DIR/run_gpu_smoke.sh"
