#!/usr/bin/env bash
# The test suite, from a clean clone: sets up .venv (or uses the active environment) and runs pytest.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
python -m pytest "$@"
