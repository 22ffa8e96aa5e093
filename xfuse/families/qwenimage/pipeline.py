"""``PipeFusionQwenImagePipeline``: diffusers' ``QwenImagePipeline`` with PipeFusion inside, under torchrun.

What every family shares, and the order of every call, is ``PipeFusionPipelineBase``'s. This file is
``QwenImagePipeline.__call__``'s signature and checks, and its recipe (``encode_prompt`` for the prompt and, with true
CFG, the negative prompt, each at its own length with its padding mask; the timesteps with ``mu`` from the whole
image's token count; ``prepare_latents`` with the packed latents; decoding through the 3-D VAE's latent statistics),
run by the diffusers pipeline object itself.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage as diffusers_qwenimage
from diffusers.pipelines.qwenimage.pipeline_output import QwenImagePipelineOutput

from xfuse.families.common.packed import grid_to_packed, packed_to_grid
from xfuse.families.common.timesteps import shifted_timesteps
from xfuse.families.qwenimage.spec import QWEN_IMAGE
from xfuse.families.qwenimage.stage import denoise_request
from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.call_driver import CallRecipe
from xfuse.pipelines.callbacks import callback_tensor_inputs, step_end_callback
from xfuse.pipelines.lora import ShardedLoraMixin

logger = logging.getLogger(__name__)


def pad_texts(texts: list[tuple[torch.Tensor, torch.Tensor | None]]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompt embeddings of different lengths, each (B_i, T_i, D) with its padding mask (B_i, T_i) or ``None`` (all
    attended), as one batch (sum B_i, max T_i, D) padded with zeros and its mask (False at padding): ``None`` where
    every token is attended, as ``QwenImagePipeline.encode_prompt`` drops an all-ones mask (the transformer then
    attends without one)."""
    length = max(embeds.shape[1] for embeds, _ in texts)
    padded, masks = [], []
    for embeds, mask in texts:
        batch, tokens, _ = embeds.shape
        mask = torch.ones(batch, tokens, dtype=torch.bool, device=embeds.device) if mask is None else mask.bool()
        padded.append(torch.nn.functional.pad(embeds, (0, 0, 0, length - tokens)))  # (B_i, T, D), zeros after
        masks.append(torch.nn.functional.pad(mask, (0, length - tokens), value=False))  # (B_i, T)
    mask = torch.cat(masks)
    return torch.cat(padded), (None if bool(mask.all()) else mask)


class PipeFusionQwenImagePipeline(ShardedLoraMixin, PipeFusionPipelineBase):
    r"""
    Text-to-image with Qwen-Image on ``cfg_degree x pipefusion_degree`` ranks (with sequence parallelism inside each
    stage), called with the arguments of diffusers' [`~diffusers.QwenImagePipeline.__call__`]; global rank 0 returns
    what diffusers returns, the others `None`. Rules: [`~xfuse.pipelines.base.PipeFusionPipelineBase`];
    `callback_on_step_end` as in [`~xfuse.pipelines.PipeFusionHunyuanDiTPipeline`] (read-only; `latents` packed as
    diffusers has them).

    Each rank loads only its blocks of the transformer (each block with its own modulation); the text encoder
    (Qwen2.5-VL-7B in the release) and the VAE only on rank 0. True CFG (`true_cfg_scale > 1` with a negative prompt)
    runs the negative and the positive prompt as one transformer batch [negative, positive], the shorter text padded
    and masked (diffusers makes two calls, each at its prompt's length: per sample the same computation), combined as
    diffusers does (rescaled to the positive prediction's norm); `parallel.cfg_degree: 2` gives each CFG group its
    own prompt, unpadded. Without true CFG `cfg_degree: 2` is refused. `guidance_scale` is ignored, as diffusers
    ignores it for a transformer without a guidance embedding (the release has none; one with it is refused at load).
    Refused by name: `attention_kwargs`.
    """

    spec = QWEN_IMAGE
    rank0_components = ("tokenizer", "text_encoder", "vae")

    def _latents_shape(self, recipe: CallRecipe) -> tuple[int, ...]:
        """QwenImagePipeline's packed latents: (B, (H/16) * (W/16), 4 * latent channels)."""
        scale, batch = self.spec.latent_scale, recipe.batch_size * recipe.num_images_per_prompt
        return (batch, (recipe.height // scale) * (recipe.width // scale), self.stage.config.in_channels)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] = None,
        negative_prompt: str | list[str] = None,
        true_cfg_scale: float = 4.0,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        sigmas: list[float] | None = None,
        guidance_scale: float | None = None,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_mask: torch.Tensor | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        attention_kwargs: dict | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = QWEN_IMAGE.text_lengths[0],
    ):
        pipe, device = self.pipeline, self.context.device
        callback_on_step_end_tensor_inputs = callback_tensor_inputs(
            callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        self._refuse(attention_kwargs=(attention_kwargs, None, "its processors take no extra arguments"))
        # diffusers only warns about a size that is not a multiple of 16 and resizes it; xfuse refuses it (the
        # family's layout check, before any communication).
        height, width = self._default_size(height, width)
        pipe.check_inputs(
            prompt,
            height,
            width,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            prompt_embeds_mask=prompt_embeds_mask,
            negative_prompt_embeds_mask=negative_prompt_embeds_mask,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length,
        )
        batch_size = self._batch_size(prompt, prompt_embeds)
        # Mirrors ``diffusers.QwenImagePipeline.__call__``: true CFG needs a negative prompt (or its embeddings).
        has_neg_prompt = negative_prompt is not None or negative_prompt_embeds is not None
        do_true_cfg = true_cfg_scale > 1 and has_neg_prompt
        if self.parallel.cfg_degree == 2 and not do_true_cfg:
            raise ValueError(
                "parallel.cfg_degree 2 splits true CFG's [negative, positive] batch, which QwenImagePipeline runs only "
                f"with true_cfg_scale > 1 and a negative prompt (got true_cfg_scale={true_cfg_scale}, "
                f"{'a' if has_neg_prompt else 'no'} negative prompt)"
            )
        if guidance_scale is not None and self.context.is_output:  # diffusers' warning, once per call
            logger.warning("guidance_scale is passed as %s, but ignored since the model is not guidance-distilled.",
                           guidance_scale)  # fmt: skip
        cfg_scale = true_cfg_scale if do_true_cfg else 1.0  # what batches [negative, positive]
        encoded = {
            "device": device,
            "num_images_per_prompt": num_images_per_prompt,
            "max_sequence_length": max_sequence_length,
        }

        def encode() -> dict[str, torch.Tensor]:  # rank 0: the prompt and, with true CFG, the negative prompt
            prompts = {"": (prompt, prompt_embeds, prompt_embeds_mask)}
            if do_true_cfg:
                prompts["negative_"] = (negative_prompt, negative_prompt_embeds, negative_prompt_embeds_mask)
            text = {}
            for prefix, (given, embeds, mask) in prompts.items():
                emb, emb_mask = pipe.encode_prompt(prompt=given, prompt_embeds=embeds, prompt_embeds_mask=mask,
                                                   **encoded)  # fmt: skip
                text[f"{prefix}prompt_embeds"] = emb.to(self.dtype)
                if emb_mask is not None:  # None: every token attended (encode_prompt drops an all-ones mask)
                    text[f"{prefix}prompt_embeds_mask"] = emb_mask
            return text

        def timesteps() -> torch.Tensor:
            # As ``diffusers.QwenImagePipeline.__call__``: mu from the whole image's packed tokens, never a band's.
            steps_sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps) if sigmas is None else sigmas
            scale = self.spec.latent_scale
            tokens = (height // scale) * (width // scale)
            return shifted_timesteps(diffusers_qwenimage, pipe.scheduler, num_inference_steps, device, steps_sigmas,
                                     tokens)  # fmt: skip

        def prepare_latents(generator) -> torch.Tensor:
            channels = self.stage.config.in_channels // 4
            batch = batch_size * num_images_per_prompt
            return pipe.prepare_latents(batch, channels, height, width, self.dtype, device, generator, latents)

        def request(text, packed, timesteps, generator):
            positive = (text["prompt_embeds"], text.get("prompt_embeds_mask"))
            cfg_half = self._cfg_half() if do_true_cfg else None
            if not do_true_cfg:
                embeds, mask = positive
            elif cfg_half is not None:  # this CFG group's own prompt, at its own length
                negative = (text["negative_prompt_embeds"], text.get("negative_prompt_embeds_mask"))
                embeds, mask = (negative, positive)[cfg_half[0]]
            else:  # one batch [negative, positive], the shorter padded and masked
                negative = (text["negative_prompt_embeds"], text.get("negative_prompt_embeds_mask"))
                embeds, mask = pad_texts([negative, positive])
            on_step_end = step_end_callback(
                self,
                callback_on_step_end,
                callback_on_step_end_tensor_inputs,
                timesteps,
                {"prompt_embeds": text["prompt_embeds"]},
                latents_view=grid_to_packed,
            )
            return denoise_request(  # on the packed latents viewed as a grid of token rows
                self.stage,
                latents=packed_to_grid(packed, height // self.spec.latent_scale).contiguous(),
                timesteps=timesteps,
                scheduler=pipe.scheduler,
                prompt_embeds=embeds,
                prompt_embeds_mask=None if mask is None else mask.bool(),
                true_cfg_scale=cfg_scale,
                cfg_half=cfg_half,
                generator=generator,
                on_step_end=on_step_end,
            )

        return self._run(
            CallRecipe(
                height=height,
                width=width,
                num_inference_steps=num_inference_steps if sigmas is None else len(sigmas),
                batch_size=batch_size,
                num_images_per_prompt=num_images_per_prompt,
                guidance_scale=cfg_scale,
                generator=generator,
                latents=latents,
                output_type=output_type,
                encode=encode,
                timesteps=timesteps,
                prepare_latents=prepare_latents,
                request=request,
                decode=lambda final: self._decode(grid_to_packed(final), height, width, output_type, return_dict),
            )
        )

    def _decode(self, packed, height, width, output_type, return_dict):
        """Rank 0: unpack to one latent frame, undo the VAE's per-channel latent statistics, decode, keep the frame and
        post-process, as ``diffusers.QwenImagePipeline.__call__`` does."""
        pipe = self.pipeline
        if output_type == "latent":
            image = packed
        else:
            latents = pipe._unpack_latents(packed, height, width, pipe.vae_scale_factor)  # -> (B, C, 1, h, w)
            latents = latents.to(pipe.vae.dtype)
            config = pipe.vae.config
            mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
            inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)
            latents = latents / inv_std.to(latents.device, latents.dtype) + mean
            image = self._decode_latents(latents)[:, :, 0]  # (B, 3, 1, H, W) -> (B, 3, H, W)
            image = pipe.image_processor.postprocess(image, output_type=output_type)
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return QwenImagePipelineOutput(images=image)
