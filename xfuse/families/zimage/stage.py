"""Z-Image adapter: one rank's share of a diffusers ``ZImageTransformer2DModel``, run whole-image or patch by patch.

Z-Image is single-stream: each sample is one sequence [image tokens, the image's pad tokens, caption tokens] (in
diffusers' words [x, cap]), the image padded with a learned token to a multiple of 32, the caption (each prompt at its
own length) with another, and a batch of sequences of different lengths padded and masked. Its blocks: two noise
refiner blocks over the image and its pad tokens only, then the main layers over the whole sequence; before them the
caption goes through the context refiner (no modulation: once per request). For PipeFusion the sequence is the
engine's image grid plus one *stream*, like an MMDiT's text stream (``xfuse.families.common.mmdit``): the image's pad
tokens and the padded caption, carried with a step's first patch, whose K/V later patches reuse. The ``Stage``
protocol takes this shape as it is:

* the stream's first value is the embedding rank's (``x_pad_token`` for the image's pads, then the context refiner's
  caption), computed once per request, which that rank alone holds the modules for;
* a noise refiner block runs [image band, stream] with the stream's caption tokens masked out of its softmax and its
  caption outputs discarded (the refiner does not see or update the caption), so the stream keeps one shape through
  every block and under sequence parallelism (each rank's chunk of it) as the text stream does;
* the stream's K/V follow the image's in every softmax (``text_first = False``); the batch padding of a shorter caption
  is masked as Qwen-Image's text padding is (``TextAttention.key_mask``).

RoPE is per sample (the image's positions start after the caption's padded length): the tables are computed once per
request from diffusers' own position ids, and a band takes its rows.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from diffusers.models.transformers.transformer_z_image import ZImageTransformer2DModel, ZSingleStreamAttnProcessor
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from xfuse.families.common.joint import JointAttention, check_joint_attention
from xfuse.families.common.mmdit import JointConditioning, JointStage
from xfuse.families.common.modulation import memoize_sequential
from xfuse.families.zimage.spec import Z_IMAGE
from xfuse.parallel.patch_grid import PatchBand
from xfuse.parallel.stage_plan import StagePlan

EMBEDDER = "2-1"  # ZImagePipeline calls the transformer with patch_size 2, f_patch_size 1: its embedder's key


@dataclasses.dataclass
class ZImageConditioning(JointConditioning):
    """``JointConditioning`` (``temb``: the blocks' ``adaln_input``, (B, 256); ``text``: the stream's first value,
    (B, S, dim), zeros but on the embedding rank) plus Z-Image's per-sample RoPE and the stream's masks."""

    image_freqs: torch.Tensor | None = None  # (B, image tokens, head_dim / 2) complex
    stream_freqs: torch.Tensor | None = None  # (B, S, head_dim / 2) complex
    stream_mask: torch.Tensor | None = None  # (B, S) bool: a main layer's attended stream keys (None: all)
    refiner_mask: torch.Tensor | None = None  # (B, S) bool: a noise refiner block's: the image's pad tokens
    image_pads: int = 0  # the stream's first tokens, the image's pads (the rest: the caption)

    REQUEST_FIELDS: ClassVar = ("text", "image_freqs", "stream_freqs", "stream_mask", "refiner_mask")


class StaleZSingleStreamAttnProcessor(JointAttention):
    """Mirrors ``diffusers.models.transformers.transformer_z_image.ZSingleStreamAttnProcessor.__call__`` (per-head RMS
    norm of q and k, complex RoPE on every token, the mask over keys) with PipeFusion's K/V: the sequence is [image
    band, this pass's stream tokens], the stage says how many stream tokens end it (``JointKV.text_tokens``), and
    ``attention_mask`` is the stream's key mask (B, the whole stream)."""

    text_first = False  # the sequence is [image, stream]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        if encoder_hidden_states is not None:
            raise ValueError("StaleZSingleStreamAttnProcessor: one sequence, no encoder_hidden_states")
        # (B, S, heads * d) -> (B, S, heads, d), normed per head
        query, key, value = (proj(hidden_states).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k,
                                                                                              attn.to_v))  # fmt: skip
        query, key = attn.norm_q(query), attn.norm_k(key)
        if freqs_cis is not None:  # as the processor's apply_rotary_emb: complex64, outside autocast
            query, key = (_rotate(x, freqs_cis) for x in (query, key))
        stream = self.state.text_tokens
        (query, text_q), (key, text_k), (value, text_v) = (x.split((x.shape[1] - stream, stream), dim=1)
                                                           for x in (query, key, value))  # fmt: skip
        # (B, S, heads, d) -> (B, heads, S, d)
        query, key, value, text_q, text_k, text_v = (x.transpose(1, 2) for x in (query, key, value, text_q, text_k,
                                                                                 text_v))  # fmt: skip
        image, text_out = self.attend((query, key, value), (text_q, text_k, text_v), attention_mask)
        out = torch.cat((image, text_out), dim=1)  # (B, band + stream tokens, heads * d)
        return attn.to_out[1](attn.to_out[0](out))


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Mirrors the ``apply_rotary_emb`` inside
    ``diffusers.models.transformers.transformer_z_image.ZSingleStreamAttnProcessor.__call__``:
    (B, S, heads, d) by (B, S, d / 2) complex."""
    with torch.amp.autocast("cuda", enabled=False):
        rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2)) * freqs.unsqueeze(2)
        return torch.view_as_real(rotated).flatten(3).type_as(x)


def patchify(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) latent rows -> (B, H/p * W/p, p * p * C) tokens, row-major, features (p, p, C): mirrors
    ``diffusers.models.transformers.transformer_z_image.ZImageTransformer2DModel._patchify_image``
    for one frame (``f_patch_size`` 1)."""
    batch, channels, height, width = latents.shape
    x = latents.view(batch, channels, height // patch, patch, width // patch, patch)  # (B, C, h, p, w, q)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(batch, -1, patch * patch * channels)  # (B, h, w, p, q, C) -> tokens


def unpatchify(tokens: torch.Tensor, token_cols: int, patch: int, channels: int) -> torch.Tensor:
    """(B, rows * cols, p * p * C) -> (B, C, rows * p, cols * p): mirrors
    ``diffusers.models.transformers.transformer_z_image.ZImageTransformer2DModel.unpatchify``."""
    batch, count, _ = tokens.shape
    x = tokens.view(batch, count // token_cols, token_cols, patch, patch, channels)  # (B, h, w, p, q, C)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(batch, channels, count // token_cols * patch, token_cols * patch)


class ZImageStage(JointStage):
    """The part of a ``ZImageTransformer2DModel`` that one pipeline rank runs (the ``Stage`` the engine calls)."""

    spec = Z_IMAGE
    blocks_attrs = ("noise_refiner", "layers")
    # the stream's first value is made on the embedding rank: the image's pad token, the caption's embedder, pad token
    # and refiner
    embed_modules = ("all_x_embedder", "x_pad_token", "cap_embedder", "cap_pad_token", "context_refiner")
    output_modules = ("all_final_layer",)
    processor_class = StaleZSingleStreamAttnProcessor
    mirrored_processor = ZSingleStreamAttnProcessor

    def __init__(self, transformer: ZImageTransformer2DModel, plan: StagePlan, rank: int):
        config = transformer.config
        if config.siglip_feat_dim is not None:
            raise ValueError("ZImageTransformer2DModel with siglip_feat_dim (Z-Image Omni's image conditioning) is not "
                             "supported by PipeFusion's ZImagePipeline")  # fmt: skip
        if EMBEDDER not in transformer.all_x_embedder:
            raise ValueError(f"ZImagePipeline runs the transformer's {EMBEDDER!r} patch embedder, which this one lacks")
        super().__init__(transformer, plan, rank)
        kept = [self.blocks[index].adaLN_modulation for index in self.block_ids]
        if transformer.all_final_layer is not None:
            kept.append(transformer.all_final_layer[EMBEDDER].adaLN_modulation)
        self.modulation += memoize_sequential(kept)

    def install_processors(self, block: nn.Module, index: int) -> None:
        check_joint_attention(block.attention, ZSingleStreamAttnProcessor)
        block.attention.set_processor(StaleZSingleStreamAttnProcessor(self.joint, (index, "attention")))

    # --- the request's sequence ----------------------------------------------------------------------------------
    def layout(self, captions: list[torch.Tensor], channels: int, rows: int, cols: int, device) -> dict:
        """What ``ZImageTransformer2DModel.forward`` derives from the batch's captions and the image's size (its own
        ``patchify_and_embed`` on a stand-in image of zeros, its position ids, its ``rope_embedder``): the pad
        counts, each sample's caption length padded to 32, and the RoPE of [image, image pads, caption, batch
        padding] per sample, as ``_build_unified_sequence`` orders it."""
        model, patch = self.transformer, self.patch_size
        image = torch.zeros((channels, 1, rows * patch, cols * patch), device=device)
        _, caps, _, x_pos, cap_pos, _, cap_pad = model.patchify_and_embed([image] * len(captions), list(captions),
                                                                          patch, 1)  # fmt: skip
        tokens = rows * cols
        cap_lens = [len(c) for c in caps]  # padded to a multiple of 32
        x_freqs = [model.rope_embedder(ids) for ids in x_pos]  # (image + pads, d / 2)
        # each sample's stream: its image pads', then its caption's (padded length), as _build_unified_sequence joins
        stream = [torch.cat((f[tokens:], model.rope_embedder(ids[:n])))
                  for f, ids, n in zip(x_freqs, cap_pos, cap_lens, strict=True)]  # fmt: skip
        pads = x_freqs[0].shape[0] - tokens
        total = pads + max(cap_lens)
        positions = torch.arange(total, device=device)
        lengths = torch.tensor([pads + n for n in cap_lens], device=device)
        return {
            "caps": caps,  # each caption padded to a multiple of 32 (its last token repeated)
            "cap_pos": cap_pos,  # their position ids and pad masks, for the context refiner
            "cap_pad": cap_pad,
            "image_freqs": torch.stack([f[:tokens] for f in x_freqs]),  # (B, image tokens, d / 2)
            "stream_freqs": pad_sequence(stream, batch_first=True, padding_value=0.0),  # (B, S, d / 2)
            "stream_mask": None if len(set(cap_lens)) == 1 else positions[None, :] < lengths[:, None],  # (B, S)
            "refiner_mask": (positions < pads)[None, :].expand(len(captions), total),  # (B, S)
            "image_pads": pads,
        }

    def first_stream(self, layout: dict, dtype: torch.dtype) -> torch.Tensor:
        """(B, S, dim): the stream's value before block 0 — the image's pad token, then each caption through
        ``cap_embedder``, its pad token and the context refiner, zero-padded to the batch's longest — as
        ``ZImageTransformer2DModel.forward`` builds it (its ``_prepare_sequence``, its refiner's layers). Zeros of
        that shape on a rank without the embedding modules (it never reads it: the stream comes with the hand-off)."""
        model, caps = self.transformer, layout["caps"]
        pads, freqs = layout["image_pads"], layout["stream_freqs"]
        shape = (len(caps), freqs.shape[1], self.hidden_size)
        if model.cap_embedder is None:
            return torch.zeros((), dtype=dtype, device=freqs.device).expand(shape)
        lengths = [len(c) for c in caps]
        embedded = model.cap_embedder(torch.cat(caps).to(dtype))  # (sum of lengths, dim)
        cap, cap_freqs, cap_mask, _, _ = model._prepare_sequence(list(embedded.split(lengths)), layout["cap_pos"],
                                                                 layout["cap_pad"], model.cap_pad_token, None,
                                                                 freqs.device)  # fmt: skip
        for layer in model.context_refiner:
            cap = layer(cap, cap_mask, cap_freqs)
        image_pads = model.x_pad_token.to(dtype).expand(pads, -1)  # (pads, dim)
        stream = [torch.cat((image_pads, cap[i, :n])) for i, n in enumerate(lengths)]
        return pad_sequence(stream, batch_first=True, padding_value=0.0)  # (B, S, dim)

    # --- the Stage --------------------------------------------------------------------------------------------
    def embed(self, latent_rows: torch.Tensor, band: PatchBand | None) -> torch.Tensor:
        """(B, C, rows, W) latent rows -> (B, band tokens, dim): patchified and embedded as
        ``ZImageTransformer2DModel.forward`` does (an image's pad tokens are the stream's)."""
        tokens = patchify(latent_rows, self.patch_size)  # (B, covering tokens, p * p * C)
        return self.transformer.all_x_embedder[EMBEDDER](tokens if band is None else band.trim(tokens))

    def head(self, hidden: torch.Tensor, cond: ZImageConditioning, token_cols: int, band: PatchBand | None = None):
        """(B, band tokens, dim) -> (B, C, rows * p, W) of the rows covering the band: the final layer on the image
        tokens and ``unpatchify`` (the stream's outputs are dropped, as diffusers' ``unpatchify`` drops them)."""
        out = self.transformer.all_final_layer[EMBEDDER](hidden, c=cond.temb)  # (B, band tokens, p * p * C)
        out = out if band is None else band.pad(out)  # -> (B, covering rows' tokens, p * p * C)
        return unpatchify(out, token_cols, self.patch_size, self.transformer.out_channels)

    def block_kwargs(self, cond: ZImageConditioning, band: PatchBand | None, owner: bool) -> dict:
        """This pass's RoPE rows ([the band's image tokens (or this rank's chunk), the stream tokens this rank holds,
        none for a later patch]) and which of those stream tokens are the caption (a noise refiner keeps them)."""
        stream = self.text_tokens() if owner else slice(0, 0)
        self.joint.text_tokens = stream.stop - stream.start  # the processor splits [image, stream] by it
        freqs = torch.cat((cond.image_freqs[:, self.hidden_tokens(band)], cond.stream_freqs[:, stream]), dim=1)
        caption = torch.arange(stream.start, stream.stop, device=freqs.device) >= cond.image_pads
        return {"freqs_cis": freqs, "caption": caption[None, :, None]}  # (1, stream tokens, 1)

    def call_block(self, index, hidden, text, cond: ZImageConditioning, kwargs):
        """Block ``index`` on [image, stream] -> (stream, image), as ``ZImageTransformer2DModel.forward`` calls the
        noise refiner's blocks (on the image and its pads, the caption neither seen nor updated) and the main layers
        (on the whole sequence, a shorter caption's batch padding masked)."""
        refiner = index < self.transformer.config.n_refiner_layers
        mask = cond.refiner_mask if refiner else cond.stream_mask
        out = self.blocks[index](torch.cat((hidden, text), dim=1), mask, kwargs["freqs_cis"], cond.temb)
        image, stream = out.split((hidden.shape[1], text.shape[1]), dim=1)
        if refiner:
            stream = torch.where(kwargs["caption"], text, stream)
        return stream, image

    def conditioning(self, timestep: torch.Tensor, dtype: torch.dtype, text, layout) -> ZImageConditioning:
        """Per-step conditioning from ZImagePipeline's ``(1000 - t) / 1000``: ``adaln_input``, as
        ``ZImageTransformer2DModel.forward`` embeds it, and the request's sequence."""
        model = self.transformer
        temb = model.t_embedder(timestep * model.t_scale).to(dtype)  # (B, min(dim, 256))
        fields = ("image_freqs", "stream_freqs", "stream_mask", "refiner_mask", "image_pads")
        return ZImageConditioning(temb, text, **{name: layout[name] for name in fields})


def z_image_guide(guidance_scale: float, cfg_half, scale_at, cfg_normalization: float):
    """The request's ``guide``: ZImagePipeline's combination of its [negative, positive] outputs (here in that order;
    diffusers batches [positive, negative]: per sample the same) ``pos + s (pos - neg)``, ``s`` the step's scale
    (``scale_at(step)``: 0 past ``cfg_truncation``), optionally renormalised to the positive prediction's norm over
    the whole sample (``cfg_normalization``: whole-image steps only), negated as the pipeline negates it; float32.
    ``cfg_half``: ``(cfg_rank, exchange)`` under CFG parallelism; ``guidance_scale`` 0: no CFG."""

    def guide(output: torch.Tensor, step: int, patch) -> torch.Tensor:
        if guidance_scale <= 0:
            return -output.float()
        if cfg_half is None:
            neg, pos = output.float().chunk(2)
        else:
            cfg_rank, exchange = cfg_half
            other = exchange(output.contiguous(), step, patch)
            neg, pos = (output.float(), other.float()) if cfg_rank == 0 else (other.float(), output.float())
        scale = scale_at(step)
        pred = pos + scale * (pos - neg)
        if cfg_normalization > 0 and scale > 0:
            if patch is not None:
                raise RuntimeError("cfg_normalization needs the whole image's norm: a patch step cannot apply it")
            for j in range(pred.shape[0]):  # as the pipeline: each sample's norm, capped
                pos_norm, new_norm = torch.linalg.vector_norm(pos[j]), torch.linalg.vector_norm(pred[j])
                cap = pos_norm * cfg_normalization
                if new_norm > cap:
                    pred[j] = pred[j] * (cap / new_norm)
        return -pred

    return guide


def denoise_request(
    stage: ZImageStage,
    *,
    latents,
    timesteps,
    scheduler,
    captions: list[torch.Tensor],
    dtype: torch.dtype,
    guidance_scale: float,
    cfg_truncation: float | None,
    cfg_normalization: float,
    cfg_half=None,
    generator=None,
    on_step_end=None,
):
    """The engine's ``DenoiseRequest`` for Z-Image, built from what ``ZImagePipeline`` prepares.

    ``latents``: (B, C, H, W) float32, the engine's grid. ``captions``: each transformer row's prompt embedding
    (tokens, cap_feat_dim), [negative..., positive...] with CFG batched here, this group's half with ``cfg_half``.
    """
    from xfuse.parallel.request import DenoiseRequest

    copies = 2 if guidance_scale > 0 and cfg_half is None else 1
    model_batch = latents.shape[0] * copies
    if len(captions) != model_batch:
        raise ValueError(f"{len(captions)} captions for a transformer batch of {model_batch}")
    layout = stage.layout(captions, latents.shape[1], latents.shape[2] // stage.patch_size,
                          latents.shape[3] // stage.patch_size, latents.device)  # fmt: skip
    text = stage.first_stream(layout, dtype)
    # As ZImagePipeline.__call__: CFG off at the steps past cfg_truncation (t_norm = (1000 - t) / 1000 above it).
    t_norms = ((1000 - timesteps.float()) / 1000).tolist()

    def scale_at(step: int) -> float:
        truncated = cfg_truncation is not None and float(cfg_truncation) <= 1 and t_norms[step] > cfg_truncation
        return 0.0 if truncated else guidance_scale

    def model_input(rows: torch.Tensor, where: slice = slice(None)) -> torch.Tensor:
        rows = rows.to(dtype)  # the pipeline casts the float32 latents to the transformer's dtype
        return torch.cat([rows] * copies) if copies > 1 else rows  # (B, C, h, W) -> (copies * B, C, h, W)

    def conditioning(step: int, t: torch.Tensor) -> ZImageConditioning:
        timestep = (1000 - t.expand(model_batch)) / 1000  # as the pipeline (repeated for the CFG batch)
        return stage.conditioning(timestep, dtype, text, layout)

    return DenoiseRequest(
        latents=latents,
        timesteps=timesteps,
        scheduler=scheduler,
        conditioning=conditioning,
        model_input=model_input,
        guide=z_image_guide(guidance_scale, cfg_half, scale_at, cfg_normalization),
        model_batch=model_batch,
        generator=generator,
        on_step_end=on_step_end,
        stream_shapes={"text": tuple(text.shape)},
    )
