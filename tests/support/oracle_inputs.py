"""The independent oracle (``tests.support.pipefusion_oracle``) on a pipeline call: a conformance call dict in, the
final latents of PipeFusion with ``num_patches`` patches and ``warmup`` warm-up steps out.

The oracle takes the tensors a diffusers pipeline's ``__call__`` prepares before its loop; each family's test
support already builds them with the pipeline's own methods (``prepare_inputs``). ``ORACLE_INPUTS`` maps the diffusers
pipeline class a family wraps to the function that turns a call into those inputs, so that a test driven by the
registry can ask for any family's oracle. A family without an entry has no oracle: ``oracle_latents`` says so by
name, and the conformance suite fails for it until its oracle is written. The patches are cut as the pipeline
classes cut them (``xfuse.parallel.patch_grid.token_counts``: where the first patch carries a joint-attention text
stream, by tokens; the cut itself is checked against hand-counted cuts in ``tests/multirank/test_mmdit.py``).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch
import torch.nn.functional as F

from tests.support import mmdit_fns, pixart_fns, wan_fns
from tests.support.pipefusion_oracle import pipefusion_ltx_reference, pipefusion_reference, pipefusion_video_reference
from xfuse.parallel.patch_grid import token_counts


def _default(pipe, name: str):
    """The pipeline's ``__call__`` default for ``name``."""
    return inspect.signature(type(pipe).__call__).parameters[name].default


def _hunyuandit(pipe, call: dict) -> dict:
    from xfuse.families.hunyuandit.reference import prepare_inputs

    return prepare_inputs(pipe, prompt=call["prompt"], negative_prompt=call.get("negative_prompt"),
                          height=call["height"], width=call["width"], num_inference_steps=call["num_inference_steps"],
                          guidance_scale=call["guidance_scale"], seed=call.get("seed", 0))  # fmt: skip


def _pixart(pipe, call: dict) -> dict:
    return pixart_fns.prepare_inputs(pipe, prompt=call["prompt"], height=call["height"], width=call["width"],
                                     steps=call["num_inference_steps"], guidance_scale=call["guidance_scale"],
                                     seed=call.get("seed", 0))  # fmt: skip


def _sd3(pipe, call: dict) -> dict:
    return mmdit_fns.prepare_inputs(pipe, height=call["height"], width=call["width"], steps=call["num_inference_steps"],
                                    cfg=call["guidance_scale"], seed=call.get("seed", 0), prompt=call["prompt"],
                                    negative_prompt=call.get("negative_prompt"),
                                    max_sequence_length=_default(pipe, "max_sequence_length"))  # fmt: skip


def _flux(pipe, call: dict) -> dict:
    return mmdit_fns.prepare_inputs(pipe, height=call["height"], width=call["width"], steps=call["num_inference_steps"],
                                    cfg=call.get("true_cfg_scale", 1.0), seed=call.get("seed", 0),
                                    prompt=call["prompt"], negative_prompt=call.get("negative_prompt") or "",
                                    max_sequence_length=_default(pipe, "max_sequence_length"))  # fmt: skip


def _flux2(pipe, call: dict) -> dict:
    """As Flux2Pipeline.__call__ and Flux2KleinPipeline.__call__ prepare them: text and its ids (klein with guidance:
    the empty negative prompt's too), packed latents and their ids, the timesteps with ``compute_empirical_mu``, the
    embedded guidance ([dev]) or the CFG scale ([klein])."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps

    steps, generator = call["num_inference_steps"], torch.Generator().manual_seed(call.get("seed", 0))
    scale = call.get("guidance_scale", _default(pipe, "guidance_scale"))
    klein = type(pipe).__name__ == "Flux2KleinPipeline"
    cfg = klein and scale > 1 and not pipe.config.is_distilled
    with torch.no_grad():
        emb, text_ids = pipe.encode_prompt(prompt=call["prompt"], device="cpu")
        negative = pipe.encode_prompt(prompt="", device="cpu")[0] if cfg else None
        channels = pipe.transformer.config.in_channels // 4
        latents, image_ids = pipe.prepare_latents(1, channels, call["height"], call["width"], emb.dtype, "cpu",
                                                  generator, None)  # fmt: skip
        sigmas = np.linspace(1.0, 1 / steps, steps)
        mu = compute_empirical_mu(image_seq_len=latents.shape[1], num_steps=steps)
        timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, "cpu", sigmas=sigmas, mu=mu)
        pipe.scheduler.set_begin_index(0)
    guidance = None if klein else torch.full([1], scale, dtype=torch.float32).expand(1)
    return dict(prompt_embeds=emb, negative_prompt_embeds=negative, cfg_scale=scale if cfg else 1.0, text_ids=text_ids,
                latents=latents, latent_image_ids=image_ids, timesteps=timesteps, guidance=guidance,
                extra_step_kwargs={}, generator=generator)  # fmt: skip


def _klein_output(pipe, packed: torch.Tensor, inputs: dict) -> torch.Tensor:
    """Flux2KleinPipeline's ``output_type="latent"`` result: unpacked, denormalised with the VAE's BatchNorm
    statistics, unpatchified (its lines after the loop)."""
    latents = pipe._unpack_latents_with_ids(packed, inputs["latent_image_ids"])
    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    return pipe._unpatchify_latents(latents * std + mean)


def _wan(pipe, call: dict) -> dict:
    return wan_fns.prepare_inputs(pipe, height=call["height"], width=call["width"], num_frames=call["num_frames"],
                                  steps=call["num_inference_steps"], guidance_scale=call["guidance_scale"],
                                  prompt=call["prompt"], seed=call.get("seed", 0))  # fmt: skip


def _ltx(pipe, call: dict) -> dict:
    """As LTXPipeline.__call__ prepares them: text and masks batched [negative, positive] with CFG, packed float32
    latents, the timesteps with ``mu`` from the video's tokens, the RoPE's micro-conditions."""
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift, retrieve_timesteps

    steps, scale = call["num_inference_steps"], call.get("guidance_scale", _default(pipe, "guidance_scale"))
    generator = torch.Generator().manual_seed(call.get("seed", 0))
    frames = (call["num_frames"] - 1) // pipe.vae_temporal_compression_ratio + 1
    height, width = (call[side] // pipe.vae_spatial_compression_ratio for side in ("height", "width"))
    with torch.no_grad():
        emb, mask, neg, neg_mask = pipe.encode_prompt(call["prompt"], call.get("negative_prompt"),
                                                      do_classifier_free_guidance=scale > 1, device="cpu")  # fmt: skip
        latents = pipe.prepare_latents(1, pipe.transformer.config.in_channels, call["height"], call["width"],
                                       call["num_frames"], torch.float32, "cpu", generator, None)  # fmt: skip
        config = pipe.scheduler.config
        mu = calculate_shift(frames * height * width, config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))  # fmt: skip
        timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps),
                                          mu=mu)  # fmt: skip
    if scale > 1:
        emb, mask = torch.cat([neg, emb]), torch.cat([neg_mask, mask])
    rope_scale = (pipe.vae_temporal_compression_ratio / call.get("frame_rate", 25), pipe.vae_spatial_compression_ratio,
                  pipe.vae_spatial_compression_ratio)  # fmt: skip
    return dict(latents=latents, timesteps=timesteps, prompt_embeds=emb, prompt_attention_mask=mask,
                guidance_scale=scale, latent_frames=frames, latent_height=height, latent_width=width,
                rope_interpolation_scale=rope_scale)  # fmt: skip


def _qwen_image(pipe, call: dict) -> dict:
    """As QwenImagePipeline.__call__ prepares them: the prompt's embeddings and, with true CFG, the negative prompt's,
    batched [negative, positive] here (the shorter zero-padded, ``prompt_embeds_mask`` False at its padding), packed
    latents, the timesteps with ``mu`` from the image's token count."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    steps, generator = call["num_inference_steps"], torch.Generator().manual_seed(call.get("seed", 0))
    scale = call.get("true_cfg_scale", _default(pipe, "true_cfg_scale"))
    cfg = scale > 1 and call.get("negative_prompt") is not None
    with torch.no_grad():
        texts = [pipe.encode_prompt(prompt=call["prompt"], device="cpu")]
        if cfg:
            texts.insert(0, pipe.encode_prompt(prompt=call["negative_prompt"], device="cpu"))
        length = max(emb.shape[1] for emb, _ in texts)
        embeds = torch.cat([F.pad(emb, (0, 0, 0, length - emb.shape[1])) for emb, _ in texts])
        masks = [torch.ones(emb.shape[:2], dtype=torch.bool) if m is None else m.bool() for emb, m in texts]
        mask = torch.cat([F.pad(m, (0, length - m.shape[1]), value=False) for m in masks])
        channels = pipe.transformer.config.in_channels // 4
        latents = pipe.prepare_latents(1, channels, call["height"], call["width"], embeds.dtype, "cpu", generator,
                                       None)  # fmt: skip
        config = pipe.scheduler.config
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))  # fmt: skip
        timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps),
                                          mu=mu)  # fmt: skip
        pipe.scheduler.set_begin_index(0)
    return dict(prompt_embeds=embeds, prompt_embeds_mask=None if bool(mask.all()) else mask,
                negative_prompt_embeds=texts[0][0] if cfg else None, true_cfg_scale=scale if cfg else 1.0,
                latents=latents, timesteps=timesteps, extra_step_kwargs={}, generator=generator)  # fmt: skip


def _z_image(pipe, call: dict) -> dict:
    """As ZImagePipeline.__call__ prepares them: each prompt's and (CFG at ``guidance_scale > 0``) each negative
    prompt's valid tokens, float32 latents, the timesteps with Z-Image's default sigmas; ``stream_tokens``: what the
    first patch carries beside its image rows (the image's pad tokens and the longest caption, each up to a multiple
    of 32), by which the patches are cut."""
    from diffusers.pipelines.z_image.pipeline_z_image import (
        calculate_shift,
        get_default_z_image_sigmas,
        retrieve_timesteps,
    )

    steps, generator = call["num_inference_steps"], torch.Generator().manual_seed(call.get("seed", 0))
    scale = call.get("guidance_scale", _default(pipe, "guidance_scale"))
    with torch.no_grad():
        positive, negative = pipe.encode_prompt(prompt=call["prompt"], device="cpu",
                                                do_classifier_free_guidance=scale > 0,
                                                negative_prompt=call.get("negative_prompt"))  # fmt: skip
        latents = pipe.prepare_latents(1, pipe.transformer.in_channels, call["height"], call["width"], torch.float32,
                                       "cpu", generator, None)  # fmt: skip
        config = pipe.scheduler.config
        tokens = (latents.shape[2] // 2) * (latents.shape[3] // 2)
        mu = calculate_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))  # fmt: skip
        timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, "cpu", sigmas=get_default_z_image_sigmas(steps),
                                          mu=mu)  # fmt: skip
        pipe.scheduler.set_begin_index(0)
    captions = max(len(c) + (-len(c)) % 32 for c in positive + negative)
    return dict(prompt_embeds=positive, negative_prompt_embeds=negative, guidance_scale=scale, latents=latents,
                timesteps=timesteps, cfg_truncation=call.get("cfg_truncation", 1.0), extra_step_kwargs={},
                generator=generator, stream_tokens=(-tokens) % 32 + captions)  # fmt: skip


def _latents(pipe, latents: torch.Tensor, inputs: dict) -> torch.Tensor:
    """The ``output_type="latent"`` result of most pipelines: the loop's latents as they are."""
    return latents


# diffusers pipeline class -> (its oracle's inputs from a call, the oracle: image, joint (an image whose text stream
# the first patch carries through every block), video or packed video (LTX's tokens), its output_type="latent" result
# from the loop's latents)
ORACLE_INPUTS = {
    "HunyuanDiTPipeline": (_hunyuandit, "image", _latents),
    "PixArtSigmaPipeline": (_pixart, "image", _latents),
    "StableDiffusion3Pipeline": (_sd3, "joint", _latents),
    "FluxPipeline": (_flux, "joint", _latents),
    "Flux2Pipeline": (_flux2, "joint", _latents),
    "Flux2KleinPipeline": (_flux2, "joint", _klein_output),
    "WanPipeline": (_wan, "video", _latents),
    "QwenImagePipeline": (_qwen_image, "joint", _latents),
    "ZImagePipeline": (_z_image, "joint", _latents),
    "LTXPipeline": (_ltx, "packed video", _latents),
}


def oracle_latents(pipe, call: dict, *, num_patches: int, warmup: int, video_patches: str = "temporal") -> torch.Tensor:
    """The oracle's final latents for ``call`` (a dict of the pipeline's ``__call__`` arguments and ``seed``) on
    ``pipe`` (diffusers' pipeline; its transformer is copied, never changed), laid out as the pipeline's
    ``output_type="latent"`` result."""
    name = type(pipe).__name__
    if name not in ORACLE_INPUTS:
        raise KeyError(f"no oracle inputs for {name}: add its entry to tests/support/oracle_inputs.ORACLE_INPUTS")
    prepare, kind, output = ORACLE_INPUTS[name]
    inputs = prepare(pipe, call)
    if kind == "video":
        return pipefusion_video_reference(pipe, inputs, direction=video_patches, num_patches=num_patches,
                                          warmup=warmup)  # fmt: skip
    if kind == "packed video":
        return pipefusion_ltx_reference(pipe, inputs, num_patches=num_patches, warmup=warmup)
    counts = None  # even bands of whole token rows
    if kind == "joint":  # the first patch carries the text: the patches are cut so that each runs as many tokens
        # token rows: latent rows per token row 2 (SD3's patch size, FLUX's 2 x 2 packing)
        rows, cols = (call[side] // pipe.vae_scale_factor // 2 for side in ("height", "width"))
        lead = inputs["stream_tokens"] if "stream_tokens" in inputs else inputs["prompt_embeds"].shape[1]
        counts = token_counts(rows, cols, num_patches, lead_tokens=lead)
    latents = pipefusion_reference(pipe, inputs, height=call["height"], width=call["width"], num_patches=num_patches,
                                   warmup=warmup, token_counts=counts)  # fmt: skip
    return output(pipe, latents, inputs)
