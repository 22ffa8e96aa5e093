"""Wan adapter: one rank's share of a diffusers ``WanTransformer3DModel``, run on the whole clip or patch by patch.

The engine sees a video's latent frames stacked into one tall image (``xfuse.parallel.video_layout``), in the order
``parallel.video_patches`` picks, so a patch is a run of frames or a strip of rows across every frame. Every layer of
Wan's blocks but self-attention is per token; self-attention goes through PipeFusion's stale-K/V buffers with each
token's 3-D RoPE from the whole clip's table, reordered to the layout's token order once per request. The diffusers
blocks (``WanTransformerBlock``: AdaLN from a table plus the step's projected timestep, self-attention with q/k
RMSNorm across heads and 3-D RoPE, cross-attention to the projected UMT5 text, MLP) run as they are; only their two
attention processors are PipeFusion's, mirroring
``diffusers.models.transformers.transformer_wan.WanAttnProcessor.__call__``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, WanTransformer3DModel

from xfuse.families.common.attention import CachedCrossAttnProcessor, StaleKVSelfAttnProcessor
from xfuse.families.common.guidance import cfg_batch, guidance
from xfuse.families.common.layers import project_heads, unpatchify
from xfuse.families.common.sharding import ShardedStage
from xfuse.families.generic.request import forward_request
from xfuse.families.generic.stage import ForwardStage
from xfuse.families.wan.spec import WAN
from xfuse.parallel.patch_grid import PatchBand
from xfuse.parallel.stage import BatchPart
from xfuse.parallel.stage_plan import Segment, StagePlan
from xfuse.parallel.video_layout import VideoLayout

# (cos, sin) halves, each (1, 1, tokens, head_dim / 2), in the layout's token order (``rope_pairs``)
RoPE = tuple[torch.Tensor, torch.Tensor]


@dataclass
class WanConditioning:
    """What every block of one denoising step needs besides the hidden states.

    With per-token timesteps (Wan 2.2 TI2V's image-to-video: the conditioning frame's tokens at timestep 0), the
    step's two timesteps (0 and t) are embedded once each and ``first_frame`` says which each token has; a pass gets
    per-token modulation only where its tokens have both (``modulation``)."""

    timestep_proj: torch.Tensor  # (B, 6, hidden): the step's AdaLN input of every block; (B, 2, 6, hidden) per token
    temb: torch.Tensor  # (B, hidden): the output layer's; (B, 2, hidden) per token
    text: torch.Tensor  # (B, S_text, hidden): projected UMT5 states, constant for the request
    rope: RoPE  # the whole clip's table in the layout's token order
    first_frame: FirstFrame | None = None  # image-to-video: each token's timestep (0 or t); None: one per sample
    part: BatchPart | None = None  # the batch rows these tensors are (ShardedStage.batch_part); None: all

    STEP_FIELDS: ClassVar = ("timestep_proj", "temb")  # batch-indexed tensors (see batch_part)
    REQUEST_FIELDS: ClassVar = ("text",)

    def modulation(self, tokens: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``(timestep_proj, temb)`` for the clip's tokens ``tokens``: (B, 6, D) and (B, D) where they share one
        timestep, else per token, (B, n, 6, D) and (B, n, D), the shapes ``WanTransformerBlock`` and the output layer
        take for Wan 2.2 TI2V (elementwise the same numbers either way)."""
        if self.first_frame is None:
            return self.timestep_proj, self.temb
        shared = self.first_frame.shared_level(tokens)  # known per request: no device read on the hot path
        if shared is not None:
            return self.timestep_proj[:, shared], self.temb[:, shared]
        index = self.first_frame.token_level[tokens]  # (n,) 0: timestep 0, 1: t
        return self.timestep_proj[:, index], self.temb[:, index]


def _heads(attn: WanAttention, x: torch.Tensor, proj, norm) -> torch.Tensor:
    """``norm(proj(x))`` split into heads (``project_heads``): Wan's q/k RMSNorm spans every head, before the split,
    unlike diffusers' ``Attention``'s per-head norm. (B, S, D) -> (B, heads, S, head_dim)."""
    return project_heads(attn, x, proj if norm is None else lambda t: norm(proj(t)))


def rope_pairs(cos: torch.Tensor, sin: torch.Tensor) -> RoPE:
    """Wan's (1, S, 1, head_dim) RoPE table -> the (1, 1, S, head_dim / 2) halves ``rotate`` multiplies by: the
    ``freqs_cos[..., 0::2]`` and ``freqs_sin[..., 1::2]`` that ``WanAttnProcessor`` takes in every block, heads first,
    taken once per request here."""
    return cos.transpose(1, 2)[..., 0::2].contiguous(), sin.transpose(1, 2)[..., 1::2].contiguous()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, heads, S, head_dim) with ``rope_pairs``' (1, 1, S, head_dim / 2) halves; mirrors the
    ``apply_rotary_emb`` inside ``diffusers.models.transformers.transformer_wan.WanAttnProcessor.__call__``
    (interleaved pairs)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)  # (..., hd) -> 2 x (..., hd/2)
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def check_wan_attention(attn: WanAttention, cross: bool) -> None:
    """The assumptions the processors below make about ``attn`` (diffusers 0.42's ``WanAttention``)."""
    if type(attn.processor) is not WanAttnProcessor:
        raise TypeError(f"expected WanAttnProcessor, found {type(attn.processor)}")
    if getattr(attn, "fused_projections", False):
        raise ValueError("fused Wan q/k/v projections are not supported: call unfuse_qkv_projections() first")
    if attn.add_k_proj is not None:
        raise ValueError("Wan image-to-video attention (an image context beside the text) is not supported")
    if attn.is_cross_attention != cross:
        raise ValueError(f"expected {'cross' if cross else 'self'}-attention")


class WanStaleKVSelfAttnProcessor(StaleKVSelfAttnProcessor):
    """Wan's self-attention through the stage's ``PassAttention`` (stale K/V, and sequence parallelism where the
    stage has it; ``attend``, the eager region of a compiled block, as every family's). Mirrors
    ``diffusers.models.transformers.transformer_wan.WanAttnProcessor.__call__`` without an image context: q/k/v
    projections, RMSNorm of q and k across heads, RoPE of this pass's tokens (K rotated before it is stored), SDPA,
    output projection."""

    def __call__(
        self, attn: WanAttention, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None
    ):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("WanStaleKVSelfAttnProcessor is for unmasked self-attention only")
        query = _heads(attn, hidden_states, attn.to_q, attn.norm_q)
        key = _heads(attn, hidden_states, attn.to_k, attn.norm_k)
        value = _heads(attn, hidden_states, attn.to_v, None)
        if rotary_emb is not None:
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        out, _ = self.attend((query, key, value))  # (B, S, heads * head_dim)
        return attn.to_out[1](attn.to_out[0](out))


class WanCachedCrossAttnProcessor(CachedCrossAttnProcessor):
    """Cross-attention to the text with its K/V computed once per request, Wan's q/k norms across heads."""

    def text_kv(self, attn, text):
        return _heads(attn, text, attn.to_k, attn.norm_k), _heads(attn, text, attn.to_v, None)

    def queries(self, attn, hidden_states):
        return _heads(attn, hidden_states, attn.to_q, attn.norm_q)


class WanStage(ShardedStage):
    """The part of a ``WanTransformer3DModel`` that one pipeline rank runs (the ``Stage`` the engine calls)."""

    spec = WAN
    blocks_attrs = ("blocks",)
    embed_modules = ("patch_embedding",)
    output_modules = ("norm_out", "proj_out", "scale_shift_table")

    def __init__(self, transformer: WanTransformer3DModel, plan: StagePlan, rank: int):
        config = transformer.config
        if tuple(config.patch_size)[0] != 1 or config.patch_size[1] != config.patch_size[2]:
            raise ValueError(f"xfuse runs Wan with patch_size (1, p, p) (got {tuple(config.patch_size)})")
        if config.image_dim is not None or config.added_kv_proj_dim is not None:
            raise ValueError("xfuse runs Wan's text-to-video transformers (no image_dim / added_kv_proj_dim)")
        super().__init__(transformer, plan, rank)
        if plan.skips:
            raise ValueError("Wan's blocks are a plain chain: its stage plan cannot have long skips")

    def install_processors(self, block, index: int) -> None:
        check_wan_attention(block.attn1, cross=False)
        check_wan_attention(block.attn2, cross=True)
        block.attn1.set_processor(WanStaleKVSelfAttnProcessor(self.attention, index))
        self._cross.append(WanCachedCrossAttnProcessor(self.kv_cache))
        block.attn2.set_processor(self._cross[-1])

    def rotary_embedding(self, latents: torch.Tensor, layout: VideoLayout) -> RoPE:
        """The whole clip's RoPE table for (B, C, F, H, W) ``latents``, in ``layout``'s token order: what
        ``diffusers.WanTransformer3DModel.forward`` computes with ``self.rope`` (from the shape alone)."""
        cos, sin = self.transformer.rope(latents)  # (1, F*h*w, 1, head_dim) each, frame-major
        order = layout.token_order(cos.device)
        return rope_pairs(cos[:, order], sin[:, order])  # -> (1, 1, tokens, head_dim / 2) each

    def text_states(self, prompt_embeds: torch.Tensor) -> torch.Tensor:
        """(B, S_text, D_umt5) -> (B, S_text, hidden): the text projection of
        ``diffusers.models.transformers.transformer_wan.WanTimeTextImageEmbedding.forward``."""
        return self.transformer.condition_embedder.text_embedder(prompt_embeds)

    def conditioning(
        self, timestep: torch.Tensor, text: torch.Tensor, rope: RoPE, first_frame: FirstFrame | None = None
    ) -> WanConditioning:
        """Per-step conditioning from the (B,) timestep, or with ``first_frame`` the (B, 2) timesteps its tokens take
        (0 and t); mirrors the timestep half of
        ``diffusers.models.transformers.transformer_wan.WanTimeTextImageEmbedding.forward`` (with
        ``timestep_seq_len``) and the ``timestep_proj.unflatten`` of ``WanTransformer3DModel.forward``."""
        embedder = self.transformer.condition_embedder
        freqs = embedder.timesteps_proj(timestep.flatten())  # (B,) or (B * 2,) -> (same, freq_dim)
        dtype = next(iter(embedder.time_embedder.parameters())).dtype
        if freqs.dtype != dtype and dtype != torch.int8:
            freqs = freqs.to(dtype)
        temb = embedder.time_embedder(freqs).type_as(text)  # -> (same, hidden)
        timestep_proj = embedder.time_proj(embedder.act_fn(temb)).unflatten(1, (6, -1))  # (same, 6*D) -> (same, 6, D)
        if timestep.ndim == 2:  # (B * 2, ...) -> (B, 2, ...)
            temb, timestep_proj = temb.unflatten(0, timestep.shape), timestep_proj.unflatten(0, timestep.shape)
        return WanConditioning(timestep_proj, temb, text, rope, first_frame)

    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        """(B, C, rows, W) rows of the stacked frames -> (B, band tokens, hidden): Wan's ``patch_embedding`` (a Conv3d
        of one frame by p x p) on the rows, as one frame of them (a token row never spans two frames)."""
        hidden = self.transformer.patch_embedding(latent_rows.unsqueeze(2))  # (B, C, 1, rows, W) -> (B, D, 1, h, w)
        hidden = hidden.flatten(2).transpose(1, 2)  # -> (B, h*w, D)
        return hidden if band is None else band.trim(hidden)

    def run_segment(
        self,
        hidden: torch.Tensor,
        segment: Segment,
        cond: WanConditioning,
        band: PatchBand | None,
        skips: dict[int, torch.Tensor],
        keep_kv: bool = True,
        streams: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run ``segment``'s blocks on (B, tokens, hidden): the band's tokens, or the whole clip."""
        self.begin_pass(cond, band, keep_kv)
        cos, sin = cond.rope
        tokens = self.hidden_tokens(band)  # the entries of the whole clip's table this pass's tokens have
        rope = (cos, sin) if tokens == slice(0, cos.shape[2]) else (cos[:, :, tokens], sin[:, :, tokens])
        timestep_proj, _ = cond.modulation(tokens)
        for index in segment.blocks:
            hidden = self.blocks[index](hidden, cond.text, timestep_proj, rope)
        return hidden

    def head(
        self, hidden: torch.Tensor, cond: WanConditioning, token_cols: int, band: PatchBand | None = None
    ) -> torch.Tensor:
        """(B, tokens, hidden) -> (B, out_channels, rows * p, token_cols * p) rows of the stacked frames: mirrors the
        output layer of ``diffusers.WanTransformer3DModel.forward`` (its unpatchify with a temporal patch of 1)."""
        model = self.transformer
        _, temb = cond.modulation(slice(0, self.num_tokens) if band is None else band.tokens)
        table = model.scale_shift_table.to(temb.device)  # (1, 2, D)
        if temb.ndim == 3:  # per token: (B, n, D) -> (B, n, 2, D) -> (B, n, D) each
            shift, scale = (table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (table + temb.unsqueeze(1)).chunk(2, dim=1)  # (B, 1, D) each
        out = (model.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
        out = model.proj_out(out)  # (B, tokens, p*p*C)
        return unpatchify(out, token_cols, self.patch_size, model.config.out_channels, band)


def denoise_request(
    stage: WanStage | ForwardStage,
    *,
    latents: torch.Tensor,
    layout: VideoLayout,
    timesteps,
    scheduler,
    prompt_embeds: torch.Tensor,
    guidance_scale: float,
    expert_guidance_scale: float | None = None,
    cfg_half=None,
    generator=None,
    on_step_end=None,
    first_frame: FirstFrame | None = None,
):
    """The engine's ``DenoiseRequest`` for Wan, from what ``WanPipeline`` prepares: ``latents`` (B, C, F, H, W) are
    handed to the engine in ``layout`` (one tall image), ``prompt_embeds`` batched [negative, positive] when
    ``guidance_scale > 1`` (diffusers runs them as two calls: per sample the same computation), or this CFG group's
    half with ``cfg_half``. ``expert_guidance_scale``: the scale this ``stage``'s expert combines the two with where it
    is not ``guidance_scale`` (Wan 2.2's ``guidance_scale_2``). The projected text and the RoPE table are computed
    once here, with this expert's own text projection.

    ``first_frame``: Wan 2.2 TI2V's image-to-video (``FirstFrame``): every transformer input has the image's latents as
    its first latent frame, whose tokens have timestep 0.

    With ``parallel.adapter: generic`` (a ``ForwardStage``), the request of the transformer's own forward with the
    arguments ``WanPipeline`` passes it."""
    from xfuse.parallel.request import DenoiseRequest

    if isinstance(stage, ForwardStage):
        if first_frame is not None:
            raise ValueError(
                "the generic adapter does not run Wan 2.2 TI2V's image-to-video (parallel.adapter: family)"
            )
        return forward_request(stage, latents=layout.to_grid(latents).contiguous(), timesteps=timesteps,
                               scheduler=scheduler, inputs={"encoder_hidden_states": prompt_embeds},
                               batched=("encoder_hidden_states",), timestep=lambda t: t,  # WanPipeline: t.expand(B)
                               input_shape=tuple(latents.shape), cfg_scale=guidance_scale,
                               guide_scale=expert_guidance_scale, cfg_half=cfg_half,
                               layout=layout, hidden_dtype=prompt_embeds.dtype, generator=generator,
                               on_step_end=on_step_end)  # fmt: skip

    grid_latents = layout.to_grid(latents).contiguous()  # (B, C, F, H, W) -> (B, C, F*H, W)
    model_batch, model_input = cfg_batch(grid_latents, guidance_scale, cfg_half)
    dtype = prompt_embeds.dtype  # the transformer's (WanPipeline keeps its latents in float32)
    text = stage.text_states(prompt_embeds)
    rope = stage.rotary_embedding(latents, layout)

    def conditioning(step: int, t: torch.Tensor) -> WanConditioning:
        if first_frame is None:
            return stage.conditioning(t.reshape(1).to(latents.device).expand(model_batch), text, rope)  # as diffusers
        levels = first_frame.timesteps(t.to(latents.device))  # (2,): 0 and t
        return stage.conditioning(levels.expand(model_batch, -1), text, rope, first_frame)

    def transformer_input(rows: torch.Tensor, where: slice) -> torch.Tensor:
        rows = rows if first_frame is None else first_frame.put_in(rows, where)
        return model_input(rows).to(dtype)  # WanPipeline: latents.to(transformer_dtype)

    return DenoiseRequest(
        latents=grid_latents,
        timesteps=timesteps,
        scheduler=scheduler,
        conditioning=conditioning,
        model_input=transformer_input,
        guide=guidance(
            guidance_scale if expert_guidance_scale is None else expert_guidance_scale,
            cfg_half,
            learned_sigma=False,
            batched=guidance_scale > 1,
        ),
        model_batch=model_batch,
        generator=generator,
        on_step_end=on_step_end,
        hidden_dtype=dtype,
    )


class FirstFrame:
    """Wan 2.2 TI2V's image-to-video conditioning in the engine's layout. Mirrors the ``expand_timesteps`` branch of
    ``diffusers.WanImageToVideoPipeline.__call__``: its ``first_frame_mask`` (0 on the first latent frame, 1 elsewhere)
    puts the image's latents in as the first frame of every transformer input (``put_in``) and gives each token the
    step's timestep times the mask (``timesteps``: 0 on the first frame's tokens)."""

    def __init__(self, image_latents: torch.Tensor, latents: torch.Tensor, layout: VideoLayout, patch_size: int):
        """``image_latents`` (B, C, 1, H, W): diffusers' ``latent_condition`` (normalised); ``latents`` (B, C, F, H, W)
        the initial ones (their shape and dtype)."""
        mask = torch.ones_like(latents[:1, :1])  # (1, 1, F, H, W)
        mask[:, :, 0] = 0
        self.mask = layout.to_grid(mask)  # -> (1, 1, F*H, W) rows in the layout's order
        frames = latents.shape[2]
        image = image_latents.to(latents.dtype).expand(-1, -1, frames, -1, -1)  # (B, C, 1, H, W) -> (B, C, F, H, W)
        self.image = layout.to_grid(image).contiguous()  # -> (B, C, F*H, W)
        token_mask = mask[0, 0, :, ::patch_size, ::patch_size].flatten()  # (F*h*w,) frame-major, as diffusers takes it
        token_mask = token_mask[layout.token_order(latents.device)]  # -> the layout's token order
        self.token_level = token_mask.long()  # (tokens,) 0: the image's frame (timestep 0), 1: timestep t
        self._host_level = self.token_level.cpu()
        self._shared: dict[tuple[int, int], int | None] = {}  # tokens -> the one level they share, or None

    def put_in(self, rows: torch.Tensor, where: slice) -> torch.Tensor:
        """(B, C, h, W) latent rows ``where`` of the grid -> the transformer's input rows (the first frame's are the
        image's), as diffusers' ``(1 - first_frame_mask) * condition + first_frame_mask * latents``."""
        mask = self.mask[:, :, where]
        return (1 - mask) * self.image[:, :, where] + mask * rows

    def timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """The step's two per-token timesteps, (2,): diffusers' ``first_frame_mask[0][0][:, ::2, ::2] * t`` takes
        the values ``0 * t`` (the image's frame) and ``1 * t``; ``token_level`` says which each token has."""
        return torch.tensor([0.0, 1.0], device=t.device) * t

    def shared_level(self, tokens: slice) -> int | None:
        """The level every token of ``tokens`` has (0 or 1), or ``None`` where they mix; computed once per token
        range on the host (a pass's tokens are the same at every step)."""
        key = (tokens.start, tokens.stop)
        if key not in self._shared:
            levels = self._host_level[tokens]
            self._shared[key] = int(levels[0]) if bool((levels == levels[0]).all()) else None
        return self._shared[key]

    def final(self, latents: torch.Tensor) -> torch.Tensor:
        """The (B, C, F*H, W) latents the loop ends with -> the ones diffusers decodes (its first frame the image's)."""
        return self.put_in(latents, slice(None))
