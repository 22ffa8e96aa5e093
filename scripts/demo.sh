#!/usr/bin/env bash
# The main job on the built-in tiny model (CPU): show the plan, then a 2-rank PipeFusion generation under torchrun.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
CONFIG=configs/tiny/pp2.yaml
xfuse plan --config "$CONFIG"
echo
torchrun --standalone --nproc_per_node=2 -m xfuse generate --config "$CONFIG" --output outputs/demo.png
