"""Sequence parallelism side by side: serial diffusers, diffusers' own Ulysses, and xfuse's Ulysses, Ring and
PipeFusion at degree 2, on FLUX (the family diffusers has a context-parallel plan for).

    python benchmarks/bench_sequence.py [--steps 8 20] [--size 512] [--repeats 3] [--json out.json]

Each configuration is a world of real gloo processes (one torch thread per rank, pinned to its own core), set up
first and then timed in turns (a round calls each configuration once, so the machine's drift falls on every ratio
alike). A call is the whole pipeline call to latents (``output_type="latent"``: text encoding, preparation, the
denoising loop; no VAE) on the ``flux-small`` preset (4 double + 8 single blocks of width 256, fp32), its default 512
T5 tokens, guidance 3.5, seed 0. Every parallel configuration's latents are compared with serial diffusers' (max
abs; all five are exact except PipeFusion, whose stale K/V make it an approximation).

diffusers' Ulysses: ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))``. diffusers
picks its device as ``rank % torch.accelerator.device_count()``, which is 0 on a CPU-only torch build
(ZeroDivisionError); the harness makes ``device_count()`` answer 1 in its ranks, and the mesh is then built on "cpu"
over gloo. Its Ring cannot run on a CPU ("Native attention does not support return_lse=True"), so it is not here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_pipefusion import pin_to_core, speedups  # noqa: E402  (after the path insert, as run directly)

PRESET, PROMPT = "flux-small", "a red house by a lake"
# name -> (ranks, how the pipeline is built: "diffusers" or xfuse's ParallelConfig keywords)
CONFIGS: dict[str, tuple[int, str | dict]] = {
    "diffusers serial": (1, "diffusers"),
    "diffusers ulysses 2": (2, "diffusers"),
    "xfuse 1 rank": (1, {}),  # the same pipeline class on one rank: what xfuse's own code costs
    "xfuse ulysses 2": (2, {"ulysses_degree": 2}),  # one patch: every step a whole-image pass
    "xfuse ring 2": (2, {"ring_degree": 2}),
    "xfuse pipefusion 2": (2, {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": 1}),
}

_PIPE: dict = {}  # in a rank process: the pipeline setup_rank built


def setup_rank(how) -> None:
    """On every rank: the preset's diffusers pipeline, made parallel by diffusers (``how == "diffusers"`` on more
    than one rank) or wrapped in xfuse's FLUX pipeline with ``how`` as its parallel config."""
    import torch
    import torch.distributed as dist

    from xfuse.families.registry import load_pipeline

    torch.set_num_threads(1)
    world = dist.get_world_size()
    pin_to_core(dist.get_rank(), world)
    pipe = load_pipeline(PRESET)
    if how == "diffusers":
        if world > 1:
            from diffusers import ContextParallelConfig

            torch.accelerator.device_count = lambda: 1  # see the module docstring
            pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    else:
        from xfuse import PipeFusionFluxPipeline

        pipe = PipeFusionFluxPipeline.from_pipe(pipe, parallel=how)
    pipe.set_progress_bar_config(disable=True)
    _PIPE["pipe"] = pipe


def call_rank(steps: int, size: int) -> dict:
    """On every rank: one call between two barriers; its wall time and (rank 0) the latents."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    out = _PIPE["pipe"](
        prompt=PROMPT,
        height=size,
        width=size,
        num_inference_steps=steps,
        guidance_scale=3.5,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
    )
    seconds = time.perf_counter() - start
    dist.barrier()
    return dict(seconds=seconds, latents=None if out is None or dist.get_rank() else out.images)


def measure(steps: int, size: int, repeats: int) -> dict:
    """Every configuration in turns; each one's times and distance from serial diffusers."""
    import contextlib

    from tests.support.world import World

    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    latents = {}
    with contextlib.ExitStack() as stack:
        worlds = {}
        for name, (ranks, how) in CONFIGS.items():
            worlds[name] = stack.enter_context(World(ranks, threads_per_rank=1, start_timeout=600))
            worlds[name].run_ok(setup_rank, how, timeout=600)
        for _ in range(repeats):
            for name, world in worlds.items():
                result = world.run_ok(call_rank, steps, size, timeout=3600)[0]
                times[name].append(result["seconds"])
                latents[name] = result["latents"]
    rows = speedups({name: {"times": runs} for name, runs in times.items()}, "diffusers serial")
    serial = latents["diffusers serial"]
    for name, row in rows.items():
        row["max_abs_vs_serial"] = (latents[name] - serial).abs().max().item()
    against_ulysses = speedups({name: {"times": runs} for name, runs in times.items()}, "diffusers ulysses 2")
    ours = rows["xfuse ulysses 2"]
    ours["over_diffusers_ulysses"] = against_ulysses["xfuse ulysses 2"]["speedup"]
    ours["round_over_diffusers_ulysses"] = against_ulysses["xfuse ulysses 2"]["round_speedups"]
    return rows


def markdown(report: dict) -> str:
    out = [
        f"Machine: {report['machine']}; {report['date']}; {report['preset']} {report['size']} px, "
        f"{report['repeats']} rounds in turns, whole call to latents.",
        "",
        "| steps | configuration | median s (min–max) | speedup over serial | max abs vs serial |",
        "|---|---|---|---|---|",
    ]
    for steps, rows in report["steps"].items():
        for name, row in rows.items():
            out.append(
                f"| {steps} | {name} | {row['median']:.2f} ({row['min']:.2f}–{row['max']:.2f}) | "
                f"{row['speedup']:.2f}x | {row['max_abs_vs_serial']:.1e} |"
            )
    for steps, rows in report["steps"].items():
        ours = rows["xfuse ulysses 2"]
        rounds = ours["round_over_diffusers_ulysses"]
        out.append(
            f"\n{steps} steps: diffusers' Ulysses 2 over xfuse's Ulysses 2: {ours['over_diffusers_ulysses']:.2f}x "
            f"(rounds {min(rounds):.2f}–{max(rounds):.2f}; above 1: xfuse is faster)."
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 20])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    report = dict(
        machine=f"{platform.machine()}, {os.cpu_count()} cores, CPU only, torch {torch.__version__}",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        preset=PRESET,
        size=args.size,
        repeats=args.repeats,
        steps={},
    )
    for steps in args.steps:
        report["steps"][steps] = measure(steps, args.size, args.repeats)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=2)
    print(markdown(report))


if __name__ == "__main__":
    main()
