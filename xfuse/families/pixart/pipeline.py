"""``PipeFusionPixArtSigmaPipeline``: diffusers' ``PixArtSigmaPipeline`` with PipeFusion inside, under torchrun.

What every family shares, and the order of every call, is ``PipeFusionPipelineBase``'s. This file is
``PixArtSigmaPipeline.__call__``'s signature and checks (resolution binning, ``check_inputs``), and its recipe
(``encode_prompt``, ``retrieve_timesteps``, ``prepare_latents``, the legacy ``callback``, decoding), run by the
diffusers pipeline object itself.
"""

from __future__ import annotations

import torch
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from diffusers.pipelines.pixart_alpha import pipeline_pixart_sigma as diffusers_sigma

from xfuse.families.common.guidance import do_classifier_free_guidance
from xfuse.families.pixart.spec import PIXART_SIGMA
from xfuse.families.pixart.stage import denoise_request
from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.call_driver import CallRecipe

# Mirrors ``diffusers.PixArtSigmaPipeline.__call__``: the aspect-ratio bins of each transformer sample size.
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
        pipe, device = self.pipeline, self.context.device
        height, width = self._default_size(height, width)
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
        batch_size = self._batch_size(prompt, prompt_embeds)
        if timesteps is not None or sigmas is not None:  # the number of steps is the custom schedule's length
            num_inference_steps = len(timesteps if timesteps is not None else sigmas)
        do_cfg = do_classifier_free_guidance(guidance_scale)

        def encode() -> dict[str, torch.Tensor]:  # rank 0
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

        def set_timesteps() -> torch.Tensor:
            return diffusers_sigma.retrieve_timesteps(pipe.scheduler, num_inference_steps, device, timesteps, sigmas)[0]

        def prepare_latents(generator) -> torch.Tensor:
            channels = self.stage.config.in_channels
            batch = batch_size * num_images_per_prompt
            return pipe.prepare_latents(batch, channels, height, width, self.dtype, device, generator, latents)

        def request(text, latents, step_times, generator):
            model_text, cfg_half = self._cfg_split(text, latents.shape[0])
            on_step_end = None
            if callback is not None and self._observer():
                order = getattr(pipe.scheduler, "order", 1)
                warmup = max(len(step_times) - num_inference_steps * order, 0)

                # Mirrors ``diffusers.PixArtSigmaPipeline.__call__``: the denoising loop's callback condition.
                def on_step_end(i, current):
                    last = i == len(step_times) - 1
                    if (last or ((i + 1) > warmup and (i + 1) % order == 0)) and i % callback_steps == 0:
                        callback(i // order, step_times[i], current.clone())

            return denoise_request(
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

        def decode(final):
            return self._decode(final, output_type, return_dict, use_resolution_binning, orig_height, orig_width)

        return self._run(
            CallRecipe(
                height=height,
                width=width,
                num_inference_steps=num_inference_steps,
                batch_size=batch_size,
                num_images_per_prompt=num_images_per_prompt,
                guidance_scale=guidance_scale,
                generator=generator,
                latents=latents,
                output_type=output_type,
                encode=encode,
                timesteps=set_timesteps,
                prepare_latents=prepare_latents,
                request=request,
                decode=decode,
            )
        )

    def _decode(self, final, output_type, return_dict, binned, orig_height, orig_width):
        """Rank 0: VAE decode and post-processing, as ``diffusers.PixArtSigmaPipeline.__call__`` does."""
        pipe = self.pipeline
        if output_type != "latent":
            image = self._decode_latents(final.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor)
            if binned:
                image = pipe.image_processor.resize_and_crop_tensor(image, orig_width, orig_height)
            image = pipe.image_processor.postprocess(image, output_type=output_type)
        else:
            image = final
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return ImagePipelineOutput(images=image)
