"""Text-to-image with PixArt-Σ and PipeFusion on N GPUs (or CPU processes).

Launch the same script on every rank:

    torchrun --nproc_per_node=4 examples/pixart_pipefusion.py \
        --model ./PixArt-Sigma-XL-2-1024-MS --prompt "A small cactus with a happy face" --output cactus.png

    # CPU, built-in tiny random-weight model (no download), 2 ranks:
    torchrun --nproc_per_node=2 examples/pixart_pipefusion.py --model pixart-tiny --steps 4 --output tiny.png

`--model` is a local diffusers PixArt-Σ folder or the `pixart-tiny` preset. The placement defaults to the family's
(linear: PixArt has no long skips). Rank 0 writes the PNG; the other ranks return None from the pipeline.
"""

import argparse
import os

import torch

from xfuse import PipeFusionPixArtSigmaPipeline
from xfuse.families.registry import PRESET_MODELS, load_pipeline


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="pixart-tiny")
    parser.add_argument("--prompt", default="A small cactus with a happy face in the Sahara desert")
    parser.add_argument("--output", default="pixart_pipefusion.png")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--num-patches", type=int, default=None, help="default: one per pipeline rank")
    parser.add_argument("--cfg-degree", type=int, default=1, choices=(1, 2))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = dict(
        pipefusion_degree=world // args.cfg_degree, cfg_degree=args.cfg_degree, num_patches=args.num_patches
    )
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if args.model in PRESET_MODELS:
        pipe = PipeFusionPixArtSigmaPipeline.from_pipe(load_pipeline(args.model, dtype), parallel=parallel)
    else:
        pipe = PipeFusionPixArtSigmaPipeline.from_pretrained(args.model, parallel=parallel, torch_dtype=dtype)
    out = pipe(
        prompt=args.prompt,
        num_inference_steps=args.steps,
        generator=torch.Generator().manual_seed(args.seed),
        clean_caption=False,  # needs beautifulsoup4 and ftfy, which xfuse does not install
    )
    if out is not None:  # global rank 0
        out.images[0].save(args.output)
        print(f"wrote {args.output} ({pipe.plan.placement} placement, {pipe.parallel.resolved_num_patches} patches)")


if __name__ == "__main__":
    main()
