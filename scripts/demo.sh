#!/usr/bin/env bash
# The main job on the built-in tiny model: show the 2-rank folded plan, then generate an image with it.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
CONFIG=configs/tiny/pp2.yaml
xfuse plan --config "$CONFIG"
echo
xfuse generate --config "$CONFIG" --output outputs/demo.png
