#!/usr/bin/env bash
# The project's test command: set up .venv, lint, then run the whole pytest suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/unit -x`).
# Generated data (embedded defaults) goes to the project's one cache, $SORL_HOME or ~/.cache/sorl_verl,
# shared with scripts/demo.sh and the sorl-verl commands.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check sorl_verl scripts tests
python -m pytest "$@"
