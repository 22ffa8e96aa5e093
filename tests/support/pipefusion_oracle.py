"""An independent reference for PipeFusion's pipelined mode, written on diffusers alone: no xfuse code.

One process, a plain loop over steps, patches and blocks, using diffusers' own transformer forward
(``HunyuanDiT2DModel``, ``PixArtTransformer2DModel``, ``SD3Transformer2DModel``, ``FluxTransformer2DModel``) on each
patch's latent rows with stale-K/V attention processors of its own. It states the semantics the engine must have,
independently of the engine's schedule, stages, channels, K/V cache and per-patch scheduler code:

* Warm-up steps ``0 … W-1`` run the whole image, like the diffusers pipeline's ``__call__``; each attention module
  that mixes image tokens keeps the whole image's image-token K/V of the last one.
* Every later step runs the patches in order: bands of whole token rows (the first ``rows % M`` bands one row
  taller), or given token counts (a cut may fall inside a row: the patch's pass then runs diffusers' forward on the
  rows that cover it, only its own tokens write K/V, and only its own pixels are stepped; FLUX's packed latents are
  cut at the tokens themselves). Patch ``p``'s attention writes its own image K/V into the module's whole-image
  buffer and attends to all of it: patches ``< p`` hold this step's K/V, patches ``> p`` the previous step's. Before
  anything was written in the request (``W = 0``), a patch attends only to the tokens written so far (patches
  ``0 … p`` of the first step).
* Joint text-image attention (SD3, FLUX): the text K/V are never buffered, they come from the block's text input of
  this call. Patch 0 owns the text stream: at patch 0 every block runs normally (its text input is the previous
  block's text output at patch 0, the first block's ``context_embedder(prompt_embeds)``) and its text input is
  recorded; at patches ``>= 1`` every block gets the text input recorded at patch 0 of the same step and its text
  output is dropped (forward pre-hooks replace ``encoder_hidden_states``; diffusers' transformer forward is untouched).
  Q = the band's image tokens (+ the text queries), K/V = the whole buffer's image tokens + the text K/V. SD3.5's
  ``attn2`` (image-only self-attention) has a buffer of its own. K is buffered after the per-head q/k RMSNorm and,
  for FLUX, after RoPE (stale rows keep their own positions).
* A ControlNet (SD3, FLUX) is a second model with stale K/V buffers of its own and its own text owner, run with
  diffusers' own forward on each pass's latents and the same rows of the control latents; its residuals go to
  diffusers' transformer forward of the same pass (``block_controlnet_hidden_states``, FLUX's
  ``controlnet_block_samples``).
* From the first pipelined step on, each patch has its own copy of the scheduler, with whole-latent state cut to
  its rows. A scheduler that draws noise through diffusers' ``randn_tensor`` draws it as serial diffusers does: at
  each step, the first request draws the whole latent's noise from the user's generator and every patch steps with
  its region of it. Any other stochastic scheduler gives each patch its own generator seeded by ``M`` draws of
  ``torch.randint(0, 2**62)`` from the user's generator (when there is one), made before the first patch is stepped.
* Positions of a patch are the rows of the whole image's table (never recomputed for a band): HunyuanDiT's RoPE
  table, PixArt's sin-cos table, SD3's centred crop ``cropped_pos_embed`` of the whole latent, FLUX's RoPE of the
  band's rows of the whole image's ``img_ids``.
* Latent geometry: the token grid is ``height / vae_scale_factor / p`` by ``width / vae_scale_factor / p`` with
  ``p`` the transformer's patch size (FLUX: 2, the 2 x 2 packing; its transformer has patch size 1). A band of token
  rows ``[r0, r1)`` is latent rows ``[r0 p, r1 p)`` of ``(B, C, H, W)`` latents, or for FLUX's packed
  ``(B, tokens, 4 C)`` latents the contiguous token range ``[r0 W_tok, r1 W_tok)``.
* Guidance: classifier-free guidance runs as one batched call [uncond, cond] per band (``B' = 2 B``); so does FLUX's
  true CFG (``true_cfg_scale > 1`` with negative embeddings), which diffusers runs as two calls, combined as
  ``neg + true_cfg_scale * (cond - neg)``.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb, get_2d_rotary_pos_embed, get_2d_sincos_pos_embed
from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_rotary
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen
from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid


class KVBuffers:
    """Whole-image K/V per attention module and the token range (and patch) the current pass covers."""

    def __init__(self) -> None:
        self.k: dict = {}
        self.v: dict = {}
        self.written: dict = {}  # tokens [0, written) hold K/V of this request
        self.tokens: slice | None = None  # the pass's tokens; None: a whole-image pass
        self.own: slice | None = None  # the patch's own tokens among them (a patch cut inside a row), None: all
        self.patch: int | None = None  # index of the patch in its step; None: a whole-image pass
        self.num_tokens = 0  # tokens of the whole image
        self.text_len = 0  # text tokens of the joint attention (FLUX single blocks see [text, image] as one)

    def update(self, layer, key: torch.Tensor, value: torch.Tensor, dim: int):
        """Write this pass's image K/V (token dimension ``dim``) and return the image K/V to attend to."""
        if self.tokens is None:  # whole image: attend to itself, keep a copy for the patches
            self.k[layer], self.v[layer], self.written[layer] = key.clone(), value.clone(), key.shape[dim]
            return key, value
        own = self.tokens if self.own is None else self.own  # only the patch's own tokens are written
        key = key.narrow(dim, own.start - self.tokens.start, own.stop - own.start)
        value = value.narrow(dim, own.start - self.tokens.start, own.stop - own.start)
        start, stop = own.start, own.stop
        if layer not in self.k:  # W = 0: nothing written yet in this request
            shape = list(key.shape)
            shape[dim] = self.num_tokens
            self.k[layer], self.v[layer], self.written[layer] = (
                torch.zeros(shape, dtype=key.dtype),
                torch.zeros(shape, dtype=key.dtype),
                0,
            )
        self.k[layer].narrow(dim, start, stop - start).copy_(key)
        self.v[layer].narrow(dim, start, stop - start).copy_(value)
        self.written[layer] = max(self.written[layer], stop)
        return self.k[layer].narrow(dim, 0, self.written[layer]), self.v[layer].narrow(dim, 0, self.written[layer])


class StaleSelfAttention:
    """diffusers' ``HunyuanAttnProcessor2_0`` / ``AttnProcessor2_0`` for self-attention (qk-norm and RoPE on q and k
    where the model has them, no mask), except that K/V go through ``KVBuffers``."""

    def __init__(self, buffers: KVBuffers, layer) -> None:
        self.buffers, self.layer = buffers, layer

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, image_rotary_emb=None
    ):
        assert encoder_hidden_states is None and attention_mask is None and attn.spatial_norm is None
        batch = hidden_states.shape[0]

        def heads(x):  # (B, S, heads * D) -> (B, heads, S, D)
            return x.view(batch, -1, attn.heads, x.shape[-1] // attn.heads).transpose(1, 2)

        query, key, value = (
            heads(attn.to_q(hidden_states)),
            heads(attn.to_k(hidden_states)),
            heads(attn.to_v(hidden_states)),
        )
        if attn.norm_q is not None:
            query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query, key = apply_rotary_emb(query, image_rotary_emb), apply_rotary_emb(key, image_rotary_emb)
        key, value = self.buffers.update(self.layer, key, value, dim=2)
        out = F.scaled_dot_product_attention(query, key, value)  # (B, heads, S, D)
        out = out.transpose(1, 2).reshape(batch, -1, out.shape[1] * out.shape[3]).to(query.dtype)  # (B, S, heads*D)
        return attn.to_out[1](attn.to_out[0](out))


class StaleJointAttention:
    """diffusers' ``JointAttnProcessor2_0`` (SD3 ``attn``: [image, text] joint attention; SD3.5 ``attn2``: image-only,
    ``encoder_hidden_states=None``), except that the image K/V go through ``KVBuffers``: Q = [band, text],
    K/V = [whole buffer, text]."""

    def __init__(self, buffers: KVBuffers, layer) -> None:
        self.buffers, self.layer = buffers, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        assert attention_mask is None and not args and not kwargs
        residual = hidden_states
        batch = hidden_states.shape[0]
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads

        def heads(x):  # (B, S, heads * D) -> (B, heads, S, D)
            return x.view(batch, -1, attn.heads, head_dim).transpose(1, 2)

        query, key, value = heads(query), heads(key), heads(value)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        key, value = self.buffers.update(self.layer, key, value, dim=2)
        if encoder_hidden_states is not None:
            text_query = heads(attn.add_q_proj(encoder_hidden_states))
            text_key = heads(attn.add_k_proj(encoder_hidden_states))
            text_value = heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                text_query = attn.norm_added_q(text_query)
            if attn.norm_added_k is not None:
                text_key = attn.norm_added_k(text_key)
            query = torch.cat([query, text_query], dim=2)
            key = torch.cat([key, text_key], dim=2)
            value = torch.cat([value, text_value], dim=2)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(query.dtype)
        if encoder_hidden_states is not None:  # split at the query's image length (the band's)
            out, text_out = out[:, : residual.shape[1]], out[:, residual.shape[1] :]
            if not attn.context_pre_only:
                text_out = attn.to_add_out(text_out)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, text_out) if encoder_hidden_states is not None else out


class StaleFluxAttention:
    """diffusers' ``FluxAttnProcessor`` (double blocks: text separate; single blocks: the first ``text_len`` tokens of
    the sequence are text), except that the image K/V (after q/k RMSNorm and RoPE) go through ``KVBuffers``:
    Q = [text, band], K/V = [text, whole buffer]."""

    def __init__(self, buffers: KVBuffers, layer) -> None:
        self.buffers, self.layer = buffers, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        assert attention_mask is None and not attn.fused_projections

        def heads(x):  # (B, S, heads * D) -> (B, S, heads, D)
            return x.unflatten(-1, (-1, attn.head_dim))

        query, key = attn.norm_q(heads(attn.to_q(hidden_states))), attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if encoder_hidden_states is not None:  # double block
            assert attn.added_kv_proj_dim is not None
            text_len = encoder_hidden_states.shape[1]
            text_query = attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states)))
            text_key = attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states)))
            query = torch.cat([text_query, query], dim=1)
            key = torch.cat([text_key, key], dim=1)
            value = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), value], dim=1)
        else:  # single block: [text, image] as one sequence; the text length must be told
            text_len = self.buffers.text_len
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        image_key, image_value = self.buffers.update(self.layer, key[:, text_len:], value[:, text_len:], dim=1)
        if self.buffers.tokens is not None:
            key = torch.cat([key[:, :text_len], image_key], dim=1)
            value = torch.cat([value[:, :text_len], image_value], dim=1)
        out = dispatch_attention_fn(query, key, value, attn_mask=None)  # (B, S, heads, D)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        text_out, out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(text_out.contiguous())


class StaleFlux2ParallelAttention:
    """diffusers' ``Flux2ParallelSelfAttnProcessor`` (FLUX.2's single blocks: fused q/k/v + MLP input projection over
    [text, image], the first ``text_len`` tokens text), except that the image K/V (after q/k RMSNorm and RoPE) go
    through ``KVBuffers``: Q = [text, band], K/V = [text, whole buffer]."""

    def __init__(self, buffers: KVBuffers, layer) -> None:
        self.buffers, self.layer = buffers, layer

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        assert attention_mask is None
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        qkv, mlp = projected[..., :qkv_dim], projected[..., qkv_dim:]
        query, key, value = (x.unflatten(-1, (-1, attn.head_dim)) for x in qkv.chunk(3, dim=-1))  # (B, S, heads, D)
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_len = self.buffers.text_len
        image_key, image_value = self.buffers.update(self.layer, key[:, text_len:], value[:, text_len:], dim=1)
        if self.buffers.tokens is not None:
            key = torch.cat([key[:, :text_len], image_key], dim=1)
            value = torch.cat([value[:, :text_len], image_value], dim=1)
        out = dispatch_attention_fn(query, key, value, attn_mask=None).flatten(2, 3).to(query.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


class StaleQwenAttention:
    """diffusers' ``QwenDoubleStreamAttnProcessor2_0`` ([text, image], complex RoPE, the text's padding masked from
    every query), except that the image K/V (after q/k RMSNorm and RoPE) go through ``KVBuffers``: Q = [text, band],
    K/V = [text, whole buffer]."""

    def __init__(self, buffers: KVBuffers, layer) -> None:
        self.buffers, self.layer = buffers, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):  # fmt: skip
        assert attention_mask is None and encoder_hidden_states is not None

        def heads(x):  # (B, S, heads * D) -> (B, S, heads, D)
            return x.unflatten(-1, (attn.heads, -1))

        query, key = attn.norm_q(heads(attn.to_q(hidden_states))), attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        text_query = attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states)))
        text_key = attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states)))
        text_value = heads(attn.add_v_proj(encoder_hidden_states))
        image_freqs, text_freqs = image_rotary_emb
        query, key = (apply_rotary_emb_qwen(x, image_freqs, use_real=False) for x in (query, key))
        text_query, text_key = (apply_rotary_emb_qwen(x, text_freqs, use_real=False) for x in (text_query, text_key))
        key, value = self.buffers.update(self.layer, key, value, dim=1)
        text_len = text_query.shape[1]
        mask = None
        if encoder_hidden_states_mask is not None:  # (B, T) -> (B, 1, 1, T + image keys)
            image = torch.ones(key.shape[:2], dtype=torch.bool)
            mask = torch.cat([encoder_hidden_states_mask.bool(), image], dim=1)[:, None, None, :]
        out = dispatch_attention_fn(
            torch.cat([text_query, query], dim=1),
            torch.cat([text_key, key], dim=1),
            torch.cat([text_value, value], dim=1),
            attn_mask=mask,
        )  # (B, S, heads, D)
        out = out.flatten(2, 3).to(query.dtype)
        text_out, out = out[:, :text_len], out[:, text_len:]
        return attn.to_out[1](attn.to_out[0](out.contiguous())), attn.to_add_out(text_out.contiguous())


class StaleZImageAttention:
    """diffusers' ``ZSingleStreamAttnProcessor`` (per-head RMS norm, complex RoPE, the mask over keys), except that the
    first ``buffers.image_len`` tokens of the sequence (the pass's image tokens) have their K/V (after norm and RoPE)
    go through ``KVBuffers``: Q = [pass's image tokens, rest], K/V = [whole buffer, rest]. A patch pass's mask covers
    [its image tokens, rest]: the buffer's keys are all attended."""

    def __init__(self, buffers: KVBuffers, layer) -> None:
        self.buffers, self.layer = buffers, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        assert encoder_hidden_states is None

        def heads(x):  # (B, S, heads * D) -> (B, S, heads, D)
            return x.unflatten(-1, (attn.heads, -1))

        def rotate(x):  # as the processor's apply_rotary_emb
            rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs_cis.unsqueeze(2)
            return torch.view_as_real(rotated).flatten(3).type_as(x)

        query = rotate(attn.norm_q(heads(attn.to_q(hidden_states))))
        key = rotate(attn.norm_k(heads(attn.to_k(hidden_states))))
        value = heads(attn.to_v(hidden_states))
        image = self.buffers.image_len
        image_key, image_value = self.buffers.update(self.layer, key[:, :image], value[:, :image], dim=1)
        key, value = torch.cat([image_key, key[:, image:]], dim=1), torch.cat([image_value, value[:, image:]], dim=1)
        if attention_mask is not None:  # (B, S) over [pass's image, rest] -> (B, 1, 1, buffer + rest)
            ones = torch.ones(attention_mask.shape[0], image_key.shape[1], dtype=torch.bool)
            attention_mask = torch.cat([ones, attention_mask[:, image:].bool()], dim=1)[:, None, None, :]
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask)  # (B, S, heads, D)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(query.dtype)))


class BandRope(torch.nn.Module):
    """Qwen-Image's ``pos_embed`` for a pass: the whole image's (image, text) RoPE, the image rows the pass's tokens
    (never the band's own centred table)."""

    def __init__(self, pos_embed, buffers: KVBuffers, token_rows: int, token_cols: int) -> None:
        super().__init__()
        self.pos_embed, self.buffers, self.shape = pos_embed, buffers, (1, token_rows, token_cols)

    def forward(self, img_shapes, max_txt_seq_len, device=None):
        image, text = self.pos_embed([self.shape], max_txt_seq_len=max_txt_seq_len, device=device)
        tokens = self.buffers.tokens
        return (image if tokens is None else image[tokens]), text


class TextOwner:
    """Patch 0 owns the text stream: forward pre-hooks on the blocks record each block's ``encoder_hidden_states`` at
    patch 0 and hand the recorded one to the same block at patches ``>= 1`` (whose text output is thus dropped); a
    block given one [text, image] sequence (FLUX.2's single blocks) has its first ``text_len`` rows recorded and
    replaced so."""

    def __init__(self, buffers: KVBuffers, blocks) -> None:
        self.buffers = buffers
        self.recorded: dict[int, torch.Tensor] = {}
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(self._hook(index), with_kwargs=True)

    def _hook(self, index):
        def hook(module, args, kwargs):
            return self.pre_hook(index, args, kwargs)

        return hook

    def pre_hook(self, index, args, kwargs):
        assert not args and "encoder_hidden_states" in kwargs
        if self.buffers.patch is None:  # whole image: the pipeline's own text stream
            return None
        if kwargs["encoder_hidden_states"] is None:  # FLUX.2's single blocks: one [text, image] sequence
            hidden, text_len = kwargs["hidden_states"], self.buffers.text_len
            if self.buffers.patch == 0:
                self.recorded[index] = hidden[:, :text_len]
                return None
            return args, kwargs | {"hidden_states": torch.cat([self.recorded[index], hidden[:, text_len:]], dim=1)}
        if self.buffers.patch == 0:
            self.recorded[index] = kwargs["encoder_hidden_states"]
            return None
        return args, kwargs | {"encoder_hidden_states": self.recorded[index]}


def token_row_bands(token_rows: int, num_patches: int) -> list[range]:
    """Bands of token rows, the first ``token_rows % num_patches`` one row taller."""
    base, extra = divmod(token_rows, num_patches)
    bands, start = [], 0
    for index in range(num_patches):
        stop = start + base + (1 if index < extra else 0)
        bands.append(range(start, stop))
        start = stop
    return bands


def _rows_of_state(value, full_shape, region: tuple):
    if isinstance(value, torch.Tensor) and value.shape == full_shape:
        return value[region].clone()  # the patch's rows (B, C, rows, W) or tokens (B, tokens, C)
    if isinstance(value, list | tuple):
        return type(value)(_rows_of_state(v, full_shape, region) for v in value)
    return value


class BandPositions(torch.nn.Module):
    """``PatchEmbed`` (projection, optional norm) adding the band's rows of the whole image's position table: PixArt's
    sin-cos table built once for the whole image, as ``PatchEmbed.forward`` builds it for the whole image; SD3's
    (``pos_embed_max_size``) centred crop of the max grid for the whole latent, ``cropped_pos_embed(H, W)``."""

    def __init__(self, embed, buffers: KVBuffers, token_rows: int, token_cols: int) -> None:
        super().__init__()
        self.embed, self.buffers = embed, buffers
        if embed.pos_embed_max_size:  # SD3: never the band's own (centred) crop
            patch = embed.patch_size
            self.table = embed.cropped_pos_embed(token_rows * patch, token_cols * patch)  # (1, tokens, D)
        else:
            table = get_2d_sincos_pos_embed(
                embed.pos_embed.shape[-1],
                (token_rows, token_cols),
                base_size=embed.base_size,
                interpolation_scale=embed.interpolation_scale,
                output_type="pt",
            )
            self.table = table.float().unsqueeze(0)  # (1, tokens, D)

    def forward(self, latent):
        x = self.embed.proj(latent).flatten(2).transpose(1, 2)  # (B, D, h, w) -> (B, h*w, D)
        if self.embed.layer_norm:
            x = self.embed.norm(x)
        tokens = self.buffers.tokens
        return (x + (self.table if tokens is None else self.table[:, tokens])).to(x.dtype)


def _cfg_input(latents, t, scheduler, do_cfg):
    latent_model_input = torch.cat([latents] * 2) if do_cfg else latents
    return scheduler.scale_model_input(latent_model_input, t)


def _hunyuandit(transformer, inputs, buffers, token_rows, token_cols):
    """Lines of HunyuanDiTPipeline.__call__ (steps 7-8): the whole image's RoPE table, one noise prediction."""
    for layer, block in enumerate(transformer.blocks):
        block.attn1.set_processor(StaleSelfAttention(buffers, layer))
    patch_size = transformer.config.patch_size
    base_size = 512 // 8 // patch_size  # as the pipeline (hard-coded 8 there too)
    crops = get_resize_crop_region_for_grid((token_rows, token_cols), base_size)
    cos, sin = get_2d_rotary_pos_embed(
        transformer.inner_dim // transformer.num_heads, crops, (token_rows, token_cols), output_type="pt"
    )
    guidance_scale = inputs["guidance_scale"]
    text = {k: inputs[k] for k in ("image_meta_size", "style")} | {
        "encoder_hidden_states": inputs["prompt_embeds"],
        "text_embedding_mask": inputs["prompt_attention_mask"],
        "encoder_hidden_states_t5": inputs["prompt_embeds_2"],
        "text_embedding_mask_t5": inputs["prompt_attention_mask_2"],
    }

    def predict(latents, t, scheduler, tokens):
        latent_model_input = _cfg_input(latents, t, scheduler, guidance_scale > 1)
        t_expand = torch.tensor([t] * latent_model_input.shape[0]).to(dtype=latent_model_input.dtype)
        rope = (cos, sin) if tokens is None else (cos[tokens], sin[tokens])  # (tokens, head_dim) rows
        noise_pred = transformer(latent_model_input, t_expand, image_rotary_emb=rope, return_dict=False, **text)[0]
        noise_pred, _ = noise_pred.chunk(2, dim=1)
        if guidance_scale > 1:
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        return noise_pred

    return predict


def _pixart(transformer, inputs, buffers, token_rows, token_cols):
    """Lines of PixArtSigmaPipeline.__call__ (step 7): one noise prediction, positions sliced per band."""
    for layer, block in enumerate(transformer.transformer_blocks):
        block.attn1.set_processor(StaleSelfAttention(buffers, layer))
    transformer.pos_embed = BandPositions(transformer.pos_embed, buffers, token_rows, token_cols)
    guidance_scale = inputs["guidance_scale"]

    def predict(latents, t, scheduler, tokens):
        latent_model_input = _cfg_input(latents, t, scheduler, guidance_scale > 1)
        noise_pred = transformer(
            latent_model_input,
            encoder_hidden_states=inputs["prompt_embeds"],
            encoder_attention_mask=inputs["prompt_attention_mask"],
            timestep=t[None].expand(latent_model_input.shape[0]),
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
            return_dict=False,
        )[0]
        if guidance_scale > 1:
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        if transformer.config.out_channels // 2 == transformer.config.in_channels:
            noise_pred = noise_pred.chunk(2, dim=1)[0]
        return noise_pred

    return predict


def _sd3(transformer, inputs, buffers, token_rows, token_cols):
    """Lines of StableDiffusion3Pipeline.__call__ (step 7, no skip-layer guidance, no IP-adapter): joint attention
    with stale image K/V (``attn``, and SD3.5's ``attn2`` with a buffer of its own), patch 0 owning the text stream,
    positions the band's rows of the whole latent's crop. FlowMatch has no ``scale_model_input``."""
    for index, block in enumerate(transformer.transformer_blocks):
        block.attn.set_processor(StaleJointAttention(buffers, ("attn", index)))
        if block.attn2 is not None:
            block.attn2.set_processor(StaleJointAttention(buffers, ("attn2", index)))
    TextOwner(buffers, transformer.transformer_blocks)
    transformer.pos_embed = BandPositions(transformer.pos_embed, buffers, token_rows, token_cols)
    guidance_scale = inputs["guidance_scale"]

    def predict(latents, t, scheduler, tokens, **control):
        latent_model_input = torch.cat([latents] * 2) if guidance_scale > 1 else latents
        noise_pred = transformer(
            hidden_states=latent_model_input,
            timestep=t.expand(latent_model_input.shape[0]),
            encoder_hidden_states=inputs["prompt_embeds"],
            pooled_projections=inputs["pooled_prompt_embeds"],
            joint_attention_kwargs=None,
            return_dict=False,
            **control,
        )[0]
        if guidance_scale > 1:
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        return noise_pred

    return predict


def _sd3_controlnet(transformer, inputs, buffers, token_rows, token_cols, controlnet):
    """Lines of StableDiffusion3ControlNetPipeline.__call__ (step 8): the ControlNet's forward, then the transformer's
    with its residuals. The ControlNet is a second model with stale image K/V of its own (keyed apart from the
    transformer's), its own text owner (patch 0) and the band's rows of the whole latent's position crop; its
    ``controlnet_cond`` is the rows of the control latents the band's pass reads."""
    for index, block in enumerate(controlnet.transformer_blocks):
        block.attn.set_processor(StaleJointAttention(buffers, ("control attn", index)))
    TextOwner(buffers, controlnet.transformer_blocks)
    controlnet.pos_embed = BandPositions(controlnet.pos_embed, buffers, token_rows, token_cols)
    predict_sd3 = _sd3(transformer, inputs, buffers, token_rows, token_cols)
    patch = transformer.config.patch_size
    control_image, scales, timesteps = inputs["control_image"], inputs["conditioning_scales"], inputs["timesteps"]
    pooled = inputs["controlnet_pooled_projections"]

    def predict(latents, t, scheduler, tokens):
        latent_model_input = torch.cat([latents] * 2) if inputs["guidance_scale"] > 1 else latents
        step = int((timesteps == t).nonzero()[0, 0])
        rows = slice(None)  # the latent rows of the pass's token rows
        if tokens is not None:
            rows = slice(tokens.start // token_cols * patch, tokens.stop // token_cols * patch)
        samples = controlnet(
            hidden_states=latent_model_input,
            timestep=t.expand(latent_model_input.shape[0]),
            encoder_hidden_states=inputs["prompt_embeds"],
            pooled_projections=pooled,
            controlnet_cond=control_image[:, :, rows],
            conditioning_scale=scales[step],
            return_dict=False,
        )[0]
        return predict_sd3(latents, t, scheduler, tokens, block_controlnet_hidden_states=samples)

    return predict


def _flux(transformer, inputs, buffers, token_rows, token_cols):
    """Lines of FluxPipeline.__call__ (step 6, no IP-adapter) on packed latents: double and single blocks with stale
    image K/V after RoPE, patch 0 owning the text stream, ``img_ids`` the band's rows of the whole image's ids. True
    CFG is batched [neg, cond] in one call (diffusers makes two calls)."""
    for index, block in enumerate(transformer.transformer_blocks):
        block.attn.set_processor(StaleFluxAttention(buffers, ("double", index)))
    for index, block in enumerate(transformer.single_transformer_blocks):
        block.attn.set_processor(StaleFluxAttention(buffers, ("single", index)))
    TextOwner(buffers, [*transformer.transformer_blocks, *transformer.single_transformer_blocks])
    img_ids, txt_ids = inputs["latent_image_ids"], inputs["text_ids"]
    assert img_ids.shape[0] == token_rows * token_cols, (img_ids.shape, token_rows, token_cols)
    prompt_embeds, pooled, guidance = inputs["prompt_embeds"], inputs["pooled_prompt_embeds"], inputs["guidance"]
    true_cfg_scale = inputs.get("true_cfg_scale", 1.0)
    true_cfg = true_cfg_scale > 1 and inputs.get("negative_prompt_embeds") is not None
    if true_cfg:  # one batched call [neg, cond]; both padded to the same length, text ids zeros for both
        assert inputs["negative_text_ids"].shape == txt_ids.shape
        prompt_embeds = torch.cat([inputs["negative_prompt_embeds"], prompt_embeds])
        pooled = torch.cat([inputs["negative_pooled_prompt_embeds"], pooled])
        guidance = None if guidance is None else torch.cat([guidance] * 2)
    buffers.text_len = prompt_embeds.shape[1]

    def predict(latents, t, scheduler, tokens, **control):
        latent_model_input = torch.cat([latents] * 2) if true_cfg else latents
        timestep = t.expand(latent_model_input.shape[0]).to(latents.dtype)
        if true_cfg:  # ControlNet residuals: diffusers' two calls take the same ones; here one batch [neg, cond]
            control = {k: None if v is None else [torch.cat([x] * 2) for x in v] for k, v in control.items()}
        noise_pred = transformer(
            hidden_states=latent_model_input,
            timestep=timestep / 1000,
            guidance=guidance,
            pooled_projections=pooled,
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids if tokens is None else img_ids[tokens],
            joint_attention_kwargs=None,
            return_dict=False,
            **control,
        )[0]
        if true_cfg:
            neg_noise_pred, noise_pred = noise_pred.chunk(2)
            noise_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
        return noise_pred

    return predict


def _flux2(transformer, inputs, buffers, token_rows, token_cols):
    """Lines of Flux2Pipeline.__call__ / Flux2KleinPipeline.__call__ (the loop, no reference images) on packed
    latents: double blocks with FLUX's stale attention, single blocks (one [text, image] sequence) with
    ``StaleFlux2ParallelAttention``, patch 0 owning the text stream, ``img_ids`` the band's rows of the whole image's
    (B, tokens, 4) ids. [dev]: guidance embedded; [klein] with ``cfg_scale > 1``: one batched call [neg, cond]
    (diffusers makes two), combined as ``neg + cfg_scale * (cond - neg)``."""
    for index, block in enumerate(transformer.transformer_blocks):
        block.attn.set_processor(StaleFluxAttention(buffers, ("double", index)))
    for index, block in enumerate(transformer.single_transformer_blocks):
        block.attn.set_processor(StaleFlux2ParallelAttention(buffers, ("single", index)))
    TextOwner(buffers, [*transformer.transformer_blocks, *transformer.single_transformer_blocks])
    img_ids, txt_ids, prompt_embeds = inputs["latent_image_ids"], inputs["text_ids"], inputs["prompt_embeds"]
    assert img_ids.shape[1] == token_rows * token_cols, (img_ids.shape, token_rows, token_cols)
    cfg_scale = inputs.get("cfg_scale", 1.0)
    if cfg_scale > 1:  # both padded to the same length: the same text ids
        prompt_embeds = torch.cat([inputs["negative_prompt_embeds"], prompt_embeds])
    buffers.text_len = prompt_embeds.shape[1]

    def predict(latents, t, scheduler, tokens):
        latent_model_input = torch.cat([latents] * 2) if cfg_scale > 1 else latents
        timestep = t.expand(latent_model_input.shape[0]).to(latents.dtype)
        noise_pred = transformer(
            hidden_states=latent_model_input,
            timestep=timestep / 1000,
            guidance=inputs["guidance"],
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids if tokens is None else img_ids[:, tokens],
            joint_attention_kwargs=None,
            return_dict=False,
        )[0]
        if cfg_scale > 1:
            neg_noise_pred, noise_pred = noise_pred.chunk(2)
            noise_pred = neg_noise_pred + cfg_scale * (noise_pred - neg_noise_pred)
        return noise_pred

    return predict


def _flux_controlnet(transformer, inputs, buffers, token_rows, token_cols, controlnet):
    """Lines of FluxControlNetPipeline.__call__ (step 7): the ControlNet's forward on the positive prompt, then the
    transformer's with its residuals (both halves of true CFG take the same ones). The ControlNet has stale image K/V
    of its own (keyed apart from the transformer's) and its own text owner; its ``controlnet_cond`` is the band's
    tokens of the packed control latents, its ``img_ids`` the band's."""
    for index, block in enumerate(controlnet.transformer_blocks):
        block.attn.set_processor(StaleFluxAttention(buffers, ("control double", index)))
    for index, block in enumerate(controlnet.single_transformer_blocks):
        block.attn.set_processor(StaleFluxAttention(buffers, ("control single", index)))
    TextOwner(buffers, [*controlnet.transformer_blocks, *controlnet.single_transformer_blocks])
    predict_flux = _flux(transformer, inputs, buffers, token_rows, token_cols)
    control_image, scales, timesteps = inputs["control_image"], inputs["conditioning_scales"], inputs["timesteps"]
    img_ids = inputs["latent_image_ids"]

    def predict(latents, t, scheduler, tokens):
        step = int((timesteps == t).nonzero()[0, 0])
        timestep = t.expand(latents.shape[0]).to(latents.dtype)
        doubles, singles = controlnet(
            hidden_states=latents,
            controlnet_cond=control_image if tokens is None else control_image[:, tokens],
            controlnet_mode=None,
            conditioning_scale=scales[step],
            timestep=timestep / 1000,
            guidance=inputs["control_guidance"],
            pooled_projections=inputs["pooled_prompt_embeds"],
            encoder_hidden_states=inputs["prompt_embeds"],
            txt_ids=inputs["text_ids"],
            img_ids=img_ids if tokens is None else img_ids[tokens],
            return_dict=False,
        )
        return predict_flux(latents, t, scheduler, tokens, controlnet_block_samples=doubles,
                            controlnet_single_block_samples=singles)  # fmt: skip

    return predict


def _qwen_image(transformer, inputs, buffers, token_rows, token_cols):
    """Lines of QwenImagePipeline.__call__ (the loop) on packed latents: stale image K/V after RoPE, patch 0 owning the
    text stream, the band's rows of the whole image's RoPE. True CFG is one batched call [neg, cond], the shorter text
    zero-padded and masked (diffusers makes two calls, each at its own length), combined as diffusers does: ``neg +
    scale * (cond - neg)`` rescaled per token to the conditional prediction's norm."""
    for index, block in enumerate(transformer.transformer_blocks):
        block.attn.set_processor(StaleQwenAttention(buffers, index))
    TextOwner(buffers, transformer.transformer_blocks)
    transformer.pos_embed = BandRope(transformer.pos_embed, buffers, token_rows, token_cols)
    scale, embeds, mask = inputs["true_cfg_scale"], inputs["prompt_embeds"], inputs["prompt_embeds_mask"]
    cfg = scale > 1 and inputs.get("negative_prompt_embeds") is not None

    def predict(latents, t, scheduler, tokens):
        latent_model_input = torch.cat([latents] * 2) if cfg else latents
        timestep = t.expand(latent_model_input.shape[0]).to(latents.dtype)
        noise_pred = transformer(
            hidden_states=latent_model_input,
            timestep=timestep / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=[[(1, token_rows, token_cols)]] * latent_model_input.shape[0],
            attention_kwargs={},
            return_dict=False,
        )[0]
        if cfg:
            neg_noise_pred, noise_pred = noise_pred.chunk(2)
            comb_pred = neg_noise_pred + scale * (noise_pred - neg_noise_pred)
            noise_pred = comb_pred * (torch.norm(noise_pred, dim=-1, keepdim=True) /
                                      torch.norm(comb_pred, dim=-1, keepdim=True))  # fmt: skip
        return noise_pred

    return predict


def _z_image(transformer, inputs, buffers, token_rows, token_cols):
    """Lines of ZImagePipeline.__call__ (the loop): a whole-image pass is diffusers' transformer forward; a patch pass
    is that forward's layers written out for the band's covering rows: the band's image tokens embedded, the noise
    refiner's blocks on [them, the image's pad tokens] (no caption), the main layers on [them, pads, caption, batch
    padding] (masked), the final layer on the image tokens; every position the whole image's (diffusers' own position
    ids and ``rope_embedder``). Patch 0 owns the stream (the pads and the caption): each block's stream input is
    recorded at patch 0 and given to the same block at later patches, whose stream output is dropped. CFG is
    diffusers' batch [positive, negative], combined as ``pos + s (pos - neg)`` with the step's scale (0 past
    ``cfg_truncation``), negated."""
    layers = [*transformer.noise_refiner, *transformer.layers]
    for index, block in enumerate(layers):
        block.attention.set_processor(StaleZImageAttention(buffers, index))
    scale, positive, negative = inputs["guidance_scale"], inputs["prompt_embeds"], inputs["negative_prompt_embeds"]
    cfg = scale > 0
    captions = positive + negative if cfg else positive
    batch = len(captions)
    tokens_whole = token_rows * token_cols
    dtype = next(transformer.parameters()).dtype
    # the request's sequence, as ZImageTransformer2DModel.forward builds it (stand-in images of zeros for the ids)
    stand_in = torch.zeros(transformer.config.in_channels, 1, 2 * token_rows, 2 * token_cols)
    _, caps, _, x_pos, cap_pos, _, cap_pad = transformer.patchify_and_embed([stand_in] * batch, list(captions), 2, 1)
    pads = (-tokens_whole) % 32
    cap_lens = [len(c) for c in caps]
    x_freqs = torch.stack([transformer.rope_embedder(ids) for ids in x_pos])  # (B, image + pads, d / 2)
    cap_embedded = transformer.cap_embedder(torch.cat(caps))
    cap, cap_freqs, cap_mask, _, _ = transformer._prepare_sequence(
        list(cap_embedded.split(cap_lens)), cap_pos, cap_pad, transformer.cap_pad_token, None, "cpu"
    )
    with torch.no_grad():
        for layer in transformer.context_refiner:
            cap = layer(cap, cap_mask, cap_freqs)
    longest = max(cap_lens)
    unified_mask = None
    if len(set(cap_lens)) > 1:  # (B, image + pads + longest caption) over the unified sequence
        lengths = torch.tensor([tokens_whole + pads + n for n in cap_lens])
        unified_mask = torch.arange(tokens_whole + pads + longest)[None, :] < lengths[:, None]
    recorded: dict[int, torch.Tensor] = {}

    def pass_on_band(latents, adaln, tokens):
        """The forward's layers on the band's covering rows (``tokens``: their token range)."""
        rows = tokens.stop // token_cols - tokens.start // token_cols
        x = (
            latents.view(batch, -1, rows, 2, token_cols, 2)
            .permute(0, 2, 4, 3, 5, 1)
            .reshape(batch, rows * token_cols, -1)
        )
        img = transformer.all_x_embedder["2-1"](x)  # (B, covering tokens, dim)
        stream = torch.cat([transformer.x_pad_token.expand(batch, pads, -1), cap[:, :longest]], dim=1)
        image_freqs = x_freqs[:, tokens]
        stream_freqs = torch.cat([x_freqs[:, tokens_whole:], cap_freqs[:, :longest]], dim=1)
        buffers.image_len = img.shape[1]
        for index, block in enumerate(layers):
            if buffers.patch == 0:
                recorded[index] = stream
            stream = recorded[index]
            refiner = index < len(transformer.noise_refiner)
            own = stream[:, :pads] if refiner else stream  # the refiner sees the image's pads only
            freqs = torch.cat([image_freqs, stream_freqs[:, : own.shape[1]]], dim=1)
            mask = None
            if not refiner and unified_mask is not None:  # [band, stream] positions of the unified mask
                mask = torch.cat([torch.ones(batch, img.shape[1], dtype=torch.bool), unified_mask[:, tokens_whole:]], 1)
            out = block(torch.cat([img, own], dim=1), mask, freqs, adaln)
            img, new = out[:, : img.shape[1]], out[:, img.shape[1] :]
            stream = torch.cat([new, stream[:, pads:]], dim=1) if refiner else new
        out = transformer.all_final_layer["2-1"](img, c=adaln)  # (B, covering tokens, 4 C)
        out = out.view(batch, rows, token_cols, 2, 2, -1).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(batch, -1, rows * 2, token_cols * 2)  # (B, C, covering latent rows, W)

    t_norms = ((1000 - inputs["timesteps"].float()) / 1000).tolist()
    truncation = inputs["cfg_truncation"]

    def predict(latents, t, scheduler, tokens):
        step = int((inputs["timesteps"] == t).nonzero()[0, 0])
        step_scale = 0.0 if truncation is not None and truncation <= 1 and t_norms[step] > truncation else scale
        model_input = latents.to(dtype).repeat(2, 1, 1, 1) if cfg else latents.to(dtype)
        timestep = ((1000 - t.expand(latents.shape[0])) / 1000).repeat(2 if cfg else 1)
        if tokens is None:
            buffers.image_len = tokens_whole
            out = transformer(list(model_input.unsqueeze(2).unbind(0)), timestep, list(captions), return_dict=False)[0]
            out = torch.stack([o.float() for o in out]).squeeze(2)
        else:
            adaln = transformer.t_embedder(timestep * transformer.t_scale).type_as(model_input)
            out = pass_on_band(model_input, adaln, tokens).float()
        if cfg:
            pos, neg = out.chunk(2)
            out = pos + step_scale * (pos - neg)
        return -out

    return predict


# family, and whether its latents are FLUX's packed (B, tokens, 4 C) rather than (B, C, H, W)
FAMILIES = {
    "HunyuanDiTPipeline": (_hunyuandit, False),
    "PixArtSigmaPipeline": (_pixart, False),
    "StableDiffusion3Pipeline": (_sd3, False),
    "StableDiffusion3ControlNetPipeline": (_sd3_controlnet, False),
    "FluxPipeline": (_flux, True),
    "FluxControlNetPipeline": (_flux_controlnet, True),
    "Flux2Pipeline": (_flux2, True),
    "Flux2KleinPipeline": (_flux2, True),
    "QwenImagePipeline": (_qwen_image, True),
    "ZImagePipeline": (_z_image, False),
}


class FirstBlockCache:
    """Step caching on the oracle's passes (HunyuanDiT and PixArt-Σ: blocks that return the hidden states), written
    from diffusers' ``FBCHeadBlockHook`` / ``FBCBlockHook`` and the engine's stated semantics, on the whole route at
    once (the engine adds per-segment residuals instead):

    * The first pass of a step (patch 0, or the whole image) decides after block 0: skip when
      ``mean|r - r_prev| / mean|r_prev| <= threshold`` over the pass's own tokens, ``r`` block 0's residual and
      ``r_prev`` the same tokens' at the last computed step; computed before ``warmup_steps``, at the first
      pipelined step (``first_pipelined``: where passes turn from the whole image to patches), before any computed
      step and after ``max_skips`` skips in a row. Every pass of the step takes that decision.
    * A computed pass records block 0's residual and the tail residual (last block's output - block 0's) at its own
      tokens. A skipped pass returns block 0's output plus the tail residual (``taylor``: extrapolated to first order
      from the last two computed steps, unless they straddle the first pipelined step) and runs no other block (no
      K/V written; a block returns its input).
    """

    def __init__(self, blocks, buffers: KVBuffers, *, method: str, threshold: float, warmup_steps: int = 0,
                 max_skips: int | None = None, first_pipelined: int | None = None) -> None:  # fmt: skip
        self.buffers, self.method, self.threshold = buffers, method, threshold
        self.first_pipelined = first_pipelined
        self.warmup_steps, self.max_skips = warmup_steps, max_skips
        self.decisions: dict[int, bool] = {}
        self.in_row = 0
        self.head = None  # (B, tokens, D): block 0's residual at the last computed step
        self.tails: list[tuple[int, torch.Tensor]] = []  # (step, (B, tokens, D) tail residual), newest last
        self.step, self.first = 0, True
        self.block0_out = None
        last = len(blocks) - 1
        for index, block in enumerate(blocks):
            block.forward = self._wrap(index, last, block.forward)

    def begin(self, step: int, first: bool) -> None:
        self.step, self.first = step, first

    def _own(self, x):
        """(B, covering tokens, D) -> the pass's own tokens and their positions in the image."""
        b = self.buffers
        if b.tokens is None:
            return x, slice(0, x.shape[1])
        own = b.own or b.tokens
        return x[:, own.start - b.tokens.start : own.stop - b.tokens.start], own

    def _wrap(self, index, last, forward):
        def wrapped(hidden_states, *args, **kwargs):
            if index == 0:
                out = forward(hidden_states, *args, **kwargs)
                return self._after_first(hidden_states, out)
            if not self.decisions[self.step]:
                return hidden_states  # skipped: diffusers' FBCBlockHook passes the input on
            out = forward(hidden_states, *args, **kwargs)
            if index == last:
                self._keep_tail(out)
            return out

        return wrapped

    def _after_first(self, x, out):
        residual, own = self._own(out - x)
        if self.step not in self.decisions:
            limited = self.max_skips is not None and self.in_row >= self.max_skips
            compute = self.step < self.warmup_steps or self.step == self.first_pipelined or self.head is None
            compute = compute or limited
            if not compute:
                previous = self.head[:, own]
                compute = ((residual - previous).abs().mean() / previous.abs().mean()).item() > self.threshold
            self.decisions[self.step] = compute
            self.in_row = 0 if compute else self.in_row + 1
        if self.decisions[self.step]:
            if self.head is None:
                self.head = torch.zeros(out.shape[0], self.buffers.num_tokens, out.shape[2], dtype=out.dtype)
            self.head[:, own] = residual
            self.block0_out = out
            return out
        tail = self.tails[-1][1][:, own]
        turned = self.first_pipelined is not None and self.tails[0][0] < self.first_pipelined <= self.tails[-1][0]
        if self.method == "taylor" and len(self.tails) == 2 and not turned:
            (b, older), (a, _) = self.tails
            tail = tail + (tail - older[:, own]) * (self.step - a) / (a - b)
        b = self.buffers
        start = 0 if b.tokens is None else own.start - b.tokens.start
        out = out.clone()
        out[:, start : start + tail.shape[1]] += tail  # only the own tokens are stepped; the others are read-only
        return out

    def _keep_tail(self, out):
        residual, own = self._own(out - self.block0_out)
        if not self.tails or self.tails[-1][0] != self.step:
            keep = 2 if self.method == "taylor" else 1
            self.tails = self.tails[-(keep - 1) :] if keep > 1 else []
            self.tails.append((self.step, torch.zeros(out.shape[0], self.buffers.num_tokens, out.shape[2],
                                                      dtype=out.dtype)))  # fmt: skip
        self.tails[-1][1][:, own] = residual


def pipefusion_reference(
    pipe,
    inputs: dict,
    *,
    height: int,
    width: int,
    num_patches: int,
    warmup: int,
    token_counts: list[int] | None = None,
    cache: dict | None = None,
):
    """Final latents of PipeFusion with ``num_patches`` patches and ``warmup`` warm-up steps (module docstring).
    ``token_counts``: the tokens of each band, top first (default: ``token_row_bands``' even cut of whole rows).
    ``cache``: step caching (``FirstBlockCache``'s keywords: ``method``, ``threshold``, ``warmup_steps``,
    ``max_skips``); its ``decisions`` (step -> computed) are returned beside the latents.

    ``pipe``: a diffusers ``HunyuanDiTPipeline``, ``PixArtSigmaPipeline``, ``StableDiffusion3Pipeline`` or
    ``FluxPipeline`` (its transformer is deep-copied, never modified; its scheduler, after ``set_timesteps``, is
    deep-copied). ``inputs``: the tensors its ``__call__`` would prepare:

    * HunyuanDiT / PixArt: ``latents`` (after ``init_noise_sigma``), ``timesteps``, ``prompt_embeds`` and
      ``prompt_attention_mask`` batched [uncond, cond] when ``guidance_scale > 1`` (HunyuanDiT also
      ``prompt_embeds_2``, ``prompt_attention_mask_2``, ``image_meta_size``, ``style``), ``guidance_scale``,
      ``extra_step_kwargs``, ``generator``.
    * SD3: ``latents`` (B, C, H, W), ``timesteps``, ``prompt_embeds`` (B', T, joint_attention_dim) and
      ``pooled_prompt_embeds`` (B', pooled), both batched [uncond, cond] when ``guidance_scale > 1``,
      ``guidance_scale``, ``extra_step_kwargs`` (``{}``), ``generator`` (may be None).
    * SD3 with a ControlNet (``StableDiffusion3ControlNetPipeline``): also ``control_image`` (the VAE-encoded control
      latents, [uncond, cond] with guidance), ``conditioning_scales`` (each step's scale, ``controlnet_keep``
      applied) and ``controlnet_pooled_projections``.
    * FLUX with a ControlNet (``FluxControlNetPipeline``): also ``control_image`` (the packed control latents of the
      positive prompt's batch), ``conditioning_scales`` and ``control_guidance`` (the ControlNet's guidance, or None).
    * FLUX: ``latents`` packed (B, tokens, 4 C), ``latent_image_ids`` (tokens, 3) of the whole image, ``timesteps``
      (set with the pipeline's ``mu``; ``set_begin_index(0)`` as the pipeline does), ``prompt_embeds`` (B, T, D),
      ``pooled_prompt_embeds`` (B, pooled), ``text_ids`` (T, 3), ``guidance`` ((B,) tensor, or None without
      ``guidance_embeds``), ``true_cfg_scale`` (default 1) with ``negative_prompt_embeds``,
      ``negative_pooled_prompt_embeds``, ``negative_text_ids`` when true CFG is on (unbatched: the oracle batches
      [neg, cond]), ``extra_step_kwargs`` (``{}``), ``generator`` (may be None).
    """
    transformer = copy.deepcopy(pipe.transformer)
    buffers = KVBuffers()
    family, packed = FAMILIES[type(pipe).__name__]
    config = transformer.config  # latent rows per token row (Z-Image's patch sizes are a list; the pipeline's is 2)
    patch_size = 2 if packed else config.get("patch_size") or config["all_patch_size"][0]
    vae_scale_factor = pipe.vae_scale_factor
    token_rows, token_cols = height // vae_scale_factor // patch_size, width // vae_scale_factor // patch_size
    buffers.num_tokens = token_rows * token_cols
    controls = (copy.deepcopy(pipe.controlnet),) if hasattr(pipe, "controlnet") else ()
    predict = family(transformer, inputs, buffers, token_rows, token_cols, *controls)
    step_cache = None
    if cache is not None:
        blocks = transformer.blocks if hasattr(transformer, "blocks") else transformer.transformer_blocks
        pipelined = num_patches > 1 and warmup < len(inputs["timesteps"])
        step_cache = FirstBlockCache(blocks, buffers, **cache, first_pipelined=warmup if pipelined else None)
    if token_counts is None:
        token_counts = [len(band) * token_cols for band in token_row_bands(token_rows, num_patches)]
    assert len(token_counts) == num_patches and sum(token_counts) == token_rows * token_cols, token_counts
    stops = np.cumsum(token_counts).tolist()
    bands = [range(stop - tokens, stop) for tokens, stop in zip(token_counts, stops, strict=True)]  # token ranges

    def covering(band: range) -> range:
        """The token range of the rows that hold the band's tokens (packed latents: the band itself)."""
        if packed:
            return band
        return range(band.start // token_cols * token_cols, -(-band.stop // token_cols) * token_cols)

    def region(band: range) -> tuple:
        """The part of the latents a band's pass reads: token range of packed latents, the latent rows of the
        covering token rows of (B, C, H, W) ones."""
        rows = covering(band)
        if packed:
            return (slice(None), slice(rows.start, rows.stop))
        latent_rows = slice(rows.start // token_cols * patch_size, rows.stop // token_cols * patch_size)
        return (slice(None), slice(None), latent_rows)

    def own_pixels(band: range) -> torch.Tensor:
        """Bool mask over ``latents[region(band)]`` of the band's own elements (per pixel: its token's index)."""
        rows = covering(band)
        if packed:
            return torch.ones(1, len(rows), 1, dtype=torch.bool)
        token_of = torch.arange(rows.start, rows.stop).reshape(-1, token_cols)  # (covering rows, cols)
        token_of = token_of.repeat_interleave(patch_size, 0).repeat_interleave(patch_size, 1)  # per latent pixel
        return ((token_of >= band.start) & (token_of < band.stop))[None, None]  # (1, 1, rows * p, W)

    def noise_prediction(latents, t, scheduler, band: range | None, patch: int | None):
        """The pipeline's loop body up to the scheduler step, on ``latents`` (whole image or a band's region)."""
        if band is None:
            buffers.tokens = buffers.own = None
        else:
            rows = covering(band)
            buffers.tokens, buffers.own = slice(rows.start, rows.stop), slice(band.start, band.stop)
        buffers.patch = patch
        if step_cache is not None:
            step_cache.begin(current_step[0], patch in (None, 0))
        return predict(latents, t, scheduler, buffers.tokens)

    scheduler = copy.deepcopy(pipe.scheduler)
    latents = inputs["latents"].clone()
    assert latents.shape[1 if packed else 2] == (token_rows * token_cols if packed else token_rows * patch_size)
    step_kwargs = dict(inputs["extra_step_kwargs"])
    patch_schedulers = patch_kwargs = None
    current_step = [0]
    with torch.no_grad():
        for step, t in enumerate(inputs["timesteps"]):
            current_step[0] = step
            if step < warmup:
                noise = noise_prediction(latents, t, scheduler, None, None)
                latents = scheduler.step(noise, t, latents, **step_kwargs, return_dict=False)[0]
                continue
            if patch_schedulers is None:  # first pipelined step
                regions = [region(b) for b in bands]
                patch_schedulers = []
                for r in regions:
                    patch_scheduler = copy.copy(scheduler)
                    for name, value in vars(scheduler).items():
                        setattr(patch_scheduler, name, _rows_of_state(copy.deepcopy(value), latents.shape, r))
                    patch_schedulers.append(patch_scheduler)
                patch_kwargs = [step_kwargs] * num_patches
                module = sys.modules[type(scheduler).__module__]
                serial_noise = hasattr(module, "randn_tensor")
                generator = inputs.get("generator")
                if not serial_noise and generator is not None:
                    seeds = torch.randint(0, 2**62, (num_patches,), generator=generator).tolist()
                    if "generator" in step_kwargs:
                        patch_kwargs = [step_kwargs | {"generator": torch.Generator().manual_seed(s)} for s in seeds]
            step_noise = StepNoise(module, latents.shape) if serial_noise else None
            for p, (band, r, patch_scheduler, kwargs) in enumerate(
                zip(bands, regions, patch_schedulers, patch_kwargs, strict=True)
            ):
                noise = noise_prediction(latents[r], t, patch_scheduler, band, p)
                sample = latents[r].clone()  # the scheduler may keep it (UniPC's last_sample); latents change below
                with step_noise.region(r) if step_noise is not None else contextlib.nullcontext():
                    stepped = patch_scheduler.step(noise, t, sample, **kwargs, return_dict=False)[0]
                latents[r] = torch.where(own_pixels(band), stepped, latents[r])
    if step_cache is not None:
        return latents, step_cache.decisions
    return latents


class StepNoise:
    """One pipelined step's scheduler noise as serial diffusers draws it: the first patch that asks draws the whole
    latent's (``latent_shape``) from the step's own arguments (the user's generator), and every patch gets its
    region of each draw, in the order it asks. Installed as the scheduler module's ``randn_tensor`` for the length of
    one patch's ``step``."""

    def __init__(self, module, latent_shape) -> None:
        self.module, self.latent_shape, self.draws = module, tuple(latent_shape), []

    @contextlib.contextmanager
    def region(self, region: tuple):
        diffusers_randn, asked = self.module.randn_tensor, [0]

        def randn(shape, generator=None, device=None, dtype=None, layout=None):
            if asked[0] == len(self.draws):
                whole = (shape[0], *self.latent_shape[1:])  # the batch of the call, the whole latent otherwise
                drawn = diffusers_randn(whole, generator=generator, device=device, dtype=dtype, layout=layout)
                self.draws.append(drawn)
            asked[0] += 1
            return self.draws[asked[0] - 1][region]

        self.module.randn_tensor = randn
        try:
            yield
        finally:
            self.module.randn_tensor = diffusers_randn


# --- video (Wan) ------------------------------------------------------------------------------------------------


class StaleWanSelfAttention:
    """diffusers' ``WanAttnProcessor`` for self-attention (q/k RMSNorm across heads, Wan's interleaved RoPE, no image
    context), except that the K/V of the pass's own tokens are written into a whole-video buffer at their tokens'
    indices (frame-major, the model's order) and the queries attend to every token written so far."""

    def __init__(self, video: VideoBuffers, layer) -> None:
        self.video, self.layer = video, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        assert encoder_hidden_states is None and attention_mask is None
        query, key = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(hidden_states))
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, attn.to_v(hidden_states)))

        def rope(x, cos, sin):  # (B, S, heads, D) with (1, S, 1, D) tables, pairs interleaved
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
            out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
            return out

        query, key = rope(query, *rotary_emb), rope(key, *rotary_emb)
        key, value = self.video.update(self.layer, key, value)
        out = dispatch_attention_fn(query, key, value)  # (B, S, heads, D), as the processor calls it
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))


class VideoBuffers:
    """Whole-video K/V per layer, in the model's token order; ``tokens``: the model indices of the pass's tokens
    (None: the whole video), ``own``: which of them the pass writes."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens, self.k, self.v, self.written = num_tokens, {}, {}, {}
        self.tokens: torch.Tensor | None = None
        self.own: torch.Tensor | None = None

    def update(self, layer, key, value):
        if self.tokens is None:
            self.k[layer], self.v[layer] = key.clone(), value.clone()
            self.written[layer] = torch.ones(self.num_tokens, dtype=torch.bool)
            return key, value
        if layer not in self.k:  # W = 0: nothing written yet in this request
            shape = (key.shape[0], self.num_tokens, *key.shape[2:])
            self.k[layer], self.v[layer] = torch.zeros(shape), torch.zeros(shape)
            self.written[layer] = torch.zeros(self.num_tokens, dtype=torch.bool)
        index = self.tokens[self.own]
        self.k[layer][:, index], self.v[layer][:, index] = key[:, self.own], value[:, self.own]
        self.written[layer][index] = True
        return self.k[layer][:, self.written[layer]], self.v[layer][:, self.written[layer]]


class BoxRoPE(torch.nn.Module):
    """``WanRotaryPosEmbed`` of the whole video, answering a forward on a box of it with the box's tokens' entries."""

    def __init__(self, rope, whole_shape) -> None:
        super().__init__()
        self.cos, self.sin = rope(torch.empty(whole_shape))  # (1, tokens, 1, D) each, frame-major
        self.tokens: torch.Tensor | None = None

    def forward(self, hidden_states):
        if self.tokens is None:
            return self.cos, self.sin
        return self.cos[:, self.tokens], self.sin[:, self.tokens]


def pipefusion_video_reference(pipe, inputs: dict, *, direction: str, num_patches: int, warmup: int):
    """Final (B, C, F, H, W) latents of PipeFusion on a ``WanPipeline`` (text-to-video; CFG batched [negative,
    positive], as one call per band), with the semantics of the module docstring and these video ones:

    * Stack the clip's token rows in ``direction``'s order: ``temporal`` frame by frame (the model's own token order),
      ``spatial`` token row by token row, each row of every frame in turn. Patches are ``num_patches`` bands of these
      stacked rows, the first ``rows % M`` one row taller; a band is the set of tokens of its rows.
    * A band's pass runs ``WanTransformer3DModel.forward`` on the smallest box of the latent holding its tokens (whole
      frames for ``temporal``, whole rows of every frame for ``spatial``), with each token's RoPE entry of the whole
      video's table; only the band's own tokens write K/V, and only their pixels are stepped.
    * Two experts (Wan 2.2: ``transformer_2`` and ``boundary_ratio``): the steps whose timestep is at least
      ``boundary_ratio * num_train_timesteps`` are the first transformer's, the rest the second's (with
      ``guidance_scale_2``). Each expert's steps run as a request of their own: fresh K/V buffers, their first
      ``warmup`` steps whole, per-patch schedulers cut from the scheduler as the expert starts pipelining and put
      back together (each patch's own pixels) when it ends.

    * Image-to-video (``inputs["image_latents"]``, Wan 2.2 TI2V: ``WanImageToVideoPipeline`` with
      ``expand_timesteps``): every pass's input has the image's latents as its first latent frame, and the forward is
      given one timestep per token of its box (0 on the first frame's tokens, as a 2-D timestep); the final latents'
      first frame is the image's.

    ``inputs``: ``latents`` (B, C, F, H, W) float32, ``timesteps``, ``prompt_embeds`` batched [negative, positive]
    when ``guidance_scale > 1``, ``guidance_scale`` (and ``guidance_scale_2`` for two experts; default: the same),
    ``image_latents`` (B, C, 1, H, W) for image-to-video.
    """
    experts = [copy.deepcopy(pipe.transformer)]
    if getattr(pipe, "transformer_2", None) is not None:
        experts.append(copy.deepcopy(pipe.transformer_2))
    latents = inputs["latents"].clone()
    batch, _, frames, height, width = latents.shape
    p = experts[0].config.patch_size[1]
    rows, cols = height // p, width // p
    model_index = torch.arange(frames * rows * cols).reshape(frames, rows, cols)  # (F, h, w)
    stacked = model_index if direction == "temporal" else model_index.transpose(0, 1)  # (F, h, w) or (h, F, w)
    stacked = stacked.reshape(-1, cols)  # (stacked rows, w)
    bands = [stacked[list(band)].reshape(-1) for band in token_row_bands(stacked.shape[0], num_patches)]

    def box(band: torch.Tensor) -> tuple:
        """The (frames, token rows) box of ``band``'s tokens, as slices of the latent's frame and row axes."""
        f, r = band // (rows * cols), band // cols % rows
        if direction == "temporal":
            return slice(int(f.min()), int(f.max()) + 1), slice(0, rows)
        return slice(0, frames), slice(int(r.min()), int(r.max()) + 1)

    def region(band: torch.Tensor) -> tuple:
        f, r = box(band)
        return (slice(None), slice(None), f, slice(r.start * p, r.stop * p))

    def box_tokens(band: torch.Tensor) -> torch.Tensor:
        f, r = box(band)
        return model_index[f, r].reshape(-1)  # frame-major, as the forward flattens the box

    def own_pixels(band):
        f, r = box(band)
        token_of = model_index[f, r]  # (frames, rows, cols) of the box
        token_of = token_of.repeat_interleave(p, 1).repeat_interleave(p, 2)  # per latent pixel
        return torch.isin(token_of, band)[None, None]  # (1, 1, frames, rows * p, W)

    guidance_scale = inputs["guidance_scale"]
    dtype = inputs["prompt_embeds"].dtype
    image = inputs.get("image_latents")
    frame_mask = torch.ones(1, 1, frames, height, width)  # 0: the image's frame
    frame_mask[:, :, 0] = 0
    token_mask = frame_mask[0, 0, :, ::p, ::p].reshape(-1)  # (F*h*w,) frame-major
    scheduler = copy.deepcopy(pipe.scheduler)
    timesteps = inputs["timesteps"]
    if len(experts) == 2:
        boundary = pipe.config.boundary_ratio * scheduler.config.num_train_timesteps
        switch = int((timesteps >= boundary).sum())
        runs = [(experts[0], 0, switch, guidance_scale), (experts[1], switch, len(timesteps), inputs.get(
            "guidance_scale_2", guidance_scale))]  # fmt: skip
    else:
        runs = [(experts[0], 0, len(timesteps), guidance_scale)]

    def merge(whole, parts):
        """The patches' values of one scheduler attribute put back together: each patch's own pixels."""
        if all(isinstance(v, torch.Tensor) and v.dim() == 5 for v in parts):
            merged = whole.clone() if isinstance(whole, torch.Tensor) and whole.shape == latents.shape else None
            merged = torch.zeros_like(latents) if merged is None else merged
            for band, part in zip(bands, parts, strict=True):
                r = region(band)
                merged[r] = torch.where(own_pixels(band), part, merged[r])
            return merged
        if isinstance(parts[0], list | tuple):
            olds = whole if isinstance(whole, list | tuple) and len(whole) == len(parts[0]) else [None] * len(parts[0])
            return type(parts[0])(merge(o, [v[i] for v in parts]) for i, o in enumerate(olds))
        return copy.deepcopy(parts[0])

    with torch.no_grad():
        for transformer, first, last, scale in runs:
            if first == last:
                continue
            video = VideoBuffers(frames * rows * cols)
            for layer, block in enumerate(transformer.blocks):
                block.attn1.set_processor(StaleWanSelfAttention(video, layer))
            transformer.rope = BoxRoPE(transformer.rope, latents.shape)

            def predict(box_latents, t, band, transformer=transformer, video=video, scale=scale):
                if band is None:
                    video.tokens = video.own = transformer.rope.tokens = None
                else:
                    tokens = box_tokens(band)
                    video.tokens = transformer.rope.tokens = tokens
                    video.own = torch.isin(tokens, band)
                box_tokens_ = torch.arange(frames * rows * cols) if band is None else box_tokens(band)
                if image is not None:  # the image is the first frame of the input; its tokens at timestep 0
                    r = (slice(None),) * 4 if band is None else region(band)  # (:, :, frames, pixel rows)
                    box_mask, box_image = frame_mask[r], image[:, :, :, r[3]]
                    box_latents = (1 - box_mask) * box_image + box_mask * box_latents
                model_input = torch.cat([box_latents] * 2) if guidance_scale > 1 else box_latents
                if image is None:
                    timestep = t.expand(model_input.shape[0])
                else:
                    timestep = (token_mask[box_tokens_] * t).expand(model_input.shape[0], -1)  # (B, box tokens)
                noise = transformer(model_input.to(dtype), timestep, inputs["prompt_embeds"], return_dict=False)[0]
                if guidance_scale > 1:  # the first expert's scale batches; each expert combines with its own
                    uncond, cond = noise.chunk(2)
                    noise = uncond + scale * (cond - uncond)
                return noise

            patch_schedulers = None
            for step in range(first, last):
                t = timesteps[step]
                if step - first < warmup:
                    latents = scheduler.step(predict(latents, t, None), t, latents, return_dict=False)[0]
                    continue
                if patch_schedulers is None:  # first pipelined step: each patch's scheduler, its state cut to its box
                    patch_schedulers = []
                    for band in bands:
                        patch_scheduler = copy.copy(scheduler)
                        for name, value in vars(scheduler).items():
                            cut = _rows_of_state(copy.deepcopy(value), latents.shape, region(band))
                            setattr(patch_scheduler, name, cut)
                        patch_schedulers.append(patch_scheduler)
                for band, patch_scheduler in zip(bands, patch_schedulers, strict=True):
                    r = region(band)
                    sample = latents[r].clone()  # the scheduler may keep it (UniPC's last_sample); latents change below
                    stepped = patch_scheduler.step(predict(sample, t, band), t, sample, return_dict=False)[0]
                    latents[r] = torch.where(own_pixels(band), stepped, latents[r])
            if patch_schedulers is not None:  # the expert's end: the scheduler takes the patches' state back
                for name, value in vars(scheduler).items():
                    setattr(scheduler, name, merge(value, [vars(ps)[name] for ps in patch_schedulers]))
    if image is not None:
        latents = (1 - frame_mask) * image + frame_mask * latents
    return latents


# --- packed video (LTX-Video) ---------------------------------------------------------------------------------------


class StaleLTXSelfAttention:
    """diffusers' ``LTXVideoAttnProcessor`` for self-attention (q/k RMSNorm across heads, RoPE on the flat q/k, no
    mask), except that the K/V of the pass's tokens go through ``KVBuffers`` (token dimension 1)."""

    def __init__(self, buffers: KVBuffers, layer) -> None:
        self.buffers, self.layer = buffers, layer

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        assert encoder_hidden_states is None and attention_mask is None
        query, key = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(hidden_states))
        query, key = ltx_rotary(query, image_rotary_emb), ltx_rotary(key, image_rotary_emb)
        query, key, value = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, attn.to_v(hidden_states)))
        key, value = self.buffers.update(self.layer, key, value, dim=1)  # (B, S, heads, D)
        out = dispatch_attention_fn(query, key, value)  # (B, S, heads, D), as the processor calls it
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).to(query.dtype)))


class BandVideoRope(torch.nn.Module):
    """``LTXVideoRotaryPosEmbed`` of the whole video, answering a forward on a band's tokens with their entries."""

    def __init__(self, rope, buffers: KVBuffers) -> None:
        super().__init__()
        self.rope, self.buffers = rope, buffers

    def forward(self, hidden_states, num_frames, height, width, rope_interpolation_scale=None, video_coords=None):
        whole = torch.empty(hidden_states.shape[0], num_frames * height * width, 1)  # the rope reads its batch only
        cos, sin = self.rope(whole, num_frames, height, width, rope_interpolation_scale, video_coords)
        tokens = self.buffers.tokens
        return (cos, sin) if tokens is None else (cos[:, tokens], sin[:, tokens])


def pipefusion_ltx_reference(pipe, inputs: dict, *, num_patches: int, warmup: int):
    """Final packed (B, tokens, C) latents of PipeFusion on an ``LTXPipeline`` (text-to-video, CFG batched [negative,
    positive] as one call per band), with the module docstring's semantics: the packed tokens (frame-major) are
    stacked token rows of ``latent width`` tokens, ``num_patches`` bands of whole rows (the first ``rows % M`` one row
    taller); a band's pass runs ``LTXVideoTransformer3DModel.forward`` on its own tokens, with their entries of the
    whole video's RoPE, its self-attention through the whole video's K/V buffers, its cross-attention on the whole
    text under its mask.

    ``inputs``: ``latents`` packed float32, ``timesteps``, ``prompt_embeds`` and ``prompt_attention_mask`` batched
    [negative, positive] when ``guidance_scale > 1``, ``guidance_scale``, ``latent_frames``, ``latent_height``,
    ``latent_width``, ``rope_interpolation_scale``."""
    transformer = copy.deepcopy(pipe.transformer)
    buffers = KVBuffers()
    for layer, block in enumerate(transformer.transformer_blocks):
        block.attn1.set_processor(StaleLTXSelfAttention(buffers, layer))
    transformer.rope = BandVideoRope(transformer.rope, buffers)
    latents = inputs["latents"].clone()
    frames, height, width = inputs["latent_frames"], inputs["latent_height"], inputs["latent_width"]
    buffers.num_tokens = frames * height * width
    bands = [range(band.start * width, band.stop * width) for band in token_row_bands(frames * height, num_patches)]
    scale, text, mask = inputs["guidance_scale"], inputs["prompt_embeds"], inputs["prompt_attention_mask"]

    def predict(rows: torch.Tensor, t, band: range | None) -> torch.Tensor:
        buffers.tokens = None if band is None else slice(band.start, band.stop)
        model_input = (torch.cat([rows] * 2) if scale > 1 else rows).to(text.dtype)
        noise = transformer(hidden_states=model_input, encoder_hidden_states=text, timestep=t.expand(len(model_input)),
                            encoder_attention_mask=mask, num_frames=frames, height=height, width=width,
                            rope_interpolation_scale=inputs["rope_interpolation_scale"],
                            return_dict=False)[0]  # fmt: skip
        noise = noise.float()
        if scale > 1:
            uncond, cond = noise.chunk(2)
            noise = uncond + scale * (cond - uncond)
        return noise

    scheduler = copy.deepcopy(pipe.scheduler)
    patch_schedulers = None
    with torch.no_grad():
        for step, t in enumerate(inputs["timesteps"]):
            if step < warmup:
                latents = scheduler.step(predict(latents, t, None), t, latents, return_dict=False)[0]
                continue
            if patch_schedulers is None:  # the first pipelined step: each patch its copy, state cut to its tokens
                patch_schedulers = []
                for band in bands:
                    patch_scheduler = copy.copy(scheduler)
                    region = (slice(None), slice(band.start, band.stop))
                    for name, value in vars(scheduler).items():
                        setattr(patch_scheduler, name, _rows_of_state(copy.deepcopy(value), latents.shape, region))
                    patch_schedulers.append(patch_scheduler)
            for band, patch_scheduler in zip(bands, patch_schedulers, strict=True):
                rows = latents[:, band.start : band.stop]
                noise = predict(rows, t, band)
                latents[:, band.start : band.stop] = patch_scheduler.step(noise, t, rows.clone(), return_dict=False)[0]
    return latents
