#!/usr/bin/env bash
# Wheels the lent GPU machine lacks, into .whl/ (git-ignored), for benchmarks/gpu_suite.py's device call.
# That machine's python3 (3.12, x86-64) has torch, transformers, accelerate, safetensors, PyYAML, tqdm, Pillow and
# typing-extensions, and no network; it misses diffusers and pydantic (with pydantic-core, annotated-types and
# typing-inspection). The versions are the ones installed here, so the GPU runs what the tests ran against. diffusers'
# own needs (huggingface-hub, numpy, regex, requests, filelock) are there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl
python -m pip download --quiet --no-deps --only-binary=:all: -d .whl \
  "diffusers==$(version diffusers)" "pydantic==$(version pydantic)" \
  "annotated-types==$(version annotated-types)" "typing-inspection==$(version typing-inspection)"
# pydantic-core is compiled: the device's CPython 3.12 on x86-64
python -m pip download --quiet --no-deps --only-binary=:all: -d .whl --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  "pydantic-core==$(version pydantic-core)"
ls .whl
