"""``PipeFusionWanPipeline``: diffusers' ``WanPipeline`` (text-to-video) with PipeFusion inside, under torchrun.

What every family shares, and the order of every call, is ``PipeFusionPipelineBase``'s. This file is
``WanPipeline.__call__``'s signature and checks, and its recipe (``encode_prompt``, ``set_timesteps``,
``prepare_latents`` of the (B, C, frames, H, W) latents, the engine's request on the frames stacked in the layout
``parallel.video_patches`` picks, the VAE decode with Wan's latent normalisation and ``postprocess_video``), run by the
diffusers pipeline object itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers import WanPipeline
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput

from xfuse.families.common.guidance import do_classifier_free_guidance
from xfuse.families.common.sharding import ShardedStage
from xfuse.families.wan.spec import WAN
from xfuse.families.wan.stage import FirstFrame, denoise_request
from xfuse.parallel.request import DenoiseRequest
from xfuse.parallel.video_layout import VideoLayout
from xfuse.pipelines.base import PipeFusionPipelineBase
from xfuse.pipelines.call_driver import CallRecipe
from xfuse.pipelines.callbacks import callback_tensor_inputs, step_end_callback
from xfuse.pipelines.lora import ShardedLoraMixin


@dataclass(frozen=True)
class ExpertRuns:
    """A Wan 2.2 request of two experts: the high-noise transformer's run on the steps whose timestep is at least the
    boundary, then the low-noise one's on the rest, from the latents and scheduler state the first left."""

    high: DenoiseRequest | None  # None: no step is above the boundary
    low: Callable[[torch.Tensor | None], DenoiseRequest] | None  # from the (B, C, F, H, W) latents; None: no step


class PipeFusionWanPipeline(ShardedLoraMixin, PipeFusionPipelineBase):
    r"""
    Text-to-video with Wan 2.1 on ``cfg_degree x pipefusion_degree`` ranks (each stage optionally a Ulysses/Ring
    group), called with the arguments of diffusers' [`~diffusers.WanPipeline.__call__`]; global rank 0 returns what
    diffusers returns (`WanPipelineOutput(frames=...)`), the others `None`. Rules:
    [`~xfuse.pipelines.base.PipeFusionPipelineBase`].

    A patch is a run of latent frames (`parallel.video_patches: temporal`, the default) or a strip of rows across every
    frame (`spatial`). Classifier-free guidance runs the negative and the positive prompt as one transformer batch
    [negative, positive] (diffusers makes two calls: per sample the same computation), which `parallel.cfg_degree: 2`
    splits. diffusers rounds a `num_frames` that is not 4k + 1 with a warning; xfuse refuses it. Refused by name:
    `attention_kwargs`.

    Wan 2.2 TI2V-5B (`expand_timesteps`, its VAE 16 px per latent pixel with 48 channels): diffusers gives every token
    the step's timestep (its mask is all ones in text-to-video), which is per sample the same modulation as one
    timestep, so the engine embeds it once per step.

    Wan 2.2's two experts (`transformer_2` with the pipeline's `boundary_ratio`, A14B): every rank holds its blocks of
    both (the same split), the high-noise expert denoises the steps whose timestep is at least the boundary and the
    low-noise one the rest, with `guidance_scale_2`. Each expert's steps are a PipeFusion run of their own: its first
    `warmup_steps` whole (its stale K/V are its own blocks'), then pipelined; the scheduler's state carries over whole
    (`xfuse.parallel.scheduler_state.merge_patch_schedulers`).
    """

    spec = WAN
    rank0_components = ("tokenizer", "text_encoder", "vae")

    def __init__(self, pipeline, context, dtype, stage=None, extra_stages=None, vae_config=None, **kwargs):
        config = pipeline.config
        extra_stages = dict(extra_stages or {})
        second = extra_stages.pop("transformer_2", None) or getattr(pipeline, "transformer_2", None)
        if (second is None) != (config.get("boundary_ratio") is None):
            raise ValueError("a two-expert Wan pipeline needs both transformer_2 and boundary_ratio (got one of them)")
        if second is not None and dict(second.config) != dict((stage or pipeline.transformer).config):
            raise ValueError("xfuse splits Wan's two experts alike: transformer_2 must have transformer's config")
        super().__init__(
            pipeline, context, dtype, stage, extra_stages, vae_config, **kwargs
        )  # anything left is refused there
        # diffusers takes 8 where the pipeline has no VAE (ranks other than 0): every rank draws the model's latents.
        pipeline.vae_scale_factor_spatial = self.spec.vae_scale_factor
        self.stage_2, self.engine_2 = None, None
        if second is not None:  # the low-noise expert: the same plan, its own blocks and K/V buffers
            if not isinstance(second, ShardedStage):  # from_pipe: the diffusers model, sharded here
                second = self.spec.adapter_class(self.parallel)(second, self.plan, context.pipe_rank)
            self.stage_2 = second.to(context.device)
            if self.compiler is not None:
                self.compiler.compile(self.stage_2)
            self.engine_2 = self._engine(self.stage_2)
            pipeline.transformer_2 = None  # the stage owns what is left of it

    def _latents_shape(self, recipe: CallRecipe) -> tuple[int, ...]:
        """WanPipeline's latents: (B, C, latent frames, H / VAE factor, W / VAE factor)."""
        vae, batch = self.spec.vae_scale_factor, recipe.batch_size * recipe.num_images_per_prompt
        shape = (batch, self.stage.config.in_channels, recipe.latent_frames, recipe.height // vae, recipe.width // vae)
        return shape

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] = None,
        negative_prompt: str | list[str] = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        guidance_scale_2: float | None = None,
        num_videos_per_prompt: int | None = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        output_type: str | None = "np",
        return_dict: bool = True,
        attention_kwargs: dict | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = WAN.text_lengths[0],
    ):
        callback_on_step_end_tensor_inputs = callback_tensor_inputs(
            callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        self._refuse(attention_kwargs=(attention_kwargs, None, "its processors take no extra arguments"))
        self.pipeline.check_inputs(
            prompt,
            negative_prompt,
            height,
            width,
            prompt_embeds,
            negative_prompt_embeds,
            callback_on_step_end_tensor_inputs,
            guidance_scale_2,
        )
        return self._generate(
            prompt=prompt,
            negative_prompt=negative_prompt,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            guidance_scale_2=guidance_scale_2,
            num_videos_per_prompt=num_videos_per_prompt,
            generator=generator,
            latents=latents,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            output_type=output_type,
            return_dict=return_dict,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length,
        )

    def _generate(
        self,
        *,
        prompt,
        negative_prompt,
        height: int,
        width: int,
        num_frames: int,
        num_inference_steps: int,
        guidance_scale: float,
        guidance_scale_2: float | None,
        num_videos_per_prompt: int,
        generator,
        latents: torch.Tensor | None,
        prompt_embeds: torch.Tensor | None,
        negative_prompt_embeds: torch.Tensor | None,
        output_type: str,
        return_dict: bool,
        callback_on_step_end,
        callback_on_step_end_tensor_inputs: list[str],
        max_sequence_length: int,
        encode_image: Callable[[int], torch.Tensor] | None = None,
    ):
        """Steps 2-7 of ``WanPipeline.__call__`` after the call's own checks; with ``encode_image`` (rank 0: the
        batch -> the image's latents (B, C, 1, H, W)), ``WanImageToVideoPipeline.__call__``'s."""
        pipe, device = self.pipeline, self.context.device
        self.spec.check_num_frames(num_frames)  # diffusers rounds it with a warning
        batch_size = self._batch_size(prompt, prompt_embeds)
        do_cfg = do_classifier_free_guidance(guidance_scale)

        @functools.cache
        def layout() -> VideoLayout:  # first used after the base class's checks, which refuse a size by name
            return VideoLayout(
                self.parallel.video_patches,
                self.spec.latent_frames(num_frames),
                height // self.spec.vae_scale_factor,
                width // self.spec.vae_scale_factor,
                self.stage.patch_size,
            )

        def encode() -> dict[str, torch.Tensor]:  # rank 0: the prompt and, with CFG, the negative prompt
            positive, negative = pipe.encode_prompt(
                prompt=prompt,
                negative_prompt=negative_prompt,
                do_classifier_free_guidance=do_cfg,
                num_videos_per_prompt=num_videos_per_prompt,
                prompt_embeds=prompt_embeds,
                negative_prompt_embeds=negative_prompt_embeds,
                max_sequence_length=max_sequence_length,
                device=device,
            )
            text = {"prompt_embeds": positive} | ({"negative_prompt_embeds": negative} if do_cfg else {})
            text = {k: v.to(self.dtype) for k, v in text.items()}
            if encode_image is not None:  # float32, as WanImageToVideoPipeline keeps them
                text["image_latents"] = encode_image(batch_size * num_videos_per_prompt)
            return text

        def set_timesteps() -> torch.Tensor:
            pipe.scheduler.set_timesteps(num_inference_steps, device=device)
            pipe.scheduler.set_begin_index(0)
            return pipe.scheduler.timesteps

        def prepare_latents(generator) -> torch.Tensor:
            batch = batch_size * num_videos_per_prompt
            channels = self.stage.config.in_channels
            # WanPipeline keeps its latents in float32 whatever the transformer's dtype. WanImageToVideoPipeline's
            # prepare_latents draws them alike before it encodes the image (the image is encoded on rank 0 only).
            return WanPipeline.prepare_latents(
                pipe, batch, channels, height, width, num_frames, torch.float32, device, generator, latents
            )

        first_frame: list[FirstFrame] = []  # image-to-video: the image's latents in the engine's layout

        def request(text, video_latents, timesteps, generator):
            if encode_image is not None:
                first_frame.append(FirstFrame(text["image_latents"], video_latents, layout(), self.stage.patch_size))
            keys = ("negative_prompt_embeds", "prompt_embeds") if do_cfg else ("prompt_embeds",)
            batched = {"prompt_embeds": torch.cat([text[k] for k in keys])}  # [negative, positive]
            model_text, cfg_half = self._cfg_split(batched, video_latents.shape[0])
            named = {k: text[k] for k in ("prompt_embeds", "negative_prompt_embeds") if k in text}
            on_step_end = step_end_callback(
                self,
                callback_on_step_end,
                callback_on_step_end_tensor_inputs,
                timesteps,
                named,
                latents_view=lambda grid: layout().from_grid(grid).clone(),
            )

            def run(stage, latents, first: int, last: int, scale: float | None) -> DenoiseRequest:
                """The request of ``stage``'s expert on steps ``first … last - 1`` (step callbacks numbered as in
                the whole loop)."""
                callback = on_step_end
                if on_step_end is not None and first:
                    callback = lambda step, current: on_step_end(step + first, current)  # noqa: E731
                return denoise_request(
                    stage,
                    latents=latents,
                    layout=layout(),
                    timesteps=timesteps[first:last],
                    scheduler=pipe.scheduler,
                    prompt_embeds=model_text["prompt_embeds"],
                    guidance_scale=guidance_scale,
                    expert_guidance_scale=scale,
                    cfg_half=cfg_half,
                    generator=generator,
                    on_step_end=callback,
                    first_frame=first_frame[0] if first_frame else None,
                )

            boundary = (
                None if self.stage_2 is None else pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
            )
            scale_2 = guidance_scale if guidance_scale_2 is None else guidance_scale_2
            return self.expert_runs(run, video_latents, timesteps, boundary, scale_2, layout())

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
                decode=lambda final: self._decode(
                    layout().from_grid(first_frame[0].final(final) if first_frame else final), output_type, return_dict
                ),
                latent_frames=self.spec.latent_frames(num_frames),
            )
        )

    def expert_runs(self, run, latents, timesteps, boundary: float | None, low_scale: float | None,
                    layout: VideoLayout):  # fmt: skip
        """The request of a call's loop from ``run(stage, latents, first, last, expert_scale)``: one run of the stage,
        or Wan 2.2's two experts (mirrors ``diffusers.WanPipeline.__call__``): the high-noise expert while the timestep
        is at least ``boundary``, then the low-noise one from the latents the first left, combined with
        ``low_scale``. ``layout``: the engine's grid as the video's latents."""
        steps = len(timesteps)
        if self.stage_2 is None:
            return run(self.stage, latents, 0, steps, None)
        switch = int((timesteps >= boundary).sum())
        device = self.context.device

        def low(grid: torch.Tensor | None) -> DenoiseRequest:
            start = latents if grid is None else layout.from_grid(grid.to(device))
            return run(self.stage_2, start, switch, steps, low_scale)

        return ExpertRuns(high=run(self.stage, latents, 0, switch, None) if switch else None,
                          low=None if switch == steps else low)  # fmt: skip

    def _denoise(self, request, engine=None):
        """One run, or a two-expert request's two: the high-noise expert's, then (from the latents it left, which rank 0
        broadcasts, and the scheduler's state) the low-noise expert's on its own engine."""
        if not isinstance(request, ExpertRuns):
            return super()._denoise(request, engine)
        final = None
        if request.high is not None:
            final = super()._denoise(request.high, self.engine)
            if request.low is None or self._stopped is not None:  # (stopped: every rank skips the second alike)
                return final
            final = self.collectives.from_rank0(final if self.context.is_output else None)  # (B, C, F*H, W), grid
        assert request.low is not None and self.engine_2 is not None
        return super()._denoise(request.low(final), self.engine_2)

    def _decode(self, latents, output_type, return_dict):
        """Rank 0: Wan's latent normalisation, VAE decode and ``postprocess_video``, as
        ``diffusers.WanPipeline.__call__`` does."""
        pipe = self.pipeline
        if output_type == "latent":
            video = latents
        else:
            vae = pipe.vae
            latents = latents.to(vae.dtype)
            shape = (1, vae.config.z_dim, 1, 1, 1)
            mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
            inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
            video = self._decode_latents(latents / inverse_std + mean)
            video = pipe.video_processor.postprocess_video(video, output_type=output_type)
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (video,)
        return WanPipelineOutput(frames=video)


class PipeFusionWanImageToVideoPipeline(PipeFusionWanPipeline):
    r"""
    Image-to-video with Wan 2.2 TI2V-5B on ``cfg_degree x pipefusion_degree`` ranks (each stage optionally a
    Ulysses/Ring group), called with the arguments of diffusers' [`~diffusers.WanImageToVideoPipeline.__call__`] and
    loaded from the same folder as text-to-video (one transformer serves both); global rank 0 returns
    `WanPipelineOutput(frames=...)`, the others `None`. Rules: [`~xfuse.pipelines.base.PipeFusionPipelineBase`] and
    [`PipeFusionWanPipeline`].

    The image is encoded by the VAE on rank 0 and broadcast with the prompt. As in diffusers (`expand_timesteps`), its
    latents are the first latent frame of every transformer input and that frame's tokens have timestep 0: a patch
    whose tokens have both timesteps gets per-token modulation, the others one per sample; the clip returned starts
    with the image's frame. Refused by name: `image_embeds` and `last_image` (Wan 2.1's image-to-video transformers,
    with an image context, are not supported; diffusers ignores `last_image` for TI2V), and folders without
    `expand_timesteps`.
    """

    diffusers_pipeline = "WanImageToVideoPipeline"
    rank0_components = ("tokenizer", "text_encoder", "vae", "image_encoder", "image_processor")

    def __init__(self, pipeline, context, dtype, stage=None, extra_stages=None, vae_config=None, **kwargs):
        if not pipeline.config.get("expand_timesteps"):
            raise ValueError(
                "xfuse runs image-to-video with Wan 2.2 TI2V folders (expand_timesteps: the image is the first latent "
                "frame); Wan 2.1 and A14B image-to-video transformers (an image context, or the image concatenated "
                "to the latents) are not supported"
            )
        super().__init__(pipeline, context, dtype, stage, extra_stages, vae_config, **kwargs)

    @torch.no_grad()
    def __call__(
        self,
        image,
        prompt: str | list[str] = None,
        negative_prompt: str | list[str] = None,
        height: int = 480,
        width: int = 832,
        num_frames: int = 81,
        num_inference_steps: int = 50,
        guidance_scale: float = 5.0,
        guidance_scale_2: float | None = None,
        num_videos_per_prompt: int | None = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
        last_image: torch.Tensor | None = None,
        output_type: str | None = "np",
        return_dict: bool = True,
        attention_kwargs: dict | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006  (diffusers' default)
        max_sequence_length: int = WAN.text_lengths[0],
    ):
        callback_on_step_end_tensor_inputs = callback_tensor_inputs(
            callback_on_step_end, callback_on_step_end_tensor_inputs
        )
        self._refuse(
            attention_kwargs=(attention_kwargs, None, "its processors take no extra arguments"),
            image_embeds=(image_embeds, None, "it is the image context of Wan 2.1's image-to-video transformers"),
            last_image=(last_image, None, "Wan 2.2 TI2V conditions on the first frame only (diffusers ignores it)"),
        )
        self.pipeline.check_inputs(
            prompt,
            negative_prompt,
            image,
            height,
            width,
            prompt_embeds,
            negative_prompt_embeds,
            image_embeds,
            callback_on_step_end_tensor_inputs,
            guidance_scale_2,
        )
        return self._generate(
            prompt=prompt,
            negative_prompt=negative_prompt,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            guidance_scale_2=guidance_scale_2,
            num_videos_per_prompt=num_videos_per_prompt,
            generator=generator,
            latents=latents,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            output_type=output_type,
            return_dict=return_dict,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length,
            encode_image=lambda batch: self._image_latents(image, batch, height, width, num_frames, generator),
        )

    def _image_latents(self, image, batch: int, height: int, width: int, num_frames: int, generator) -> torch.Tensor:
        """Rank 0: the image's normalised latents (batch, C, 1, H, W), by ``WanImageToVideoPipeline``'s own
        ``video_processor.preprocess`` and ``prepare_latents`` (given latents, it draws none: every rank draws them
        in ``prepare_latents``, as diffusers does before it encodes the image)."""
        pipe, device = self.pipeline, self.context.device
        pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(device, dtype=torch.float32)
        shape = (batch, self.stage.config.in_channels, self.spec.latent_frames(num_frames), 1, 1)  # any: unused
        _, image_latents, _ = pipe.prepare_latents(
            pixels, batch, shape[1], height, width, num_frames, torch.float32, device, generator, torch.empty(shape)
        )
        return image_latents
