"""PixArt-Σ adapter: one rank's share of a diffusers ``PixArtTransformer2DModel``, run whole-image or patch by patch.

The diffusers blocks (``BasicTransformerBlock`` with AdaLN-single), caption projection, timestep embedder and
output layer run as they are. PixArt's blocks are a plain chain (no long skips) and only self-attention mixes image
tokens; its positions are a sin-cos table added in the patch embedding, which this adapter builds once for the whole
image and slices per band (``PatchEmbed.forward`` on a band would rescale the grid to the band's height).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from diffusers.models.embeddings import get_2d_sincos_pos_embed
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel

from xfuse.families.common.guidance import cfg_batch, guidance
from xfuse.families.common.layers import unpatchify
from xfuse.families.common.sharding import ShardedStage
from xfuse.families.pixart.spec import PIXART_SIGMA
from xfuse.parallel.patch_grid import PatchBand, PatchGrid
from xfuse.parallel.stage import BatchPart
from xfuse.parallel.stage_plan import Segment, StagePlan


@dataclass
class PixArtConditioning:
    """What every block of one denoising step needs besides the hidden states."""

    timestep: torch.Tensor  # (B, 6 * hidden): AdaLN-single modulation of every block
    embedded_timestep: torch.Tensor  # (B, hidden): modulation of the output layer
    text: torch.Tensor  # (B, S_text, hidden): projected T5 states, constant for the request
    text_bias: torch.Tensor | None  # (B, 1, S_text): 0 for a kept text token, -10000 for padding
    part: BatchPart | None = None  # the batch rows these tensors are (ShardedStage.batch_part); None: all

    STEP_FIELDS: ClassVar = ("timestep", "embedded_timestep")  # batch-indexed tensors (see batch_part)
    REQUEST_FIELDS: ClassVar = ("text", "text_bias")


class PixArtStage(ShardedStage):
    """The part of a ``PixArtTransformer2DModel`` that one pipeline rank runs (the ``Stage`` the engine calls)."""

    REQUEST_STATE = (*ShardedStage.REQUEST_STATE, "_positions")  # the request's position table

    spec = PIXART_SIGMA
    blocks_attrs = ("transformer_blocks",)
    embed_modules = ("pos_embed",)
    output_modules = ("norm_out", "proj_out", "scale_shift_table")

    def __init__(self, transformer: PixArtTransformer2DModel, plan: StagePlan, rank: int):
        super().__init__(transformer, plan, rank)
        if plan.skips:
            raise ValueError("PixArt's blocks are a plain chain: its stage plan cannot have long skips")
        config = transformer.config
        if config.norm_type != "ada_norm_single" or transformer.use_additional_conditions:
            raise ValueError("xfuse runs PixArt-Σ (ada_norm_single, no resolution/aspect-ratio conditioning)")
        if transformer.pos_embed is not None and transformer.pos_embed.pos_embed_max_size is not None:
            raise ValueError("PixArt patch embedding with pos_embed_max_size (SD3-style cropping) is not supported")
        self._positions: torch.Tensor | None = None

    def begin_request(self, grid: PatchGrid) -> None:
        """Start a request: forget every K/V, and build the whole image's position table (embedding rank)."""
        super().begin_request(grid)
        embed = self.transformer.pos_embed
        if embed is None:
            return
        # Mirrors ``diffusers.models.embeddings.PatchEmbed.forward``: the stored table at the configured size, else one
        # for the whole image's grid.
        if (grid.token_rows, grid.token_cols) == (embed.height, embed.width):
            self._positions = embed.pos_embed  # (1, tokens, hidden)
        else:
            table = get_2d_sincos_pos_embed(
                embed_dim=embed.pos_embed.shape[-1],
                grid_size=(grid.token_rows, grid.token_cols),
                base_size=embed.base_size,
                interpolation_scale=embed.interpolation_scale,
                device=embed.pos_embed.device,
                output_type="pt",
            )
            self._positions = table.float().unsqueeze(0)  # (tokens, hidden) -> (1, tokens, hidden)

    def text_states(self, prompt_embeds: torch.Tensor) -> torch.Tensor:
        """(B, S_text, D_t5) -> (B, S_text, hidden): ``caption_projection`` as the model's forward applies it."""
        batch = prompt_embeds.shape[0]
        return self.transformer.caption_projection(prompt_embeds).view(batch, -1, self.hidden_size)

    def conditioning(self, timestep: torch.Tensor, text, text_bias, dtype) -> PixArtConditioning:
        """Per-step conditioning from the (B,) timestep, as ``diffusers.PixArtTransformer2DModel.forward`` builds it."""
        modulation, embedded = self.transformer.adaln_single(
            timestep, {"resolution": None, "aspect_ratio": None}, batch_size=timestep.shape[0], hidden_dtype=dtype
        )
        return PixArtConditioning(modulation, embedded, text, text_bias)

    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        """(B, C, rows, W) -> (B, band tokens, hidden): mirrors ``diffusers.models.embeddings.PatchEmbed.forward`` with
        the band's rows of the whole image's position table."""
        embed = self.transformer.pos_embed
        hidden = embed.proj(latent_rows).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h*w, D)
        if embed.layer_norm:
            hidden = embed.norm(hidden)
        positions = self._positions if band is None else self._positions[:, band.row_tokens]  # (1, tokens, D)
        if positions.shape[1] != hidden.shape[1]:
            raise RuntimeError("PixArtStage.embed: begin_request() was not called for this request's grid")
        hidden = (hidden + positions).to(hidden.dtype)
        return hidden if band is None else band.trim(hidden)  # -> (B, band tokens, D)

    def run_segment(
        self,
        hidden: torch.Tensor,
        segment: Segment,
        cond: PixArtConditioning,
        band: PatchBand | None,
        skips: dict[int, torch.Tensor],
        keep_kv: bool = True,
        streams: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run ``segment``'s blocks on (B, tokens, hidden): the band's tokens, or the whole image."""
        self.begin_pass(cond, band, keep_kv)
        for index in segment.blocks:
            hidden = self.blocks[index](
                hidden,
                encoder_hidden_states=cond.text,
                encoder_attention_mask=cond.text_bias,
                timestep=cond.timestep,
            )
        return hidden

    def head(
        self, hidden: torch.Tensor, cond: PixArtConditioning, token_cols: int, band: PatchBand | None = None
    ) -> torch.Tensor:
        """(B, tokens, hidden) -> (B, out_channels, rows * p, token_cols * p): mirrors the output layer of
        ``diffusers.PixArtTransformer2DModel.forward``."""
        model = self.transformer
        table = model.scale_shift_table[None]  # (1, 2, hidden)
        shift, scale = (table + cond.embedded_timestep[:, None].to(table.device)).chunk(2, dim=1)  # (B, 1, D) each
        out = model.proj_out(model.norm_out(hidden) * (1 + scale) + shift)  # (B, tokens, p*p*C)
        return unpatchify(out, token_cols, model.config.patch_size, model.out_channels, band)


def denoise_request(
    stage: PixArtStage,
    *,
    latents,
    timesteps,
    scheduler,
    prompt_embeds,
    prompt_attention_mask,
    guidance_scale: float,
    cfg_half=None,
    extra_step_kwargs=None,
    generator=None,
    on_step_end=None,
):
    """The engine's ``DenoiseRequest`` for PixArt-Σ, built from what ``PixArtSigmaPipeline`` prepares.

    Text is batched as the pipeline batches it ([uncond, cond] when ``guidance_scale > 1``), or this CFG group's half
    with ``cfg_half`` (see ``xfuse.families.common.guidance``). The projected text and its mask bias are computed once
    here.
    """
    from xfuse.parallel.request import DenoiseRequest

    model_batch, model_input = cfg_batch(latents, guidance_scale, cfg_half)
    text = stage.text_states(prompt_embeds)
    # Mirrors ``diffusers.PixArtTransformer2DModel.forward``: a (B, S) keep-mask becomes a (B, 1, S) additive bias.
    text_bias = ((1 - prompt_attention_mask.to(latents.dtype)) * -10000.0).unsqueeze(1)
    learned_sigma = stage.config.out_channels // 2 == stage.config.in_channels

    def conditioning(step: int, t: torch.Tensor) -> PixArtConditioning:
        timestep = t.reshape(1).to(latents.device).expand(model_batch)  # as PixArtSigmaPipeline broadcasts it
        return stage.conditioning(timestep, text, text_bias, latents.dtype)

    return DenoiseRequest(
        latents=latents,
        timesteps=timesteps,
        scheduler=scheduler,
        conditioning=conditioning,
        model_input=model_input,
        guide=guidance(guidance_scale, cfg_half, learned_sigma=learned_sigma),
        model_batch=model_batch,
        extra_step_kwargs=extra_step_kwargs or {},
        generator=generator,
        on_step_end=on_step_end,
    )
