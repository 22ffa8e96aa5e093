"""Text-to-image with FLUX.1 and PipeFusion on N GPUs (or CPU processes).

Launch the same script on every rank:

    torchrun --nproc_per_node=4 examples/flux_pipefusion.py \
        --model ./FLUX.1-dev --prompt "A small cactus with a happy face" --output cactus.png

    # CPU, built-in tiny random-weight model (no download), 2 ranks:
    torchrun --nproc_per_node=2 examples/flux_pipefusion.py --model flux-tiny --steps 4 --output tiny.png

    # True CFG with a negative prompt: the transformer batch becomes [negative, positive] (2 forward passes'
    # worth of work per step), which --cfg-degree 2 can split over two pipelines (4 ranks: 2 x 2).
    torchrun --nproc_per_node=4 examples/flux_pipefusion.py --model flux-tiny --steps 4 \
        --true-cfg 4.0 --negative-prompt "blurry, low quality" --cfg-degree 2 --output tiny_cfg.png

`--model` is a local diffusers FLUX.1 folder (FLUX.1-dev or -schnell) or a preset (flux-tiny, flux-small, or the
released shapes with random weights: flux-dev, flux-schnell). FLUX.1-dev's `--guidance-scale` (3.5) is embedded in
the model, not classifier-free guidance: the transformer batch stays 1. FluxPipeline defaults to 1024 px, which is
too large for a CPU demo, so the tiny presets default to 128x96 here. Use bfloat16 on GPUs, never float16 (FLUX's
activations overflow it). Rank 0 encodes the prompt (CLIP-L, T5), decodes and writes the PNG; the other ranks hold
only their blocks and return None from the pipeline.
"""

import argparse
import os

import torch

from xfuse.families.flux.pipeline import PipeFusionFluxPipeline
from xfuse.families.flux.presets import DEFAULT_SIZE
from xfuse.families.registry import PRESET_MODELS, load_pipeline

# The test-sized presets get a small image (a CPU demo); a folder or a released-shape preset gets 1024 px.
DEMO_SIZE = (128, 96)  # width, height: multiples of 16 px (VAE factor 8 x 2x2 packing)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="flux-tiny")
    parser.add_argument("--prompt", default="A small cactus with a happy face in the Sahara desert")
    parser.add_argument("--output", default="flux_pipefusion.png")
    parser.add_argument("--steps", type=int, default=28, help="FLUX.1-dev: 28; FLUX.1-schnell: 4")
    parser.add_argument(
        "--guidance-scale", type=float, default=3.5, help="FLUX.1-dev's embedded guidance (ignored by schnell)"
    )
    parser.add_argument(
        "--true-cfg", type=float, default=1.0, help="true CFG scale; > 1 with --negative-prompt doubles the batch"
    )
    parser.add_argument("--negative-prompt", default=None, help="used only with --true-cfg > 1")
    parser.add_argument("--width", type=int, default=None, help="default: 128 for tiny presets, else 1024")
    parser.add_argument("--height", type=int, default=None, help="default: 96 for tiny presets, else 1024")
    parser.add_argument("--num-patches", type=int, default=None, help="default: one per pipeline rank")
    parser.add_argument("--cfg-degree", type=int, default=1, choices=(1, 2), help="2 needs true CFG")
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
        pipe = PipeFusionFluxPipeline.from_pipe(load_pipeline(args.model, dtype), parallel=parallel)
    else:
        pipe = PipeFusionFluxPipeline.from_pretrained(args.model, parallel=parallel, torch_dtype=dtype)
    out = pipe(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        true_cfg_scale=args.true_cfg,
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
