"""Text-to-video with Wan 2.1 / 2.2 and PipeFusion on N GPUs (or CPU processes); image-to-video with Wan 2.2 TI2V.

Launch the same script on every rank:

    torchrun --nproc_per_node=4 examples/wan_pipefusion.py \
        --model ./Wan2.1-T2V-1.3B-Diffusers --prompt "A cat walks on the grass, realistic" --output cat.mp4

    # CPU, built-in tiny random-weight model (no download), 2 ranks:
    torchrun --nproc_per_node=2 examples/wan_pipefusion.py --model wan-tiny --steps 4 --height 64 --width 96 \
        --frames 9 --output tiny.mp4

    # Image-to-video (Wan 2.2 TI2V-5B: the same folder, 1280 x 704 px, 121 frames at 24 fps):
    torchrun --nproc_per_node=4 examples/wan_pipefusion.py --model ./Wan2.2-TI2V-5B-Diffusers --image first.png \
        --height 704 --width 1280 --frames 121 --fps 24 --output fox.mp4

`--model` is a local diffusers Wan folder (`WanPipeline`) or a `wan-*` preset. A patch is a run of latent frames
(`--patches temporal`, the default) or a strip of rows across every frame (`spatial`). Rank 0 writes the clip with
diffusers' `export_to_video` (MP4 through imageio-ffmpeg: `pip install -e ".[video]"`); the other ranks return None
from the pipeline.
"""

import argparse
import os

import torch
from diffusers.utils import export_to_video
from PIL import Image

from xfuse import PipeFusionWanImageToVideoPipeline, PipeFusionWanPipeline
from xfuse.families.registry import PRESET_MODELS, load_pipeline


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="wan-tiny")
    parser.add_argument("--prompt", default="A cat walks on the grass, realistic")
    parser.add_argument("--negative-prompt", default="blurry, static")
    parser.add_argument("--output", default="wan_pipefusion.mp4")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--frames", type=int, default=81, help="4k + 1 (Wan's VAE)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--patches", default="temporal", choices=("temporal", "spatial"))
    parser.add_argument("--num-patches", type=int, default=None, help="default: one per pipeline rank")
    parser.add_argument("--cfg-degree", type=int, default=1, choices=(1, 2))
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", help="image-to-video from this first frame (a Wan 2.2 TI2V model)")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = dict(
        pipefusion_degree=world // args.cfg_degree,
        cfg_degree=args.cfg_degree,
        num_patches=args.num_patches,
        video_patches=args.patches,
    )
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    # One transformer serves both tasks of Wan 2.2 TI2V: the class (and diffusers' pipeline) says which.
    pipeline_class = PipeFusionWanPipeline if args.image is None else PipeFusionWanImageToVideoPipeline
    if args.model in PRESET_MODELS:
        diffusers_pipe = load_pipeline(args.model, dtype, pipeline_class.diffusers_name())
        pipe = pipeline_class.from_pipe(diffusers_pipe, parallel=parallel)
    else:
        pipe = pipeline_class.from_pretrained(args.model, parallel=parallel, torch_dtype=dtype)
    first_frame = {} if args.image is None else {"image": Image.open(args.image).convert("RGB")}
    out = pipe(
        **first_frame,
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        height=args.height,
        width=args.width,
        num_frames=args.frames,
        num_inference_steps=args.steps,
        generator=torch.Generator().manual_seed(args.seed),
    )
    if out is not None:  # global rank 0
        frames = out.frames[0]  # (frames, H, W, 3) floats in [0, 1]
        # ffmpeg started with no Python run between fork and exec: this process has threads (see xfuse.cli.write_clip)
        os.environ.setdefault("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", "1")
        export_to_video(list(frames), args.output, fps=args.fps)
        print(f"wrote {args.output}: {len(frames)} frames at {args.fps} fps ({args.patches} patches)")


if __name__ == "__main__":
    main()
