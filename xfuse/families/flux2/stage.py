"""FLUX.2 adapter: one rank's share of a diffusers ``Flux2Transformer2DModel``, run whole-image or patch by patch.

FLUX.1's layout (``xfuse.families.common.packed``) with FLUX.2's blocks: double-stream blocks then single-stream ones,
indexed as one chain, [text, image] joint attention with RoPE on every token, the first patch of a step owning the
text update. What differs:

* the modulation is the transformer's, not the blocks': three ``Flux2Modulation`` linears turn the step's ``temb``
  into the double blocks' image and text parameters and the single blocks' parameters once per step, which every
  block is given (``Flux2Conditioning``); a rank keeps only the modulation its blocks use;
* a single-stream block's attention (``Flux2ParallelSelfAttention``) fuses q/k/v with the MLP's input projection and
  its output projection with the MLP's (a "parallel" block): ``StaleFlux2ParallelAttnProcessor`` stands in for it with
  PipeFusion's K/V; its double-stream attention is FLUX.1's algorithm (``StaleFluxAttnProcessor``);
* RoPE has four axes (``Flux2PosEmbed`` over (t, row, column, l) ids), still one row per token: the whole image's
  table is computed once per request and a band takes its rows;
* the pipeline draws its latents already patchified, (B, 4 C, H/16, W/16): the engine's grid itself.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from diffusers.models.transformers.transformer_flux2 import (
    Flux2AttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
    Flux2Transformer2DModel,
)
from torch import nn

from xfuse.families.common.joint import (
    JointAttention,
    StaleFluxAttnProcessor,
    attend_text_first,
    check_joint_attention,
    split_text,
)
from xfuse.families.common.mmdit import JointConditioning, joint_request
from xfuse.families.common.packed import PackedJointStage
from xfuse.families.flux2.spec import FLUX2, FLUX2_KLEIN
from xfuse.families.generic.request import forward_request
from xfuse.families.generic.stage import ForwardStage
from xfuse.parallel.stage_plan import StagePlan


@dataclasses.dataclass
class Flux2Conditioning(JointConditioning):
    """``JointConditioning`` plus the step's shared modulation (``None`` where this rank has no such block)."""

    mod_img: torch.Tensor | None = None  # (B, 6 hidden): the double blocks' image-stream shift/scale/gate pairs
    mod_txt: torch.Tensor | None = None  # (B, 6 hidden): their text stream's
    mod_single: torch.Tensor | None = None  # (B, 3 hidden): the single blocks'

    STEP_FIELDS: ClassVar = ("temb", "mod_img", "mod_txt", "mod_single")


class StaleFlux2ParallelAttnProcessor(JointAttention):
    """Mirrors ``diffusers.models.transformers.transformer_flux2.Flux2ParallelSelfAttnProcessor.__call__`` (a single
    block's [text, image] sequence: fused q/k/v + MLP input projection, per-head RMSNorm, RoPE on every token, fused
    output projection of [attention, SwiGLU MLP]) with PipeFusion's K/V; the stage says how many text tokens lead
    the sequence (``JointKV.text_tokens``)."""

    text_first = True  # the joint sequence is [text, image]

    def __call__(self, attn: Flux2ParallelSelfAttention, hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise ValueError("StaleFlux2ParallelAttnProcessor: no attention mask")
        projected = attn.to_qkv_mlp_proj(hidden_states)  # (B, S, 3 inner + 2 mlp)
        qkv, mlp = projected.split((3 * attn.inner_dim, projected.shape[-1] - 3 * attn.inner_dim), dim=-1)
        # (B, S, inner) -> (B, S, heads, d) each, q and k normed per head
        query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in qkv.chunk(3, dim=-1))
        query, key = attn.norm_q(query), attn.norm_k(key)
        (text_q, query), (text_k, key), (text_v, value) = split_text((query, key, value), self.state.text_tokens)
        image, text_out = attend_text_first(self, (query, key, value), (text_q, text_k, text_v), image_rotary_emb)
        out = torch.cat((text_out, image), dim=1).to(query.dtype)  # (B, text_len + band, inner)
        return attn.to_out(torch.cat((out, attn.mlp_act_fn(mlp)), dim=-1))  # -> (B, text_len + band, hidden)


class Flux2Stage(PackedJointStage):
    """The part of a ``Flux2Transformer2DModel`` that one pipeline rank runs (the ``Stage`` the engine calls)."""

    spec = FLUX2
    processor_class = StaleFluxAttnProcessor  # the double blocks'; install_processors picks the single blocks' too
    mirrored_processor = Flux2AttnProcessor

    def __init__(self, transformer: Flux2Transformer2DModel, plan: StagePlan, rank: int):
        super().__init__(transformer, plan, rank)
        doubles = transformer.config.num_layers
        self.has_doubles = any(index < doubles for index in self.block_ids)
        self.has_singles = any(index >= doubles for index in self.block_ids)
        if not self.has_doubles:  # the shared modulation of blocks this rank does not run: not kept, not read
            transformer.double_stream_modulation_img = None
            transformer.double_stream_modulation_txt = None
        if not self.has_singles:
            transformer.single_stream_modulation = None

    def install_processors(self, block: nn.Module, index: int) -> None:
        if index < self.transformer.config.num_layers:
            check_joint_attention(block.attn, Flux2AttnProcessor)
            block.attn.set_processor(StaleFluxAttnProcessor(self.joint, (index, "attn")))
        else:
            check_joint_attention(block.attn, Flux2ParallelSelfAttnProcessor)
            block.attn.set_processor(StaleFlux2ParallelAttnProcessor(self.joint, (index, "attn")))

    def rotary_embedding(self, text_ids: torch.Tensor, image_ids: torch.Tensor):
        """(cos, sin), each (T + image tokens, head_dim): ``Flux2PosEmbed`` over the whole image, as
        ``Flux2Transformer2DModel.forward`` computes it from its first sample's ids (B, S, 4)."""
        return super().rotary_embedding(text_ids[0], image_ids[0])

    def conditioning(self, timestep, guidance_value, text, rope) -> Flux2Conditioning:
        """Per-step conditioning, as ``diffusers.Flux2Transformer2DModel.forward`` builds it from Flux2Pipeline's
        ``timestep / 1000`` and ``guidance``: ``temb`` and the shared modulation of this rank's blocks."""
        model, dtype = self.transformer, text.dtype
        guidance = None if guidance_value is None else guidance_value.to(dtype) * 1000
        temb = model.time_guidance_embed(timestep.to(dtype) * 1000, guidance)  # (B, hidden)
        mods = {}
        if self.has_doubles:
            mods = {
                "mod_img": model.double_stream_modulation_img(temb),
                "mod_txt": model.double_stream_modulation_txt(temb),
            }
        if self.has_singles:
            mods["mod_single"] = model.single_stream_modulation(temb)
        return Flux2Conditioning(temb, text, rope, **mods)

    def call_block(self, index, hidden, text, cond, kwargs):
        """As ``Flux2Transformer2DModel.forward`` calls its blocks, except that a single block is given the text
        separately and returns it split off (``split_hidden_states``: the same computation on [text, image])."""
        if index < self.transformer.config.num_layers:
            return self.blocks[index](hidden_states=hidden, encoder_hidden_states=text, temb_mod_img=cond.mod_img,
                                      temb_mod_txt=cond.mod_txt, **kwargs)  # fmt: skip
        return self.blocks[index](hidden_states=hidden, encoder_hidden_states=text, temb_mod=cond.mod_single,
                                  split_hidden_states=True, **kwargs)  # fmt: skip


class Flux2KleinStage(Flux2Stage):
    """FLUX.2 [klein]'s stage: the same transformer class (without the guidance embedding), under its own spec."""

    spec = FLUX2_KLEIN


def denoise_request(
    stage: Flux2Stage | ForwardStage,
    *,
    latents,
    timesteps,
    scheduler,
    prompt_embeds,
    text_ids,
    latent_image_ids,
    guidance_value,
    cfg_scale: float = 1.0,
    cfg_half=None,
    generator=None,
    on_step_end=None,
):
    """The engine's ``DenoiseRequest`` for FLUX.2, built from what ``Flux2Pipeline`` prepares (with
    ``parallel.adapter: generic``, a ``ForwardStage``: the request of the transformer's own forward).

    ``latents``: the patchified latents (B, 4 C, H/16, W/16), the engine's grid. ``guidance_value``: the (B',)
    embedded guidance of a guidance-distilled model (FLUX.2 [dev]), ``None`` otherwise. ``cfg_scale > 1``: the text
    is batched [negative, positive] and combined as ``neg + cfg_scale * (pos - neg)``.
    """
    if isinstance(stage, ForwardStage):  # mirrors ``diffusers.Flux2Pipeline.__call__``'s transformer call
        inputs = dict(encoder_hidden_states=prompt_embeds, txt_ids=text_ids, img_ids=latent_image_ids)
        batched: tuple[str, ...] = ("encoder_hidden_states",)
        if guidance_value is not None:
            inputs["guidance"], batched = guidance_value, (*batched, "guidance")
        batch, channels, rows, cols = latents.shape
        return forward_request(stage, latents=latents, timesteps=timesteps, scheduler=scheduler, inputs=inputs,
                               batched=batched, timestep=lambda t: t.to(latents.dtype) / 1000,
                               input_shape=(batch, rows * cols, channels), cfg_scale=cfg_scale, cfg_half=cfg_half,
                               generator=generator, on_step_end=on_step_end)  # fmt: skip
    rope = stage.rotary_embedding(text_ids, latent_image_ids)

    def conditioning(timestep: torch.Tensor, text: torch.Tensor) -> Flux2Conditioning:
        # Flux2Pipeline passes t.expand(B).to(latents.dtype) / 1000
        return stage.conditioning(timestep.to(latents.dtype) / 1000, guidance_value, text, rope)

    return joint_request(
        stage,
        latents=latents,
        timesteps=timesteps,
        scheduler=scheduler,
        prompt_embeds=prompt_embeds,
        cfg_scale=cfg_scale,
        conditioning=conditioning,
        cfg_half=cfg_half,
        generator=generator,
        on_step_end=on_step_end,
    )
