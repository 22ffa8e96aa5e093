"""The call driver: one ``__call__`` of a family pipeline, in the one order every family shares. A family's
``__call__`` makes its own argument checks and hands ``CallDriverMixin._run`` a :class:`CallRecipe`; ``_run`` makes the
checks every family makes (``_check_call``, before any communication), prepares (the prompts encoded and broadcast, the
timesteps, generator and latents, the engine's request), denoises (``denoising``) and finishes (the generator as serial
diffusers leaves it, and the decode). ``stream`` prepares and finishes several calls around one stream of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from xfuse.errors import RequestCancelled
from xfuse.parallel.request import DenoiseRequest
from xfuse.parallel.scheduler_state import draws_serial_noise
from xfuse.parallel.trace import CALL, null_span
from xfuse.runtime.peak import phase_peak

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer (got {value!r})")


@dataclass(frozen=True)
class CallRecipe:
    """One ``__call__`` of a family pipeline after the family's own argument checks: what the request is and the
    family's steps, which :meth:`CallDriverMixin._run` calls in its one fixed order.

    Attributes:
        height, width: the image size in pixels (defaults resolved, binned if the family bins).
        num_inference_steps: the steps the caller asked for (a custom schedule's length).
        batch_size: prompts (or prompt embeddings) in the call; the latents' batch is this times
            ``num_images_per_prompt``.
        num_images_per_prompt: as diffusers' argument.
        guidance_scale: the scale that batches [uncond, cond] when it is > 1 (FLUX: ``true_cfg_scale`` when true
            CFG runs, else 1).
        do_cfg: whether the call batches [uncond, cond] where that is not ``guidance_scale > 1`` (ZImagePipeline:
            ``guidance_scale > 0``); ``None``: ``guidance_scale > 1``.
        generator, latents, output_type: the caller's arguments, checked here on every rank.
        encode: ``() -> {name: tensor}``, rank 0 only: the prompt embeddings (broadcast to every rank).
        timesteps: ``() -> timesteps``, every rank: the scheduler's timesteps, set before the latents are drawn
            (``init_noise_sigma`` may depend on them).
        prepare_latents: ``generator -> latents``, every rank: the initial latents as diffusers draws them (rank 0's
            are broadcast; every rank draws, so its generator advances as diffusers' does).
        request: ``(text, latents, timesteps, generator) -> DenoiseRequest``, every rank, no communication: the
            engine's request (conditioning, guidance, this CFG group's half, step callbacks).
        decode: ``final latents -> output``, rank 0 only: the VAE decode and diffusers' output object.
        latent_frames: a video's latent frames (``num_frames`` through the VAE's temporal factor); 1 for an image.
        encode_draws: ``encode`` draws from the user's generator on rank 0 (FLUX's ControlNet pipeline samples the
            control image's VAE latents with it, before the latents): every rank then takes rank 0's generator
            state, as serial diffusers' generator has it at that point.
    """

    height: int
    width: int
    num_inference_steps: int
    batch_size: int
    num_images_per_prompt: int
    guidance_scale: float
    generator: Any
    latents: torch.Tensor | None
    output_type: str
    encode: Callable[[], dict[str, torch.Tensor]]
    timesteps: Callable[[], torch.Tensor]
    prepare_latents: Callable[[torch.Generator], torch.Tensor]
    request: Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Generator], DenoiseRequest]
    decode: Callable[[torch.Tensor], Any]
    latent_frames: int = 1
    encode_draws: bool = False
    do_cfg: bool | None = None


class CallDriverMixin:
    """``PipeFusionPipelineBase``'s call driver (module docstring): ``_run`` and its steps."""

    def _run(self, recipe: CallRecipe) -> Any:
        """Run one call of the family's ``recipe`` in the one order every family shares.

        The order is a cross-rank invariant: every rank must make the same collectives in the same order (a family
        that drew its seed before encoding, or broadcast on one branch only, would deadlock the world), so it lives
        here once:

        1. the checks every family makes, on every rank, before any communication (the generator's state is
           compared across ranks: the first collective, and one that cannot deadlock on a bad argument);
        2. rank 0 encodes the prompts; the embeddings are broadcast;
        3. every rank sets the scheduler's timesteps;
        4. the generator every rank steps the scheduler with (with none given: rank 0's seed, broadcast);
        5. the initial latents: every rank draws them (so its generator advances as diffusers' does), rank 0's
           are broadcast;
        6. every rank builds the engine's request, without communication;
        7. the denoising loop (the engine: point-to-point messages only);
        8. rank 0 decodes and returns diffusers' output (every rank decoding a band of the latent with it when the
           call decodes in parallel, see ``parallel.vae_parallel``); every other rank returns ``None``.
        """
        if self._recipes is not None:  # run_stream collects the calls' recipes; it runs them together
            self._recipes.append(recipe)
            return None
        self._check_call(recipe)
        self._begin_call()
        result = None
        span = self._tracer.span if self._tracer is not None else null_span
        # from here on every rank communicates: a failure anywhere stops everyone
        with self.context.monitor.guard(), span("call", CALL):
            request, timesteps = self._prepare(recipe, span)
            final = self._denoise(request)
            if self._stopped is None:  # (a stopped call: every rank knows it, and skips the rest alike)
                result = self._finish(recipe, final, span)
        if self._stopped is not None:
            raise RequestCancelled(self._stopped, len(timesteps))
        if self._callback_error is not None:  # a refused callback change: raised once every peer is done
            raise self._callback_error
        return result

    def denoise_everywhere(self, tensors: dict[str, torch.Tensor], request: Callable[[dict], tuple[Any, Callable]]):
        """One denoising loop that a caller prepared on every rank outside ``_run`` (``xfuse.modular``'s denoise step),
        in ``_run``'s order: rank 0's ``tensors`` broadcast to every rank (no rank's own draw or encoder can differ),
        ``request(tensors)`` -> (the engine's request, ``finish``) built on every rank, the loop, and ``finish`` of
        its final latents, which every rank receives from rank 0. A failure anywhere stops everyone."""
        self._begin_call()
        with self.context.monitor.guard():
            tensors = self.collectives.from_rank0(tensors if self.context.is_output else None)
            made, finish = request(tensors)
            final = self._denoise(made)
            return finish(self.collectives.from_rank0(final))

    def _prepare(self, recipe: CallRecipe, span) -> tuple[Any, torch.Tensor]:
        """Steps 2-6 of ``_run``: the prompts encoded and broadcast, the timesteps, generator and latents; returns
        the engine's request (Wan 2.2's: two runs) and the call's timesteps."""
        if self.text_group is not None and not self.context.is_output:
            with span("text encoder layers", CALL):
                self.text_group.serve()  # this rank's layers of rank 0's text-encoder calls
        text = self.collectives.broadcast_tensors(self._encoding(recipe.encode), span)
        if recipe.encode_draws:
            self.collectives.generator_of_rank0(recipe.generator)
        with span("prepare", CALL):
            timesteps = recipe.timesteps()
            generator = self.collectives.shared_generator(recipe.generator)
            latents = self.collectives.shared_latents(lambda: recipe.prepare_latents(generator))
            return recipe.request(text, latents, timesteps, generator), timesteps

    def _finish(self, recipe: CallRecipe, final, span) -> Any:
        """Step 8 of ``_run``: the generator as serial diffusers leaves it, and the decode (rank 0's output)."""
        self.collectives.sync_generator(recipe.generator, self._observer())
        if self.context.is_output:
            with span("decode", CALL), phase_peak(self.context.device) as self._decode_peak:
                return recipe.decode(final)  # the family's decode calls _decode_latents
        if self._decode_shape is not None:
            with span("decode", CALL), phase_peak(self.context.device) as self._decode_peak:
                self.band_decode.decode(None, self._decode_shape)
        return None

    def _encoding(self, encode: Callable[[], dict[str, torch.Tensor]]) -> Callable[[], dict[str, torch.Tensor]]:
        """Rank 0's ``encode``, ending the text group's serving after it (with a split text encoder)."""
        group = self.text_group
        if group is None:
            return encode

        def encode_then_release() -> dict[str, torch.Tensor]:
            with group.leading():
                return encode()

        return encode_then_release

    def _check_call(self, recipe: CallRecipe) -> None:
        """Checks every family makes up front, on every rank, before any communication (diffusers makes some of
        them late, after the loop, or on one rank only)."""
        if recipe.output_type not in OUTPUT_TYPES:
            raise ValueError(
                f"output_type must be one of {', '.join(map(repr, OUTPUT_TYPES))} (got {recipe.output_type!r})"
            )
        _positive_int("num_images_per_prompt", recipe.num_images_per_prompt)
        _positive_int("num_inference_steps", recipe.num_inference_steps)
        par = self.parallel
        self.spec.check_layout(
            par,
            num_blocks=self.num_blocks,
            patch_size=self.stage.patch_size,
            height=recipe.height,
            width=recipe.width,
            num_heads=self.spec.num_heads(self.stage.config),
            latent_frames=recipe.latent_frames,
        )
        if recipe.latents is not None:
            shape = self._latents_shape(recipe)
            if not isinstance(recipe.latents, torch.Tensor) or tuple(recipe.latents.shape) != shape:
                raise ValueError(
                    f"latents must be a tensor of shape {shape} for this request "
                    f"(got {getattr(recipe.latents, 'shape', type(recipe.latents).__name__)})"
                )
        do_cfg = recipe.guidance_scale > 1 if recipe.do_cfg is None else recipe.do_cfg
        if par.cfg_degree == 2 and not do_cfg:
            raise ValueError(
                f"guidance_scale must be > 1 with parallel.cfg_degree=2, which splits the "
                f"classifier-free-guidance batch (got {recipe.guidance_scale})"
            )
        self._decode_shape = self._band_decode_shape(recipe)
        generator = recipe.generator
        pipelined = par.warmup_steps < recipe.num_inference_steps
        if isinstance(generator, list) and pipelined and not draws_serial_noise(self.scheduler):
            raise ValueError(
                f"generator: a list of generators works with {type(self.scheduler).__name__} only with "
                "parallel.warmup_steps >= num_inference_steps: its noise is not drawn through diffusers' randn_tensor, "
                "so pipelined steps derive per-patch generators from one generator"
            )
        gens = generator if isinstance(generator, list) else [generator]
        self.collectives.same_everywhere(
            "generator",
            [None if g is None else hashlib.sha1(g.get_state().numpy().tobytes()).hexdigest()[:12] for g in gens],
        )

    def _begin_call(self) -> None:
        self._interrupt, self._callback_error, self._stopped, self._steps_run = False, None, None, 0
        if self._cancellation is not None:
            self._cancellation.begin_call()
        self._decode_peak = None  # what this rank's part of the call's decode added at its peak
        self._cache_counts = (0, 0)  # (steps computed, skipped) by step caching in this call
        for channels in self.context.all_channels:
            channels.counters.reset()  # rank_stats() reports the last call
