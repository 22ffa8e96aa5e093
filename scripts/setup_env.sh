# Sourced by demo.sh and test.sh: use the active virtual environment, or create/reuse .venv, and install xfuse.
# torch==2.13.0 goes first: it is the CPU build this project's machines have locally; installing the package
# first would let pip pull the newest torch with several GB of CUDA packages.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
stamp="$VIRTUAL_ENV/.xfuse-install-$(cat pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python -c "import torch" 2>/dev/null || pip install --quiet "torch==2.13.0"
  pip install --quiet -e ".[test]"
  touch "$stamp"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
