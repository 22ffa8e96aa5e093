"""``PipeFusionLTXPipeline``: diffusers' ``LTXPipeline`` with PipeFusion inside, under torchrun, its transformer run by
the generic family (``xfuse.families.generic``: the model's own forward, context-parallel plan and attention
dispatcher).

What every family shares, and the order of every call, is ``PipeFusionPipelineBase``'s. This file is
``LTXPipeline.__call__``'s signature and checks, and its recipe (``encode_prompt`` with the attention masks; the
timesteps with ``mu`` from the whole video's tokens; ``prepare_latents`` with the packed latents; the transformer's
arguments; unpacking, denormalising and decoding), run by the diffusers pipeline object itself.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.ltx import pipeline_ltx as diffusers_ltx
from diffusers.pipelines.ltx.pipeline_output import LTXPipelineOutput
from diffusers.utils.torch_utils import randn_tensor

from xfuse.families.common.guidance import do_classifier_free_guidance
from xfuse.families.common.packed import grid_to_packed, packed_to_grid
from xfuse.families.common.timesteps import shifted_timesteps
from xfuse.families.generic.request import forward_request
from xfuse.families.ltx.spec import LTX
from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.call_driver import CallRecipe
from xfuse.pipelines.callbacks import callback_tensor_inputs, step_end_callback
from xfuse.pipelines.lora import ShardedLoraMixin


def denoise_request(stage, *, packed: torch.Tensor, size: tuple[int, int, int], text: dict[str, torch.Tensor],
                    rope_interpolation_scale, timesteps, scheduler, cfg_scale: float, guidance_rescale: float, cfg_half,
                    dtype: torch.dtype, timestep, generator=None, on_step_end=None):  # fmt: skip
    """The engine's request of LTX-Video's transformer forward with the arguments ``LTXPipeline.__call__`` (and the
    modular ``LTXLoopDenoiser``) passes it: ``packed`` latents (B, frames * rows * cols, C) of ``size`` (latent
    frames, rows, cols) viewed as a grid of token rows, frame after frame; ``text``: this rank's ``prompt_embeds`` and
    ``prompt_attention_mask`` of the transformer batch ([negative, positive] with CFG); ``dtype``: the transformer's;
    ``timestep(t)``: the forward's timestep at the scheduler's ``t``."""
    frames, rows, cols = size
    inputs = dict(
        encoder_hidden_states=text["prompt_embeds"].to(dtype),
        encoder_attention_mask=text["prompt_attention_mask"].to(dtype),
        num_frames=frames,
        height=rows,
        width=cols,
        rope_interpolation_scale=rope_interpolation_scale,
    )
    return forward_request(
        stage,
        latents=packed_to_grid(packed, frames * rows).contiguous(),  # (B, C, frames * rows, cols)
        timesteps=timesteps,
        scheduler=scheduler,
        inputs=inputs,
        batched=("encoder_hidden_states", "encoder_attention_mask"),
        timestep=timestep,
        input_shape=tuple(packed.shape),
        cfg_scale=cfg_scale,
        guidance_rescale=guidance_rescale,
        cfg_half=cfg_half,
        hidden_dtype=dtype,
        generator=generator,
        on_step_end=on_step_end,
    )


class PipeFusionLTXPipeline(ShardedLoraMixin, PipeFusionPipelineBase):
    r"""
    Text-to-video with LTX-Video on ``cfg_degree x pipefusion_degree`` ranks (each stage optionally a Ulysses/Ring
    group), called with the arguments of diffusers' [`~diffusers.LTXPipeline.__call__`]; global rank 0 returns
    `LTXPipelineOutput(frames=...)`, the others `None`. Rules: [`~xfuse.pipelines.base.PipeFusionPipelineBase`];
    `callback_on_step_end` as in [`~xfuse.pipelines.PipeFusionHunyuanDiTPipeline`] (read-only; `latents` packed as
    diffusers has them).

    The transformer runs through the generic family: each pass is a call of its own forward, cut by its
    context-parallel plan, the text and its mask read whole by every pass's cross-attention. A patch is a run of the
    packed tokens, frame after frame. `guidance_rescale > 0` needs whole-video statistics: only in exact mode
    (`parallel.warmup_steps >= num_inference_steps`). Refused by name: `attention_kwargs`, `timesteps` (a custom
    schedule: give `num_inference_steps`).
    """

    spec = LTX
    rank0_components = ("tokenizer", "text_encoder", "vae")

    def _latents_shape(self, recipe: CallRecipe) -> tuple[int, ...]:
        """LTXPipeline's packed latents: (B, latent frames * (H / 32) * (W / 32), latent channels)."""
        scale, batch = self.spec.latent_scale, recipe.batch_size * recipe.num_images_per_prompt
        tokens = recipe.latent_frames * (recipe.height // scale) * (recipe.width // scale)
        return (batch, tokens, self.stage.config.in_channels)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] = None,
        negative_prompt: str | list[str] | None = None,
        height: int = 512,
        width: int = 704,
        num_frames: int = 161,
        frame_rate: int = 25,
        num_inference_steps: int = 50,
        timesteps: list[int] = None,
        guidance_scale: float = 3,
        guidance_rescale: float = 0.0,
        num_videos_per_prompt: int | None = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_attention_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_attention_mask: torch.Tensor | None = None,
        decode_timestep: float | list[float] = 0.0,
        decode_noise_scale: float | list[float] | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        attention_kwargs: dict | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = LTX.text_lengths[0],
    ):
        pipe, device = self.pipeline, self.context.device
        callback_on_step_end_tensor_inputs = callback_tensor_inputs(
            callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        self._refuse(
            attention_kwargs=(attention_kwargs, None, "its processors take no extra arguments"),
            timesteps=(timesteps, None, "a custom schedule; give num_inference_steps"),
        )
        pipe.check_inputs(
            prompt=prompt,
            height=height,
            width=width,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            prompt_attention_mask=prompt_attention_mask,
            negative_prompt_attention_mask=negative_prompt_attention_mask,
        )
        self.spec.check_num_frames(num_frames)  # diffusers rounds it down without a word
        if guidance_rescale > 0 and self.parallel.warmup_steps < num_inference_steps:
            raise ValueError(
                f"guidance_rescale={guidance_rescale} needs whole-video statistics, which pipelined steps do not "
                f"have: use guidance_rescale=0, or parallel.warmup_steps >= num_inference_steps "
                f"({self.parallel.warmup_steps} < {num_inference_steps})"
            )
        batch_size = self._batch_size(prompt, prompt_embeds)
        do_cfg = do_classifier_free_guidance(guidance_scale)
        latent_frames = self.spec.latent_frames(num_frames)
        latent_height, latent_width = height // self.spec.vae_scale_factor, width // self.spec.vae_scale_factor

        def encode() -> dict[str, torch.Tensor]:  # rank 0: the prompt and, with CFG, the negative prompt
            embeds, mask, negative, negative_mask = pipe.encode_prompt(
                prompt=prompt,
                negative_prompt=negative_prompt,
                do_classifier_free_guidance=do_cfg,
                num_videos_per_prompt=num_videos_per_prompt,
                prompt_embeds=prompt_embeds,
                negative_prompt_embeds=negative_prompt_embeds,
                prompt_attention_mask=prompt_attention_mask,
                negative_prompt_attention_mask=negative_prompt_attention_mask,
                max_sequence_length=max_sequence_length,
                device=device,
            )
            text = {"prompt_embeds": embeds.to(self.dtype), "prompt_attention_mask": mask}
            if do_cfg:
                text |= {
                    "negative_prompt_embeds": negative.to(self.dtype),
                    "negative_prompt_attention_mask": negative_mask,
                }
            return text

        def set_timesteps() -> torch.Tensor:  # mirrors ``diffusers.LTXPipeline.__call__``'s step 5
            sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
            tokens = latent_frames * latent_height * latent_width  # the whole video's, never a band's
            return shifted_timesteps(diffusers_ltx, pipe.scheduler, num_inference_steps, device, sigmas, tokens)

        def prepare_latents(generator) -> torch.Tensor:  # float32, packed, as LTXPipeline keeps them
            batch = batch_size * num_videos_per_prompt
            channels = self.stage.config.in_channels
            return pipe.prepare_latents(batch, channels, height, width, num_frames, torch.float32, device, generator,
                                        latents)  # fmt: skip

        def request(text, packed, timesteps, generator):
            names = ("prompt_embeds", "prompt_attention_mask")
            batched = {k: torch.cat([text[f"negative_{k}"], text[k]]) if do_cfg else text[k] for k in names}
            model_text, cfg_half = self._cfg_split(batched, packed.shape[0])
            on_step_end = step_end_callback(
                self,
                callback_on_step_end,
                callback_on_step_end_tensor_inputs,
                timesteps,
                {"prompt_embeds": text["prompt_embeds"]},
                latents_view=grid_to_packed,
            )
            rope_interpolation_scale = (
                pipe.vae_temporal_compression_ratio / frame_rate,
                pipe.vae_spatial_compression_ratio,
                pipe.vae_spatial_compression_ratio,
            )  # LTXPipeline's micro-conditions
            return denoise_request(
                self.stage,
                packed=packed,
                size=(latent_frames, latent_height, latent_width),
                text=model_text,
                rope_interpolation_scale=rope_interpolation_scale,
                timesteps=timesteps,
                scheduler=pipe.scheduler,
                cfg_scale=guidance_scale,
                guidance_rescale=guidance_rescale,
                cfg_half=cfg_half,
                dtype=self.dtype,  # latent_model_input.to(prompt_embeds.dtype)
                timestep=lambda t: t,  # LTXPipeline: t.expand(B)
                generator=generator,
                on_step_end=on_step_end,
            )

        def decode(final: torch.Tensor):
            packed = grid_to_packed(final)
            return self._decode(packed, latent_frames, latent_height, latent_width, batch_size, generator,
                                decode_timestep, decode_noise_scale, output_type, return_dict)  # fmt: skip

        return self._run(
            CallRecipe(
                height=height,
                width=width,
                num_inference_steps=num_inference_steps,
                batch_size=batch_size,
                num_images_per_prompt=num_videos_per_prompt,
                guidance_scale=guidance_scale,
                generator=generator,
                latents=latents,
                output_type=output_type,
                encode=encode,
                timesteps=set_timesteps,
                prepare_latents=prepare_latents,
                request=request,
                decode=decode,
                latent_frames=latent_frames,
            )
        )

    def _decode(self, packed, latent_frames, latent_height, latent_width, batch_size, generator, decode_timestep,
                decode_noise_scale, output_type, return_dict):  # fmt: skip
        """Rank 0: unpack, denormalise, the timestep-conditioned VAE's noise, decode and ``postprocess_video``, as
        ``diffusers.LTXPipeline.__call__`` does after its loop."""
        pipe = self.pipeline
        if output_type == "latent":
            video = packed
        else:
            patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
            latents = pipe._unpack_latents(packed, latent_frames, latent_height, latent_width, patch, patch_t)
            vae = pipe.vae
            latents = pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
            latents = latents.to(self.dtype)
            timestep = None
            if vae.config.timestep_conditioning:
                noise = randn_tensor(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
                if not isinstance(decode_timestep, list):
                    decode_timestep = [decode_timestep] * batch_size
                if decode_noise_scale is None:
                    decode_noise_scale = decode_timestep
                elif not isinstance(decode_noise_scale, list):
                    decode_noise_scale = [decode_noise_scale] * batch_size
                timestep = torch.tensor(decode_timestep, device=latents.device, dtype=latents.dtype)
                scale = torch.tensor(decode_noise_scale, device=latents.device, dtype=latents.dtype)
                scale = scale[:, None, None, None, None]  # (B,) -> (B, 1, 1, 1, 1)
                latents = (1 - scale) * latents + scale * noise
            latents = latents.to(vae.dtype)
            video = vae.decode(latents, timestep, return_dict=False)[0]
            video = pipe.video_processor.postprocess_video(video, output_type=output_type)
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (video,)
        return LTXPipelineOutput(frames=video)
