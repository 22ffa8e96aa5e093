"""Text-to-image with HunyuanDiT and PipeFusion on N GPUs (or CPU processes).

Launch the same script on every rank:

    torchrun --nproc_per_node=4 examples/hunyuandit_pipefusion.py \
        --model ./HunyuanDiT-v1.2-Diffusers --prompt "一只可爱的猫" --output cat.png

    # CPU, built-in tiny random-weight model (no download), 2 ranks:
    torchrun --nproc_per_node=2 examples/hunyuandit_pipefusion.py --model tiny --output tiny.png

`--model` is a local diffusers folder (HunyuanDiT-v1.2-Diffusers layout) or a built-in preset (tiny, small).
Rank 0 writes the PNG; the other ranks return None from the pipeline.
"""

import argparse
import os

import torch
import torch.distributed as dist

from xfuse import PipeFusionHunyuanDiTPipeline
from xfuse.families.registry import PRESET_MODELS


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt", default="一只可爱的猫")
    parser.add_argument("--output", default="hunyuandit_pipefusion.png")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--size", type=int, default=None, help="height = width in pixels (default: the model's)")
    parser.add_argument("--num-patches", type=int, default=None, help="default: one per pipeline rank")
    parser.add_argument("--warmup-steps", type=int, default=1)
    parser.add_argument("--cfg-degree", type=int, default=1, choices=(1, 2))
    parser.add_argument("--placement", default="folded", choices=("balanced", "folded", "linear"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = dict(
        pipefusion_degree=world // args.cfg_degree,
        cfg_degree=args.cfg_degree,
        num_patches=args.num_patches,
        warmup_steps=args.warmup_steps,
        placement=args.placement,
    )
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if args.model in PRESET_MODELS:
        from xfuse.families.registry import load_pipeline

        pipe = PipeFusionHunyuanDiTPipeline.from_pipe(load_pipeline(args.model, dtype), parallel=parallel)
    else:
        pipe = PipeFusionHunyuanDiTPipeline.from_pretrained(args.model, parallel=parallel, torch_dtype=dtype)

    out = pipe(
        prompt=args.prompt,
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        generator=torch.Generator().manual_seed(args.seed),
        use_resolution_binning=args.model not in PRESET_MODELS,
    )
    if out is not None:  # global rank 0
        out.images[0].save(args.output)
        print(f"wrote {args.output}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
