"""``PipeFusionPixArtSigmaPipeline``: diffusers' ``PixArtSigmaPipeline`` with PipeFusion inside, under torchrun.

What every family shares is ``PipeFusionPipelineBase``'s. This file is ``PixArtSigmaPipeline.__call__``'s
preparation (resolution binning, ``check_inputs``, ``encode_prompt``, ``retrieve_timesteps``, ``prepare_latents``)
and decoding, run by the diffusers pipeline object itself.
"""

from __future__ import annotations

import torch
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from diffusers.pipelines.pixart_alpha import pipeline_pixart_sigma as diffusers_sigma

from xfuse.families.pixart.spec import PIXART_SIGMA
from xfuse.families.pixart.stage import denoise_request
from xfuse.pipelines.base import PipeFusionPipelineBase

# Mirrors PixArtSigmaPipeline.__call__: the aspect-ratio bins of each transformer sample size.
_BINS = {size: getattr(diffusers_sigma, f"ASPECT_RATIO_{8 * size}_BIN") for size in (256, 128, 64, 32)}


class PipeFusionPixArtSigmaPipeline(PipeFusionPipelineBase):
    r"""
    Text-to-image with PixArt-Σ on ``cfg_degree x pipefusion_degree`` ranks, called with the arguments of diffusers'
    [`~diffusers.PixArtSigmaPipeline.__call__`]; global rank 0 returns what diffusers returns, the others `None`.
    Rules: [`~xfuse.pipelines.base.PipeFusionPipelineBase`]. `callback` runs on the rank that steps the scheduler of
    CFG group 0 with a copy of the latents. Keyword arguments diffusers would ignore are refused.
    """

    spec = PIXART_SIGMA
    rank0_components = ("tokenizer", "text_encoder", "vae")

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] = None,
        negative_prompt: str = "",
        num_inference_steps: int = 20,
        timesteps: list[int] = None,
        sigmas: list[float] = None,
        guidance_scale: float = 4.5,
        num_images_per_prompt: int | None = 1,
        height: int | None = None,
        width: int | None = None,
        eta: float = 0.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_attention_mask: torch.Tensor | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        callback=None,
        callback_steps: int = 1,
        clean_caption: bool = True,
        use_resolution_binning: bool = True,
        max_sequence_length: int = PIXART_SIGMA.text_lengths[0],
        **kwargs,
    ):
        if kwargs:
            raise TypeError(f"PipeFusionPixArtSigmaPipeline got unexpected keyword arguments {sorted(kwargs)}")
        pipe, ctx = self.pipeline, self.context
        # 1. Size (optionally binned) and checks, the same on every rank before any communication.
        height = height or self.default_sample_size * pipe.vae_scale_factor
        width = width or self.default_sample_size * pipe.vae_scale_factor
        orig_height, orig_width = height, width
        if use_resolution_binning:
            if self.default_sample_size not in _BINS:
                raise ValueError(f"use_resolution_binning: no bins for sample size {self.default_sample_size}")
            height, width = pipe.image_processor.classify_height_width_bin(
                height, width, ratios=_BINS[self.default_sample_size]
            )
        pipe.check_inputs(
            prompt,
            height,
            width,
            negative_prompt,
            callback_steps,
            prompt_embeds,
            negative_prompt_embeds,
            prompt_attention_mask,
            negative_prompt_attention_mask,
        )
        batch_size = 1 if isinstance(prompt, str) else len(prompt) if isinstance(prompt, list) else len(prompt_embeds)
        if timesteps is not None or sigmas is not None:  # the number of steps is the custom schedule's length
            num_inference_steps = len(timesteps if timesteps is not None else sigmas)
        self._check_common(
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            generator=generator,
            output_type=output_type,
            num_images_per_prompt=num_images_per_prompt,
            latents=latents,
            batch_size=batch_size,
        )
        self._begin_call()
        do_cfg = guidance_scale > 1.0

        result = None
        with ctx.monitor.guard():  # from here on every rank communicates: a failure anywhere stops everyone
            device = ctx.device

            # 2. Encode the prompt on rank 0 and broadcast the embeddings.
            def encode() -> dict[str, torch.Tensor]:
                emb, mask, neg, neg_mask = pipe.encode_prompt(
                    prompt,
                    do_cfg,
                    negative_prompt=negative_prompt,
                    num_images_per_prompt=num_images_per_prompt,
                    device=device,
                    prompt_embeds=prompt_embeds,
                    negative_prompt_embeds=negative_prompt_embeds,
                    prompt_attention_mask=prompt_attention_mask,
                    negative_prompt_attention_mask=negative_prompt_attention_mask,
                    clean_caption=clean_caption,
                    max_sequence_length=max_sequence_length,
                )
                if do_cfg:
                    emb, mask = torch.cat([neg, emb]), torch.cat([neg_mask, mask])
                return {"prompt_embeds": emb.to(self.dtype), "prompt_attention_mask": mask}

            text = self._broadcast_tensors(encode)

            # 3. Timesteps, latents (rank 0's, broadcast), scheduler kwargs.
            step_times, num_inference_steps = diffusers_sigma.retrieve_timesteps(
                pipe.scheduler, num_inference_steps, device, timesteps, sigmas
            )
            generator = self._shared_generator(generator)
            channels = self.stage.config.in_channels
            latents = self._shared_latents(
                lambda: pipe.prepare_latents(
                    batch_size * num_images_per_prompt, channels, height, width, self.dtype, device, generator, latents
                )
            )
            model_text, cfg_half = self._cfg_split(text, latents.shape[0])

            # 4. The denoising loop: xfuse's engine.
            on_step_end = None
            if callback is not None and self._observer():
                order = getattr(pipe.scheduler, "order", 1)
                warmup = max(len(step_times) - num_inference_steps * order, 0)

                def on_step_end(i, current):  # mirrors the loop's callback condition
                    last = i == len(step_times) - 1
                    if (last or ((i + 1) > warmup and (i + 1) % order == 0)) and i % callback_steps == 0:
                        callback(i // order, step_times[i], current.clone())

            request = denoise_request(
                self.stage,
                latents=latents,
                timesteps=step_times,
                scheduler=pipe.scheduler,
                guidance_scale=guidance_scale,
                cfg_half=cfg_half,
                extra_step_kwargs=pipe.prepare_extra_step_kwargs(generator, eta),
                generator=generator,
                on_step_end=on_step_end,
                **model_text,
            )
            final = self._denoise(request, height, width, num_inference_steps)
            if ctx.is_output:
                result = self._decode(final, output_type, return_dict, use_resolution_binning, orig_height, orig_width)
        return self._finish(result)

    def _decode(self, final, output_type, return_dict, binned, orig_height, orig_width):
        """Rank 0: VAE decode and post-processing, as ``PixArtSigmaPipeline.__call__`` does."""
        pipe = self.pipeline
        if output_type != "latent":
            image = pipe.vae.decode(final.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]
            if binned:
                image = pipe.image_processor.resize_and_crop_tensor(image, orig_width, orig_height)
            image = pipe.image_processor.postprocess(image, output_type=output_type)
        else:
            image = final
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return ImagePipelineOutput(images=image)
