"""FLUX.1 adapter: one rank's share of a diffusers ``FluxTransformer2DModel``, run whole-image or patch by patch.

Its 19 double-stream and 38 single-stream blocks are indexed as one chain (double first), so a stage boundary can fall
anywhere; both kinds take (image, text) separately and return both, and run as they are with
``xfuse.families.common.joint``'s processor. The latent the engine steps is FluxPipeline's packed latent viewed as a
grid: packed ``(B, rows * cols, C * 4)`` -> ``(B, C * 4, rows, cols)``, one latent row per packed token row, so a patch
is a band of packed token rows (2 VAE latent rows each) and the scheduler, elementwise, steps it unchanged. RoPE
(``FluxPosEmbed`` over text ids then image ids) is computed once per request for the whole image and its rows are sliced
per band: a band's ids must keep their rows in the whole image.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, FluxTransformer2DModel

from xfuse.families.common.joint import StaleFluxAttnProcessor
from xfuse.families.common.mmdit import JointConditioning, joint_request
from xfuse.families.common.packed import PackedJointStage
from xfuse.families.flux.spec import FLUX
from xfuse.families.generic.request import forward_request
from xfuse.families.generic.stage import ForwardStage
from xfuse.parallel.stage_plan import StagePlan


class FluxStage(PackedJointStage):
    """The part of a ``FluxTransformer2DModel`` that one pipeline rank runs (the ``Stage`` the engine calls)."""

    spec = FLUX
    processor_class = StaleFluxAttnProcessor
    mirrored_processor = FluxAttnProcessor

    def __init__(self, transformer: FluxTransformer2DModel, plan: StagePlan, rank: int):
        super().__init__(transformer, plan, rank)
        if plan.skips:
            raise ValueError("FLUX's blocks are a plain chain: its stage plan cannot have long skips")

    def conditioning(self, timestep, guidance_value, pooled, text, rope) -> JointConditioning:
        """Per-step conditioning, as ``diffusers.FluxTransformer2DModel.forward`` builds it from FluxPipeline's
        ``timestep / 1000`` and ``guidance``."""
        dtype = text.dtype
        timestep = timestep.to(dtype) * 1000
        embed = self.transformer.time_text_embed
        if guidance_value is None:
            temb = embed(timestep, pooled)
        else:
            temb = embed(timestep, guidance_value.to(dtype) * 1000, pooled)
        return JointConditioning(temb, text, rope)


def denoise_request(
    stage: FluxStage | ForwardStage,
    *,
    latents,
    timesteps,
    scheduler,
    prompt_embeds,
    pooled_prompt_embeds,
    text_ids,
    latent_image_ids,
    guidance_value,
    true_cfg_scale: float = 1.0,
    cfg_half=None,
    generator=None,
    on_step_end=None,
):
    """The engine's ``DenoiseRequest`` for FLUX, built from what ``FluxPipeline`` prepares.

    ``latents``: the engine grid of the packed latents. With true CFG (``true_cfg_scale > 1``) the text is batched
    [negative, positive] and both run in one transformer batch (diffusers runs two calls; per sample they are the
    same computation), combined as ``neg + true_cfg_scale * (pos - neg)``. ``guidance_value``: the (B',) embedded
    guidance of guidance-distilled models (FLUX.1-dev), ``None`` otherwise.

    With ``parallel.adapter: generic`` (a ``ForwardStage``), the request of the transformer's own forward with the
    arguments ``FluxPipeline`` passes it.
    """
    if isinstance(stage, ForwardStage):
        inputs = dict(encoder_hidden_states=prompt_embeds, pooled_projections=pooled_prompt_embeds, txt_ids=text_ids,
                      img_ids=latent_image_ids)  # fmt: skip
        batched: tuple[str, ...] = ("encoder_hidden_states", "pooled_projections")
        if guidance_value is not None:
            inputs["guidance"], batched = guidance_value, (*batched, "guidance")
        batch, channels, rows, cols = latents.shape
        return forward_request(stage, latents=latents, timesteps=timesteps, scheduler=scheduler, inputs=inputs,
                               batched=batched, timestep=lambda t: t.to(latents.dtype) / 1000,
                               input_shape=(batch, rows * cols, channels), cfg_scale=true_cfg_scale, cfg_half=cfg_half,
                               generator=generator, on_step_end=on_step_end)  # fmt: skip
    rope = stage.rotary_embedding(text_ids, latent_image_ids)

    def conditioning(timestep: torch.Tensor, text: torch.Tensor) -> JointConditioning:
        # FluxPipeline passes t.expand(B).to(latents.dtype) / 1000
        return stage.conditioning(timestep.to(latents.dtype) / 1000, guidance_value, pooled_prompt_embeds, text, rope)

    return joint_request(
        stage,
        latents=latents,
        timesteps=timesteps,
        scheduler=scheduler,
        prompt_embeds=prompt_embeds,
        cfg_scale=true_cfg_scale,
        conditioning=conditioning,
        cfg_half=cfg_half,
        generator=generator,
        on_step_end=on_step_end,
    )
