"""PixArt-Σ inputs prepared as ``PixArtSigmaPipeline.__call__`` prepares them, and rank functions for its tests."""

import copy

import torch
import torch.distributed as dist

_PIPES = {}


def tiny_pixart():
    """The ``pixart-tiny`` preset, built once per process (stages copy its transformer)."""
    if "pipe" not in _PIPES:
        from xfuse.families.registry import load_pipeline

        _PIPES["pipe"] = load_pipeline("pixart-tiny")
        _PIPES["pipe"].set_progress_bar_config(disable=True)
    return _PIPES["pipe"]


def prepare_inputs(pipe, *, prompt="a red house by a lake", height=128, width=96, steps=3, guidance_scale=4.5, seed=0):
    """What the denoising loop needs, built with the diffusers pipeline's own methods (steps 3-6 of its
    ``__call__``): text batched [uncond, cond], latents, timesteps, step kwargs, the advanced generator."""
    do_cfg = guidance_scale > 1
    with torch.no_grad():
        emb, mask, neg, neg_mask = pipe.encode_prompt(prompt, do_cfg, device="cpu", clean_caption=False)
    if do_cfg:
        emb, mask = torch.cat([neg, emb]), torch.cat([neg_mask, mask])
    pipe.scheduler.set_timesteps(steps, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    latents = pipe.prepare_latents(1, 4, height, width, emb.dtype, "cpu", generator, None)
    return dict(
        prompt_embeds=emb,
        prompt_attention_mask=mask,
        latents=latents,
        timesteps=pipe.scheduler.timesteps,
        guidance_scale=guidance_scale,
        extra_step_kwargs=pipe.prepare_extra_step_kwargs(generator, 0.0),
        generator=generator,
    )


def request_of(stage, inputs, scheduler):
    """The engine's ``DenoiseRequest`` for ``stage`` on ``inputs``."""
    from xfuse.families.pixart.stage import denoise_request

    keys = ("prompt_embeds", "prompt_attention_mask", "guidance_scale", "extra_step_kwargs", "generator", "latents")
    return denoise_request(stage, timesteps=inputs["timesteps"], scheduler=scheduler, **{k: inputs[k] for k in keys})


def engine_latents(stages, plan, inputs, scheduler, grid, warmup, channels=None, rank=0):
    """Run PipeFusion's engine for ``stages[rank]`` on ``inputs``; the final latents on the embedding rank."""
    from xfuse.parallel.engine import PipeFusionEngine

    request = request_of(stages[rank], inputs, scheduler)
    engine = PipeFusionEngine(
        stages[rank], plan, channels, pipe_rank=rank, group_ranks=list(range(plan.degree)), warmup_steps=warmup
    )
    return engine.denoise(request, grid)


def run_engine(degree, placement, num_patches, warmup, *, height=128, width=96, steps=3, guidance_scale=4.5):
    """PipeFusion on ranks 0 … degree-1 of the world (the others idle); rank 0 returns the final latents."""
    from xfuse.comm.p2p import P2PChannels
    from xfuse.config import ParallelConfig
    from xfuse.families.pixart.stage import PixArtStage
    from xfuse.families.registry import PIXART_SIGMA
    from xfuse.parallel.patch_grid import patch_grid

    rank = dist.get_rank()
    if rank >= degree:
        return None
    pipe = tiny_pixart()
    plan = PIXART_SIGMA.plan(8, ParallelConfig(pipefusion_degree=degree, placement=placement))
    stages = {rank: PixArtStage(copy.deepcopy(pipe.transformer), plan, rank)}
    channels = P2PChannels(rank=rank, timeout_s=60, max_inflight=2, device=torch.device("cpu"))
    inputs = prepare_inputs(pipe, height=height, width=width, steps=steps, guidance_scale=guidance_scale)
    grid = patch_grid(height // 8, width // 8, num_patches, 2)
    try:
        return engine_latents(stages, plan, inputs, copy.deepcopy(pipe.scheduler), grid, warmup, channels, rank)
    finally:
        channels.close()


def from_pipe_call(parallel, call):
    """``from_pipe`` on the ``pixart-tiny`` preset (the same weights as its saved folder): rank 0's images, and the
    error ``from_pipe`` raises for a pipeline of another family."""
    from tests.support.pipeline_fns import as_array, generators
    from xfuse import PipeFusionPixArtSigmaPipeline
    from xfuse.families.registry import load_pipeline

    try:
        PipeFusionPixArtSigmaPipeline.from_pipe(load_pipeline("tiny"), parallel=parallel)
        refused = None
    except TypeError as err:
        refused = str(err)
    pipe = PipeFusionPixArtSigmaPipeline.from_pipe(load_pipeline("pixart-tiny"), parallel=parallel)
    pipe.set_progress_bar_config(disable=True)
    call = dict(call)
    out = pipe(**call, generator=generators(call))
    return refused, None if out is None else as_array(out)
