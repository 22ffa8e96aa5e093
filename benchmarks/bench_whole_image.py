"""What stays serial at high resolution besides the decode: the pipeline's steps that handle a whole image on one rank
or send it to every rank, timed alone at 1024, 2048 and 4096 px (issue 30: "nothing else serial grows with the image").

    python benchmarks/bench_whole_image.py [--sizes 1024 2048 4096] [--repeats 3] [--json out]

Per size, median (min–max) of ``--repeats`` runs, each step as xfuse runs it:

* ``prepare latents``: diffusers' own ``prepare_latents`` (a ``randn`` of the latent, SD3's 16 channels) on a rank;
* ``broadcast latents``: rank 0's latents to the other rank of a 2-rank gloo world, as the pipeline's
  ``_shared_latents`` sends them (``broadcast_object_list`` on the control group);
* ``postprocess``: diffusers' ``VaeImageProcessor.postprocess(output_type="pil")`` of the decoded (1, 3, H, W) image on
  rank 0 (denormalise, to NHWC numpy, to uint8, to PIL);
* ``png``: PIL's PNG encoding of that image (what ``xfuse generate`` writes; the server's response too), for the
  decoded image of random latents (noise: the slowest to compress) and for a smooth gradient.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LATENT_CHANNELS = 16  # SD3 / FLUX (HunyuanDiT and PixArt-Σ have 4)


def _median(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def _timed(fn, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return _median(times)


def broadcast_rank(size: int, repeats: int) -> dict | None:
    """Rank function: rank 0's (1, 16, h, w) latents to the other rank, as ``_shared_latents`` sends them."""
    import torch
    import torch.distributed as dist

    latent = size // 8
    times = []
    for _ in range(repeats):
        dist.barrier()
        payload = [torch.randn(1, LATENT_CHANNELS, latent, latent) if dist.get_rank() == 0 else None]
        start = time.perf_counter()
        dist.broadcast_object_list(payload, src=0)
        times.append(time.perf_counter() - start)
    return _median(times) if dist.get_rank() == 1 else None


def serial_parts(size: int, repeats: int) -> dict:
    import torch
    from diffusers import StableDiffusion3Pipeline
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    prepare = StableDiffusion3Pipeline.prepare_latents  # uses no pipeline state but vae_scale_factor
    holder = type("Holder", (), {"vae_scale_factor": 8})()
    rows = {
        "prepare latents": _timed(
            lambda: prepare(holder, 1, LATENT_CHANNELS, size, size, torch.float32, "cpu", generator), repeats
        )
    }
    processor = VaeImageProcessor(vae_scale_factor=8)
    image = torch.randn(1, 3, size, size, generator=generator).clamp(-1, 1)
    rows["postprocess"] = _timed(lambda: processor.postprocess(image, output_type="pil"), repeats)
    noise = processor.postprocess(image, output_type="pil")[0]
    ramp = torch.linspace(0, 255, size).to(torch.uint8)
    smooth = Image.fromarray(ramp[None, :, None].expand(size, size, 3).contiguous().numpy())
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "image.png")
        rows["png (noise)"] = _timed(lambda: noise.save(path), repeats)
        rows["png (smooth)"] = _timed(lambda: smooth.save(path), repeats)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/whole_image.json")
    args = parser.parse_args()
    from tests.support.world import World  # a real 2-rank gloo world (the benchmarks reuse the tests' launcher)

    results = {}
    with World(2) as world:
        for size in args.sizes:
            rows = serial_parts(size, args.repeats)
            rows["broadcast latents"] = world.run_ok(broadcast_rank, size, args.repeats, timeout=600)[1]
            results[size] = rows
            for name, row in rows.items():
                print(f"{size} px  {name:18s} {row['median_s'] * 1000:9.1f} ms "
                      f"({row['min_s'] * 1000:.1f}-{row['max_s'] * 1000:.1f})")  # fmt: skip
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or "cpu"}
    with open(args.json, "w") as f:
        json.dump({**meta, "repeats": args.repeats, "sizes": results}, f, indent=1)
    print(f"written: {args.json}")


if __name__ == "__main__":
    main()
