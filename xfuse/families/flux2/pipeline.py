"""``PipeFusionFlux2Pipeline`` and ``PipeFusionFlux2KleinPipeline``: diffusers' ``Flux2Pipeline`` (FLUX.2 [dev])
and ``Flux2KleinPipeline`` (FLUX.2 [klein]) with PipeFusion inside, under torchrun.

What every family shares, and the order of every call, is ``PipeFusionPipelineBase``'s. This file is the two
``__call__`` signatures and checks, and their one recipe (``encode_prompt`` with the stacked text-encoder layers;
[klein] with classifier-free guidance also the empty negative prompt; the timesteps with ``compute_empirical_mu`` from
the whole image's token count; ``prepare_latents`` with the packed latents and their ids; [dev]'s embedded guidance;
decoding through the VAE's BatchNorm statistics), run by the diffusers pipeline object itself.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux2 import pipeline_flux2 as diffusers_flux2
from diffusers.pipelines.flux2.pipeline_output import Flux2PipelineOutput

from xfuse.families.common.packed import grid_to_packed, packed_to_grid
from xfuse.families.flux2.spec import FLUX2, FLUX2_KLEIN
from xfuse.families.flux2.stage import denoise_request
from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.call_driver import CallRecipe
from xfuse.pipelines.callbacks import callback_tensor_inputs, step_end_callback
from xfuse.pipelines.lora import ShardedLoraMixin


class _Flux2PipelineBase(ShardedLoraMixin, PipeFusionPipelineBase):
    """What both FLUX.2 pipelines run: each rank loads only its blocks of the transformer and only the shared
    modulation its blocks use; the text encoder and the VAE only on rank 0."""

    rank0_components = ("tokenizer", "text_encoder", "vae")

    def _latents_shape(self, recipe: CallRecipe) -> tuple[int, ...]:
        """The pipelines' ``latents`` argument: patchified, (B, 4 x latent channels, H/16, W/16)."""
        scale, batch = self.spec.latent_scale, recipe.batch_size * recipe.num_images_per_prompt
        return (batch, self.stage.config.in_channels, recipe.height // scale, recipe.width // scale)

    def _flux2_call(self, *, prompt, height, width, num_inference_steps, sigmas, guidance_scale, num_images_per_prompt,
                    generator, latents, prompt_embeds, negative_prompt_embeds, output_type, return_dict,
                    callback_on_step_end, callback_on_step_end_tensor_inputs, max_sequence_length,
                    text_encoder_out_layers, do_cfg: bool, unpacked_latent_output: bool):  # fmt: skip
        """The recipe of ``Flux2Pipeline.__call__`` and ``Flux2KleinPipeline.__call__`` after their own checks.
        ``do_cfg``: [klein]'s classifier-free guidance (the text batched [negative, positive]); without it [dev]
        embeds ``guidance_scale`` where the transformer has a guidance embedding. ``unpacked_latent_output``: the
        ``output_type="latent"`` result is the denormalised, unpatchified latent ([klein]), not the packed one."""
        pipe, device = self.pipeline, self.context.device
        height, width = self._default_size(height, width)
        batch_size = self._batch_size(prompt, prompt_embeds)
        image_ids = []  # the packed latents' position ids, from prepare_latents
        encoded = {
            "device": device,
            "num_images_per_prompt": num_images_per_prompt,
            "max_sequence_length": max_sequence_length,
            "text_encoder_out_layers": text_encoder_out_layers,
        }

        def encode() -> dict[str, torch.Tensor]:  # rank 0
            emb, text_ids = pipe.encode_prompt(prompt=prompt, prompt_embeds=prompt_embeds, **encoded)
            text = {"prompt_embeds": emb.to(self.dtype), "text_ids": text_ids}
            if do_cfg:  # as Flux2KleinPipeline.__call__: the empty prompt, one per prompt of a list
                negative = [""] * len(prompt) if isinstance(prompt, list) else ""
                neg, _ = pipe.encode_prompt(prompt=negative, prompt_embeds=negative_prompt_embeds, **encoded)
                text["negative_prompt_embeds"] = neg.to(self.dtype)
            return text

        def timesteps() -> torch.Tensor:
            # As ``diffusers.Flux2Pipeline.__call__``: mu from the caller's num_inference_steps, custom sigmas too.
            steps_sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps) if sigmas is None else sigmas
            if getattr(pipe.scheduler.config, "use_flow_sigmas", False):
                steps_sigmas = None
            scale = self.spec.latent_scale
            image_seq_len = (height // scale) * (width // scale)  # the whole image's packed tokens, never a band's
            mu = diffusers_flux2.compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_inference_steps)
            steps = diffusers_flux2.retrieve_timesteps(
                pipe.scheduler, num_inference_steps, device, sigmas=steps_sigmas, mu=mu
            )[0]
            pipe.scheduler.set_begin_index(0)
            return steps

        def prepare_latents(generator) -> torch.Tensor:
            channels = self.stage.config.in_channels // 4
            batch = batch_size * num_images_per_prompt
            packed, ids = pipe.prepare_latents(batch, channels, height, width, self.dtype, device, generator, latents)
            image_ids.append(ids)
            return packed

        def request(text, packed, timesteps, generator):
            batched = text["prompt_embeds"]
            if do_cfg:
                batched = torch.cat([text["negative_prompt_embeds"], batched])  # [negative, positive]
            model_text, cfg_half = self._cfg_split({"prompt_embeds": batched}, packed.shape[0])
            model_batch = model_text["prompt_embeds"].shape[0]
            guidance_value = None
            if self.stage.config.guidance_embeds:  # as Flux2Pipeline builds it, for the transformer batch
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
            return denoise_request(  # on the packed latents viewed as a grid of token rows
                self.stage,
                latents=packed_to_grid(packed, height // self.spec.latent_scale).contiguous(),
                timesteps=timesteps,
                scheduler=pipe.scheduler,
                prompt_embeds=model_text["prompt_embeds"],
                text_ids=text["text_ids"],
                latent_image_ids=image_ids[0],
                guidance_value=guidance_value,
                cfg_scale=guidance_scale if do_cfg else 1.0,
                cfg_half=cfg_half,
                generator=generator,
                on_step_end=on_step_end,
            )

        return self._run(
            CallRecipe(
                height=height,
                width=width,
                num_inference_steps=num_inference_steps,
                batch_size=batch_size,
                num_images_per_prompt=num_images_per_prompt,
                guidance_scale=guidance_scale if do_cfg else 1.0,  # what batches [negative, positive]
                generator=generator,
                latents=latents,
                output_type=output_type,
                encode=encode,
                timesteps=timesteps,
                prepare_latents=prepare_latents,
                request=request,
                decode=lambda final: self._decode(
                    final, image_ids[0], output_type, return_dict, unpacked_latent_output
                ),  # fmt: skip
            )
        )

    def _decode(self, grid, latent_ids, output_type, return_dict, unpacked_latent_output):
        """Rank 0: denormalise with the VAE's BatchNorm statistics, unpatchify, VAE decode and post-process, as
        ``diffusers.Flux2Pipeline.__call__`` and ``diffusers.Flux2KleinPipeline.__call__`` do."""
        pipe = self.pipeline
        packed = grid_to_packed(grid)  # (B, C4, rows, cols) -> (B, tokens, C4), as diffusers' loop has them
        if output_type == "latent" and not unpacked_latent_output:
            image = packed
        else:
            latents = pipe._unpack_latents_with_ids(packed, latent_ids)  # -> (B, C4, rows, cols)
            mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
            latents = latents * std.to(latents.device, latents.dtype) + mean
            latents = pipe._unpatchify_latents(latents)  # -> (B, C, H/8, W/8)
            if output_type == "latent":
                image = latents
            else:
                image = self._decode_latents(latents)
                image = pipe.image_processor.postprocess(image, output_type=output_type)
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return Flux2PipelineOutput(images=image)

    def _refuse_common(self, image, attention_kwargs) -> None:
        self._refuse(
            image=(image, None, "reference images append their tokens to every pass's sequence"),
            attention_kwargs=(attention_kwargs, None, "its processors take no extra arguments"),
        )


class PipeFusionFlux2Pipeline(_Flux2PipelineBase):
    r"""
    Text-to-image with FLUX.2 [dev] on ``pipefusion_degree`` ranks (with sequence parallelism inside each stage),
    called with the arguments of diffusers' [`~diffusers.Flux2Pipeline.__call__`]; global rank 0 returns what
    diffusers returns, the others `None`. Rules: [`~xfuse.pipelines.base.PipeFusionPipelineBase`];
    `callback_on_step_end` as in [`~xfuse.pipelines.PipeFusionHunyuanDiTPipeline`] (read-only; `latents` packed as
    diffusers has them).

    Each rank loads only its blocks of the transformer and only the shared modulation its blocks use; the text
    encoder (Mistral Small 3.x in the release) and the VAE only on rank 0. FLUX.2 [dev] embeds `guidance_scale`: it
    has no CFG batch, so `parallel.cfg_degree: 2` is refused. Refused by name: reference images (`image`, which
    append tokens to the sequence), `attention_kwargs` and `caption_upsample_temperature` (sampling with the text
    encoder's processor).
    """

    spec = FLUX2

    @torch.no_grad()
    def __call__(
        self,
        image=None,
        prompt: str | list[str] = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        sigmas: list[float] | None = None,
        guidance_scale: float | None = 4.0,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        attention_kwargs: dict | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = FLUX2.text_lengths[0],
        text_encoder_out_layers: tuple[int] = (10, 20, 30),
        caption_upsample_temperature: float = None,
    ):
        if self.parallel.cfg_degree != 1:
            raise ValueError(
                "parallel.cfg_degree must be 1 for Flux2Pipeline: FLUX.2 [dev] embeds guidance_scale and has no "
                f"classifier-free-guidance batch to split (got {self.parallel.cfg_degree})"
            )
        callback_on_step_end_tensor_inputs = callback_tensor_inputs(
            callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        self._refuse_common(image, attention_kwargs)
        self._refuse(caption_upsample_temperature=(caption_upsample_temperature, None, "it samples with the text "
                                                   "encoder's processor"))  # fmt: skip
        # diffusers only warns about a size that is not a multiple of 16 and crops it; xfuse refuses it (the
        # family's layout check, before any communication).
        self.pipeline.check_inputs(prompt=prompt, height=height, width=width, prompt_embeds=prompt_embeds,
                                   callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs)  # fmt: skip
        return self._flux2_call(
            prompt=prompt, height=height, width=width, num_inference_steps=num_inference_steps, sigmas=sigmas,
            guidance_scale=guidance_scale, num_images_per_prompt=num_images_per_prompt, generator=generator,
            latents=latents, prompt_embeds=prompt_embeds, negative_prompt_embeds=None, output_type=output_type,
            return_dict=return_dict, callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length, text_encoder_out_layers=text_encoder_out_layers, do_cfg=False,
            unpacked_latent_output=False,
        )  # fmt: skip


class PipeFusionFlux2KleinPipeline(_Flux2PipelineBase):
    r"""
    Text-to-image with FLUX.2 [klein] on ``cfg_degree x pipefusion_degree`` ranks (with sequence parallelism inside
    each stage), called with the arguments of diffusers' [`~diffusers.Flux2KleinPipeline.__call__`]; global rank 0
    returns what diffusers returns, the others `None`. Rules: [`~xfuse.pipelines.base.PipeFusionPipelineBase`].

    Classifier-free guidance (`guidance_scale > 1` on a model that is not step-distilled, the pipeline's
    `is_distilled`) runs the empty negative prompt and the prompt as one transformer batch [negative, positive]
    (diffusers makes two calls: per sample the same computation), which `parallel.cfg_degree: 2` splits. Refused by
    name: reference images (`image`) and `attention_kwargs`.
    """

    spec = FLUX2_KLEIN

    @torch.no_grad()
    def __call__(
        self,
        image=None,
        prompt: str | list[str] = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        sigmas: list[float] | None = None,
        guidance_scale: float | None = 4.0,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        attention_kwargs: dict | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = FLUX2_KLEIN.text_lengths[0],
        text_encoder_out_layers: tuple[int] = (9, 18, 27),
    ):
        callback_on_step_end_tensor_inputs = callback_tensor_inputs(
            callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        self._refuse_common(image, attention_kwargs)
        self.pipeline.check_inputs(prompt=prompt, height=height, width=width, prompt_embeds=prompt_embeds,
                                   callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
                                   guidance_scale=guidance_scale)  # fmt: skip
        # As Flux2KleinPipeline's do_classifier_free_guidance property.
        do_cfg = guidance_scale > 1 and not self.pipeline.config.is_distilled
        if do_cfg and prompt_embeds is not None and negative_prompt_embeds is not None:
            if prompt_embeds.shape != negative_prompt_embeds.shape:
                raise ValueError(
                    f"prompt_embeds {tuple(prompt_embeds.shape)} and negative_prompt_embeds "
                    f"{tuple(negative_prompt_embeds.shape)} must have the same shape"
                )
        return self._flux2_call(
            prompt=prompt, height=height, width=width, num_inference_steps=num_inference_steps, sigmas=sigmas,
            guidance_scale=guidance_scale, num_images_per_prompt=num_images_per_prompt, generator=generator,
            latents=latents, prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
            output_type=output_type, return_dict=return_dict, callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length, text_encoder_out_layers=text_encoder_out_layers, do_cfg=do_cfg,
            unpacked_latent_output=True,
        )  # fmt: skip
