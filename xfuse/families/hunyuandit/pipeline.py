"""``PipeFusionHunyuanDiTPipeline``: diffusers' ``HunyuanDiTPipeline`` with PipeFusion inside, under torchrun.

What every family shares (world, loading this rank's blocks, broadcasts, the engine call, the order of every call) is
``PipeFusionPipelineBase``'s. This file is ``HunyuanDiTPipeline.__call__``'s signature and checks (its
``check_inputs``, size binning), and its recipe (``encode_prompt`` for both text encoders, the timesteps,
``prepare_latents``, size/style conditioning, decoding with the VAE, safety checker and image processor), run by the
diffusers pipeline object itself.
"""

from __future__ import annotations

import torch
from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import SUPPORTED_SHAPE, map_to_standard_shapes
from diffusers.pipelines.stable_diffusion import StableDiffusionPipelineOutput
from diffusers.utils import logging

from xfuse.families.common.guidance import do_classifier_free_guidance
from xfuse.families.hunyuandit.spec import HUNYUANDIT
from xfuse.families.hunyuandit.stage import denoise_request
from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.call_driver import CallRecipe
from xfuse.pipelines.callbacks import callback_tensor_inputs, step_end_callback

logger = logging.get_logger(__name__)

_TEXT_KEYS = ("prompt_embeds", "prompt_attention_mask", "prompt_embeds_2", "prompt_attention_mask_2")


class PipeFusionHunyuanDiTPipeline(PipeFusionPipelineBase):
    r"""
    Text-to-image with HunyuanDiT on ``cfg_degree x pipefusion_degree`` ranks (PipeFusion patch pipelining).

    Launch the same script on every rank with ``torchrun --nproc_per_node=N``; build the pipeline with
    [`~PipeFusionHunyuanDiTPipeline.from_pretrained`] (a local HunyuanDiT-v1.2-Diffusers folder) or
    [`~PipeFusionHunyuanDiTPipeline.from_pipe`] and call it with exactly the arguments of diffusers'
    [`~diffusers.HunyuanDiTPipeline.__call__`]. Global rank 0 returns the output; every other rank returns `None`.
    See [`~xfuse.pipelines.base.PipeFusionPipelineBase`] for the attributes.
    """

    spec = HUNYUANDIT
    rank0_components = (
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
        "vae",
        "safety_checker",
        "feature_extractor",
    )

    # ----------------------------------------------------------------------------------------------- __call__
    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = 50,
        guidance_scale: float | None = 5.0,
        negative_prompt: str | list[str] | None = None,
        num_images_per_prompt: int | None = 1,
        eta: float | None = 0.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_2: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_2: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None,
        prompt_attention_mask_2: torch.Tensor | None = None,
        negative_prompt_attention_mask: torch.Tensor | None = None,
        negative_prompt_attention_mask_2: torch.Tensor | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        guidance_rescale: float = 0.0,
        original_size: tuple[int, int] | None = (1024, 1024),
        target_size: tuple[int, int] | None = None,
        crops_coords_top_left: tuple[int, int] = (0, 0),
        use_resolution_binning: bool = True,
    ):
        r"""
        Generate images; arguments, defaults and meaning are those of diffusers'
        [`~diffusers.HunyuanDiTPipeline.__call__`]. Call it on every rank with the same arguments.

        Parallel-specific rules (each violation raises `ValueError` on every rank before any communication):
        - `guidance_rescale > 0` needs whole-image statistics: only with `parallel.warmup_steps >=
          num_inference_steps` (exact mode).
        - `cfg_degree: 2` needs classifier-free guidance (`guidance_scale > 1`).
        - A list of generators is accepted in exact mode only (pipelined steps derive per-patch generators from
          one generator).
        - `callback_on_step_end` runs on the rank that steps the scheduler of CFG group 0 (global rank 0 with
          folded placement, rank `pipefusion_degree - 1` with linear), once every patch of a step is stepped. It
          may read the tensors. Returning changed tensors or setting the interrupt flag cannot be honoured (later
          patches are already in flight): the loop finishes without further callbacks and that rank raises
          `ValueError`.
        - `generator` must be seeded identically on every rank (checked).

        Returns:
            On global rank 0, a [`~diffusers.pipelines.stable_diffusion.StableDiffusionPipelineOutput`] (or the
            tuple `(images, nsfw_content_detected)` if `return_dict=False`), exactly as diffusers returns it; on
            every other rank, `None`.
        """
        pipe, device = self.pipeline, self.context.device
        callback_on_step_end_tensor_inputs = callback_tensor_inputs(
            callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        # Default height and width as diffusers does, optionally binned. diffusers silently rounds a size down to a
        # multiple of 16; xfuse refuses it instead (binning, which users opt into and which logs, still maps).
        height, width = self._default_size(height, width)
        for name, value in (("height", height), ("width", width)):
            if not use_resolution_binning and (not isinstance(value, int) or isinstance(value, bool) or value % 16):
                raise ValueError(
                    f"{name} must be a positive multiple of 16 (got {value!r}; diffusers would "
                    f"silently use {int(value // 16 * 16) if isinstance(value, (int, float)) else '?'})"
                )
        height, width = int(height // 16 * 16), int(width // 16 * 16)
        if use_resolution_binning and (height, width) not in SUPPORTED_SHAPE:
            width, height = map(int, map_to_standard_shapes(width, height))
            logger.warning(f"Reshaped to (height, width)=({height}, {width}), Supported shapes are {SUPPORTED_SHAPE}")
        pipe.check_inputs(
            prompt,
            height,
            width,
            negative_prompt,
            prompt_embeds,
            negative_prompt_embeds,
            prompt_attention_mask,
            negative_prompt_attention_mask,
            prompt_embeds_2,
            negative_prompt_embeds_2,
            prompt_attention_mask_2,
            negative_prompt_attention_mask_2,
            callback_on_step_end_tensor_inputs,
        )
        batch_size = self._batch_size(prompt, prompt_embeds)
        for name, value in (
            ("original_size", original_size),
            ("target_size", target_size),
            ("crops_coords_top_left", crops_coords_top_left),
        ):
            if value is None and name == "target_size":
                continue
            if (
                not isinstance(value, tuple)
                or len(value) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
            ):
                raise ValueError(f"{name} must be a tuple of two ints (got {value!r})")
        if guidance_rescale > 0 and self.parallel.warmup_steps < num_inference_steps:
            raise ValueError(
                f"guidance_rescale={guidance_rescale} needs whole-image statistics, which pipelined steps do not "
                f"have: use guidance_rescale=0, or parallel.warmup_steps >= num_inference_steps "
                f"({self.parallel.warmup_steps} < {num_inference_steps})"
            )
        do_cfg = do_classifier_free_guidance(guidance_scale)

        def encode() -> dict[str, torch.Tensor]:  # rank 0: both text encoders, as diffusers does
            text = {}
            given = {
                "": (prompt_embeds, negative_prompt_embeds, prompt_attention_mask, negative_prompt_attention_mask),
                "_2": (
                    prompt_embeds_2,
                    negative_prompt_embeds_2,
                    prompt_attention_mask_2,
                    negative_prompt_attention_mask_2,
                ),
            }
            for index, (suffix, length) in enumerate(zip(("", "_2"), self.spec.text_lengths, strict=True)):
                emb, neg, mask, neg_mask = pipe.encode_prompt(
                    prompt=prompt,
                    device=device,
                    dtype=self.dtype,
                    num_images_per_prompt=num_images_per_prompt,
                    do_classifier_free_guidance=do_cfg,
                    negative_prompt=negative_prompt,
                    prompt_embeds=given[suffix][0],
                    negative_prompt_embeds=given[suffix][1],
                    prompt_attention_mask=given[suffix][2],
                    negative_prompt_attention_mask=given[suffix][3],
                    max_sequence_length=length,
                    text_encoder_index=index,
                )
                text[f"prompt_embeds{suffix}"], text[f"prompt_attention_mask{suffix}"] = emb, mask
                if do_cfg:
                    text[f"negative_prompt_embeds{suffix}"] = neg
                    text[f"negative_prompt_attention_mask{suffix}"] = neg_mask
            return text

        def timesteps() -> torch.Tensor:
            pipe.scheduler.set_timesteps(num_inference_steps, device=device)
            return pipe.scheduler.timesteps

        def prepare_latents(generator) -> torch.Tensor:
            channels = self.stage.config.in_channels
            batch = batch_size * num_images_per_prompt
            return pipe.prepare_latents(batch, channels, height, width, self.dtype, device, generator, latents)

        def request(text, latents, timesteps, generator):
            # Size/style conditioning, as diffusers builds it.
            style = torch.tensor([0], device=device)
            add_time_ids = torch.tensor(
                [list(original_size + (target_size or (height, width)) + crops_coords_top_left)], dtype=self.dtype
            )
            if do_cfg:
                batched = {k: torch.cat([text[f"negative_{k}"], text[k]]) for k in _TEXT_KEYS}
                add_time_ids, style = torch.cat([add_time_ids] * 2, dim=0), torch.cat([style] * 2, dim=0)
            else:
                batched = {k: text[k] for k in _TEXT_KEYS}
            add_time_ids = add_time_ids.to(device=device).repeat(batch_size * num_images_per_prompt, 1)
            style = style.to(device=device).repeat(batch_size * num_images_per_prompt)
            model_text, cfg_half = self._cfg_split(
                dict(batched, image_meta_size=add_time_ids, style=style), latents.shape[0]
            )
            on_step_end = step_end_callback(
                self,
                callback_on_step_end,
                callback_on_step_end_tensor_inputs,
                timesteps,
                {
                    "prompt_embeds": batched["prompt_embeds"],
                    "prompt_embeds_2": batched["prompt_embeds_2"],
                    "negative_prompt_embeds": text.get("negative_prompt_embeds"),
                    "negative_prompt_embeds_2": text.get("negative_prompt_embeds_2"),
                },
            )
            return denoise_request(
                self.stage,
                latents=latents,
                timesteps=timesteps,
                scheduler=pipe.scheduler,
                guidance_scale=guidance_scale,
                guidance_rescale=guidance_rescale,
                cfg_half=cfg_half,
                extra_step_kwargs=pipe.prepare_extra_step_kwargs(generator, eta),
                generator=generator,
                on_step_end=on_step_end,
                **model_text,
            )

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
        """Rank 0: VAE decode, safety checker and post-processing, as ``diffusers.HunyuanDiTPipeline.__call__`` does."""
        pipe, device = self.pipeline, self.context.device
        if output_type != "latent":
            image = self._decode_latents(final / pipe.vae.config.scaling_factor)
            image, has_nsfw_concept = pipe.run_safety_checker(image, device, self.dtype)
        else:
            image, has_nsfw_concept = final, None
        do_denormalize = [True] * image.shape[0] if has_nsfw_concept is None else [not n for n in has_nsfw_concept]
        image = pipe.image_processor.postprocess(image, output_type=output_type, do_denormalize=do_denormalize)
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (image, has_nsfw_concept)
        return StableDiffusionPipelineOutput(images=image, nsfw_content_detected=has_nsfw_concept)
