#!/usr/bin/env bash
# The test suite, from a clean clone: sets up .venv (or uses the active environment) and runs pytest.
#   bash scripts/test.sh           every tier: tests/unit, multirank, launch, netns (what .ci/run runs)
#   bash scripts/test.sh --fast    the unit tier only: pure tests, no process group, about a minute
# Other arguments go to pytest (e.g. bash scripts/test.sh --fast -k config -x; XFUSE_TEST_WORKERS=0 or -n 0 runs
# every module in this one process).
# Test modules run in XFUSE_TEST_WORKERS parallel processes (pytest-xdist; default 2, the cores of this project's
# machines), each module whole on one worker: its world and fixtures start once, its tests run in order.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- tests/unit "$@"
fi
python -m pytest -n "${XFUSE_TEST_WORKERS:-2}" --dist loadfile "$@"
