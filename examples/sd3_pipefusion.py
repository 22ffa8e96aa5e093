"""Text-to-image with Stable Diffusion 3 / 3.5 and PipeFusion on N GPUs (or CPU processes).

Launch the same script on every rank:

    torchrun --nproc_per_node=4 examples/sd3_pipefusion.py \
        --model ./stable-diffusion-3-medium-diffusers --prompt "A small cactus with a happy face" --output cactus.png

    # CPU, built-in tiny random-weight model (no download), 2 ranks:
    torchrun --nproc_per_node=2 examples/sd3_pipefusion.py --model sd3-tiny --steps 4 --output tiny.png

`--model` is a local diffusers SD3 / SD3.5 folder or a preset (sd3-tiny, sd35-tiny, sd3-small, or the released
shapes with random weights: sd3-medium, sd3.5-medium, sd3.5-large). The placement defaults to the family's (linear:
an MMDiT has no long skips). Rank 0 encodes the prompt (CLIP-L, CLIP-G, T5), decodes and writes the PNG; the other
ranks hold only their blocks and return None from the pipeline.
"""

import argparse
import os

import torch

from xfuse.families.registry import PRESET_MODELS, load_pipeline
from xfuse.families.sd3.pipeline import PipeFusionStableDiffusion3Pipeline
from xfuse.families.sd3.presets import DEFAULT_SIZE

# The test-sized presets get a small image (a CPU demo); a folder or a released-shape preset gets 1024 px.
DEMO_SIZE = (128, 96)  # width, height: multiples of 16 px (VAE factor 8 x patch size 2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sd3-tiny")
    parser.add_argument("--prompt", default="A small cactus with a happy face in the Sahara desert")
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--output", default="sd3_pipefusion.png")
    parser.add_argument("--steps", type=int, default=28, help="StableDiffusion3Pipeline's default: 28")
    parser.add_argument("--guidance-scale", type=float, default=7.0, help="CFG; > 1 batches [uncond, cond]")
    parser.add_argument("--width", type=int, default=None, help="default: 128 for tiny presets, else 1024")
    parser.add_argument("--height", type=int, default=None, help="default: 96 for tiny presets, else 1024")
    parser.add_argument("--num-patches", type=int, default=None, help="default: one per pipeline rank")
    parser.add_argument("--cfg-degree", type=int, default=1, choices=(1, 2))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    small = DEFAULT_SIZE.get(args.model, 1024) < 1024
    width = args.width or (DEMO_SIZE[0] if small else 1024)
    height = args.height or (DEMO_SIZE[1] if small else 1024)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = dict(
        pipefusion_degree=world // args.cfg_degree, cfg_degree=args.cfg_degree, num_patches=args.num_patches
    )
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if args.model in PRESET_MODELS:
        pipe = PipeFusionStableDiffusion3Pipeline.from_pipe(load_pipeline(args.model, dtype), parallel=parallel)
    else:
        pipe = PipeFusionStableDiffusion3Pipeline.from_pretrained(args.model, parallel=parallel, torch_dtype=dtype)
    out = pipe(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        height=height,
        width=width,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale,
        generator=torch.Generator().manual_seed(args.seed),
    )
    if out is not None:  # global rank 0
        out.images[0].save(args.output)
        print(
            f"wrote {args.output} ({width}x{height} px, {pipe.plan.placement} placement, "
            f"{pipe.parallel.resolved_num_patches} patches)"
        )


if __name__ == "__main__":
    main()
