"""PipeFusion on CPU for the MMDiT families: degree-2 speedup of SD3 and FLUX on their ``small`` presets.

    python benchmarks/bench_mmdit.py [--steps 8] [--repeats 3] [--size 256] [--json out.json]

Each run is one call of the xfuse pipeline class (``output_type="latent"``: text encoding and the loop, no VAE), at
degree 1 and at degree 2 (linear, M = 2, warm-up 1), one torch thread per rank, in its own world of real gloo
processes; the first call is included (nothing is warmed up before). ``sd3-small`` runs with CFG (guidance 7,
batch 2), ``flux-small`` with its embedded guidance (batch 1). The ideal degree-2 speedup is
``bench_pipefusion.ideal_speedup`` (SD3's warm-up step runs in two batch parts, FLUX's whole).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRESETS = {"sd3-small": {"guidance_scale": 7.0}, "flux-small": {"guidance_scale": 3.5}}
MODEL_BATCH = {"sd3-small": 2, "flux-small": 1}  # transformer batch: SD3's CFG [uncond, cond]; FLUX embeds guidance


def bench_rank(preset, degree, steps, size, repeats):
    """On every rank: build the preset (deterministic), time ``repeats`` calls; rank 0 returns the wall times."""
    import torch

    from xfuse.families.registry import load_pipeline, model_spec

    torch.set_num_threads(1)
    parallel = {"pipefusion_degree": degree, "num_patches": 2, "warmup_steps": 1, "placement": "linear"}
    pipe = model_spec(preset).pipeline_class().from_pipe(load_pipeline(preset), parallel=parallel)
    pipe.set_progress_bar_config(disable=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pipe(
            prompt="a red house by a lake",
            height=size,
            width=size,
            num_inference_steps=steps,
            max_sequence_length=16,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
            **PRESETS[preset],
        )
        times.append(time.perf_counter() - start)
    return times


def main():
    from benchmarks.bench_pipefusion import ideal_speedup
    from tests.support.world import World

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = {"steps": args.steps, "size": args.size, "presets": {}}
    for preset in PRESETS:
        ideal = ideal_speedup(args.steps, 2, MODEL_BATCH[preset])
        seconds = {}
        for degree in (1, 2):
            with World(degree, start_timeout=240) as world:
                seconds[degree] = world.run_ok(bench_rank, preset, degree, args.steps, args.size, args.repeats,
                                               timeout=3600)[0]  # fmt: skip
        speedups = [one / two for one, two in zip(seconds[1], seconds[2], strict=True)]
        report["presets"][preset] = {
            "degree1_s": seconds[1],
            "degree2_s": seconds[2],
            "speedup_median": round(statistics.median(speedups), 3),
            "speedup_min": round(min(speedups), 3),
            "speedup_max": round(max(speedups), 3),
            "ideal_speedup": round(ideal, 3),
        }
        print(f"{preset}: degree 1 {statistics.median(seconds[1]):.2f} s, degree 2 {statistics.median(seconds[2]):.2f}"
              f" s, speedup {statistics.median(speedups):.2f}x ({min(speedups):.2f}-{max(speedups):.2f}; ideal "
              f"{ideal:.2f}x)", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
