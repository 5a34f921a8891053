#!/usr/bin/env bash
# Runs scripts/bench/loss_cuda.py on a lent GPU machine, from the repository root, with the tree and
# .gpu/ carried over (device command: `bash scripts/bench/loss_cuda_device.sh`, carry ['.gpu']).
#
# That machine has python3 3.12 with torch, numpy, transformers (and requests, pyyaml, packaging, attrs,
# click, msgpack, protobuf, ...) but not verl or what importing it needs. .gpu/site.tar.xz (git-ignored
# through .git/info/exclude, ~11 MB) is a cp312 site-packages dir with exactly what is missing, versions as
# in .venv: verl 0.9.1, ray 2.60.0 (import only: raylet/gcs binaries, jars, dashboard client, rllib, tune,
# train, serve, data, llm, air, autoscaler, runtime-env agent removed), tensordict 0.10.0, pyvers 0.1.0,
# omegaconf 2.3.1, antlr4-python3-runtime 4.9.3, codetiming 1.4.0, nvtx 0.2.17, orjson 3.13.0,
# jsonschema 4.26.0, jsonschema-specifications 2025.9.1, referencing 0.37.0, rpds-py 2026.9.1.
# Rebuild it: `bash scripts/bench/build_bench_bundle.sh` (versions: scripts/bench/bench-bundle-lock.txt).
set -euo pipefail
OUT=${OUT:-/tmp/loss_cuda_out}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT" "$SITE"
tar -xJf .gpu/site.tar.xz -C "$SITE"
export PYTHONPATH="$SITE:$PWD"
export VERL_USE_EXTERNAL_PLUGINS=none  # sorl_verl is not pip-installed here; the script calls its functions
export PYTHONUNBUFFERED=1
nvidia-smi -L || true
python3 - <<'PY' || true
import importlib.metadata as md
for name in ("torch", "numpy", "transformers", "packaging", "pyyaml", "requests", "attrs", "click", "msgpack",
             "protobuf", "filelock", "jsonschema", "pydantic", "pillow", "datasets", "scikit-learn"):
    try:
        print(f"{name}=={md.version(name)}", end="  ")
    except md.PackageNotFoundError:
        print(f"{name}: absent", end="  ")
print()
PY
python3 -c 'import sorl_verl.algorithms.losses, sorl_verl.algorithms.advantages, sorl_verl.algorithms.optim' 2>&1 | tail -20
python3 scripts/bench/loss_cuda.py --device cuda --json-out "$OUT/loss_cuda_results.json" "$@" 2>&1 | tee "$OUT/loss_cuda.log"
