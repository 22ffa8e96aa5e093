"""``PipeFusionHunyuanDiTPipeline``: diffusers' ``HunyuanDiTPipeline`` with PipeFusion inside, under torchrun.

Every rank runs the same script. Global rank 0 keeps the text encoders, tokenizers, VAE and safety checker; it
encodes the prompts and broadcasts the embeddings, and it decodes and returns the images. Every rank loads and
keeps only the transformer blocks of its stage. The diffusers pipeline object does the pre- and post-processing (its
``check_inputs``, ``encode_prompt``, ``prepare_latents``, ``prepare_extra_step_kwargs``, VAE and image processor);
the denoising loop is xfuse's engine.
"""

from __future__ import annotations

import hashlib
import resource

import torch
import torch.distributed as dist
from diffusers import HunyuanDiT2DModel, HunyuanDiTPipeline
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import SUPPORTED_SHAPE, map_to_standard_shapes
from diffusers.pipelines.stable_diffusion import StableDiffusionPipelineOutput
from diffusers.utils import logging

from xfuse.comm.p2p import Recv, Send
from xfuse.config import (
    CommConfig,
    ParallelConfig,
    RuntimeConfig,
    check_world,
    comm_config,
    parallel_config,
)
from xfuse.distributed import ParallelContext, init_parallel
from xfuse.health import config_hash, handshake
from xfuse.models.hunyuandit import HunyuanDiTStage, denoise_request
from xfuse.parallel.engine import PipeFusionEngine
from xfuse.parallel.patch_grid import patch_grid
from xfuse.parallel.stage_plan import stage_plan
from xfuse.parallel.trace import Tracer, write_trace

logger = logging.get_logger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Components only global rank 0 uses: the others never load them.
_RANK0_COMPONENTS = (
    "text_encoder",
    "text_encoder_2",
    "tokenizer",
    "tokenizer_2",
    "vae",
    "safety_checker",
    "feature_extractor",
)


def _runtime(torch_dtype, device) -> RuntimeConfig:
    if torch_dtype is not None and torch_dtype not in _DTYPE_NAMES:
        raise ValueError(f"torch_dtype must be one of {list(_DTYPE_NAMES)} (got {torch_dtype!r})")
    device = "auto" if device is None else str(torch.device(device).type)
    return RuntimeConfig(device=device, dtype=_DTYPE_NAMES.get(torch_dtype, "float32"))


class PipeFusionHunyuanDiTPipeline:
    r"""
    Text-to-image with HunyuanDiT on ``cfg_degree x pipefusion_degree`` ranks (PipeFusion patch pipelining).

    Launch the same script on every rank with ``torchrun --nproc_per_node=N``; build the pipeline with
    [`~PipeFusionHunyuanDiTPipeline.from_pretrained`] or [`~PipeFusionHunyuanDiTPipeline.from_pipe`] and call it
    with exactly the arguments of diffusers' [`~diffusers.HunyuanDiTPipeline.__call__`]. Global rank 0 returns
    the output; every other rank returns `None`.

    Attributes:
        pipeline ([`~diffusers.HunyuanDiTPipeline`]): the wrapped pipeline (rank 0 has every component; other ranks
            have no text encoders, tokenizers or VAE).
        stage ([`~xfuse.models.hunyuandit.HunyuanDiTStage`]): this rank's share of the transformer.
        parallel, comm: the validated configs; context: this rank's place in the world.
    """

    def __init__(
        self,
        pipeline: HunyuanDiTPipeline,
        parallel: ParallelConfig,
        comm: CommConfig,
        context: ParallelContext,
        dtype: torch.dtype,
        stage: HunyuanDiTStage | None = None,
    ):
        self.pipeline, self.parallel, self.comm, self.context, self.dtype = pipeline, parallel, comm, context, dtype
        config = (stage or pipeline.transformer).config
        self.plan = stage_plan(config.num_layers, parallel.pipefusion_degree, parallel.placement, parallel.stage_split)
        # Second handshake, now that the model is loaded: same weights' config, dtype and plan everywhere.
        handshake(
            {
                "model.config_hash": config_hash(dict(config)),
                "model.dtype": str(dtype),
                "model.scheduler": type(pipeline.scheduler).__name__,
                "plan.route": " ".join(f"r{s.rank}{list(s.blocks)}" for s in self.plan.route),
            },
            world_size=context.world_size,
            group=context.control_group,
        )
        self.stage = (stage or HunyuanDiTStage(pipeline.transformer, self.plan, context.pipe_rank)).to(context.device)
        pipeline.transformer = None  # the stage owns what is left of it
        pipeline.default_sample_size = config.sample_size  # what diffusers derives from the transformer
        if not context.is_output:
            for name in _RANK0_COMPONENTS:
                setattr(pipeline, name, None)
        elif pipeline.vae is not None:
            pipeline.vae.to(context.device)
            for name in ("text_encoder", "text_encoder_2", "safety_checker"):
                if getattr(pipeline, name, None) is not None:
                    getattr(pipeline, name).to(context.device)
        self.engine = PipeFusionEngine(
            self.stage,
            self.plan,
            context.channels,
            pipe_rank=context.pipe_rank,
            group_ranks=context.pipe_ranks,
            warmup_steps=parallel.warmup_steps,
            lookahead=comm.max_inflight,
        )
        self._interrupt, self._callback_error = False, None
        self._tracer: Tracer | None = None

    # ---------------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        parallel=None,
        comm=None,
        torch_dtype=None,
        device=None,
        fingerprint=None,
        **kwargs,
    ) -> PipeFusionHunyuanDiTPipeline:
        r"""
        Load a local diffusers HunyuanDiT folder (the HunyuanDiT-v1.2-Diffusers layout) on every rank.

        Args:
            pretrained_model_name_or_path (`str`): local folder with `model_index.json`, `transformer/`, `vae/`,
                `text_encoder/`, `text_encoder_2/`, `tokenizer/`, `tokenizer_2/`, `scheduler/`.
            parallel ([`~xfuse.config.ParallelConfig`] or `dict`): parallel degrees, patches, warm-up, placement.
            comm ([`~xfuse.config.CommConfig`] or `dict`): backend, timeout, in-flight bound, interface.
            torch_dtype (`torch.dtype`, *optional*): float32 (default), bfloat16 or float16.
            device (`str` or `torch.device`, *optional*): `cpu` or `cuda` (default: CUDA when available; each
                rank uses `cuda:LOCAL_RANK`).
            fingerprint (`dict`, *optional*): extra `{field: value}` every rank must agree on (checked at start-up
                with the config, versions, model config and plan; a difference raises on every rank).
            kwargs: passed to [`~diffusers.DiffusionPipeline.from_pretrained`] (e.g. `scheduler=`).

        Ranks other than 0 do not load the text encoders, tokenizers or VAE; every rank reads only its own
        transformer blocks from the checkpoint (`transformer/*.safetensors`).
        """
        parallel, comm, runtime = parallel_config(parallel), comm_config(comm), _runtime(torch_dtype, device)
        context = init_parallel(parallel, comm, runtime, fingerprint)
        skip = {} if context.is_output else {name: None for name in _RANK0_COMPONENTS}
        config = HunyuanDiT2DModel.load_config(
            pretrained_model_name_or_path, subfolder="transformer", local_files_only=True
        )
        plan = stage_plan(config["num_layers"], parallel.pipefusion_degree, parallel.placement, parallel.stage_split)
        # Only this rank's blocks are read from the checkpoint; diffusers loads the other components.
        stage = HunyuanDiTStage.from_pretrained(pretrained_model_name_or_path, plan, context.pipe_rank, torch_dtype)
        pipeline = HunyuanDiTPipeline.from_pretrained(
            pretrained_model_name_or_path,
            torch_dtype=torch_dtype,
            local_files_only=True,
            transformer=None,
            **skip,
            **kwargs,
        )
        return cls(pipeline, parallel, comm, context, torch_dtype or torch.float32, stage)

    @classmethod
    def from_pipe(
        cls, pipeline: HunyuanDiTPipeline, parallel=None, comm=None, device=None, fingerprint=None
    ) -> PipeFusionHunyuanDiTPipeline:
        """Parallelise an already loaded diffusers ``HunyuanDiTPipeline`` (same object on every rank).

        The pipeline's transformer is sharded in place (blocks of other ranks are dropped) and ranks other than 0
        drop the text encoders and VAE: do not keep using ``pipeline`` itself afterwards.
        """
        dtype = pipeline.transformer.dtype
        parallel, comm = parallel_config(parallel), comm_config(comm)
        context = init_parallel(parallel, comm, _runtime(dtype, device), fingerprint)
        return cls(pipeline, parallel, comm, context, dtype)

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def scheduler(self):
        return self.pipeline.scheduler

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    def set_progress_bar_config(self, **kwargs) -> None:
        self.pipeline.set_progress_bar_config(**kwargs)

    def enable_trace(self, enabled: bool = True) -> None:
        """Record a timeline of the following calls (compute per segment and patch, communication waits)."""
        self._tracer = Tracer(self.context.rank) if enabled else None

    def write_trace(self, path: str) -> int | None:
        """Collective: merge every rank's timeline into one Chrome/Perfetto trace at ``path`` (written by global
        rank 0, which gets the number of events; the others get ``None``)."""
        if self._tracer is None:
            raise ValueError("write_trace: call enable_trace() before the calls to record")
        mine = self._tracer.metadata() + self._tracer.events
        if self.context.world_size == 1:
            return write_trace(path, [mine])
        gathered = [None] * self.context.world_size
        dist.all_gather_object(gathered, mine, group=self.context.control_group)
        return write_trace(path, gathered) if self.context.is_output else None

    def rank_stats(self) -> list[dict] | None:
        """Per rank: bytes sent in the last call by kind (``hidden``, ``skip``, ``latent``, ``cfg``) and peak memory.

        Collective: call it on every rank; global rank 0 gets the list indexed by rank, the others ``None``.
        ``peak_rss_mib`` is the process's peak resident memory; ``peak_cuda_mib`` the peak CUDA allocation.
        """
        sent: dict[str, int] = {}
        for channels in (self.context.channels, self.context.cfg_channels):
            if channels is not None:
                for kind, nbytes in channels.counters.sent_bytes.items():
                    sent[kind] = sent.get(kind, 0) + nbytes
        mine = dict(
            sent=sent,
            peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            peak_cuda_mib=torch.cuda.max_memory_allocated() / 2**20 if self.context.device.type == "cuda" else None,
        )
        if self.context.world_size == 1:
            return [mine]
        gathered = [None] * self.context.world_size
        dist.all_gather_object(gathered, mine, group=self.context.control_group)
        return gathered if self.context.is_output else None

    # ------------------------------------------------------------------------------------------ collectives
    def _broadcast(self, payload):
        """Broadcast a picklable object from global rank 0 (tensors travel on the CPU)."""
        if self.context.world_size == 1:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, src=0, group=self.context.control_group)
        return box[0]

    def _same_everywhere(self, name: str, value) -> None:
        """Raise the same ValueError on every rank if ``value`` differs between ranks."""
        if self.context.world_size == 1:
            return
        values = [None] * self.context.world_size
        dist.all_gather_object(values, value, group=self.context.control_group)
        if any(v != values[0] for v in values):
            held = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"{name} must be the same on every rank ({held})")

    def _cfg_exchange(self, noise: torch.Tensor, step: int, patch) -> torch.Tensor:
        """Swap noise-prediction rows with the other CFG group's rank at the same pipeline position."""
        peer = self.context.cfg_peer
        sends, recvs = self.context.cfg_channels.exchange(
            [Send(peer, "cfg", noise, step, patch)], [Recv(peer, "cfg", tuple(noise.shape), noise.dtype, step, patch)]
        )
        other = recvs[0].wait().clone()
        recvs[0].release()
        sends[0].wait()
        return other

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
        pipe, ctx, par = self.pipeline, self.context, self.parallel
        if isinstance(callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            callback_on_step_end_tensor_inputs = callback_on_step_end.tensor_inputs

        # 0. Default height and width as diffusers does, optionally binned. diffusers silently rounds a size down to
        #    a multiple of 16; xfuse refuses it instead (binning, which users opt into and which logs, still maps).
        height = height or pipe.default_sample_size * pipe.vae_scale_factor
        width = width or pipe.default_sample_size * pipe.vae_scale_factor
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

        # 1. Every check before any communication, the same on every rank.
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
        self._check_call_args(
            output_type,
            num_images_per_prompt,
            latents,
            original_size,
            target_size,
            crops_coords_top_left,
            height,
            width,
            prompt,
            prompt_embeds,
        )
        self._check_parallel_args(height, width, num_inference_steps, guidance_scale, guidance_rescale, generator)
        self._interrupt = False
        for channels in (ctx.channels, ctx.cfg_channels):
            if channels is not None:
                channels.counters.reset()  # rank_stats() reports the last call
        do_cfg = guidance_scale > 1
        if prompt is not None and isinstance(prompt, str):
            batch_size = 1
        elif prompt is not None and isinstance(prompt, list):
            batch_size = len(prompt)
        else:
            batch_size = prompt_embeds.shape[0]

        result = None
        with ctx.monitor.guard():  # from here on every rank communicates: a failure anywhere stops everyone
            device = ctx.device
            # 2. Encode the prompts on rank 0 and broadcast the embeddings.
            text = None
            if ctx.is_output:
                text = {}
                for index, length, suffix, given in (
                    (
                        0,
                        77,
                        "",
                        (prompt_embeds, negative_prompt_embeds, prompt_attention_mask, negative_prompt_attention_mask),
                    ),
                    (
                        1,
                        256,
                        "_2",
                        (
                            prompt_embeds_2,
                            negative_prompt_embeds_2,
                            prompt_attention_mask_2,
                            negative_prompt_attention_mask_2,
                        ),
                    ),
                ):
                    emb, neg, mask, neg_mask = pipe.encode_prompt(
                        prompt=prompt,
                        device=device,
                        dtype=self.dtype,
                        num_images_per_prompt=num_images_per_prompt,
                        do_classifier_free_guidance=do_cfg,
                        negative_prompt=negative_prompt,
                        prompt_embeds=given[0],
                        negative_prompt_embeds=given[1],
                        prompt_attention_mask=given[2],
                        negative_prompt_attention_mask=given[3],
                        max_sequence_length=length,
                        text_encoder_index=index,
                    )
                    text[f"prompt_embeds{suffix}"], text[f"prompt_attention_mask{suffix}"] = emb.cpu(), mask.cpu()
                    if do_cfg:
                        text[f"negative_prompt_embeds{suffix}"] = neg.cpu()
                        text[f"negative_prompt_attention_mask{suffix}"] = neg_mask.cpu()
            text = {k: v.to(device) for k, v in self._broadcast(text).items()}

            # 3. Timesteps, latents (rank 0's, broadcast), scheduler kwargs.
            pipe.scheduler.set_timesteps(num_inference_steps, device=device)
            timesteps = pipe.scheduler.timesteps
            if generator is None:  # every rank (and both CFG groups) must draw the same scheduler noise
                seed = self._broadcast(int(torch.randint(0, 2**62, (1,))) if ctx.is_output else None)
                generator = torch.Generator().manual_seed(seed)
            latents = pipe.prepare_latents(
                batch_size * num_images_per_prompt,
                self.stage.config.in_channels,
                height,
                width,
                self.dtype,
                device,
                generator,
                latents,
            )
            latents = self._broadcast(latents.cpu() if ctx.is_output else None).to(device)
            extra_step_kwargs = pipe.prepare_extra_step_kwargs(generator, eta)

            # 4. Size/style conditioning, as diffusers builds it.
            style = torch.tensor([0], device=device)
            add_time_ids = torch.tensor(
                [list(original_size + (target_size or (height, width)) + crops_coords_top_left)], dtype=self.dtype
            )
            if do_cfg:
                keys = ("prompt_embeds", "prompt_attention_mask", "prompt_embeds_2", "prompt_attention_mask_2")
                batched = {k: torch.cat([text[f"negative_{k}"], text[k]]) for k in keys}
                add_time_ids, style = torch.cat([add_time_ids] * 2, dim=0), torch.cat([style] * 2, dim=0)
            else:
                batched = {
                    k: text[k]
                    for k in ("prompt_embeds", "prompt_attention_mask", "prompt_embeds_2", "prompt_attention_mask_2")
                }
            add_time_ids = add_time_ids.to(device=device).repeat(batch_size * num_images_per_prompt, 1)
            style = style.to(device=device).repeat(batch_size * num_images_per_prompt)
            model_text = dict(batched, image_meta_size=add_time_ids, style=style)
            cfg_half = None
            if par.cfg_degree == 2:  # this CFG group's half of every batched tensor: [uncond | cond]
                half = latents.shape[0]
                model_text = {k: v[ctx.cfg_rank * half : (ctx.cfg_rank + 1) * half] for k, v in model_text.items()}
                cfg_half = (ctx.cfg_rank, self._cfg_exchange)

            # 5. The denoising loop: xfuse's engine.
            progress = pipe.progress_bar(total=num_inference_steps) if ctx.is_output else None
            on_step_end, self._callback_error = None, None
            if callback_on_step_end is not None and ctx.cfg_rank == 0 and ctx.pipe_rank == self.plan.output_rank:

                def on_step_end(step, current):
                    if self._callback_error is None:  # after a refused change, the loop finishes without callbacks
                        self._callback_error = self._run_callback(
                            callback_on_step_end,
                            callback_on_step_end_tensor_inputs,
                            step,
                            timesteps[step],
                            current,
                            batched,
                            text,
                        )

            request = denoise_request(
                self.stage,
                latents=latents,
                timesteps=timesteps,
                scheduler=pipe.scheduler,
                guidance_scale=guidance_scale,
                guidance_rescale=guidance_rescale,
                cfg_half=cfg_half,
                extra_step_kwargs=extra_step_kwargs,
                generator=generator,
                on_step_end=on_step_end,
                on_progress=None if progress is None else (lambda step: progress.update()),
                **model_text,
            )
            grid = patch_grid(
                height // pipe.vae_scale_factor,
                width // pipe.vae_scale_factor,
                par.resolved_num_patches,
                self.stage.config.patch_size,
            )
            try:
                final = self.engine.denoise(request, grid, self._tracer)
            finally:
                if progress is not None:
                    progress.close()
            if ctx.is_output:
                result = self._decode(final, output_type, return_dict)
        if self._callback_error is not None:  # raised once the loop is over, so no peer is left waiting
            raise self._callback_error
        return result

    def _decode(self, final, output_type, return_dict):
        """Rank 0: VAE decode, safety checker and post-processing, as diffusers does."""
        pipe, device = self.pipeline, self.context.device
        # 6. Decode and post-process on rank 0, as diffusers does.
        if output_type != "latent":
            image = pipe.vae.decode(final / pipe.vae.config.scaling_factor, return_dict=False)[0]
            image, has_nsfw_concept = pipe.run_safety_checker(image, device, self.dtype)
        else:
            image, has_nsfw_concept = final, None
        do_denormalize = [True] * image.shape[0] if has_nsfw_concept is None else [not n for n in has_nsfw_concept]
        image = pipe.image_processor.postprocess(image, output_type=output_type, do_denormalize=do_denormalize)
        pipe.maybe_free_model_hooks()
        if not return_dict:
            return (image, has_nsfw_concept)
        return StableDiffusionPipelineOutput(images=image, nsfw_content_detected=has_nsfw_concept)

    def _check_call_args(
        self,
        output_type,
        num_images_per_prompt,
        latents,
        original_size,
        target_size,
        crops_coords_top_left,
        height,
        width,
        prompt,
        prompt_embeds,
    ):
        """Checks diffusers makes late (after the loop, or on one rank only): made up front, on every rank."""
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"output_type must be one of 'pil', 'np', 'pt', 'latent' (got {output_type!r})")
        if (
            not isinstance(num_images_per_prompt, int)
            or isinstance(num_images_per_prompt, bool)
            or (num_images_per_prompt < 1)
        ):
            raise ValueError(f"num_images_per_prompt must be a positive integer (got {num_images_per_prompt!r})")
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
        if latents is not None:
            batch = (
                1 if isinstance(prompt, str) else len(prompt) if isinstance(prompt, list) else prompt_embeds.shape[0]
            ) * num_images_per_prompt
            shape = (batch, self.stage.config.in_channels, height // 8, width // 8)
            if not isinstance(latents, torch.Tensor) or tuple(latents.shape) != shape:
                raise ValueError(
                    f"latents must be a tensor of shape {shape} for this request "
                    f"(got {getattr(latents, 'shape', type(latents).__name__)})"
                )

    def _check_parallel_args(self, height, width, num_inference_steps, guidance_scale, guidance_rescale, generator):
        par = self.parallel
        if (
            not isinstance(num_inference_steps, int)
            or isinstance(num_inference_steps, bool)
            or (num_inference_steps < 1)
        ):
            raise ValueError(f"num_inference_steps must be a positive integer (got {num_inference_steps!r})")
        config = self.stage.config
        check_world(
            par,
            world_size=self.context.world_size,
            num_layers=config.num_layers,
            patch_size=config.patch_size,
            height=height,
            width=width,
        )
        pipelined = par.warmup_steps < num_inference_steps
        if guidance_rescale > 0 and pipelined:
            raise ValueError(
                f"guidance_rescale={guidance_rescale} needs whole-image statistics, which pipelined steps do not "
                f"have: use guidance_rescale=0, or parallel.warmup_steps >= num_inference_steps "
                f"({par.warmup_steps} < {num_inference_steps})"
            )
        if par.cfg_degree == 2 and not guidance_scale > 1:
            raise ValueError(
                f"guidance_scale must be > 1 with parallel.cfg_degree=2, which splits the "
                f"classifier-free-guidance batch (got {guidance_scale})"
            )
        if isinstance(generator, list) and pipelined:
            raise ValueError(
                "generator: a list of generators works only with parallel.warmup_steps >= "
                "num_inference_steps; pipelined steps derive per-patch generators from one generator"
            )
        gens = generator if isinstance(generator, list) else [generator]
        self._same_everywhere(
            "generator",
            [None if g is None else hashlib.sha1(g.get_state().numpy().tobytes()).hexdigest()[:12] for g in gens],
        )

    def _run_callback(self, callback, tensor_inputs, step, t, current, batched, text) -> ValueError | None:
        """Run the user's callback on a copy of the tensors; return the error to raise if it changed any."""
        names = {
            "latents": current.clone(),
            "prompt_embeds": batched["prompt_embeds"],
            "prompt_embeds_2": batched["prompt_embeds_2"],
            "negative_prompt_embeds": text.get("negative_prompt_embeds"),
            "negative_prompt_embeds_2": text.get("negative_prompt_embeds_2"),
        }
        kwargs = {k: names[k] for k in tensor_inputs}
        outputs = callback(self, step, t, dict(kwargs)) or {}
        for key, value in outputs.items():
            original = current if key == "latents" else kwargs.get(key)
            if value is not kwargs.get(key) and not (
                isinstance(value, torch.Tensor) and original is not None and torch.equal(value, original)
            ):
                return ValueError(
                    f"callback_on_step_end returned a changed {key!r} at step {step}: PipeFusion "
                    "cannot apply it (later patches are already in flight)"
                )
        if self._interrupt:
            return ValueError(
                "callback_on_step_end set the pipeline's interrupt flag: PipeFusion cannot stop mid-pipeline"
            )
        return None
