"""``PipeFusionStableDiffusion3Pipeline``: diffusers' ``StableDiffusion3Pipeline`` with PipeFusion, under torchrun.

What every family shares, and the order of every call, is ``PipeFusionPipelineBase``'s. This file is
``StableDiffusion3Pipeline.__call__``'s signature and checks, and its recipe (``encode_prompt`` with the three text
encoders, the flow-matching timesteps with an optional ``mu``, ``prepare_latents``, decoding), run by the diffusers
pipeline object itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffusers.pipelines.stable_diffusion_3 import pipeline_stable_diffusion_3 as diffusers_sd3
from diffusers.pipelines.stable_diffusion_3.pipeline_output import StableDiffusion3PipelineOutput

from xfuse.families.common.guidance import do_classifier_free_guidance
from xfuse.families.sd3.spec import STABLE_DIFFUSION_3
from xfuse.families.sd3.stage import denoise_request
from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.call_driver import CallRecipe
from xfuse.pipelines.callbacks import callback_tensor_inputs, step_end_callback
from xfuse.pipelines.lora import ShardedLoraMixin

if TYPE_CHECKING:
    from xfuse.families.common.control import ControlCall


class PipeFusionStableDiffusion3Pipeline(ShardedLoraMixin, PipeFusionPipelineBase):
    r"""
    Text-to-image with SD3 / SD3.5 on ``cfg_degree x pipefusion_degree`` ranks, called with the arguments of
    diffusers' [`~diffusers.StableDiffusion3Pipeline.__call__`]; global rank 0 returns what diffusers returns, the
    others `None`. Rules: [`~xfuse.pipelines.base.PipeFusionPipelineBase`]; `callback_on_step_end` as in
    [`~xfuse.pipelines.PipeFusionHunyuanDiTPipeline`] (read-only). Refused by name: IP-Adapter images,
    `joint_attention_kwargs` and skip-layer guidance (`skip_guidance_layers`: a third forward pass with its own K/V).
    """

    spec = STABLE_DIFFUSION_3
    rank0_components = (
        "tokenizer",
        "tokenizer_2",
        "tokenizer_3",
        "text_encoder",
        "text_encoder_2",
        "text_encoder_3",
        "vae",
    )

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] = None,
        prompt_2: str | list[str] | None = None,
        prompt_3: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 28,
        sigmas: list[float] | None = None,
        guidance_scale: float = 7.0,
        negative_prompt: str | list[str] | None = None,
        negative_prompt_2: str | list[str] | None = None,
        negative_prompt_3: str | list[str] | None = None,
        num_images_per_prompt: int | None = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.FloatTensor | None = None,
        prompt_embeds: torch.FloatTensor | None = None,
        negative_prompt_embeds: torch.FloatTensor | None = None,
        pooled_prompt_embeds: torch.FloatTensor | None = None,
        negative_pooled_prompt_embeds: torch.FloatTensor | None = None,
        ip_adapter_image=None,
        ip_adapter_image_embeds: torch.Tensor | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: dict | None = None,
        clip_skip: int | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = STABLE_DIFFUSION_3.text_lengths[1],
        skip_guidance_layers: list[int] = None,
        skip_layer_guidance_scale: float = 2.8,
        skip_layer_guidance_stop: float = 0.2,
        skip_layer_guidance_start: float = 0.01,
        mu: float | None = None,
    ):
        return self._sd3_call(None, **{name: value for name, value in locals().items() if name != "self"})

    def _sd3_call(
        self,
        control: ControlCall | None,  # controlnet.py's SD3ControlCall, from its pipeline class
        prompt=None,
        prompt_2=None,
        prompt_3=None,
        height=None,
        width=None,
        num_inference_steps=28,
        sigmas=None,
        guidance_scale=7.0,
        negative_prompt=None,
        negative_prompt_2=None,
        negative_prompt_3=None,
        num_images_per_prompt=1,
        generator=None,
        latents=None,
        prompt_embeds=None,
        negative_prompt_embeds=None,
        pooled_prompt_embeds=None,
        negative_pooled_prompt_embeds=None,
        ip_adapter_image=None,
        ip_adapter_image_embeds=None,
        output_type="pil",
        return_dict=True,
        joint_attention_kwargs=None,
        clip_skip=None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs=("latents",),
        max_sequence_length=STABLE_DIFFUSION_3.text_lengths[1],
        skip_guidance_layers=None,
        skip_layer_guidance_scale=2.8,
        skip_layer_guidance_stop=0.2,
        skip_layer_guidance_start=0.01,
        mu=None,
    ):
        """``StableDiffusion3Pipeline.__call__``'s recipe (its arguments, defaults as there); with ``control``,
        ``StableDiffusion3ControlNetPipeline``'s: the control image encoded with the prompt on rank 0, the control
        model's residuals in the engine's request."""
        pipe, device = self.pipeline, self.context.device
        callback_on_step_end_tensor_inputs = callback_tensor_inputs(
            callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        self._refuse(
            ip_adapter_image=(ip_adapter_image, None, "IP-Adapter attention is not a stale-K/V processor"),
            ip_adapter_image_embeds=(ip_adapter_image_embeds, None, "IP-Adapter attention"),
            joint_attention_kwargs=(joint_attention_kwargs, None, "its processors take no extra arguments"),
            skip_guidance_layers=(skip_guidance_layers, None, "a third forward pass would need its own K/V buffers"),
        )
        height, width = self._default_size(height, width)
        pipe.check_inputs(
            prompt,
            prompt_2,
            prompt_3,
            height,
            width,
            negative_prompt=negative_prompt,
            negative_prompt_2=negative_prompt_2,
            negative_prompt_3=negative_prompt_3,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length,
        )
        batch_size = self._batch_size(prompt, prompt_embeds)
        if sigmas is not None:  # the number of steps is the custom schedule's length
            num_inference_steps = len(sigmas)
        do_cfg = do_classifier_free_guidance(guidance_scale)

        def encode() -> dict[str, torch.Tensor]:  # rank 0: CLIP-L, CLIP-G and T5
            emb, neg, pooled, neg_pooled = pipe.encode_prompt(
                prompt=prompt,
                prompt_2=prompt_2,
                prompt_3=prompt_3,
                negative_prompt=negative_prompt,
                negative_prompt_2=negative_prompt_2,
                negative_prompt_3=negative_prompt_3,
                do_classifier_free_guidance=do_cfg,
                prompt_embeds=prompt_embeds,
                negative_prompt_embeds=negative_prompt_embeds,
                pooled_prompt_embeds=pooled_prompt_embeds,
                negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
                device=device,
                clip_skip=clip_skip,
                num_images_per_prompt=num_images_per_prompt,
                max_sequence_length=max_sequence_length,
            )
            text = {"prompt_embeds": emb, "pooled_prompt_embeds": pooled}
            if do_cfg:
                text |= {"negative_prompt_embeds": neg, "negative_pooled_prompt_embeds": neg_pooled}
            if control is not None:  # after the prompt, as diffusers (its VAE draws from the global generator)
                batch = batch_size * num_images_per_prompt
                text["control_latents"] = control.encode(self, height, width, batch, num_images_per_prompt, do_cfg)
            return {k: v.to(self.dtype) for k, v in text.items()}

        def timesteps() -> torch.Tensor:
            scheduler_kwargs = {} if mu is None else {"mu": mu}
            if pipe.scheduler.config.get("use_dynamic_shifting", None) and mu is None:
                # Mirrors ``diffusers.StableDiffusion3Pipeline.__call__``: mu from the whole latent's token count
                # (diffusers reads it off the latents' shape: the same number).
                patch, vae = self.stage.config.patch_size, self.spec.vae_scale_factor
                config = pipe.scheduler.config
                scheduler_kwargs["mu"] = diffusers_sd3.calculate_shift(
                    (height // vae // patch) * (width // vae // patch),
                    config.get("base_image_seq_len", 256),
                    config.get("max_image_seq_len", 4096),
                    config.get("base_shift", 0.5),
                    config.get("max_shift", 1.16),
                )
            return diffusers_sd3.retrieve_timesteps(
                pipe.scheduler, num_inference_steps, device, sigmas=sigmas, **scheduler_kwargs
            )[0]

        def prepare_latents(generator) -> torch.Tensor:
            channels = self.stage.config.in_channels
            batch = batch_size * num_images_per_prompt
            return pipe.prepare_latents(batch, channels, height, width, self.dtype, device, generator, latents)

        def request(text, latents, timesteps, generator):
            keys = ("prompt_embeds", "pooled_prompt_embeds")
            batched = {k: torch.cat([text[f"negative_{k}"], text[k]]) if do_cfg else text[k] for k in keys}
            if control is not None:  # [uncond, cond] already: diffusers encodes the doubled control image
                batched["control_latents"] = text["control_latents"]
            model_text, cfg_half = self._cfg_split(batched, latents.shape[0])
            control_latents = model_text.pop("control_latents", None)
            on_step_end = step_end_callback(
                self, callback_on_step_end, callback_on_step_end_tensor_inputs, timesteps, batched
            )
            request = denoise_request(
                self.stage,
                latents=latents,
                timesteps=timesteps,
                scheduler=pipe.scheduler,
                guidance_scale=guidance_scale,
                cfg_half=cfg_half,
                generator=generator,
                on_step_end=on_step_end,
                **model_text,
            )
            if control is not None:
                request.control = control.residuals(self, model_text, control_latents, timesteps)
            return request

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
                timesteps=timesteps,
                prepare_latents=prepare_latents,
                request=request,
                decode=lambda final: self._decode(final, output_type, return_dict),
            )
        )

    def _decode(self, final, output_type, return_dict):
        """Rank 0: VAE decode and post-processing, as ``diffusers.StableDiffusion3Pipeline.__call__`` does."""
        pipe = self.pipeline
        if output_type == "latent":
            image = final
        else:
            final = (final / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
            image = self._decode_latents(final)
            image = pipe.image_processor.postprocess(image, output_type=output_type)
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return StableDiffusion3PipelineOutput(images=image)
