"""A diffusers HunyuanDiT script made parallel by changing two lines (marked "xfuse").

    torchrun --nproc_per_node=2 examples/from_diffusers.py ./HunyuanDiT-v1.2-Diffusers
    torchrun --nproc_per_node=2 examples/from_diffusers.py tiny      # built-in tiny model, CPU

The diffusers original:

    pipe = HunyuanDiTPipeline.from_pretrained(path, torch_dtype=torch.float16).to("cuda")
    image = pipe(prompt="一个宇航员在骑马", generator=torch.Generator().manual_seed(0)).images[0]
    image.save("astronaut.png")
"""

import os
import sys

import torch

from xfuse import PipeFusionHunyuanDiTPipeline  # xfuse (1/2)
from xfuse.families.registry import PRESET_MODELS

path = sys.argv[1] if len(sys.argv) > 1 else "tiny"
dtype = torch.float16 if torch.cuda.is_available() else torch.float32
parallel = {"pipefusion_degree": int(os.environ.get("WORLD_SIZE", "1"))}

if path in PRESET_MODELS:  # the built-in model is built in memory instead of loaded from a folder
    from xfuse.families.registry import load_pipeline

    pipe = PipeFusionHunyuanDiTPipeline.from_pipe(load_pipeline(path, dtype), parallel=parallel)
else:
    pipe = PipeFusionHunyuanDiTPipeline.from_pretrained(path, torch_dtype=dtype, parallel=parallel)  # xfuse (2/2)

size = {} if path not in PRESET_MODELS else {"height": 256, "width": 256, "use_resolution_binning": False}
out = pipe(prompt="一个宇航员在骑马", num_inference_steps=20, generator=torch.Generator().manual_seed(0), **size)
if out is not None:  # rank 0 holds the images; the other ranks get None
    out.images[0].save("astronaut.png")
    print("wrote astronaut.png")
