"""Sequence parallelism side by side: serial diffusers, diffusers' own Ulysses (FLUX: the family diffusers has a
context-parallel plan for), and xfuse's Ulysses, Ring, PipeFusion (and, for the families that batch classifier-free
guidance, CFG) at degree 2, on any family's preset; for a video family (Wan) both PipeFusion patch directions.

    python benchmarks/bench_sequence.py [--preset flux-small] [--steps 8 20] [--size 512] [--repeats 3] [--json out]
    python benchmarks/bench_sequence.py --preset wan-small --size 256 --frames 17 --steps 20

Each configuration is a world of real gloo processes (one torch thread per rank, pinned to its own core), set up
first and then timed in turns (a round calls each configuration once, so the machine's drift falls on every ratio
alike). A call is the whole pipeline call to latents (``output_type="latent"``: text encoding, preparation, the
denoising loop; no VAE) on the preset (``flux-small``: 4 double + 8 single blocks of width 256, fp32, its default
512 T5 tokens, guidance 3.5; the other families' ``*-small`` presets: 16 blocks of width 256, guidance 5, batched
[uncond, cond]), seed 0. Every parallel configuration's latents are compared with serial diffusers' (max abs; all
are exact except PipeFusion, whose stale K/V make it an approximation). For PipeFusion, each rank's bytes sent in the
last call are printed beside ``xfuse.parallel.costs.comm_volume``'s count (``xfuse plan``'s table) times the steps.

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

PROMPT = "a red house by a lake"
# Qwen-Image's prompts keep their own length, and diffusers' Ulysses shards the text evenly (EquipartitionSharder):
# it refuses a prompt of an odd number of tokens on 2 ranks, which the default prompt (149 tokens in the presets'
# byte-level tokenizer, after the template's 34) and the model card's negative " " (129) are. These have 150 and 130.
EVEN_PROMPT, EVEN_NEGATIVE = "a red house by a lake.", "  "
# name -> (ranks, how the pipeline is built: "diffusers" or xfuse's ParallelConfig keywords)
CONFIGS: dict[str, tuple[int, str | dict]] = {
    "diffusers serial": (1, "diffusers"),
    "diffusers ulysses 2": (2, "diffusers"),  # FLUX only (diffusers' context-parallel plans)
    "xfuse 1 rank": (1, {}),  # the same pipeline class on one rank: what xfuse's own code costs
    "xfuse ulysses 2": (2, {"ulysses_degree": 2}),  # one patch: every step a whole-image pass
    "xfuse ring 2": (2, {"ring_degree": 2}),
    "xfuse pipefusion 2": (2, {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": 1}),
    # a video family's other patch direction (the line above: its default, temporal)
    "xfuse pipefusion 2 spatial": (
        2,
        {"pipefusion_degree": 2, "num_patches": 2, "warmup_steps": 1, "video_patches": "spatial"},
    ),  # fmt: skip
    "xfuse cfg 2": (2, {"cfg_degree": 2}),  # the families that batch [uncond, cond]
}


def configs(preset: str) -> dict[str, tuple[int, str | dict]]:
    """The configurations that apply to ``preset``'s family."""
    import diffusers

    from xfuse.families.registry import model_spec

    spec = model_spec(preset)
    drop = {"xfuse cfg 2"} if spec.distilled_guidance and not spec.negative_prompt_guides else set()
    if not getattr(getattr(diffusers, spec.diffusers_transformer), "_cp_plan", None):  # no context-parallel plan
        drop.add("diffusers ulysses 2")
    if not spec.video:
        drop.add("xfuse pipefusion 2 spatial")
    return {name: how for name, how in CONFIGS.items() if name not in drop}


def call_kwargs(preset: str, frames: int) -> dict:
    """The call's family-specific arguments: FLUX's distilled guidance, the others' batched CFG (and no binning),
    Qwen-Image's true CFG (its default scale 4.0, turned on by a negative prompt; both prompts of an even length: see
    ``EVEN_PROMPT``), a video family's ``frames``."""
    from xfuse.families.registry import model_spec

    spec = model_spec(preset)
    if spec.negative_prompt_guides:
        kwargs: dict = {"prompt": EVEN_PROMPT, "negative_prompt": EVEN_NEGATIVE}
    else:
        kwargs = {"guidance_scale": 3.5 if spec.distilled_guidance else 5.0}
    if spec.resolution_binning:
        kwargs["use_resolution_binning"] = False
    if spec.video:
        kwargs["num_frames"] = frames
    return kwargs


_PIPE: dict = {}  # in a rank process: the pipeline setup_rank built


def setup_rank(preset: str, how) -> None:
    """On every rank: the preset's diffusers pipeline, made parallel by diffusers (``how == "diffusers"`` on more
    than one rank) or wrapped in xfuse's pipeline of its family with ``how`` as its parallel config."""
    import torch
    import torch.distributed as dist

    from xfuse.families.registry import load_pipeline, model_spec

    torch.set_num_threads(1)
    world = dist.get_world_size()
    pin_to_core(dist.get_rank(), world)
    pipe = load_pipeline(preset)
    if how == "diffusers":
        if world > 1:
            from diffusers import ContextParallelConfig

            torch.accelerator.device_count = lambda: 1  # see the module docstring
            pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    else:
        pipe = model_spec(preset).pipeline_class().from_pipe(pipe, parallel=how)
    pipe.set_progress_bar_config(disable=True)
    _PIPE["pipe"] = pipe


def call_rank(preset: str, steps: int, size: int, frames: int = 1) -> dict:
    """On every rank: one call between two barriers; its wall time, (rank 0) the latents, and (xfuse) the bytes each
    rank sent by kind."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    kwargs = {"prompt": PROMPT, **call_kwargs(preset, frames)}
    out = _PIPE["pipe"](
        height=size,
        width=size,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
        **kwargs,
    )
    seconds = time.perf_counter() - start
    dist.barrier()
    pipe = _PIPE["pipe"]
    sent = pipe.rank_stats() if hasattr(pipe, "rank_stats") else None  # collective: every rank of an xfuse world
    latents = None if out is None or dist.get_rank() else getattr(out, "images", getattr(out, "frames", None))
    return dict(seconds=seconds, latents=latents, sent=None if sent is None else [s["sent"] for s in sent])


def stream_tokens(preset: str, kwargs: dict, size: int) -> int:
    """The tokens the first patch's stream carries in this call, where the family keeps a prompt at its own length,
    from diffusers' own code: Qwen-Image's ``encode_prompt`` (the longer of the prompt and the negative prompt);
    Z-Image's ``encode_prompt`` and its transformer's ``patchify_and_embed`` (the image's pad tokens and the longest
    caption, padded)."""
    import torch

    from xfuse.families.registry import load_pipeline

    pipe = load_pipeline(preset)
    prompt = kwargs.get("prompt", PROMPT)
    if not hasattr(pipe.transformer, "patchify_and_embed"):
        prompts = [prompt, *([kwargs["negative_prompt"]] if "negative_prompt" in kwargs else [])]
        return max(pipe.encode_prompt(p, device="cpu")[0].shape[1] for p in prompts)
    guided = kwargs.get("guidance_scale", 5.0) > 0
    positive, negative = pipe.encode_prompt(prompt, device="cpu", do_classifier_free_guidance=guided)
    side = size // pipe.vae_scale_factor
    image = torch.zeros(pipe.transformer.in_channels, 1, side, side)
    captions = positive + negative
    _, caps, _, x_pos, _, _, _ = pipe.transformer.patchify_and_embed([image] * len(captions), captions, 2, 1)
    return len(x_pos[0]) - (side // 2) ** 2 + max(len(c) for c in caps)


def predicted_bytes(preset: str, how: dict, steps: int, size: int, frames: int) -> list[dict[str, int]]:
    """The bytes each pipeline rank sends in one call as ``xfuse.parallel.costs.comm_volume`` counts them (per step,
    times the steps): PipeFusion's hand-offs and stepped latent; sequence parallelism's own messages are not in it."""
    from xfuse.config import config_from_dict
    from xfuse.families.registry import model_spec
    from xfuse.plan_report import plan_report

    kwargs = call_kwargs(preset, frames)
    generation = {"height": size, "width": size, "num_inference_steps": steps}
    generation |= {key: kwargs[key] for key in ("guidance_scale", "negative_prompt") if key in kwargs}
    if frames > 1:
        generation["num_frames"] = frames
    text = None if model_spec(preset).text_padded else stream_tokens(preset, kwargs, size)
    report = plan_report(config_from_dict({"model": preset, "parallel": how, "generation": generation}),
                         text_tokens=text)  # fmt: skip
    return [{k: v * steps for k, v in report.volume[r].items() if v} for r in sorted(report.volume)]


def measure(preset: str, steps: int, size: int, repeats: int, frames: int = 1, only=None) -> dict:
    """Every configuration (``only``: these and serial diffusers) in turns; each one's times and distance from serial
    diffusers."""
    import contextlib

    from tests.support.world import World

    chosen = configs(preset)
    if only:
        unknown = set(only) - set(chosen)
        if unknown:
            raise SystemExit(f"--only: unknown configurations {sorted(unknown)}; known: {sorted(chosen)}")
        chosen = {name: how for name, how in chosen.items() if name in only or name == "diffusers serial"}
    times: dict[str, list[float]] = {name: [] for name in chosen}
    latents, sent = {}, {}
    with contextlib.ExitStack() as stack:
        worlds = {}
        for name, (ranks, how) in chosen.items():
            worlds[name] = stack.enter_context(World(ranks, threads_per_rank=1, start_timeout=600))
            worlds[name].run_ok(setup_rank, preset, how, timeout=600)
        for _ in range(repeats):
            for name, world in worlds.items():
                result = world.run_ok(call_rank, preset, steps, size, frames, timeout=3600)[0]
                times[name].append(result["seconds"])
                latents[name], sent[name] = result["latents"], result["sent"]
    rows = speedups({name: {"times": runs} for name, runs in times.items()}, "diffusers serial")
    for name, (_, how) in chosen.items():
        if sent[name] is not None:
            rows[name]["sent_bytes"] = sent[name]  # the last call's, per rank and kind
            if "pipefusion_degree" in how:
                rows[name]["predicted_bytes"] = predicted_bytes(preset, how, steps, size, frames)
    serial = latents["diffusers serial"]
    for name, row in rows.items():
        row["max_abs_vs_serial"] = (latents[name] - serial).abs().max().item()
    if "diffusers ulysses 2" in times:
        against_ulysses = speedups({name: {"times": runs} for name, runs in times.items()}, "diffusers ulysses 2")
        ours = rows["xfuse ulysses 2"]
        ours["over_diffusers_ulysses"] = against_ulysses["xfuse ulysses 2"]["speedup"]
        ours["round_over_diffusers_ulysses"] = against_ulysses["xfuse ulysses 2"]["round_speedups"]
    return rows


def markdown(report: dict) -> str:
    out = [
        f"Machine: {report['machine']}; {report['date']}; {report['preset']} {report['size']} px"
        + (f", {report['frames']} frames" if report.get("frames", 1) > 1 else "")
        + f", {report['repeats']} rounds in turns, whole call to latents.",
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
        ours = rows.get("xfuse ulysses 2", {})
        if "round_over_diffusers_ulysses" not in ours:
            continue
        rounds = ours["round_over_diffusers_ulysses"]
        out.append(
            f"\n{steps} steps: diffusers' Ulysses 2 over xfuse's Ulysses 2: {ours['over_diffusers_ulysses']:.2f}x "
            f"(rounds {min(rounds):.2f}–{max(rounds):.2f}; above 1: xfuse is faster)."
        )
    for steps, rows in report["steps"].items():
        for name, row in rows.items():
            if "predicted_bytes" not in row:
                continue
            ranks = "; ".join(
                f"rank {r}: sent {sum(got.values()) / 2**20:.2f} MiB, predicted {sum(want.values()) / 2**20:.2f} MiB"
                for r, (got, want) in enumerate(zip(row["sent_bytes"], row["predicted_bytes"], strict=False))
            )
            out.append(f"\n{steps} steps, {name}: {ranks} (xfuse.parallel.costs.comm_volume x steps).")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="flux-small", help="any family's preset (the *-small ones: CPU speed)")
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 20])
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--frames", type=int, default=17, help="a video family's num_frames (4k + 1)")
    parser.add_argument("--only", nargs="+", default=None, help="only these configurations (diffusers serial always)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    report = dict(
        machine=f"{platform.machine()}, {os.cpu_count()} cores, CPU only, torch {torch.__version__}",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        preset=args.preset,
        size=args.size,
        frames=args.frames,
        repeats=args.repeats,
        steps={},
    )
    for steps in args.steps:
        report["steps"][steps] = measure(args.preset, steps, args.size, args.repeats, args.frames, args.only)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=2)
    print(markdown(report))


if __name__ == "__main__":
    main()
