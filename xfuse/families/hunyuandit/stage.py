"""HunyuanDiT adapter: one rank's share of a diffusers ``HunyuanDiT2DModel``, run whole-image or patch by patch.

The diffusers blocks, embedders and output layer run as they are; sharding and checkpoint reading are
``ShardedStage``'s, the attention processors ``xfuse.families.common.attention``'s. What this file adds: HunyuanDiT's
text states and RoPE table built as its pipeline builds them, and the long skips routed between segments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from diffusers.models.embeddings import get_2d_rotary_pos_embed
from diffusers.models.transformers.hunyuan_transformer_2d import HunyuanDiT2DModel
from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

from xfuse.families.common.guidance import cfg_batch, guidance
from xfuse.families.common.layers import unpatchify
from xfuse.families.common.sharding import ShardedStage
from xfuse.families.hunyuandit.spec import HUNYUANDIT
from xfuse.parallel.patch_grid import PatchBand
from xfuse.parallel.stage import BatchPart
from xfuse.parallel.stage_plan import Segment, StagePlan


@dataclass
class Conditioning:
    """What every block of one denoising step needs besides the hidden states."""

    temb: torch.Tensor  # (B, hidden)
    text: torch.Tensor  # (B, 77 + 256, cross_attention_dim): BERT and projected T5 states, padding swapped in
    rope: tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (tokens, head_dim), row-major over the whole image
    part: BatchPart | None = None  # the batch rows these tensors are (ShardedStage.batch_part); None: all

    STEP_FIELDS: ClassVar = ("temb",)  # batch-indexed tensors (see batch_part)
    REQUEST_FIELDS: ClassVar = ("text",)
    MODULATION: ClassVar = "temb"  # what every block's adaptive norms take (ShardedStage.prepare_step)


def text_states(
    model: HunyuanDiT2DModel,
    encoder_hidden_states,
    text_embedding_mask,
    encoder_hidden_states_t5,
    text_embedding_mask_t5,
) -> torch.Tensor:
    """The cross-attention input, as ``diffusers.HunyuanDiT2DModel.forward`` builds it: constant for a whole request."""
    batch, seq, _ = encoder_hidden_states_t5.shape
    t5 = model.text_embedder(encoder_hidden_states_t5.view(-1, encoder_hidden_states_t5.shape[-1]))
    t5 = t5.view(batch, seq, -1)  # (B*S, D_t5) -> (B, S, D)
    text = torch.cat([encoder_hidden_states, t5], dim=1)  # (B, 77 + 256, D)
    mask = torch.cat([text_embedding_mask, text_embedding_mask_t5], dim=-1).unsqueeze(2).bool()  # (B, 333, 1)
    return torch.where(mask, text, model.text_embedding_padding)


def rotary_embedding(config, latent_height: int, latent_width: int, device=None):
    """The 2D RoPE (cos, sin), each (tokens, head_dim), exactly as ``diffusers.HunyuanDiTPipeline.__call__`` builds
    it."""
    grid = (latent_height // config.patch_size, latent_width // config.patch_size)  # token rows, token cols
    base_size = 512 // 8 // config.patch_size  # mirrors ``diffusers.HunyuanDiTPipeline.__call__`` (its literal VAE 8)
    crops = get_resize_crop_region_for_grid(grid, base_size)
    return get_2d_rotary_pos_embed(config.attention_head_dim, crops, grid, device=device, output_type="pt")


class HunyuanDiTStage(ShardedStage):
    """The part of a ``HunyuanDiT2DModel`` that one pipeline rank runs (the ``Stage`` the engine calls).

    Args:
        transformer: the diffusers model; it is modified in place (blocks of other ranks dropped, processors set).
        plan: the stage plan (with HunyuanDiT's long skips); ``rank``: this rank.
    """

    spec = HUNYUANDIT
    blocks_attrs = ("blocks",)
    embed_modules = ("pos_embed",)
    output_modules = ("norm_out", "proj_out")

    def __init__(self, transformer: HunyuanDiT2DModel, plan: StagePlan, rank: int):
        super().__init__(transformer, plan, rank)
        self.skip_source = {s.consumer: s.producer for s in plan.skips}  # consumer block -> producer block
        self.skip_producers = {s.producer for s in plan.skips}

    def conditioning(self, timestep, text, encoder_hidden_states_t5, image_meta_size, style, rope) -> Conditioning:
        """Per-step conditioning: ``temb`` from timestep, pooled T5 states and size/style (cheap, per token-free)."""
        temb = self.transformer.time_extra_emb(
            timestep, encoder_hidden_states_t5, image_meta_size, style, hidden_dtype=timestep.dtype
        )  # (B, hidden)
        return Conditioning(temb, text, rope)

    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        """(B, C, rows, W) latent rows -> (B, band tokens, hidden). HunyuanDiT's positions are RoPE, applied in the
        attention with the band's rows of the whole-image table: the patch embedding itself has none."""
        hidden = self.transformer.pos_embed(latent_rows)  # (B, rows * cols, D)
        return hidden if band is None else band.trim(hidden)

    def run_segment(
        self,
        hidden: torch.Tensor,
        segment: Segment,
        cond: Conditioning,
        band: PatchBand | None,
        skips: dict[int, torch.Tensor],
        keep_kv: bool = True,
        streams: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run ``segment``'s blocks on ``hidden`` (B, tokens, hidden): the band's tokens, or the whole image.

        ``skips`` maps a producer block to its output for this patch: producers add to it, consumers pop from it.
        ``keep_kv=False`` (whole image only): do not store this pass's K/V, no patch will read them.
        """
        self.begin_pass(cond, band, keep_kv)
        cos, sin = cond.rope
        tokens = self.hidden_tokens(band)  # the rows of the whole-image table this pass's tokens have
        rope = (cos, sin) if tokens == slice(0, len(cos)) else (cos[tokens], sin[tokens])  # (tokens, head_dim) each
        for index in segment.blocks:
            skip = skips.pop(self.skip_source[index]) if index in self.skip_source else None
            hidden = self.transformer.blocks[index](
                hidden, temb=cond.temb, encoder_hidden_states=cond.text, image_rotary_emb=rope, skip=skip
            )
            if index in self.skip_producers:
                skips[index] = hidden
        return hidden

    def head(
        self, hidden: torch.Tensor, cond: Conditioning, token_cols: int, band: PatchBand | None = None
    ) -> torch.Tensor:
        """(B, tokens, hidden) -> model output (B, out_channels, rows * p, token_cols * p) of the same band; mirrors
        the output layer of ``diffusers.HunyuanDiT2DModel.forward``."""
        model = self.transformer
        out = model.proj_out(model.norm_out(hidden, cond.temb.to(torch.float32)))  # (B, tokens, p*p*C)
        return unpatchify(out, token_cols, model.config.patch_size, model.out_channels, band)


def denoise_request(
    stage: HunyuanDiTStage,
    *,
    latents,
    timesteps,
    scheduler,
    prompt_embeds,
    prompt_attention_mask,
    prompt_embeds_2,
    prompt_attention_mask_2,
    image_meta_size,
    style,
    guidance_scale: float,
    guidance_rescale: float = 0.0,
    cfg_half=None,
    extra_step_kwargs=None,
    generator=None,
    on_step_end=None,
    on_progress=None,
):
    """The engine's ``DenoiseRequest`` for HunyuanDiT, built from what ``HunyuanDiTPipeline`` prepares.

    Text inputs are batched as the pipeline batches them: [uncond, cond] when ``guidance_scale > 1``. With CFG
    parallelism (``cfg_half=(cfg_rank, exchange)``) they are this rank's half only (0: uncond, 1: cond) and
    ``exchange(noise, step, patch)`` returns the other half's noise prediction of the same rows. The
    cross-attention input is computed once here, so every step and patch passes the same tensor (which lets
    ``CachedCrossAttnProcessor`` reuse the text K/V).
    """
    from xfuse.parallel.request import DenoiseRequest

    model_batch, model_input = cfg_batch(latents, guidance_scale, cfg_half)
    rope = rotary_embedding(stage.config, latents.shape[-2], latents.shape[-1], device=latents.device)
    text = text_states(
        stage.transformer, prompt_embeds, prompt_attention_mask, prompt_embeds_2, prompt_attention_mask_2
    )

    # Mirrors ``diffusers.HunyuanDiTPipeline.__call__``'s t_expand for every step at once (one copy and cast per
    # request): ``torch.tensor([t] * B, device=device).to(dtype=latent_model_input.dtype)`` keeps t's dtype (int64
    # from DDPM) and casts on the device, as here. Built per step, that ``torch.tensor`` of a list of tensors read each
    # t to the host and copied the list back: 3 host/device synchronisations a step (60 in 20 steps on an H100,
    # benchmarks/results/gpu.md).
    t_table = timesteps.to(latents.device).to(latents.dtype)  # (steps,), on the latents' device and in their dtype
    t_table = t_table[:, None].expand(-1, model_batch).contiguous()  # (steps,) -> (steps, model_batch)

    def conditioning(step: int, t: torch.Tensor) -> Conditioning:
        t_batch = t_table[step]  # (model_batch,): t = timesteps[step] (the engine's call), as diffusers' t_expand
        return stage.conditioning(t_batch, text, prompt_embeds_2, image_meta_size, style, rope)

    return DenoiseRequest(
        latents=latents,
        timesteps=timesteps,
        scheduler=scheduler,
        conditioning=conditioning,
        model_input=model_input,
        guide=guidance(guidance_scale, cfg_half, learned_sigma=True, guidance_rescale=guidance_rescale),
        model_batch=model_batch,
        extra_step_kwargs=extra_step_kwargs or {},
        generator=generator,
        on_step_end=on_step_end,
        on_progress=on_progress,
    )
