"""The generic family (``xfuse.families.generic``) beside the hand-written ones: requests for a ``ForwardStage`` built
from the inputs the hand-written families' tests prepare (``mmdit_fns``, ``wan_fns``), and rank functions that run
both stages on the same ranks."""

import copy

import torch
import torch.distributed as dist


def flux_request(stage, inputs, scheduler, grid):
    """A ``forward_request`` of FLUX.1 from ``mmdit_fns.prepare_inputs``: the arguments ``FluxPipeline`` passes its
    transformer (true CFG batched [negative, positive]); returns it and the packed view of the final grid."""
    from xfuse.families.common.packed import grid_to_packed, packed_to_grid
    from xfuse.families.generic.request import forward_request

    cfg = inputs["true_cfg_scale"]
    keys = ("prompt_embeds", "pooled_prompt_embeds")
    text = {k: torch.cat([inputs[f"negative_{k}"], inputs[k]]) if cfg > 1 else inputs[k] for k in keys}
    batch = text["prompt_embeds"].shape[0]
    guidance = inputs["guidance"]
    forward = dict(encoder_hidden_states=text["prompt_embeds"], pooled_projections=text["pooled_prompt_embeds"],
                   txt_ids=inputs["text_ids"], img_ids=inputs["latent_image_ids"])  # fmt: skip
    batched = ("encoder_hidden_states", "pooled_projections")
    if guidance is not None:
        forward["guidance"], batched = guidance.expand(batch), (*batched, "guidance")
    latents = inputs["latents"]  # (B, tokens, C4) packed
    request = forward_request(
        stage,
        latents=packed_to_grid(latents, grid.token_rows).contiguous(),
        timesteps=inputs["timesteps"],
        scheduler=scheduler,
        inputs=forward,
        batched=batched,
        timestep=lambda t: t.to(latents.dtype) / 1000,  # FluxPipeline: t.expand(B).to(latents.dtype) / 1000
        input_shape=(batch, *latents.shape[1:]),
        cfg_scale=cfg,
        generator=inputs["generator"],
    )
    return request, grid_to_packed


def wan_request(stage, inputs, scheduler, layout):
    """A ``forward_request`` of Wan from ``wan_fns.prepare_inputs``: the arguments ``WanPipeline`` passes its
    transformer (CFG batched [negative, positive]) with the clip in ``layout``."""
    from xfuse.families.generic.request import forward_request

    text, latents = inputs["prompt_embeds"], inputs["latents"]  # (B', S, D), (B, C, F, H, W)
    return forward_request(
        stage,
        latents=layout.to_grid(latents).contiguous(),
        timesteps=inputs["timesteps"],
        scheduler=scheduler,
        inputs={"encoder_hidden_states": text},
        batched=("encoder_hidden_states",),
        timestep=lambda t: t,  # WanPipeline: t.expand(B)
        input_shape=(text.shape[0], *latents.shape[1:]),
        cfg_scale=inputs["guidance_scale"],
        layout=layout,
        hidden_dtype=text.dtype,
    )


def _engine(stage, plan, channels, rank, warmup, request, grid):
    from xfuse.parallel.engine import PipeFusionEngine

    engine = PipeFusionEngine(stage, plan, channels, pipe_rank=rank, group_ranks=list(range(plan.degree)),
                              warmup_steps=warmup)  # fmt: skip
    return engine.denoise(request, grid)


def run_flux_both(degree, num_patches, warmup, *, height, width, steps, cfg):
    """FLUX.1 tiny through the engine on ranks 0 … degree-1, with the generic stage and then the hand-written one;
    rank 0 returns both final latents (packed)."""
    from tests.support.mmdit_fns import engine_latents, grid_of, prepare_inputs, tiny
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
        request, unpack = flux_request(generic, inputs, copy.deepcopy(pipe.scheduler), grid)
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
    from xfuse.families.wan.stage import denoise_request
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
            if stage_class is spec.stage_class():
                request = denoise_request(stage, latents=latents, layout=layout, timesteps=inputs["timesteps"],
                                          scheduler=scheduler, prompt_embeds=inputs["prompt_embeds"],
                                          guidance_scale=guidance_scale)  # fmt: skip
            else:
                request = wan_request(stage, inputs, scheduler, layout)
            grid = patch_grid(layout.grid_height, layout.width, num_patches, stage.patch_size)
            out = _engine(stage, plan, channels, rank, warmup, request, grid)
            outs.append(None if out is None else layout.from_grid(out))
    finally:
        channels.close()
    return None if outs[0] is None else tuple(outs)
