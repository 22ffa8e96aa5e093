"""ControlNet on the sharded SD3 pipeline: what it costs, and where its control model should run.

    python benchmarks/bench_controlnet.py              # writes benchmarks/results/controlnet.{json,md}
    python benchmarks/bench_controlnet.py --rounds 3 --steps 10

``sd3-small`` (16 blocks of width 256) with a random ControlNet of 8 blocks (built as diffusers' ``from_transformer``
builds one, its zero-initialised layers drawn at random), 512 px, CFG 7 (batch 2), T5 cut to 16 tokens, whole call to
latents; each configuration a world of real gloo processes, one torch thread per rank pinned to its own core, timed
in turns (a round runs every configuration once; the worlds' first calls are untimed):

* degree 1 without and with the ControlNet (``PipeFusionStableDiffusion3Pipeline`` / ``...ControlNetPipeline``);
* degree 2 (M = 2, warm-up 1) without it, with it on the even split ``[8, 8]`` (rank 0 runs its 8 blocks and the
  ControlNet's 8), and with it on the default split (``control_split``: ``[4, 12]``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tests.support

from benchmarks.bench_pipefusion import pin_to_core  # noqa: E402  (after the path insert, as run directly)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PRESET, CONTROL_LAYERS = "sd3-small", 8
PIPELINED = {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": 1}
CONFIGS = {  # name -> (degree, parallel, with the ControlNet)
    "degree 1": (1, {"pipefusion_degree": 1}, False),
    "degree 1, ControlNet": (1, {"pipefusion_degree": 1}, True),
    "degree 2": (2, PIPELINED, False),
    "degree 2, ControlNet, split [8, 8]": (2, {**PIPELINED, "stage_split": [8, 8]}, True),
    "degree 2, ControlNet, default split": (2, PIPELINED, True),
}

_PIPE: dict = {}  # in a rank process: the pipeline setup_rank built, kept between calls


def setup_rank(degree: int, parallel: dict, controlled: bool, controlnet_folder: str) -> list[int]:
    """On every rank: the preset's xfuse pipeline (with the ControlNet: its ControlNet pipeline, from diffusers'
    ``StableDiffusion3ControlNetPipeline.from_pipe``); returns the plan's blocks per rank."""
    import torch
    import torch.distributed as dist
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline

    from xfuse import PipeFusionStableDiffusion3ControlNetPipeline, PipeFusionStableDiffusion3Pipeline
    from xfuse.families.registry import load_pipeline
    from xfuse.runtime.heap import freeze_startup_heap, keep_freed_heap

    torch.set_num_threads(1)
    pin_to_core(dist.get_rank(), degree)
    base = load_pipeline(PRESET)
    if controlled:
        controlnet = SD3ControlNetModel.from_pretrained(controlnet_folder)
        diffusers_pipe = StableDiffusion3ControlNetPipeline.from_pipe(base, controlnet=controlnet)
        pipe = PipeFusionStableDiffusion3ControlNetPipeline.from_pipe(diffusers_pipe, parallel=parallel)
    else:
        pipe = PipeFusionStableDiffusion3Pipeline.from_pipe(base, parallel=parallel)
    pipe.set_progress_bar_config(disable=True)
    _PIPE.update(pipe=pipe, controlled=controlled)
    freeze_startup_heap()
    keep_freed_heap()
    return [len(pipe.plan.blocks_of(r)) for r in range(pipe.plan.degree)]


def call_rank(steps: int, size: int) -> float:
    """On every rank: one call between two barriers; its wall time."""
    import torch
    import torch.distributed as dist

    from tests.support.controlnet_fns import control_image

    pipe = _PIPE["pipe"]
    extra = {"control_image": control_image(size, size)} if _PIPE["controlled"] else {}
    dist.barrier()
    start = time.perf_counter()
    pipe(prompt="a red house by a lake", height=size, width=size, num_inference_steps=steps, guidance_scale=7.0,
         max_sequence_length=16, output_type="latent", generator=torch.Generator().manual_seed(0), **extra)  # fmt: skip
    dist.barrier()
    return time.perf_counter() - start


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=512)
    args = parser.parse_args()

    from tests.support.controlnet_fns import save_controlnet
    from tests.support.world import World
    from xfuse.families.registry import load_pipeline

    started = time.time()
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    splits = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        folder = save_controlnet(load_pipeline(PRESET), os.path.join(tmp, "controlnet"), seed=1,
                                 num_layers=CONTROL_LAYERS)  # fmt: skip
        worlds = {}
        for name, (degree, parallel, controlled) in CONFIGS.items():
            worlds[name] = stack.enter_context(World(degree, threads_per_rank=1, start_timeout=600))
            splits[name] = worlds[name].run_ok(setup_rank, degree, parallel, controlled, folder, timeout=600)[0]
            worlds[name].run_ok(call_rank, args.steps, args.size, timeout=3600)  # the first call, untimed
        for _ in range(args.rounds):
            for name, world in worlds.items():
                times[name].append(world.run_ok(call_rank, args.steps, args.size, timeout=3600)[0])
                print(name, round(times[name][-1], 2), flush=True)
    base = statistics.median(times["degree 1"])
    controlled_base = statistics.median(times["degree 1, ControlNet"])
    rows = {}
    for name, runs in times.items():
        reference = controlled_base if "ControlNet" in name else base
        rows[name] = spread(runs) | {"blocks": splits[name], "speedup": reference / statistics.median(runs)}
    out = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "seconds": round(time.time() - started),
        "preset": PRESET,
        "controlnet_layers": CONTROL_LAYERS,
        "steps": args.steps,
        "size": args.size,
        "rounds": args.rounds,
        "rows": rows,
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "controlnet.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(RESULTS, "controlnet.md"), "w") as f:
        f.write(markdown(out))
    print(markdown(out))


def markdown(out: dict) -> str:
    lines = [
        f"{out['preset']}, ControlNet of {out['controlnet_layers']} blocks, {out['size']} px, {out['steps']} steps, "
        f"{out['rounds']} rounds ({out['when']})",
        "",
        "| configuration | blocks per rank | seconds, median (min–max) | speedup over degree 1 (same model) |",
        "|---|---|---|---|",
    ]
    for name, row in out["rows"].items():
        lines.append(f"| {name} | {row['blocks']} | {row['median']:.2f} ({row['min']:.2f}–{row['max']:.2f}) | "
                     f"{row['speedup']:.2f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
