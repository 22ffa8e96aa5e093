"""SD3 / SD3.5 adapter: one rank's share of a diffusers ``SD3Transformer2DModel``, run whole-image or patch by patch.

The diffusers ``JointTransformerBlock``s run as they are, with ``xfuse.families.common.joint``'s processor on their
joint attention (and on SD3.5's image-only ``attn2``); the text stream is ``JointStage``'s. What this file adds: SD3's
positions (``PatchEmbed`` with ``pos_embed_max_size`` crops a centred window of its table: the window is cut once
for the whole image and sliced per band, since cropping for a band would centre the band), its conditioning and
its output layer.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_processor import JointAttnProcessor2_0
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

from xfuse.families.common.joint import StaleJointAttnProcessor
from xfuse.families.common.layers import unpatchify
from xfuse.families.common.mmdit import JointConditioning, JointStage, joint_request
from xfuse.families.sd3.spec import STABLE_DIFFUSION_3
from xfuse.parallel.patch_grid import PatchBand, PatchGrid
from xfuse.parallel.stage_plan import StagePlan


class SD3Stage(JointStage):
    """The part of an ``SD3Transformer2DModel`` that one pipeline rank runs (the ``Stage`` the engine calls)."""

    REQUEST_STATE = (*JointStage.REQUEST_STATE, "_positions")  # the request's position window

    spec = STABLE_DIFFUSION_3
    blocks_attrs = ("transformer_blocks",)
    embed_modules = ("pos_embed",)
    output_modules = ("norm_out", "proj_out")
    processor_class = StaleJointAttnProcessor
    mirrored_processor = JointAttnProcessor2_0

    def __init__(self, transformer: SD3Transformer2DModel, plan: StagePlan, rank: int):
        super().__init__(transformer, plan, rank)
        if plan.skips:
            raise ValueError("SD3's blocks are a plain chain: its stage plan cannot have long skips")
        embed = transformer.pos_embed
        if embed is not None and embed.pos_embed_max_size is None:
            raise ValueError("SD3 patch embedding without pos_embed_max_size is not supported")
        self._positions: torch.Tensor | None = None

    def begin_request(self, grid: PatchGrid) -> None:
        """Start a request: forget every K/V; the embedding rank crops the whole image's position window."""
        super().begin_request(grid)
        embed = self.transformer.pos_embed
        if embed is not None:
            # Mirrors ``diffusers.models.embeddings.PatchEmbed.forward`` (latent height/width in latent pixels); raises
            # past pos_embed_max_size.
            self._positions = embed.cropped_pos_embed(grid.latent_height, grid.latent_width)  # (1, tokens, hidden)

    def conditioning(self, timestep: torch.Tensor, pooled: torch.Tensor, text: torch.Tensor) -> JointConditioning:
        """Per-step conditioning from the (B,) timestep, as ``diffusers.SD3Transformer2DModel.forward`` builds it."""
        return JointConditioning(self.transformer.time_text_embed(timestep, pooled), text)

    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        """(B, C, rows, W) -> (B, band tokens, hidden): mirrors ``diffusers.models.embeddings.PatchEmbed.forward`` with
        the band's rows of the whole image's cropped position window."""
        embed = self.transformer.pos_embed
        hidden = embed.proj(latent_rows).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h*w, D)
        if embed.layer_norm:
            hidden = embed.norm(hidden)
        positions = self._positions if band is None else self._positions[:, band.row_tokens]  # (1, tokens, D)
        if positions.shape[1] != hidden.shape[1]:
            raise RuntimeError("SD3Stage.embed: begin_request() was not called for this request's grid")
        hidden = (hidden + positions).to(hidden.dtype)  # as SD3Transformer2DModel.forward
        return (hidden if band is None else band.trim(hidden)).contiguous()  # -> (B, band tokens, D)

    def head(
        self, hidden: torch.Tensor, cond: JointConditioning, token_cols: int, band: PatchBand | None = None
    ) -> torch.Tensor:
        """(B, tokens, hidden) -> (B, out_channels, rows * p, token_cols * p): mirrors the end of
        ``diffusers.SD3Transformer2DModel.forward``."""
        model = self.transformer
        out = model.proj_out(model.norm_out(hidden, cond.temb))  # (B, tokens, p*p*C)
        return unpatchify(out, token_cols, model.config.patch_size, model.out_channels, band)


def denoise_request(
    stage: SD3Stage,
    *,
    latents,
    timesteps,
    scheduler,
    prompt_embeds,
    pooled_prompt_embeds,
    guidance_scale: float,
    cfg_half=None,
    generator=None,
    on_step_end=None,
):
    """The engine's ``DenoiseRequest`` for SD3, built from what ``StableDiffusion3Pipeline`` prepares (text batched
    [uncond, cond] when ``guidance_scale > 1``; see ``joint_request``)."""
    return joint_request(
        stage,
        latents=latents,
        timesteps=timesteps,
        scheduler=scheduler,
        prompt_embeds=prompt_embeds,
        cfg_scale=guidance_scale,
        conditioning=lambda timestep, text: stage.conditioning(timestep, pooled_prompt_embeds, text),
        cfg_half=cfg_half,
        generator=generator,
        on_step_end=on_step_end,
    )
