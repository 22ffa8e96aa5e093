"""SD3 and FLUX inputs prepared as their diffusers pipelines prepare them, and rank functions for their tests."""

import copy

import numpy as np
import torch
import torch.distributed as dist

_PIPES = {}
PROMPT, NEGATIVE = "a red house by a lake", "blurry"


def tiny(preset):
    """A tiny preset's diffusers pipeline, built once per process (stages copy its transformer)."""
    if preset not in _PIPES:
        from xfuse.families.registry import load_pipeline

        _PIPES[preset] = load_pipeline(preset)
        _PIPES[preset].set_progress_bar_config(disable=True)
    return _PIPES[preset]


def prepare_inputs(pipe, *, height, width, steps, cfg, max_sequence_length=16, seed=0, generator=None, prompt=PROMPT,
                   negative_prompt=NEGATIVE):  # fmt: skip
    """What the denoising loop needs, built with the diffusers pipeline's own methods (the oracle's ``inputs``):
    SD3 with ``guidance_scale=cfg`` (batched [uncond, cond] when > 1), FLUX with ``true_cfg_scale=cfg`` and a
    negative prompt when > 1 (its guidance embedding at 3.5). ``generator``: the one to draw the latents from, where
    the pipeline drew from it before (default: seeded with ``seed``)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

    generator = generator if generator is not None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if type(pipe).__name__.startswith("StableDiffusion3"):  # with or without a ControlNet
            emb, neg, pooled, neg_pooled = pipe.encode_prompt(
                prompt, None, None, negative_prompt=negative_prompt, do_classifier_free_guidance=cfg > 1,
                device="cpu", max_sequence_length=max_sequence_length,
            )  # fmt: skip
            if cfg > 1:
                emb, pooled = torch.cat([neg, emb]), torch.cat([neg_pooled, pooled])
            channels = pipe.transformer.config.in_channels
            latents = pipe.prepare_latents(1, channels, height, width, emb.dtype, "cpu", generator, None)
            pipe.scheduler.set_timesteps(steps, device="cpu")
            return dict(prompt_embeds=emb, pooled_prompt_embeds=pooled, latents=latents, guidance_scale=cfg,
                        timesteps=pipe.scheduler.timesteps, extra_step_kwargs={}, generator=generator)  # fmt: skip
        text = {}
        for prefix, text_prompt in (("", prompt), ("negative_", negative_prompt)):
            emb, pooled, ids = pipe.encode_prompt(
                text_prompt, None, device="cpu", max_sequence_length=max_sequence_length
            )
            text |= {f"{prefix}prompt_embeds": emb, f"{prefix}pooled_prompt_embeds": pooled, f"{prefix}text_ids": ids}
        channels = pipe.transformer.config.in_channels // 4
        latents, image_ids = pipe.prepare_latents(1, channels, height, width, emb.dtype, "cpu", generator, None)
        config = pipe.scheduler.config
        mu = calculate_shift(latents.shape[1], config.base_image_seq_len, config.max_image_seq_len,
                             config.base_shift, config.max_shift)  # fmt: skip
        sigmas = np.linspace(1.0, 1 / steps, steps)  # as FluxPipeline.__call__
        timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, "cpu", sigmas=sigmas, mu=mu)
        pipe.scheduler.set_begin_index(0)
        guidance = torch.full([1], 3.5).expand(1) if pipe.transformer.config.guidance_embeds else None
        return dict(text, latents=latents, latent_image_ids=image_ids, timesteps=timesteps, guidance=guidance,
                    true_cfg_scale=cfg, extra_step_kwargs={}, generator=generator)  # fmt: skip


def request_of(stage, inputs, scheduler, grid):
    """The engine's ``DenoiseRequest`` for ``stage`` on the oracle's ``inputs``, and how its final latents become the
    diffusers pipeline's layout (FLUX: packed)."""
    if stage.spec.name == "flux":
        from xfuse.families.common.packed import grid_to_packed, packed_to_grid
        from xfuse.families.flux.stage import denoise_request

        cfg = inputs["true_cfg_scale"] > 1
        keys = ("prompt_embeds", "pooled_prompt_embeds")
        text = {k: torch.cat([inputs[f"negative_{k}"], inputs[k]]) if cfg else inputs[k] for k in keys}
        guidance = inputs["guidance"]
        request = denoise_request(
            stage,
            latents=packed_to_grid(inputs["latents"], grid.token_rows).contiguous(),
            timesteps=inputs["timesteps"],
            scheduler=scheduler,
            text_ids=inputs["text_ids"],
            latent_image_ids=inputs["latent_image_ids"],
            guidance_value=None if guidance is None else guidance.expand(text["prompt_embeds"].shape[0]),
            true_cfg_scale=inputs["true_cfg_scale"],
            generator=inputs["generator"],
            **text,
        )
        return request, grid_to_packed
    from xfuse.families.sd3.stage import denoise_request

    keys = ("prompt_embeds", "pooled_prompt_embeds", "guidance_scale", "generator", "latents")
    request = denoise_request(stage, timesteps=inputs["timesteps"], scheduler=scheduler, **{k: inputs[k] for k in keys})
    return request, lambda x: x


def engine_latents(stage, plan, inputs, scheduler, grid, warmup, channels=None, rank=0):
    """Run PipeFusion's engine for ``stage`` on the oracle's ``inputs``; the final latents on the embedding rank, in
    the diffusers pipeline's layout (FLUX: packed)."""
    from xfuse.parallel.engine import PipeFusionEngine

    request, unpack = request_of(stage, inputs, scheduler, grid)
    engine = PipeFusionEngine(
        stage, plan, channels, pipe_rank=rank, group_ranks=list(range(plan.degree)), warmup_steps=warmup
    )
    out = engine.denoise(request, grid)
    return None if out is None else unpack(out)


def grid_of(spec, pipe, height, width, num_patches, lead_tokens=0):
    from xfuse.parallel.patch_grid import patch_grid

    scale = spec.latent_scale
    return patch_grid(height // scale, width // scale, num_patches, pipe.transformer.config.patch_size, lead_tokens)


def run_engine(
    preset, degree, num_patches, warmup, *, height, width, steps, cfg, placement="linear", counters=False, lead_tokens=0
):
    """PipeFusion on ranks 0 … degree-1 of the world (the others idle); rank 0 returns the final latents (with
    ``counters``: every rank of the pipeline returns ``(latents, its channels' counters)``). ``lead_tokens``: the
    grid cut by cost with the first patch carrying that many tokens (0: even rows)."""
    from xfuse.comm.p2p import P2PChannels
    from xfuse.config import ParallelConfig
    from xfuse.families.registry import model_spec

    rank = dist.get_rank()
    if rank >= degree:
        return None
    pipe, spec = tiny(preset), model_spec(preset)
    plan = spec.plan(spec.num_blocks(pipe.transformer.config), ParallelConfig(pipefusion_degree=degree,
                                                                             placement=placement))  # fmt: skip
    stage = spec.stage_class()(copy.deepcopy(pipe.transformer), plan, rank)
    channels = P2PChannels(rank=rank, timeout_s=60, max_inflight=2, device=torch.device("cpu"))
    inputs = prepare_inputs(pipe, height=height, width=width, steps=steps, cfg=cfg)
    grid = grid_of(spec, pipe, height, width, num_patches, lead_tokens)
    try:
        out = engine_latents(stage, plan, inputs, copy.deepcopy(pipe.scheduler), grid, warmup, channels, rank)
        return (out, channels.counters.as_dict()) if counters else out
    finally:
        channels.close()


def traced_patch_tokens(preset, parallel, call):
    """On every rank: the family's xfuse pipeline class on ``preset``, one traced ``__call__(**call)``; returns the
    tokens of each patch its denoising loop ran, the text the first carries included (the loop span's
    ``patch_tokens``), and the names of the spans on the pipeline-call track (``trace.call_time``)."""
    from xfuse.families.registry import load_pipeline, model_spec
    from xfuse.parallel.trace import LOOP, call_time

    pipe = model_spec(preset).pipeline_class().from_pipe(load_pipeline(preset), parallel=parallel)
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_trace()
    pipe(**call)
    events = pipe.trace_events()
    (loop,) = [e for e in events if e["tid"] == LOOP]
    return list(loop["args"]["patch_tokens"]), sorted(call_time(events))
