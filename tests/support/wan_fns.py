"""Wan inputs prepared as ``WanPipeline.__call__`` prepares them, and rank functions for its tests."""

import copy

import torch
import torch.distributed as dist

_PIPES = {}


def tiny_wan():
    """The ``wan-tiny`` preset, built once per process (stages copy its transformer)."""
    if "pipe" not in _PIPES:
        from xfuse.families.registry import load_pipeline

        _PIPES["pipe"] = load_pipeline("wan-tiny")
        _PIPES["pipe"].set_progress_bar_config(disable=True)
    return _PIPES["pipe"]


def prepare_inputs(pipe, *, height, width, num_frames, steps, guidance_scale, prompt="a red ball rolls", seed=0):
    """What the denoising loop needs, built with the diffusers pipeline's own methods (steps 3-5 of its
    ``__call__``): text batched [negative, positive], float32 latents (B, C, F, H, W), timesteps."""
    do_cfg = guidance_scale > 1
    with torch.no_grad():
        emb, neg = pipe.encode_prompt(prompt, do_classifier_free_guidance=do_cfg, device="cpu", max_sequence_length=512)
    pipe.scheduler.set_timesteps(steps, device="cpu")
    generator = torch.Generator().manual_seed(seed)
    channels = pipe.transformer.config.in_channels
    latents = pipe.prepare_latents(1, channels, height, width, num_frames, torch.float32, "cpu", generator, None)
    return dict(
        prompt_embeds=torch.cat([neg, emb]) if do_cfg else emb,
        latents=latents,
        timesteps=pipe.scheduler.timesteps,
        guidance_scale=guidance_scale,
    )


def run_engine(degree, direction, num_patches, warmup, *, height, width, num_frames, steps, guidance_scale):
    """PipeFusion on ranks 0 … degree-1 of the world (the others idle), linear placement; rank 0 returns the final
    latents as (B, C, F, H, W)."""
    from xfuse.comm.p2p import P2PChannels
    from xfuse.config import ParallelConfig
    from xfuse.families.registry import model_spec
    from xfuse.families.wan.stage import WanStage, denoise_request
    from xfuse.parallel.engine import PipeFusionEngine
    from xfuse.parallel.patch_grid import patch_grid
    from xfuse.parallel.video_layout import VideoLayout

    rank = dist.get_rank()
    if rank >= degree:
        return None
    pipe = tiny_wan()
    spec = model_spec("wan-tiny")
    plan = spec.plan(spec.num_blocks(pipe.transformer.config), ParallelConfig(pipefusion_degree=degree))
    stage = WanStage(copy.deepcopy(pipe.transformer), plan, rank)
    inputs = prepare_inputs(
        pipe, height=height, width=width, num_frames=num_frames, steps=steps, guidance_scale=guidance_scale
    )
    latents = inputs["latents"]
    layout = VideoLayout(direction, *latents.shape[2:], stage.patch_size)
    request = denoise_request(
        stage,
        latents=latents,
        layout=layout,
        timesteps=inputs["timesteps"],
        scheduler=copy.deepcopy(pipe.scheduler),
        prompt_embeds=inputs["prompt_embeds"],
        guidance_scale=guidance_scale,
    )
    channels = P2PChannels(rank=rank, timeout_s=60, max_inflight=2, device=torch.device("cpu"))
    engine = PipeFusionEngine(
        stage, plan, channels, pipe_rank=rank, group_ranks=list(range(degree)), warmup_steps=warmup
    )
    try:
        out = engine.denoise(request, patch_grid(layout.grid_height, layout.width, num_patches, stage.patch_size))
    finally:
        channels.close()
    return None if out is None else layout.from_grid(out)


def calls_without_scheduler_merge(folder, parallel, calls):
    """``run_calls`` with the engine's hand-back of per-patch scheduler state disabled (an injected bug: a second
    expert then continues from the scheduler as the first left it before pipelining)."""
    from unittest import mock

    from tests.support.pipeline_fns import run_calls

    with mock.patch("xfuse.parallel.scheduler_state.merge_patch_schedulers", lambda *args: None):
        return run_calls(folder, parallel, calls, family="wan")


def prepare_image_inputs(pipe, image, *, height, width, num_frames, steps, guidance_scale, prompt="a red ball rolls"):
    """``prepare_inputs`` for image-to-video, by a ``WanImageToVideoPipeline`` of a Wan 2.2 TI2V folder (its own
    ``video_processor`` and ``prepare_latents``): also the image's normalised latents (B, C, 1, H, W)."""
    do_cfg = guidance_scale > 1
    with torch.no_grad():
        emb, neg = pipe.encode_prompt(prompt, do_classifier_free_guidance=do_cfg, device="cpu", max_sequence_length=512)
        pipe.scheduler.set_timesteps(steps, device="cpu")
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to("cpu", dtype=torch.float32)
        channels = pipe.transformer.config.in_channels
        latents, image_latents, _ = pipe.prepare_latents(
            pixels, 1, channels, height, width, num_frames, torch.float32, "cpu", torch.Generator().manual_seed(0)
        )
    return dict(
        prompt_embeds=torch.cat([neg, emb]) if do_cfg else emb,
        latents=latents,
        image_latents=image_latents,
        timesteps=pipe.scheduler.timesteps,
        guidance_scale=guidance_scale,
    )


def calls_with_one_timestep(folder, parallel, calls):
    """``run_calls`` of the image-to-video pipeline with every token at the step's timestep (an injected bug: the
    conditioning frame's tokens should have timestep 0)."""
    from unittest import mock

    from tests.support.pipeline_fns import run_calls
    from xfuse.families.wan.stage import FirstFrame

    def one_timestep(self, t):
        return t.float() * torch.ones(2, device=t.device)  # both levels at t

    with mock.patch.object(FirstFrame, "timesteps", one_timestep):
        return run_calls(folder, parallel, calls, family="wan", pipeline="PipeFusionWanImageToVideoPipeline")


def load_error(folder, pipeline):
    """The message of the error loading ``folder`` with the Wan family's class ``pipeline`` raises on this rank."""
    from xfuse.families.wan.spec import WAN

    try:
        WAN.pipeline_class_named(pipeline).from_pretrained(folder, parallel={"pipefusion_degree": 4})
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{pipeline} loaded {folder}")
