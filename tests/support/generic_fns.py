"""The generic family (``xfuse.families.generic``) beside the hand-written ones: requests for either stage built from
the inputs the hand-written families' tests prepare (``mmdit_fns.request_of`` for FLUX.1, ``wan_request`` here; the
families' ``denoise_request`` builds a ``ForwardStage``'s), and rank functions that run both stages on the same
ranks."""

import copy

import torch
import torch.distributed as dist


def wan_request(stage, inputs, scheduler, layout):
    """A request of Wan from ``wan_fns.prepare_inputs`` for either stage (``wan.stage.denoise_request``)."""
    from xfuse.families.wan.stage import denoise_request

    return denoise_request(stage, latents=inputs["latents"], layout=layout, timesteps=inputs["timesteps"],
                           scheduler=scheduler, prompt_embeds=inputs["prompt_embeds"],
                           guidance_scale=inputs["guidance_scale"])  # fmt: skip


def _engine(stage, plan, channels, rank, warmup, request, grid):
    from xfuse.parallel.engine import PipeFusionEngine

    engine = PipeFusionEngine(stage, plan, channels, pipe_rank=rank, group_ranks=list(range(plan.degree)),
                              warmup_steps=warmup)  # fmt: skip
    return engine.denoise(request, grid)


def run_flux_both(degree, num_patches, warmup, *, height, width, steps, cfg):
    """FLUX.1 tiny through the engine on ranks 0 … degree-1, with the generic stage and then the hand-written one;
    rank 0 returns both final latents (packed)."""
    from tests.support.mmdit_fns import engine_latents, grid_of, prepare_inputs, request_of, tiny
    from xfuse.comm.p2p import P2PChannels
    from xfuse.config import ParallelConfig
    from xfuse.families.registry import model_spec

    rank = dist.get_rank()
    if rank >= degree:
        return None
    pipe, spec = tiny("flux-tiny"), model_spec("flux-tiny")
    plan = spec.plan(spec.num_blocks(pipe.transformer.config), ParallelConfig(pipefusion_degree=degree))
    grid = grid_of(spec, pipe, height, width, num_patches)
    channels = P2PChannels(rank=rank, timeout_s=60, max_inflight=2, device=torch.device("cpu"))
    try:
        generic = spec.forward_stage_class()(copy.deepcopy(pipe.transformer), plan, rank)
        inputs = prepare_inputs(pipe, height=height, width=width, steps=steps, cfg=cfg)
        request, unpack = request_of(generic, inputs, copy.deepcopy(pipe.scheduler), grid)  # a ForwardStage's
        out = _engine(generic, plan, channels, rank, warmup, request, grid)
        family = spec.stage_class()(copy.deepcopy(pipe.transformer), plan, rank)
        inputs = prepare_inputs(pipe, height=height, width=width, steps=steps, cfg=cfg)
        reference = engine_latents(family, plan, inputs, copy.deepcopy(pipe.scheduler), grid, warmup, channels, rank)
    finally:
        channels.close()
    return None if out is None else (unpack(out), reference)


def run_wan_both(degree, direction, num_patches, warmup, *, height, width, num_frames, steps, guidance_scale):
    """Wan tiny through the engine on ranks 0 … degree-1, with the generic stage and then ``WanStage``; rank 0 returns
    both final latents (B, C, F, H, W)."""
    from tests.support.wan_fns import prepare_inputs, tiny_wan
    from xfuse.comm.p2p import P2PChannels
    from xfuse.config import ParallelConfig
    from xfuse.families.registry import model_spec
    from xfuse.parallel.patch_grid import patch_grid
    from xfuse.parallel.video_layout import VideoLayout

    rank = dist.get_rank()
    if rank >= degree:
        return None
    pipe, spec = tiny_wan(), model_spec("wan-tiny")
    plan = spec.plan(spec.num_blocks(pipe.transformer.config), ParallelConfig(pipefusion_degree=degree))
    outs = []
    channels = P2PChannels(rank=rank, timeout_s=60, max_inflight=2, device=torch.device("cpu"))
    try:
        for stage_class in (spec.forward_stage_class(), spec.stage_class()):
            stage = stage_class(copy.deepcopy(pipe.transformer), plan, rank)
            inputs = prepare_inputs(pipe, height=height, width=width, num_frames=num_frames, steps=steps,
                                    guidance_scale=guidance_scale)  # fmt: skip
            latents, scheduler = inputs["latents"], copy.deepcopy(pipe.scheduler)
            layout = VideoLayout(direction, *latents.shape[2:], stage.patch_size)
            request = wan_request(stage, inputs, scheduler, layout)
            grid = patch_grid(layout.grid_height, layout.width, num_patches, stage.patch_size)
            out = _engine(stage, plan, channels, rank, warmup, request, grid)
            outs.append(None if out is None else layout.from_grid(out))
    finally:
        channels.close()
    return None if outs[0] is None else tuple(outs)
