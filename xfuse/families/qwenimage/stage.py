"""Qwen-Image adapter: one rank's share of a diffusers ``QwenImageTransformer2DModel``, run whole-image or patch by
patch.

FLUX.1's layout (``xfuse.families.common.packed``: the packed latent as a grid of token rows, [text, image] joint
attention, the first patch of a step owning the text update) with Qwen-Image's blocks. What differs:

* 60 double-stream blocks only, each with its own modulation of ``temb`` (``img_mod``, ``txt_mod``: 6 x width each, a
  third of the released model's weights), memoised once per step as the adaptive norms' are
  (``xfuse.families.common.modulation.memoize_sequential``);
* the text input is ``txt_in(txt_norm(prompt_embeds))``, a prompt keeps its own length, and prompts of different
  lengths in one batch (a list of prompts, or true CFG's [negative, positive] batched on one rank) are padded to the
  longest and their padding masked in every joint softmax (``encoder_hidden_states_mask``, handed to the attention
  as ``TextAttention.key_mask``);
* RoPE is complex (``QwenEmbedRope``): the image's table (centred rows and columns, ``scale_rope``) and the text's
  (positions after the image's largest half side) are computed once per request; a band takes its image rows.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    QwenImageTransformer2DModel,
    apply_rotary_emb_qwen,
)
from torch import nn

from xfuse.families.common.joint import JointAttention, check_joint_attention
from xfuse.families.common.mmdit import JointConditioning, joint_request
from xfuse.families.common.modulation import memoize_sequential
from xfuse.families.common.packed import PackedJointStage
from xfuse.families.qwenimage.spec import QWEN_IMAGE
from xfuse.parallel.patch_grid import PatchBand
from xfuse.parallel.stage_plan import StagePlan

# Transformer options of Qwen-Image's edit and layered models, which QwenImagePipeline (text-to-image) never sets.
_REFUSED_OPTIONS = {
    "zero_cond_t": "the edit models' zero-timestep conditioning of reference-image tokens",
    "use_additional_t_cond": "the layered model's additional timestep conditioning",
    "use_layer3d_rope": "the layered model's 3-D RoPE over layers",
    "guidance_embeds": "QwenImagePipeline's guidance embedding, which diffusers' own forward cannot call",
}


@dataclasses.dataclass
class QwenImageConditioning(JointConditioning):
    """``JointConditioning`` plus the text's padding mask: (B, T) bool, False at a shorter prompt's padding; ``None``
    where every prompt has the batch's length (``QwenImagePipeline.encode_prompt`` drops an all-ones mask)."""

    text_mask: torch.Tensor | None = None

    REQUEST_FIELDS: ClassVar = ("text", "text_mask")


class StaleQwenDoubleStreamAttnProcessor(JointAttention):
    """Mirrors ``diffusers.models.transformers.transformer_qwenimage.QwenDoubleStreamAttnProcessor2_0.__call__``
    ([text, image] joint attention: per-stream q/k/v, per-head RMSNorm, complex RoPE on every token, the text's
    padding masked from every query) with PipeFusion's K/V."""

    text_first = True  # the joint sequence is [text, image]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):  # fmt: skip
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("StaleQwenDoubleStreamAttnProcessor: a text stream and no attention_mask")

        def heads(x, proj, norm):  # (B, S, heads * d) -> (B, S, heads, d), normed per head
            out = proj(x).unflatten(-1, (-1, attn.inner_dim // attn.heads))
            return out if norm is None else norm(out)

        query = heads(hidden_states, attn.to_q, attn.norm_q)
        key = heads(hidden_states, attn.to_k, attn.norm_k)
        value = heads(hidden_states, attn.to_v, None)
        text_q = heads(encoder_hidden_states, attn.add_q_proj, attn.norm_added_q)
        text_k = heads(encoder_hidden_states, attn.add_k_proj, attn.norm_added_k)
        text_v = heads(encoder_hidden_states, attn.add_v_proj, None)
        if image_rotary_emb is not None:
            image_freqs, text_freqs = image_rotary_emb  # complex, (band tokens, d / 2) and (text tokens, d / 2)
            query, key = (apply_rotary_emb_qwen(x, image_freqs, use_real=False) for x in (query, key))
            if text_q.shape[1]:  # a later patch has none (the rotation cannot reshape zero tokens)
                text_q, text_k = (apply_rotary_emb_qwen(x, text_freqs, use_real=False) for x in (text_q, text_k))
        # (B, S, heads, d) -> (B, heads, S, d)
        query, key, value, text_q, text_k, text_v = (x.transpose(1, 2) for x in (query, key, value, text_q, text_k,
                                                                                 text_v))  # fmt: skip
        image, text_out = self.attend((query, key, value), (text_q, text_k, text_v), encoder_hidden_states_mask)
        return attn.to_out[1](attn.to_out[0](image)), attn.to_add_out(text_out)


class QwenImageStage(PackedJointStage):
    """The part of a ``QwenImageTransformer2DModel`` that one pipeline rank runs (the ``Stage`` the engine calls)."""

    spec = QWEN_IMAGE
    blocks_attrs = ("transformer_blocks",)
    embed_modules = ("img_in",)
    processor_class = StaleQwenDoubleStreamAttnProcessor
    mirrored_processor = QwenDoubleStreamAttnProcessor2_0

    def __init__(self, transformer: QwenImageTransformer2DModel, plan: StagePlan, rank: int):
        for option, what in _REFUSED_OPTIONS.items():
            if transformer.config.get(option):
                raise ValueError(f"QwenImageTransformer2DModel with {option}=True ({what}) is not supported by "
                                 "PipeFusion's QwenImagePipeline")  # fmt: skip
        super().__init__(transformer, plan, rank)
        kept = [self.blocks[index] for index in self.block_ids]
        self.modulation += memoize_sequential([m for block in kept for m in (block.img_mod, block.txt_mod)])

    def install_processors(self, block: nn.Module, index: int) -> None:
        check_joint_attention(block.attn, QwenDoubleStreamAttnProcessor2_0)
        block.attn.set_processor(StaleQwenDoubleStreamAttnProcessor(self.joint, (index, "attn")))

    def embed_text(self, prompt_embeds: torch.Tensor) -> torch.Tensor:
        """As ``QwenImageTransformer2DModel.forward``: ``txt_in(txt_norm(encoder_hidden_states))``."""
        return self.transformer.txt_in(self.transformer.txt_norm(prompt_embeds))  # (B', T, joint dim) -> hidden

    def rotary_embedding(self, token_rows: int, token_cols: int, text_len: int):
        """(image freqs (rows * cols, d / 2), text freqs (text_len, d / 2)), complex: ``QwenEmbedRope`` over the whole
        image, as ``QwenImageTransformer2DModel.forward`` computes it from ``img_shapes`` and the text's length."""
        # the model's device: pos_embed keeps its tables as plain attributes (on the CPU), moved per device on demand
        device = self.transformer.txt_in.weight.device
        return self.transformer.pos_embed([(1, token_rows, token_cols)], device=device, max_txt_seq_len=text_len)

    def block_kwargs(self, cond: QwenImageConditioning, band: PatchBand | None, owner: bool) -> dict:
        """The RoPE rows of this pass (the band's image tokens, or this rank's chunk of them; the text this rank holds,
        none for a later patch) and the whole text's padding mask (a later patch attends to the recorded text)."""
        image_freqs, text_freqs = cond.rope
        text = self.text_tokens() if owner else slice(0, 0)
        rope = (image_freqs[self.hidden_tokens(band)], text_freqs[text])
        return {"image_rotary_emb": rope, "encoder_hidden_states_mask": cond.text_mask}

    def conditioning(self, timestep, text, rope, text_mask) -> QwenImageConditioning:
        """Per-step conditioning, as ``diffusers.QwenImageTransformer2DModel.forward`` builds ``temb`` from
        QwenImagePipeline's ``timestep / 1000``."""
        temb = self.transformer.time_text_embed(timestep.to(text.dtype), text)  # (B, hidden)
        return QwenImageConditioning(temb, text, rope, text_mask=text_mask)


def denoise_request(
    stage: QwenImageStage,
    *,
    latents,
    timesteps,
    scheduler,
    prompt_embeds,
    prompt_embeds_mask,
    true_cfg_scale: float = 1.0,
    cfg_half=None,
    generator=None,
    on_step_end=None,
):
    """The engine's ``DenoiseRequest`` for Qwen-Image, built from what ``QwenImagePipeline`` prepares.

    ``latents``: the engine grid of the packed latents (B, C4, rows, cols). ``prompt_embeds``: (B', T, joint dim),
    [negative, positive] with true CFG batched on this rank (``true_cfg_scale > 1``, no ``cfg_half``), padded to the
    longest; ``prompt_embeds_mask`` (B', T) bool or ``None`` (every token attended). The combination is diffusers':
    ``neg + true_cfg_scale * (pos - neg)`` rescaled per token to the positive prediction's norm.
    """
    rope = stage.rotary_embedding(latents.shape[2], latents.shape[3], prompt_embeds.shape[1])

    def conditioning(timestep: torch.Tensor, text: torch.Tensor) -> QwenImageConditioning:
        # QwenImagePipeline passes t.expand(B).to(latents.dtype) / 1000
        return stage.conditioning(timestep.to(latents.dtype) / 1000, text, rope, prompt_embeds_mask)

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
        keep_cond_norm=True,
    )
