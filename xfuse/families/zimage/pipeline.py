"""``PipeFusionZImagePipeline``: diffusers' ``ZImagePipeline`` with PipeFusion inside, under torchrun.

What every family shares, and the order of every call, is ``PipeFusionPipelineBase``'s. This file is
``ZImagePipeline.__call__``'s signature and checks, and its recipe (``encode_prompt`` for the prompts and, with CFG,
the negative prompts, each at its own length; the timesteps with Z-Image's default sigmas; float32 latents; the
combination with ``cfg_truncation`` and ``cfg_normalization``; the VAE's scale and shift), run by the diffusers
pipeline object itself.
"""

from __future__ import annotations

import torch
from diffusers.pipelines.z_image import pipeline_z_image as diffusers_z_image
from diffusers.pipelines.z_image.pipeline_output import ZImagePipelineOutput

from xfuse.families.common.timesteps import shifted_timesteps
from xfuse.families.zimage.spec import Z_IMAGE
from xfuse.families.zimage.stage import denoise_request
from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.call_driver import CallRecipe
from xfuse.pipelines.callbacks import callback_tensor_inputs, step_end_callback
from xfuse.pipelines.lora import ShardedLoraMixin


def _pack(captions: list[torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Captions of their own lengths as one broadcastable pair: ``name`` (B, the longest, D) zero-padded and
    ``name + "_lengths"`` (B,)."""
    lengths = torch.tensor([len(c) for c in captions])
    return {name: torch.nn.utils.rnn.pad_sequence(list(captions), batch_first=True), f"{name}_lengths": lengths}


def _unpack(text: dict[str, torch.Tensor], name: str) -> list[torch.Tensor]:
    return [row[:n] for row, n in zip(text[name], text[f"{name}_lengths"].tolist(), strict=True)]


class PipeFusionZImagePipeline(ShardedLoraMixin, PipeFusionPipelineBase):
    r"""
    Text-to-image with Z-Image on ``cfg_degree x pipefusion_degree`` ranks (with sequence parallelism inside each
    stage), called with the arguments of diffusers' [`~diffusers.ZImagePipeline.__call__`]; global rank 0 returns
    what diffusers returns, the others `None`. Rules: [`~xfuse.pipelines.base.PipeFusionPipelineBase`];
    `callback_on_step_end` as in [`~xfuse.pipelines.PipeFusionHunyuanDiTPipeline`] (read-only).

    Each rank loads only its blocks of the transformer (the noise refiner's two and the main layers, as one chain);
    the rank of the first block also the patch embedding, the pad tokens, the caption embedder and the context refiner
    (the stream's first value is made there); the text encoder (Qwen3-4B in the release) and the VAE only on rank 0.
    Classifier-free guidance (`guidance_scale > 0`, as diffusers) runs [negative, positive] as one transformer batch,
    the shorter caption's sequence padded and masked (diffusers' own batch is [positive, negative]: per sample the same
    computation), which `parallel.cfg_degree: 2` splits; `cfg_truncation` turns the guidance off at late steps as
    diffusers does (the batch keeps its negative half, at scale 0); `cfg_normalization` needs the whole image's norm:
    refused where a step runs in patches (`parallel.warmup_steps` below `num_inference_steps`). Refused by name:
    `joint_attention_kwargs`.
    """

    spec = Z_IMAGE
    rank0_components = ("tokenizer", "text_encoder", "vae")

    def _latents_shape(self, recipe: CallRecipe) -> tuple[int, ...]:
        """ZImagePipeline's latents: (B, latent channels, H/8, W/8), float32."""
        factor, batch = self.spec.vae_scale_factor, recipe.batch_size * recipe.num_images_per_prompt
        return (batch, self.stage.config.in_channels, recipe.height // factor, recipe.width // factor)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        sigmas: list[float] | None = None,
        guidance_scale: float = 5.0,
        cfg_normalization: bool = False,
        cfg_truncation: float = 1.0,
        negative_prompt: str | list[str] | None = None,
        num_images_per_prompt: int | None = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.FloatTensor | None = None,
        prompt_embeds: list[torch.FloatTensor] | None = None,
        negative_prompt_embeds: list[torch.FloatTensor] | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        joint_attention_kwargs: dict | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = Z_IMAGE.text_lengths[0],
    ):
        pipe, device = self.pipeline, self.context.device
        callback_on_step_end_tensor_inputs = callback_tensor_inputs(
            callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        self._refuse(joint_attention_kwargs=(joint_attention_kwargs, None, "its processors take no extra arguments"))
        height, width = self._default_size(height, width)
        do_cfg = guidance_scale > 0  # ZImagePipeline.do_classifier_free_guidance
        if self.parallel.cfg_degree == 2 and not do_cfg:
            raise ValueError(
                "parallel.cfg_degree 2 splits the classifier-free-guidance batch, which ZImagePipeline runs only with "
                f"guidance_scale > 0 (got {guidance_scale})"
            )
        normalization = float(cfg_normalization) if cfg_normalization else 0.0
        if do_cfg and normalization > 0 and self.parallel.warmup_steps < num_inference_steps:
            raise ValueError(
                "cfg_normalization is not supported by PipeFusion's patch steps (it rescales by the whole image's "
                f"norm): set parallel.warmup_steps >= num_inference_steps ({num_inference_steps}) to run every step "
                f"whole, or leave it False (got {cfg_normalization!r})"
            )
        # As ZImagePipeline.__call__: given prompt embeddings need the negative ones for CFG.
        if prompt_embeds is not None and prompt is None and do_cfg and negative_prompt_embeds is None:
            raise ValueError("When `prompt_embeds` is provided without `prompt`, `negative_prompt_embeds` must also "
                             "be provided for classifier-free guidance.")  # fmt: skip
        batch_size = 1 if isinstance(prompt, str) else len(prompt) if prompt is not None else len(prompt_embeds)
        batch = batch_size * num_images_per_prompt
        steps = num_inference_steps if sigmas is None else len(sigmas)

        def encode() -> dict[str, torch.Tensor]:  # rank 0: each prompt's valid tokens, and the negative prompts'
            if prompt_embeds is not None and prompt is None:
                positive, negative = prompt_embeds, negative_prompt_embeds or []
            else:
                positive, negative = pipe.encode_prompt(
                    prompt=list(prompt) if isinstance(prompt, list) else prompt,  # (diffusers rewrites the list)
                    device=device,
                    do_classifier_free_guidance=do_cfg,
                    negative_prompt=negative_prompt,
                    prompt_embeds=prompt_embeds,
                    negative_prompt_embeds=negative_prompt_embeds,
                    max_sequence_length=max_sequence_length,
                )
            text = _pack([p.to(self.dtype) for p in positive], "prompt_embeds")
            if do_cfg:
                text |= _pack([n.to(self.dtype) for n in negative], "negative_prompt_embeds")
            return text

        def timesteps() -> torch.Tensor:
            # As ``diffusers.ZImagePipeline.__call__``: mu from the whole image's tokens, Z-Image's default sigmas.
            factor = self.spec.vae_scale_factor * 2
            schedule = diffusers_z_image.get_default_z_image_sigmas(num_inference_steps) if sigmas is None else sigmas
            tokens = (height // factor) * (width // factor)
            return shifted_timesteps(diffusers_z_image, pipe.scheduler, num_inference_steps, device, schedule, tokens)

        def prepare_latents(generator) -> torch.Tensor:
            channels = self.stage.config.in_channels
            return pipe.prepare_latents(batch, channels, height, width, torch.float32, device, generator, latents)

        def request(text, latents_, timesteps_, generator_):
            # each prompt's embedding once per image, as ZImagePipeline repeats them
            positive = [p for p in _unpack(text, "prompt_embeds") for _ in range(num_images_per_prompt)]
            captions, cfg_half = positive, None
            if do_cfg:
                negative = [n for n in _unpack(text, "negative_prompt_embeds") for _ in range(num_images_per_prompt)]
                cfg_half = self._cfg_half()
                captions = negative + positive if cfg_half is None else (negative, positive)[cfg_half[0]]
            on_step_end = step_end_callback(self, callback_on_step_end, callback_on_step_end_tensor_inputs,
                                            timesteps_, {"prompt_embeds": positive})  # fmt: skip
            return denoise_request(
                self.stage,
                latents=latents_,
                timesteps=timesteps_,
                scheduler=pipe.scheduler,
                captions=captions,
                dtype=self.dtype,
                guidance_scale=guidance_scale if do_cfg else 0.0,
                cfg_truncation=cfg_truncation,
                cfg_normalization=normalization,
                cfg_half=cfg_half,
                generator=generator_,
                on_step_end=on_step_end,
            )

        return self._run(
            CallRecipe(
                height=height,
                width=width,
                num_inference_steps=steps,
                batch_size=batch_size,
                num_images_per_prompt=num_images_per_prompt,
                guidance_scale=guidance_scale,
                do_cfg=do_cfg,
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

    def _decode(self, latents, output_type, return_dict):
        """Rank 0: the VAE's scale and shift, decode and post-processing, as ``diffusers.ZImagePipeline.__call__``."""
        pipe = self.pipeline
        if output_type == "latent":
            image = latents
        else:
            latents = latents.to(pipe.vae.dtype)
            latents = (latents / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
            image = self._decode_latents(latents)
            image = pipe.image_processor.postprocess(image, output_type=output_type)
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return ZImagePipelineOutput(images=image)
