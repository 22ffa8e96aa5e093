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
from xfuse.families.common.mmdit import JointConditioning, JointStage, joint_request
from xfuse.families.flux.spec import FLUX
from xfuse.parallel.patch_grid import PatchBand
from xfuse.parallel.stage_plan import StagePlan


def packed_to_grid(packed: torch.Tensor, token_rows: int) -> torch.Tensor:
    """FluxPipeline's packed latents (B, rows * cols, C4) -> the engine's grid (B, C4, rows, cols)."""
    batch, tokens, channels = packed.shape
    grid = packed.reshape(batch, token_rows, tokens // token_rows, channels)  # (B, rows, cols, C4)
    return grid.permute(0, 3, 1, 2)  # -> (B, C4, rows, cols)


def grid_to_packed(grid: torch.Tensor) -> torch.Tensor:
    """The engine's grid (B, C4, rows, cols) -> FluxPipeline's packed latents (B, rows * cols, C4)."""
    return grid.permute(0, 2, 3, 1).flatten(1, 2)  # (B, rows, cols, C4) -> (B, rows * cols, C4)


class FluxStage(JointStage):
    """The part of a ``FluxTransformer2DModel`` that one pipeline rank runs (the ``Stage`` the engine calls)."""

    spec = FLUX
    blocks_attrs = ("transformer_blocks", "single_transformer_blocks")
    embed_modules = ("x_embedder",)
    output_modules = ("norm_out", "proj_out")
    processor_class = StaleFluxAttnProcessor
    mirrored_processor = FluxAttnProcessor

    def __init__(self, transformer: FluxTransformer2DModel, plan: StagePlan, rank: int):
        super().__init__(transformer, plan, rank)
        if plan.skips:
            raise ValueError("FLUX's blocks are a plain chain: its stage plan cannot have long skips")

    def rotary_embedding(self, text_ids: torch.Tensor, image_ids: torch.Tensor):
        """(cos, sin), each (T + image tokens, head_dim): ``FluxPosEmbed`` over the whole image, as
        ``FluxTransformer2DModel.forward`` computes it from ``cat(txt_ids, img_ids)``."""
        return self.transformer.pos_embed(torch.cat((text_ids, image_ids), dim=0))

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

    def block_kwargs(self, cond: JointConditioning, band: PatchBand | None, owner: bool) -> dict:
        """The RoPE rows of this pass's sequence: [text (owner only), the image tokens of the band (or of this
        rank's chunk of it)]."""
        cos, sin = cond.rope
        text_len = cond.text.shape[1]
        text = self.text_tokens()  # the text tokens this rank holds (all, or its SP chunk)
        self.joint.text_tokens = text.stop - text.start if owner else 0
        tokens = self.hidden_tokens(band)  # the image tokens this pass's hidden states are
        if tokens == slice(0, len(cos) - text_len) and text == slice(0, text_len):
            return {"image_rotary_emb": (cos, sin)}
        rows = slice(text_len + tokens.start, text_len + tokens.stop)
        if not owner:
            return {"image_rotary_emb": (cos[rows], sin[rows])}
        return {"image_rotary_emb": tuple(torch.cat([x[text], x[rows]]) for x in (cos, sin))}

    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        """(B, C4, rows, cols) packed latent rows -> (B, band tokens, hidden): ``x_embedder`` on the packed tokens."""
        tokens = grid_to_packed(latent_rows)  # (B, rows * cols, C4)
        return self.transformer.x_embedder(tokens if band is None else band.trim(tokens))  # (B, band tokens, hidden)

    def head(
        self, hidden: torch.Tensor, cond: JointConditioning, token_cols: int, band: PatchBand | None = None
    ) -> torch.Tensor:
        """(B, band tokens, hidden) -> (B, C4, rows, token_cols) of the rows covering the band: mirrors the end of
        ``diffusers.FluxTransformer2DModel.forward`` (packed output), as engine grid rows."""
        model = self.transformer
        out = model.proj_out(model.norm_out(hidden, cond.temb))  # (B, band tokens, C4)
        out = out if band is None else band.pad(out)  # -> (B, covering rows' tokens, C4)
        return packed_to_grid(out, out.shape[1] // token_cols)


def denoise_request(
    stage: FluxStage,
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
    """
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
