#!/usr/bin/env bash
# The test suite, from a clean clone: sets up .venv (or uses the active environment) and runs pytest.
#   bash scripts/test.sh           every tier: tests/unit, multirank, launch, netns (what .ci/run runs)
#   bash scripts/test.sh --fast    the unit tier only: pure tests, no process group, about a minute
# Other arguments go to pytest (e.g. bash scripts/test.sh --fast -k config -x).
# XFUSE_TEST_WORKERS parallel test processes (pytest-xdist, --dist loadfile: each module whole on one worker, its
# world and fixtures started once): 2 by default; 0 runs every module in this one process.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
workers="${XFUSE_TEST_WORKERS:-2}"
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- tests/unit "$@"
fi
python -m pytest -n "$workers" --dist loadfile "$@"
