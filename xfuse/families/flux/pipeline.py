"""``PipeFusionFluxPipeline``: diffusers' ``FluxPipeline`` with PipeFusion inside, under torchrun.

What every family shares, and the order of every call, is ``PipeFusionPipelineBase``'s. This file is
``FluxPipeline.__call__``'s signature and checks, and its recipe (``encode_prompt`` for the prompt and, with true CFG,
the negative prompt; the timesteps with ``mu`` from the whole image's token count; ``prepare_latents`` with the packed
latents and their ids; the guidance embedding; decoding with unpacking), run by the diffusers pipeline object itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from diffusers.pipelines.flux import pipeline_flux as diffusers_flux
from diffusers.pipelines.flux.pipeline_output import FluxPipelineOutput

from xfuse.families.common.packed import grid_to_packed, packed_to_grid
from xfuse.families.common.timesteps import shifted_timesteps
from xfuse.families.flux.spec import FLUX
from xfuse.families.flux.stage import denoise_request
from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.call_driver import CallRecipe
from xfuse.pipelines.callbacks import callback_tensor_inputs, step_end_callback
from xfuse.pipelines.lora import ShardedLoraMixin

if TYPE_CHECKING:
    from xfuse.families.common.control import ControlCall


class PipeFusionFluxPipeline(ShardedLoraMixin, PipeFusionPipelineBase):
    r"""
    Text-to-image with FLUX.1 on ``cfg_degree x pipefusion_degree`` ranks, called with the arguments of diffusers'
    [`~diffusers.FluxPipeline.__call__`]; global rank 0 returns what diffusers returns, the others `None`. Rules:
    [`~xfuse.pipelines.base.PipeFusionPipelineBase`]; `callback_on_step_end` as in
    [`~xfuse.pipelines.PipeFusionHunyuanDiTPipeline`] (read-only; `latents` packed as diffusers has them).

    True CFG (`true_cfg_scale > 1` with a negative prompt) runs the negative and the positive prompt as one
    transformer batch [negative, positive] (diffusers makes two calls: per sample the same computation), so
    `parallel.cfg_degree: 2` splits it like the CFG of the other families. Without true CFG the batch is the images'
    (FLUX.1-dev embeds `guidance_scale`), and `cfg_degree: 2` is refused. Refused by name: IP-Adapter images and
    `joint_attention_kwargs`.
    """

    spec = FLUX
    rank0_components = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2", "vae")

    def _latents_shape(self, recipe: CallRecipe) -> tuple[int, ...]:
        """FluxPipeline's packed latents: (B, (H/16) * (W/16), 4 * latent channels)."""
        scale, batch = self.spec.latent_scale, recipe.batch_size * recipe.num_images_per_prompt
        return (batch, (recipe.height // scale) * (recipe.width // scale), self.stage.config.in_channels)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] = None,
        prompt_2: str | list[str] | None = None,
        negative_prompt: str | list[str] = None,
        negative_prompt_2: str | list[str] | None = None,
        true_cfg_scale: float = 1.0,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 28,
        sigmas: list[float] | None = None,
        guidance_scale: float = 3.5,
        num_images_per_prompt: int | None = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.FloatTensor | None = None,
        prompt_embeds: torch.FloatTensor | None = None,
        pooled_prompt_embeds: torch.FloatTensor | None = None,
        ip_adapter_image=None,
        ip_adapter_image_embeds: list[torch.Tensor] | None = None,
        negative_ip_adapter_image=None,
        negative_ip_adapter_image_embeds: list[torch.Tensor] | None = None,
        negative_prompt_embeds: torch.FloatTensor | None = None,
        negative_pooled_prompt_embeds: torch.FloatTensor | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: dict | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = FLUX.text_lengths[0],
    ):
        return self._flux_call(None, **{name: value for name, value in locals().items() if name != "self"})

    def _flux_call(
        self,
        control: ControlCall | None,  # controlnet.py's FluxControlCall, from its pipeline class
        prompt=None,
        prompt_2=None,
        negative_prompt=None,
        negative_prompt_2=None,
        true_cfg_scale=1.0,
        height=None,
        width=None,
        num_inference_steps=28,
        sigmas=None,
        guidance_scale=3.5,
        num_images_per_prompt=1,
        generator=None,
        latents=None,
        prompt_embeds=None,
        pooled_prompt_embeds=None,
        ip_adapter_image=None,
        ip_adapter_image_embeds=None,
        negative_ip_adapter_image=None,
        negative_ip_adapter_image_embeds=None,
        negative_prompt_embeds=None,
        negative_pooled_prompt_embeds=None,
        output_type="pil",
        return_dict=True,
        joint_attention_kwargs=None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs=("latents",),
        max_sequence_length=FLUX.text_lengths[0],
    ):
        """``FluxPipeline.__call__``'s recipe (its arguments, defaults as there); with ``control``,
        ``FluxControlNetPipeline``'s: the control image encoded after the prompt on rank 0 (its VAE sample drawn
        from the user's generator, whose state every rank then takes), the ControlNet's residuals in the engine's
        request."""
        pipe, device = self.pipeline, self.context.device
        callback_on_step_end_tensor_inputs = callback_tensor_inputs(
            callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        why_ip = "IP-Adapter attention is not a stale-K/V processor"
        self._refuse(
            ip_adapter_image=(ip_adapter_image, None, why_ip),
            ip_adapter_image_embeds=(ip_adapter_image_embeds, None, why_ip),
            negative_ip_adapter_image=(negative_ip_adapter_image, None, why_ip),
            negative_ip_adapter_image_embeds=(negative_ip_adapter_image_embeds, None, why_ip),
            joint_attention_kwargs=(joint_attention_kwargs, None, "its processors take no extra arguments"),
        )
        # diffusers only warns about a size that is not a multiple of 16 and resizes it; xfuse refuses it (the
        # family's layout check, before any communication).
        height, width = self._default_size(height, width)
        pipe.check_inputs(
            prompt,
            prompt_2,
            height,
            width,
            negative_prompt=negative_prompt,
            negative_prompt_2=negative_prompt_2,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds,
            negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length,
        )
        batch_size = self._batch_size(prompt, prompt_embeds)
        # Mirrors ``diffusers.FluxPipeline.__call__``: true CFG needs a negative prompt (or both negative embeddings).
        has_neg_prompt = negative_prompt is not None or (
            negative_prompt_embeds is not None and negative_pooled_prompt_embeds is not None
        )
        do_true_cfg = true_cfg_scale > 1 and has_neg_prompt
        if do_true_cfg and prompt_embeds is not None and negative_prompt_embeds is not None:
            if prompt_embeds.shape != negative_prompt_embeds.shape:
                raise ValueError(
                    f"prompt_embeds {tuple(prompt_embeds.shape)} and negative_prompt_embeds "
                    f"{tuple(negative_prompt_embeds.shape)} must have the same shape"
                )
        if sigmas is not None:
            num_inference_steps = len(sigmas)
        cfg_scale = true_cfg_scale if do_true_cfg else 1.0  # what batches [negative, positive]
        image_ids = []  # the packed latents' position ids, from prepare_latents

        def encode() -> dict[str, torch.Tensor]:  # rank 0: the prompt and, with true CFG, the negative prompt
            text = {}
            prompts = {"": (prompt, prompt_2, prompt_embeds, pooled_prompt_embeds)}
            if do_true_cfg:
                given = (negative_prompt, negative_prompt_2, negative_prompt_embeds, negative_pooled_prompt_embeds)
                prompts["negative_"] = given
            for prefix, (first, second, embeds, pooled) in prompts.items():
                emb, pooled_emb, ids = pipe.encode_prompt(
                    prompt=first,
                    prompt_2=second,
                    prompt_embeds=embeds,
                    pooled_prompt_embeds=pooled,
                    device=device,
                    num_images_per_prompt=num_images_per_prompt,
                    max_sequence_length=max_sequence_length,
                )
                text |= {f"{prefix}prompt_embeds": emb, f"{prefix}pooled_prompt_embeds": pooled_emb}
                text[f"{prefix}text_ids"] = ids
            if control is not None:
                batch = batch_size * num_images_per_prompt
                token_rows = height // self.spec.latent_scale
                text["control_latents"] = control.encode(self, height, width, batch, num_images_per_prompt, generator,
                                                         token_rows)  # fmt: skip
            return {k: v.to(self.dtype) for k, v in text.items()}

        def timesteps() -> torch.Tensor:
            steps_sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps) if sigmas is None else sigmas
            if getattr(pipe.scheduler.config, "use_flow_sigmas", False):
                steps_sigmas = None
            scale = self.spec.latent_scale
            tokens = (height // scale) * (width // scale)  # the whole image's packed tokens, never a band's
            return shifted_timesteps(diffusers_flux, pipe.scheduler, num_inference_steps, device, steps_sigmas, tokens)

        def prepare_latents(generator) -> torch.Tensor:
            channels = self.stage.config.in_channels // 4
            batch = batch_size * num_images_per_prompt
            packed, ids = pipe.prepare_latents(batch, channels, height, width, self.dtype, device, generator, latents)
            image_ids.append(ids)
            return packed

        def request(text, packed, timesteps, generator):
            keys = ("prompt_embeds", "pooled_prompt_embeds")
            batched = {k: torch.cat([text[f"negative_{k}"], text[k]]) if do_true_cfg else text[k] for k in keys}
            model_text, cfg_half = self._cfg_split(batched, packed.shape[0])
            model_batch = model_text["prompt_embeds"].shape[0]
            guidance_value = None
            if self.stage.config.guidance_embeds:  # as FluxPipeline builds it, for the transformer batch
                guidance_value = torch.full([1], guidance_scale, device=device, dtype=torch.float32)
                guidance_value = guidance_value.expand(model_batch)
            on_step_end = step_end_callback(
                self,
                callback_on_step_end,
                callback_on_step_end_tensor_inputs,
                timesteps,
                {"prompt_embeds": text["prompt_embeds"]},
                latents_view=grid_to_packed,
            )
            request = denoise_request(  # on the packed latents viewed as a grid of token rows
                self.stage,
                latents=packed_to_grid(packed, height // self.spec.latent_scale).contiguous(),
                timesteps=timesteps,
                scheduler=pipe.scheduler,
                text_ids=text["text_ids"],
                latent_image_ids=image_ids[0],
                guidance_value=guidance_value,
                true_cfg_scale=cfg_scale,
                cfg_half=cfg_half,
                generator=generator,
                on_step_end=on_step_end,
                **model_text,
            )
            if control is not None:
                request.control = control.residuals(self, text, image_ids[0], timesteps, model_batch, guidance_scale)
            return request

        return self._run(
            CallRecipe(
                height=height,
                width=width,
                num_inference_steps=num_inference_steps,
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
                encode_draws=control is not None,
            )
        )

    def _decode(self, packed, height, width, output_type, return_dict):
        """Rank 0: unpack, VAE decode and post-processing, as ``diffusers.FluxPipeline.__call__`` does."""
        pipe = self.pipeline
        if output_type == "latent":
            image = packed
        else:
            latents = pipe._unpack_latents(packed, height, width, pipe.vae_scale_factor)
            latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
            image = self._decode_latents(latents)
            image = pipe.image_processor.postprocess(image, output_type=output_type)
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return FluxPipelineOutput(images=image)
