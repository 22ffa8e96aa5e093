#!/usr/bin/env bash
# Wheels the lent GPU machine lacks, into .whl/ (git-ignored), for benchmarks/gpu_suite.py's device call.
# That machine's python3 (3.12) has torch, transformers, accelerate, safetensors, PyYAML, tqdm and Pillow, and no
# network; diffusers is the one dependency it misses. The version is the one installed here, so the GPU runs the
# diffusers the tests ran against. Its own needs (huggingface-hub, numpy, regex, requests, filelock) are there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/setup_env.sh
version="$(python -c 'import diffusers; print(diffusers.__version__)')"
rm -rf .whl
python -m pip download --quiet --no-deps --only-binary=:all: -d .whl "diffusers==$version"
ls .whl
