"""An independent reference for PipeFusion's pipelined mode, written on diffusers alone: no xfuse code.

One process, a plain loop over steps, patches and blocks, using diffusers' own transformer forward
(``HunyuanDiT2DModel``, ``PixArtTransformer2DModel``) on each patch's latent rows with a stale-K/V self-attention
processor of its own. It states the semantics the engine must
have, independently of the engine's schedule, stages, channels, K/V cache and per-patch scheduler code:

* Warm-up steps ``0 … W-1`` run the whole image, like ``HunyuanDiTPipeline.__call__``; each self-attention layer
  keeps the whole image's K/V of the last one.
* Every later step runs the patches (bands of whole token rows; the first ``rows % M`` bands one row taller) in
  order. Patch ``p``'s self-attention writes its own K/V into the layer's whole-image buffer and attends to all of
  it: patches ``< p`` hold this step's K/V, patches ``> p`` the previous step's. Before anything was written in the
  request (``W = 0``), a patch attends only to the tokens written so far (patches ``0 … p`` of the first step).
* From the first pipelined step on, each patch has its own copy of the scheduler, with whole-latent state cut to
  its rows, and (for schedulers that draw noise) its own generator seeded by ``M`` draws of
  ``torch.randint(0, 2**62)`` from the user's generator, made before the first patch is stepped.
* Positions of a patch are the rows of the whole image's table (never recomputed for a band): HunyuanDiT's RoPE
  table, PixArt's sin-cos table.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb, get_2d_rotary_pos_embed, get_2d_sincos_pos_embed
from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid


class KVBuffers:
    """Whole-image K/V per self-attention layer and the token range the current pass covers."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.written: dict[int, int] = {}  # tokens [0, written) hold K/V of this request
        self.tokens: slice | None = None  # None: a whole-image pass
        self.num_tokens = 0  # tokens of the whole image


class StaleSelfAttention:
    """diffusers' ``HunyuanAttnProcessor2_0`` / ``AttnProcessor2_0`` for self-attention (qk-norm and RoPE on q and k
    where the model has them, no mask), except that K/V go through ``KVBuffers``."""

    def __init__(self, buffers: KVBuffers, layer: int) -> None:
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
        buffers, layer = self.buffers, self.layer
        if buffers.tokens is None:  # whole image: attend to itself, keep a copy for the patches
            buffers.k[layer], buffers.v[layer], buffers.written[layer] = key.clone(), value.clone(), key.shape[2]
        else:
            start, stop = buffers.tokens.start, buffers.tokens.stop
            if layer not in buffers.k:  # W = 0: nothing written yet in this request
                shape = (*key.shape[:2], buffers.num_tokens, key.shape[3])  # (B, heads, all tokens, D)
                buffers.k[layer], buffers.v[layer], buffers.written[layer] = (
                    torch.zeros(shape, dtype=key.dtype),
                    torch.zeros(shape, dtype=key.dtype),
                    0,
                )
            buffers.k[layer][:, :, start:stop] = key
            buffers.v[layer][:, :, start:stop] = value
            buffers.written[layer] = max(buffers.written[layer], stop)
            key = buffers.k[layer][:, :, : buffers.written[layer]]
            value = buffers.v[layer][:, :, : buffers.written[layer]]
        out = F.scaled_dot_product_attention(query, key, value)  # (B, heads, S, D)
        out = out.transpose(1, 2).reshape(batch, -1, out.shape[1] * out.shape[3]).to(query.dtype)  # (B, S, heads*D)
        return attn.to_out[1](attn.to_out[0](out))


def token_row_bands(token_rows: int, num_patches: int) -> list[range]:
    """Bands of token rows, the first ``token_rows % num_patches`` one row taller."""
    base, extra = divmod(token_rows, num_patches)
    bands, start = [], 0
    for index in range(num_patches):
        stop = start + base + (1 if index < extra else 0)
        bands.append(range(start, stop))
        start = stop
    return bands


def _rows_of_state(value, full_shape, rows: slice):
    if isinstance(value, torch.Tensor) and value.shape == full_shape:
        return value[:, :, rows].clone()  # (B, C, H, W) -> (B, C, rows, W)
    if isinstance(value, list | tuple):
        return type(value)(_rows_of_state(v, full_shape, rows) for v in value)
    return value


class BandPositions(torch.nn.Module):
    """PixArt's ``PatchEmbed`` (projection, optional norm) adding the band's rows of the whole image's sin-cos
    table: the table is built once for the whole image, as ``PatchEmbed.forward`` builds it for the whole image."""

    def __init__(self, embed, buffers: KVBuffers, token_rows: int, token_cols: int) -> None:
        super().__init__()
        self.embed, self.buffers = embed, buffers
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


def _hunyuandit(transformer, inputs, buffers, token_rows, token_cols):
    """Lines of HunyuanDiTPipeline.__call__ (steps 7-8): the whole image's RoPE table, one noise prediction."""
    for layer, block in enumerate(transformer.blocks):
        block.attn1.set_processor(StaleSelfAttention(buffers, layer))
    patch_size = transformer.config.patch_size
    base_size = 512 // 8 // patch_size
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

    def predict(latent_model_input, t, tokens):
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

    def predict(latent_model_input, t, tokens):
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


FAMILIES = {"HunyuanDiTPipeline": _hunyuandit, "PixArtSigmaPipeline": _pixart}


def pipefusion_reference(pipe, inputs: dict, *, height: int, width: int, num_patches: int, warmup: int):
    """Final latents of PipeFusion with ``num_patches`` patches and ``warmup`` warm-up steps (module docstring).

    ``pipe``: a diffusers ``HunyuanDiTPipeline`` or ``PixArtSigmaPipeline`` (its transformer is deep-copied, never
    modified). ``inputs``: the tensors its ``__call__`` would prepare (latents after ``init_noise_sigma``,
    timesteps, text batched [uncond, cond] with its masks, HunyuanDiT's ``image_meta_size`` and ``style``,
    ``guidance_scale``, ``extra_step_kwargs``, ``generator``).
    """
    transformer = copy.deepcopy(pipe.transformer)
    buffers = KVBuffers()
    patch_size = transformer.config.patch_size
    token_rows, token_cols = height // 8 // patch_size, width // 8 // patch_size
    buffers.num_tokens = token_rows * token_cols
    predict = FAMILIES[type(pipe).__name__](transformer, inputs, buffers, token_rows, token_cols)
    bands = token_row_bands(token_rows, num_patches)
    do_cfg = inputs["guidance_scale"] > 1

    def noise_prediction(latents, t, scheduler, tokens: slice | None):
        """The pipeline's loop body up to the scheduler step, on ``latents`` (whole image or one band)."""
        latent_model_input = torch.cat([latents] * 2) if do_cfg else latents
        latent_model_input = scheduler.scale_model_input(latent_model_input, t)
        buffers.tokens = tokens
        return predict(latent_model_input, t, tokens)

    scheduler = copy.deepcopy(pipe.scheduler)
    latents = inputs["latents"].clone()
    step_kwargs = dict(inputs["extra_step_kwargs"])
    patch_schedulers = patch_kwargs = None
    with torch.no_grad():
        for step, t in enumerate(inputs["timesteps"]):
            if step < warmup:
                noise = noise_prediction(latents, t, scheduler, None)
                latents = scheduler.step(noise, t, latents, **step_kwargs, return_dict=False)[0]
                continue
            if patch_schedulers is None:  # first pipelined step
                rows = [slice(b.start * patch_size, b.stop * patch_size) for b in bands]  # latent rows
                patch_schedulers = []
                for r in rows:
                    patch_scheduler = copy.copy(scheduler)
                    for name, value in vars(scheduler).items():
                        setattr(patch_scheduler, name, _rows_of_state(copy.deepcopy(value), latents.shape, r))
                    patch_schedulers.append(patch_scheduler)
                generator = inputs["generator"]
                seeds = torch.randint(0, 2**62, (num_patches,), generator=generator).tolist()
                patch_kwargs = [
                    step_kwargs | {"generator": torch.Generator().manual_seed(s)}
                    if "generator" in step_kwargs
                    else step_kwargs
                    for s in seeds
                ]
            for band, r, patch_scheduler, kwargs in zip(bands, rows, patch_schedulers, patch_kwargs):
                tokens = slice(band.start * token_cols, band.stop * token_cols)
                noise = noise_prediction(latents[:, :, r], t, patch_scheduler, tokens)
                latents[:, :, r] = patch_scheduler.step(noise, t, latents[:, :, r], **kwargs, return_dict=False)[0]
    return latents
