#!/usr/bin/env bash
# The demo: the shipped `shapes` model (trained here on CPU, see scripts/train_tiny.py) draws the prompt with
# 2-rank PipeFusion on the CPU (`xfuse generate` starts both ranks itself: the config's world is 2). Shows the plan
# first; prints where it wrote the PNG.
# Another prompt: bash scripts/demo.sh "a blue triangle at the top on a black background"
# The video model `shapes-video` (scripts/train_video.py), a 13-frame clip (an MP4 with xfuse[video], else a GIF):
#   bash scripts/demo.sh --video ["a blue triangle moving up on a black background"]
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
if [[ "${1:-}" == "--video" ]]; then
  shift
  CONFIG=configs/shapes-video/pp2.yaml
  PROMPT="${1:-a red circle moving to the right on a white background}"
  OUTPUT=outputs/demo.mp4
else
  CONFIG=configs/shapes/pp2.yaml
  PROMPT="${1:-a red circle on the left on a white background}"
  OUTPUT=outputs/demo.png
fi
xfuse plan --config "$CONFIG"
echo
xfuse generate --config "$CONFIG" --prompt "$PROMPT" --output "$OUTPUT"
