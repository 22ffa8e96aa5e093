"""The generic family against the hand-written one: the same model through its own diffusers forward
(``xfuse.families.generic.ForwardStage``) and through the family's stage, the engine's denoising loop timed.

    python benchmarks/bench_generic.py [--steps 8] [--repeats 3] [--json benchmarks/results/generic.json]

FLUX.1 ``flux-small`` (4 double + 8 single blocks of width 256) at 512 x 512 px with its embedded guidance (batch 1,
16 text tokens), FLUX.2 ``flux2-small`` (2 double + 10 single blocks of width 256, its single blocks taking [text,
image] joined: ``ForwardPlan.joined``) likewise, and Wan ``wan-small`` (16 blocks of width 256) at 17 frames of
192 x 336 px with CFG (batch 2), each
at degree 1 and degree 2 (M = 2, warm-up 1, linear placement), one torch thread per rank pinned to its own core,
in gloo worlds set up first and then timed in turns (generic, hand-written, per degree, each round): the loop only
(``PipeFusionEngine.denoise`` on the inputs the diffusers pipeline prepares), median (min-max) of the rounds.
Each call's final latents are compared between the two stages (max abs).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_pipefusion import pin_to_core  # noqa: E402  (after the path insert, as run directly)

MODELS = {
    "flux-small": dict(height=512, width=512),
    "wan-small": dict(height=192, width=336, num_frames=17),
    "flux2-small": dict(height=512, width=512),
}
_RANK: dict = {}  # in a rank process: the stages, inputs and grids setup_rank built


def setup_rank(preset: str, degree: int, steps: int) -> None:
    """On every rank: the preset's two stages of this rank and the loop's inputs, built once."""
    import torch
    import torch.distributed as dist

    from tests.support import generic_fns, mmdit_fns, wan_fns
    from xfuse.comm.p2p import P2PChannels
    from xfuse.config import ParallelConfig
    from xfuse.families.registry import load_pipeline, model_spec
    from xfuse.parallel.patch_grid import patch_grid
    from xfuse.parallel.video_layout import VideoLayout

    rank = dist.get_rank()
    pin_to_core(rank, degree)
    torch.set_num_threads(1)
    pipe, spec = load_pipeline(preset), model_spec(preset)
    pipe.set_progress_bar_config(disable=True)
    plan = spec.plan(spec.num_blocks(pipe.transformer.config), ParallelConfig(pipefusion_degree=degree))
    size = MODELS[preset]
    stages = {name: cls(copy.deepcopy(pipe.transformer), plan, rank).eval()
              for name, cls in (("generic", spec.forward_stage_class()), ("family", spec.stage_class()))}  # fmt: skip
    if preset.startswith("flux2"):
        request = flux2_requests(pipe, stages, steps, **size)
        grid = mmdit_fns.grid_of(spec, pipe, size["height"], size["width"], 2)
    elif preset.startswith("flux"):
        inputs = mmdit_fns.prepare_inputs(pipe, height=size["height"], width=size["width"], steps=steps, cfg=1.0)
        grid = mmdit_fns.grid_of(spec, pipe, size["height"], size["width"], 2)

        def request(name):
            fresh = dict(inputs, generator=torch.Generator().manual_seed(0))
            return mmdit_fns.request_of(stages[name], fresh, copy.deepcopy(pipe.scheduler), grid)[0]
    else:
        inputs = wan_fns.prepare_inputs(pipe, steps=steps, guidance_scale=5.0, **size)
        latents = inputs["latents"]
        layout = VideoLayout("temporal", *latents.shape[2:], stages["family"].patch_size)
        grid = patch_grid(layout.grid_height, layout.width, 2, stages["family"].patch_size)

        def request(name):
            return generic_fns.wan_request(stages[name], inputs, copy.deepcopy(pipe.scheduler), layout)

    channels = P2PChannels(rank=rank, timeout_s=600, max_inflight=2, device=torch.device("cpu"))
    _RANK.update(stages=stages, plan=plan, grid=grid, request=request, channels=channels, rank=rank)


def flux2_requests(pipe, stages, steps: int, *, height: int, width: int):
    """FLUX.2's loop inputs as ``Flux2Pipeline.__call__`` prepares them (its prompt, latents, timesteps and embedded
    guidance 4.0), and the engine's request for a stage of ``stages`` on them."""
    import numpy as np
    import torch
    from diffusers.pipelines.flux2 import pipeline_flux2 as diffusers_flux2

    from xfuse.families.common.packed import packed_to_grid
    from xfuse.families.flux2.stage import denoise_request

    with torch.no_grad():
        emb, text_ids = pipe.encode_prompt(prompt="a red house by a lake", device="cpu", max_sequence_length=16)
    channels = pipe.transformer.config.in_channels // 4
    packed, image_ids = pipe.prepare_latents(1, channels, height, width, torch.float32, "cpu",
                                             torch.Generator().manual_seed(0), None)  # fmt: skip
    tokens = packed.shape[1]
    mu = diffusers_flux2.compute_empirical_mu(image_seq_len=tokens, num_steps=steps)
    sigmas = np.linspace(1.0, 1 / steps, steps)

    def request(name):
        scheduler = copy.deepcopy(pipe.scheduler)
        timesteps = diffusers_flux2.retrieve_timesteps(scheduler, steps, "cpu", sigmas=sigmas, mu=mu)[0]
        scheduler.set_begin_index(0)
        rows = height // (pipe.vae_scale_factor * 2)  # packed token rows
        return denoise_request(stages[name], latents=packed_to_grid(packed, rows).contiguous(), timesteps=timesteps,
                               scheduler=scheduler, prompt_embeds=emb, text_ids=text_ids, latent_image_ids=image_ids,
                               guidance_value=torch.full([1], 4.0))  # fmt: skip

    return request


def call_rank(name: str) -> dict:
    """One timed denoising loop with stage ``name`` (``generic`` or ``family``); rank 0 returns its seconds and
    final latents."""
    import torch

    from xfuse.parallel.engine import PipeFusionEngine

    r = _RANK
    stage, plan = r["stages"][name], r["plan"]
    engine = PipeFusionEngine(stage, plan, r["channels"], pipe_rank=r["rank"], group_ranks=list(range(plan.degree)),
                              warmup_steps=1)  # fmt: skip
    request = r["request"](name)
    with torch.no_grad():
        start = time.perf_counter()
        out = engine.denoise(request, r["grid"])
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "latents": out}


def measure(preset: str, steps: int, repeats: int) -> dict:
    from tests.support.world import World

    rows: dict = {}
    with contextlib.ExitStack() as stack:
        worlds = {}
        for degree in (1, 2):
            worlds[degree] = stack.enter_context(World(degree, threads_per_rank=1, start_timeout=600))
            worlds[degree].run_ok(setup_rank, preset, degree, steps, timeout=600)
        times: dict = {(d, n): [] for d in worlds for n in ("generic", "family")}
        difference: dict = {}
        for _ in range(repeats):
            for degree, world in worlds.items():
                outs = {}
                for name in ("generic", "family"):
                    result = world.run_ok(call_rank, name, timeout=3600)[0]
                    times[degree, name].append(result["seconds"])
                    outs[name] = result["latents"]
                difference[degree] = (outs["generic"] - outs["family"]).abs().max().item()
    for degree in (1, 2):
        generic, family = times[degree, "generic"], times[degree, "family"]
        rows[f"degree {degree}"] = {
            "generic": summary(generic),
            "family": summary(family),
            "generic over family": statistics.median(generic) / statistics.median(family),
            "max abs difference": difference[degree],
        }
    return rows


def summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {"machine": platform.processor() or platform.machine(), "steps": args.steps, "repeats": args.repeats,
              "models": {preset: measure(preset, args.steps, args.repeats) for preset in args.models}}  # fmt: skip
    for preset, rows in report["models"].items():
        for degree, row in rows.items():
            g, f = row["generic"], row["family"]
            print(f"{preset} {degree}: generic {g['median']:.2f} s ({g['min']:.2f}-{g['max']:.2f}), hand-written "
                  f"{f['median']:.2f} s ({f['min']:.2f}-{f['max']:.2f}), ratio {row['generic over family']:.3f}, "
                  f"max abs difference {row['max abs difference']:.1e}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
