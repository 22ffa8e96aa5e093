"""The engine's ``DenoiseRequest`` for a ``ForwardStage``: the transformer's forward arguments of each step, as the
diffusers pipeline passes them to its transformer in its denoising loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from xfuse.families.common.guidance import cfg_batch, guidance
from xfuse.families.generic.stage import TEXT, ForwardConditioning, ForwardStage
from xfuse.parallel.video_layout import VideoLayout


def forward_request(
    stage: ForwardStage,
    *,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    scheduler,
    inputs: dict[str, Any],
    batched: tuple[str, ...],
    timestep: Callable[[torch.Tensor], torch.Tensor],
    input_shape: tuple[int, ...],
    cfg_scale: float = 1.0,
    guide_scale: float | None = None,
    guidance_rescale: float = 0.0,
    cfg_half=None,
    layout: VideoLayout | None = None,
    hidden_dtype: torch.dtype | None = None,
    generator=None,
    on_step_end=None,
):
    """The request of one denoising loop on ``stage``.

    ``latents``: the engine's grid (B, C, rows, W). ``inputs``: the transformer's forward arguments besides its latent
    and timestep, for the transformer batch (with CFG [uncond, cond], or this CFG group's half with ``cfg_half``);
    ``batched``: those indexed by that batch. ``cfg_scale`` > 1 batches [uncond, cond], combined with ``guide_scale``
    where it is not ``cfg_scale`` (Wan 2.2's second expert's ``guidance_scale_2``) and rescaled by
    ``guidance_rescale`` (whole-image steps only). ``timestep(t)``: the forward's ``timestep`` at the scheduler's
    ``t``, expanded to the transformer batch (FluxPipeline passes ``t / 1000``). ``input_shape``: the transformer's
    whole latent input (its batch is the transformer batch's wherever given). ``layout``: a video's frames as the grid
    (``None``: an image). ``hidden_dtype``: the transformer's, where the latents are stepped in another (Wan: float32
    latents, a bfloat16 transformer): the latent input is cast to it."""
    from xfuse.parallel.request import DenoiseRequest

    model_batch, cfg_input = cfg_batch(latents, cfg_scale, cfg_half)
    dtype = latents.dtype if hidden_dtype is None else hidden_dtype

    def model_input(rows: torch.Tensor, where: slice = slice(None)) -> torch.Tensor:
        return cfg_input(rows).to(dtype)  # WanPipeline: latents.to(transformer_dtype)

    shape = (model_batch, *input_shape[1:])  # the transformer's whole latent input
    stream = stage.forward_plan.text_stream
    text_tokens = 0 if stream is None else inputs[stream].shape[1]

    def conditioning(step: int, t: torch.Tensor) -> ForwardConditioning:
        kwargs = inputs | {"timestep": timestep(t.expand(model_batch))}
        cond = ForwardConditioning(kwargs, (*batched, "timestep"), shape, text_tokens, layout)
        return stage.note_conditioning(step, cond)

    shapes = {} if stream is None else {TEXT: (model_batch, text_tokens, stage.hidden_size)}
    return DenoiseRequest(
        latents=latents,
        timesteps=timesteps,
        scheduler=scheduler,
        conditioning=conditioning,
        model_input=model_input,
        guide=guidance(
            cfg_scale if guide_scale is None else guide_scale,
            cfg_half,
            learned_sigma=False,
            batched=cfg_scale > 1,
            guidance_rescale=guidance_rescale,
        ),
        model_batch=model_batch,
        generator=generator,
        on_step_end=on_step_end,
        stream_shapes=shapes,
        hidden_dtype=hidden_dtype,
    )
