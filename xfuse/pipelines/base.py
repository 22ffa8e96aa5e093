"""``PipeFusionPipelineBase``: what every family's PipeFusion pipeline shares under torchrun.

Every rank runs the same script. Global rank 0 keeps the text encoders, tokenizers, VAE and safety checker; it
encodes the prompts and broadcasts the embeddings, and it decodes and returns the images. Every rank loads and keeps
only the transformer blocks of its stage. This class holds the model's handshake, the engine and its call, progress,
tracing and statistics, and the one ``__call__`` driver (``_run``) that puts the call's steps in order; beside it,
``loading`` (``from_pretrained`` / ``from_pipe``), ``collectives`` (rank 0's broadcasts and gathers, the shared
generator, the CFG exchange) and ``callbacks`` (diffusers' ``callback_on_step_end``). A family's subclass holds its
diffusers ``__call__`` signature and argument checks, and hands ``_run`` a :class:`CallRecipe`: how to encode its
prompts, set its timesteps, draw its latents, build the engine's request and decode.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from xfuse.config import (
    CommConfig,
    ParallelConfig,
    XfuseConfig,
)
from xfuse.errors import ConfigError, RequestCancelled
from xfuse.families.spec import ModelSpec
from xfuse.parallel.cancellation import Cancellation
from xfuse.parallel.engine import PipeFusionEngine
from xfuse.parallel.patch_grid import PatchGrid, patch_grid
from xfuse.parallel.request import DenoiseRequest
from xfuse.parallel.scheduler_state import draws_serial_noise
from xfuse.parallel.sequence import SequenceParallel
from xfuse.parallel.sequence_stage import SequenceParallelStage
from xfuse.parallel.step_cache import check_decisions
from xfuse.parallel.trace import CALL, Tracer, null_span, write_trace
from xfuse.parallel.vae_decode import (
    BAND_DECODED_VAES,
    VIDEO_BAND_DECODED_VAES,
    ParallelVAEDecode,
    decodes_in_parallel,
    vae_on_every_rank,
    world_decodes,
)
from xfuse.parallel.video_vae_decode import band_decoder
from xfuse.pipelines.collectives import Collectives
from xfuse.pipelines.loading import load_from_folder, shard_loaded
from xfuse.pipelines.stage_compiler import StageCompiler
from xfuse.pipelines.text_placement import place_text_encoders, text_components
from xfuse.pipelines.text_placement import text_placement as resolve_text_placement
from xfuse.runtime.compile_cache import CompileCache
from xfuse.runtime.handshake import config_hash, handshake
from xfuse.runtime.monitor import default_store
from xfuse.runtime.peak import PhasePeak, peak_cuda_mib, peak_rss_mib, phase_peak
from xfuse.runtime.world import ParallelContext

OUTPUT_TYPES = ("pil", "np", "pt", "latent")


def _counts(decisions: list[bool]) -> tuple[int, int]:
    """(steps computed, steps skipped) of a run's caching decisions."""
    return sum(decisions), len(decisions) - sum(decisions)


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer (got {value!r})")


@dataclass(frozen=True)
class CallRecipe:
    """One ``__call__`` of a family pipeline after the family's own argument checks: what the request is and the
    family's steps, which :meth:`PipeFusionPipelineBase._run` calls in its one fixed order.

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


class PipeFusionPipelineBase:
    r"""
    A diffusers pipeline of one family run on ``cfg_degree x pipefusion_degree`` ranks with PipeFusion.

    Subclasses set ``spec`` (the family's [`~xfuse.families.spec.ModelSpec`]) and ``rank0_components`` (the
    pipeline components only global rank 0 uses), and implement `__call__` with their diffusers pipeline's
    arguments: check them, then `return self._run(CallRecipe(...))`.

    Attributes:
        pipeline: the wrapped diffusers pipeline (rank 0 has every component; other ranks have no text encoders,
            tokenizers or VAE). stage: this rank's share of the transformer. plan: the stage plan.
        config: the whole validated config (``config.parallel.placement`` as given; ``plan.placement`` resolved).
        parallel, comm: its sections. context: this rank's place in the world. dtype: the transformer's dtype.
    """

    spec: ModelSpec  # the family's (a class attribute), made the model's own in __init__ (``ModelSpec.for_vae``)
    rank0_components: ClassVar[tuple[str, ...]]
    diffusers_pipeline: ClassVar[str | None] = None  # see diffusers_name

    @classmethod
    def diffusers_name(cls) -> str:
        """The diffusers pipeline class whose arguments this one takes: the family's (``spec.diffusers_pipeline``),
        or another of its pipelines on the same transformer (``WanImageToVideoPipeline``)."""
        return cls.diffusers_pipeline or cls.spec.diffusers_pipeline

    def __init__(self, pipeline, context: ParallelContext, dtype: torch.dtype, stage=None, extra_stages=None,
                 vae_config=None, text_placement: str | None = None):  # fmt: skip
        self.pipeline, self.context, self.dtype = pipeline, context, dtype
        self.collectives = Collectives(context)
        # The model's own VAE factor where the family reads it from the VAE (Wan 2.2's 16 px). Ranks that did not
        # load the VAE have its config from the folder (``vae_config``).
        vae = getattr(pipeline, "vae", None)
        self.spec = self.spec.for_vae(dict(vae.config) if vae is not None else vae_config)
        self._vae_class = type(vae).__name__ if vae is not None else (vae_config or {}).get("_class_name")
        if extra_stages:  # a family with several transformers (Wan 2.2's experts) takes its own before calling here
            raise ValueError(f"{type(self).__name__} runs one transformer; the folder also has {sorted(extra_stages)}")
        self.config: XfuseConfig = context.config
        self.parallel: ParallelConfig = self.config.parallel
        self.comm: CommConfig = self.config.comm
        config = (stage or pipeline.transformer).config
        self.num_blocks = self.spec.num_blocks(config)
        self.plan = self.spec.plan(self.num_blocks, self.parallel, self._control_blocks(pipeline))
        # parallel.text_encoder resolved (from_pretrained resolved it before loading the text ranks' shares)
        self.text_placement = text_placement or resolve_text_placement(self.config, context.device)
        # Second handshake, now that the model is loaded: same weights' config, dtype and plan everywhere.
        handshake(
            {
                "model.family": self.spec.name,
                "model.config_hash": config_hash(dict(config)),
                "model.dtype": str(dtype),
                "model.vae_scale_factor": str(self.spec.vae_scale_factor),
                "model.scheduler": type(pipeline.scheduler).__name__,
                "plan.route": " ".join(f"r{s.rank}{list(s.blocks)}" for s in self.plan.route),
                "plan.text_encoder": self.text_placement,
            },
            world_size=context.world_size,
            group=context.control_group,
        )
        stage_class = self.spec.stage_class()
        self.stage = (stage or stage_class(pipeline.transformer, self.plan, context.pipe_rank)).to(context.device)
        pipeline.transformer = None  # the stage owns what is left of it
        self.compiler: StageCompiler | None = None  # compile.mode: regional
        if self.config.compile.enabled:
            self.compiler = self._compiler(config_hash(dict(config)), dtype)
            self.compiler.compile(self.stage)
        # What diffusers derives from the transformer (FluxPipeline: a constant; the spec knows which).
        self.default_sample_size = self.spec.default_side(config) // self.spec.vae_scale_factor
        self.band_decode = self._band_decode(pipeline, context)
        self.text_group = place_text_encoders(pipeline, context, self.text_placement)  # collective with split
        if not context.is_output:
            for name in self._rank0_only(context.config.parallel, context.world_size, self._vae_class):
                setattr(pipeline, name, None)
            if self.band_decode is None:
                pipeline.vae = None
        offloaded = text_components(pipeline) if self.text_placement == "offload" else []
        for name in self.rank0_components:
            module = getattr(pipeline, name, None)
            if isinstance(module, torch.nn.Module) and name not in offloaded:
                module.to(context.device)
        self.engine = self._engine(self.stage)
        self._interrupt, self._callback_error = False, None
        self._cancellation: Cancellation | None = None  # enable_cancellation()
        self._stopped: int | None = None  # the step (of the whole call) a cancelled call stopped before
        self._steps_run = 0  # engine steps this call's earlier runs took (a two-expert call runs twice)
        self._cache_counts: tuple[int, int] = (0, 0)
        self._tracer: Tracer | None = None
        self._buffer_shape: tuple | None = None  # the request shape the pooled receive buffers were made for
        self._recipes: list[CallRecipe] | None = None  # run_stream: the calls' recipes, collected instead of run
        self._decode_peak: PhasePeak | None = None  # the last call's decode on this rank (xfuse.runtime.peak)
        self._decode_shape: tuple | None = None  # this call's latents for a band-parallel decode (None: rank 0 alone)

    def _compiler(self, model_config_hash: str, dtype) -> StageCompiler:
        """``compile.mode: regional``'s compiler of this rank's stage, with ``compile.cache_dir``'s folder for this
        torch, model, dtype, device, backend and ``dynamic``."""
        section, cache = self.config.compile, None
        if section.cache_dir is not None:
            cache = CompileCache(section.cache_dir, torch=torch.__version__, family=self.spec.name,
                                 model_config_hash=model_config_hash, dtype=str(dtype),
                                 device=self.context.device.type, backend=section.backend,
                                 dynamic=section.dynamic)  # fmt: skip
        monitor, patches = self.context.monitor, self.parallel.resolved_num_patches
        return StageCompiler(section, self.context.rank, monitor, patches, cache)

    @contextlib.contextmanager
    def _compile_bounds(self):
        """While a request compiles new shapes: every wait for a message on every rank, and this rank's host
        deadline, bounded by ``XfuseConfig.longest_wait_s`` (every rank decides alike: the request's shape is the
        same everywhere). Nothing is bounded until it is entered: ``StageCompiler`` enters it for compiling
        requests only, and a request of a compiled shape keeps the plain ``comm.timeout_s``."""
        with contextlib.ExitStack() as stack:
            for channels in self.context.all_channels:
                stack.enter_context(channels.bounded_by(self.config.longest_wait_s))
            if self.context.host_deadline is not None:
                stack.enter_context(self.context.host_deadline.bounded_by(self.config.longest_wait_s))
            yield

    def enable_cancellation(self, enabled: bool = True) -> None:
        """Let a call stop between two denoising steps when global rank 0's ``cancel_if`` condition holds (``xfuse
        serve`` does, for a client that went away). Call it on every rank alike, before the calls it applies to:
        every rank then learns at each step whether the call goes on (``xfuse.parallel.cancellation``; one store
        round trip per step and rank)."""
        if not enabled:
            self._cancellation = None
            return
        self._cancellation = Cancellation(
            rank=self.context.rank,
            world_size=self.context.world_size,
            store=default_store() if self.context.world_size > 1 else None,
            timeout_s=self.comm.timeout_s,
        )

    @contextlib.contextmanager
    def cancel_if(self, condition: Callable[[], bool]):
        """On global rank 0 (other ranks follow its decisions; elsewhere the condition is never asked): the calls
        made inside stop before the next step once ``condition()`` returns True, raising ``RequestCancelled`` on
        every rank. Asked once per step, from the calling thread; needs ``enable_cancellation()``."""
        if self._cancellation is None:
            raise RuntimeError("cancel_if needs enable_cancellation() on every rank first")
        self._cancellation.condition = condition
        try:
            yield
        finally:
            self._cancellation.condition = None

    def _control_blocks(self, pipeline) -> int:
        """Blocks of a ControlNet the embedding rank runs beside its stage (``ShardedControlNetMixin``); 0: none."""
        return 0

    @classmethod
    def _control_blocks_of(cls, folder: str, kwargs: dict) -> int:
        """``_control_blocks`` of the pipeline ``from_pretrained`` is about to load (before it loads)."""
        return 0

    def _engine(self, stage) -> PipeFusionEngine:
        """The engine that runs ``stage`` (this rank's share of a transformer) over the world's pipeline group, inside
        this rank's sequence-parallel group where the config has one (applied from outside the family's stage)."""
        context = self.context
        engine_stage = stage
        if self.parallel.sequence_degree > 1:
            sequence = SequenceParallel(
                ulysses=self.parallel.ulysses_degree,
                ring=self.parallel.ring_degree,
                index=context.sp_rank,
                group_ranks=context.sp_ranks,
                channels=context.sp_channels,
            )
            engine_stage = SequenceParallelStage(stage, sequence)
        return PipeFusionEngine(
            engine_stage,
            self.plan,
            context.channels,
            pipe_rank=context.pipe_rank,
            group_ranks=context.pipe_ranks,
            warmup_steps=self.parallel.warmup_steps,
            lookahead=self.comm.max_inflight,
            cache=self.config.cache,
            host_deadline=context.host_deadline,
        )

    @classmethod
    def _rank0_only(cls, parallel: ParallelConfig, world_size: int, vae_class: str | None) -> tuple[str, ...]:
        """The components ranks other than 0 do not load: ``rank0_components``, less the VAE when every rank may
        decode a band of the image (``parallel.vae_parallel`` not ``off``, a VAE the bands run: ``vae_class``)."""
        if not vae_on_every_rank(parallel, world_size, vae_class):
            return cls.rank0_components
        return tuple(name for name in cls.rank0_components if name != "vae")

    def _band_decode(self, pipeline, context: ParallelContext) -> ParallelVAEDecode | None:
        """This rank's share of the band-parallel VAE decode, or ``None`` where rank 0 decodes alone (one rank,
        ``vae_parallel: off``, or ``auto`` with a decoder the bands cannot run exactly)."""
        if not world_decodes(self.parallel, context.world_size):
            return None
        if self._vae_class not in BAND_DECODED_VAES:
            if self.parallel.vae_parallel == "on":
                raise ConfigError("parallel.vae_parallel", f"is on, but the parallel VAE decode runs "
                                  f"{' and '.join(BAND_DECODED_VAES)} only (this model's VAE: {self._vae_class}); "
                                  "use auto or off")  # fmt: skip
            return None
        try:
            return band_decoder(
                pipeline.vae, ranks=list(range(context.world_size)), rank=context.rank, channels=context.world_channels
            )
        except ValueError as exc:
            if self.parallel.vae_parallel == "on":
                raise ConfigError("parallel.vae_parallel", f"is on, but {exc}; use auto or off") from exc
            return None

    # ---------------------------------------------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        parallel=None,
        comm=None,
        torch_dtype=None,
        device=None,
        *,
        config: XfuseConfig | None = None,
        dtype=None,
        cache=None,
        compile=None,
        **kwargs,
    ):
        r"""
        Load a local diffusers folder of this family on every rank.

        Args:
            pretrained_model_name_or_path (`str`): local folder with `model_index.json` and the pipeline's
                components, as `save_pretrained` writes it.
            parallel ([`~xfuse.config.ParallelConfig`] or `dict`): parallel degrees, patches, warm-up, placement.
            comm ([`~xfuse.config.CommConfig`] or `dict`): backend, timeout, in-flight bound, interface.
            torch_dtype (`torch.dtype`, *optional*): float32 (default), bfloat16 or float16; `dtype=` is the same
                (the name diffusers now prefers; give one of them).
            device (`str` or `torch.device`, *optional*): `cpu` or `cuda` (default: CUDA when available; each
                rank uses `cuda:LOCAL_RANK`).
            cache ([`~xfuse.config.CacheConfig`] or `dict`, *optional*): step caching (`method`, `threshold`,
                `warmup_steps`, `max_skips`; default off).
            compile ([`~xfuse.config.CompileConfig`] or `dict`, *optional*): regional `torch.compile` of each rank's
                blocks (`mode`, `backend`, `dynamic`, `max_shapes`, `timeout_s`; default off).
            config ([`~xfuse.config.XfuseConfig`], *optional*): the whole config instead of the arguments
                above (what `xfuse generate` and `xfuse serve` pass). Every rank must hold the same: it is compared
                at start-up with the versions, model config and plan, and a difference raises on every rank.
            kwargs: passed to the diffusers pipeline's `from_pretrained` (e.g. `scheduler=`).

        Ranks other than 0 do not load the text encoders, tokenizers or VAE; every rank reads only its own
        transformer blocks from the checkpoint (`transformer/*.safetensors`).
        """
        return load_from_folder(cls, pretrained_model_name_or_path, parallel, comm, torch_dtype, device, config, dtype,
                                cache, kwargs, compile)  # fmt: skip

    @classmethod
    def from_pipe(cls, pipeline, parallel=None, comm=None, device=None, *, config: XfuseConfig | None = None,
                  cache=None, compile=None):  # fmt: skip
        """Parallelise an already loaded diffusers pipeline of this family (the same object on every rank).

        ``config``: the whole config instead of ``parallel``, ``comm``, ``cache``, ``compile`` and ``device`` (its
        ``runtime.dtype`` must be the pipeline's). The pipeline's transformer is sharded in place (blocks of other
        ranks are dropped) and ranks other than 0 drop the text encoders and VAE: do not keep using ``pipeline``
        itself afterwards.
        """
        return shard_loaded(cls, pipeline, parallel, comm, device, config, cache, compile)

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

    def trace_events(self) -> list[dict]:
        """This rank's recorded trace events (Chrome trace format) since ``enable_trace()``."""
        if self._tracer is None:
            raise ValueError("trace_events: call enable_trace() before the calls to record")
        return list(self._tracer.events)

    def write_trace(self, path: str) -> int | None:
        """Collective: merge every rank's timeline into one Chrome/Perfetto trace at ``path`` (written by global
        rank 0, which gets the number of events; the others get ``None``)."""
        if self._tracer is None:
            raise ValueError("write_trace: call enable_trace() before the calls to record")
        mine = self._tracer.metadata() + self._tracer.events
        gathered = self.collectives.gather(mine)
        return write_trace(path, gathered) if gathered is not None else None

    def local_stats(self) -> dict:
        """This rank's bytes sent in the last call by kind (``hidden``, ``skip``, ``latent``, ``cfg``), with step
        caching the last call's (steps computed, steps skipped) (``cache_steps``; every patch of a step takes its
        step's branch), its peak memory (``peak_rss_mib``: the process's peak resident memory; ``peak_cuda_mib``: the
        peak CUDA allocation) and what its part of the last call's VAE decode added at its peak (``decode_peak``:
        ``(what was measured, MiB)``, ``xfuse.runtime.peak``; ``None`` where this rank did not decode)."""
        sent: dict[str, int] = {}
        for channels in self.context.all_channels:
            for kind, nbytes in channels.counters.sent_bytes.items():
                sent[kind] = sent.get(kind, 0) + nbytes
        return dict(
            sent=sent,
            cache_steps=self._cache_counts if self.engine.cache is not None else None,
            peak_rss_mib=peak_rss_mib(),
            peak_cuda_mib=peak_cuda_mib(self.context.device) if self.context.device.type == "cuda" else None,
            decode_peak=None if self._decode_peak is None else (self._decode_peak.kind, self._decode_peak.mib),
        )

    def rank_stats(self) -> list[dict] | None:
        """Every rank's `local_stats`. Collective: call it on every rank; global rank 0 gets the list indexed by
        rank, the others ``None``."""
        return self.collectives.gather(self.local_stats())

    @property
    def decode_ranks(self) -> int:
        """The ranks the last call's VAE decode ran on (1: rank 0 alone; see ``parallel.vae_parallel``)."""
        return 1 if self._decode_shape is None else self.context.world_size

    # ------------------------------------------------------------------------------------------ the __call__ driver
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

    @torch.no_grad()
    def run_stream(
        self, calls: Sequence[dict[str, Any]], stop_if: Sequence[Callable[[], bool] | None] | None = None
    ) -> list[Any]:
        """Run several calls as one stream through the pipeline: ``calls[i]`` are the keyword arguments of one
        ``__call__``; returns what each call returns, in order (rank 0's outputs, ``None`` elsewhere).

        The calls' tasks are scheduled together (``xfuse.parallel.request_stream``): the next call's patches enter
        the first stage while the one before it drains the last, and one call's whole-image steps share the ranks
        with another's patches. Each call keeps its own scheduler (a copy taken after its timesteps are set),
        generator, latents and stale K/V, so each output is the one the call alone returns, bit for bit; the calls
        are prepared (text, latents) one after another, denoised together, then decoded one after another. Every
        rank calls it with the same calls. Calls of one size, or of several (each keeps its own buffers).

        ``stop_if`` (global rank 0, with ``enable_cancellation()`` on every rank): one condition per call (``None``:
        never stopped), asked once per step of its call as ``cancel_if``'s is; a call whose condition holds stops
        before its next step on every rank while the others run on, and its entry in the result is the
        ``RequestCancelled`` every rank gets alike (returned, not raised).

        Refused before any communication: a ControlNet, a compiled stage and sequence parallelism;
        a call of two experts (Wan 2.2) on every rank alike once the calls are prepared. Run those one at a time.
        """
        if not calls:
            raise ValueError("run_stream needs at least one call")
        if stop_if is not None and len(stop_if) != len(calls):
            raise ValueError(f"stop_if needs one condition (or None) per call: {len(stop_if)} for {len(calls)} calls")
        if stop_if is not None and self._cancellation is None:
            raise RuntimeError("run_stream's stop_if needs enable_cancellation() on every rank first")
        if self._control_blocks(self.pipeline):
            raise ValueError("run_stream does not run ControlNet pipelines: call them one at a time")
        if self.compiler is not None:
            raise ValueError("run_stream does not run compiled stages (compile.mode: off)")
        self.engine.stage.request_state_holders()  # raises where the stage cannot keep several requests
        recipes: list[CallRecipe] = []
        self._recipes = recipes
        try:
            for call in calls:
                self(**call)  # the family's own checks, then _run collects the recipe
        finally:
            self._recipes = None
        decode_shapes = []
        for recipe in recipes:
            self._check_call(recipe)
            decode_shapes.append(self._decode_shape)
        self._begin_call()
        span = self._tracer.span if self._tracer is not None else null_span
        results: list[Any] = []
        if self._cancellation is not None:
            self._cancellation.conditions = list(stop_if) if stop_if is not None else [None] * len(recipes)
        try:
            with self.context.monitor.guard(), span("call", CALL, calls=len(recipes)):
                requests = []
                for index, recipe in enumerate(recipes):
                    request, _ = self._prepare(recipe, span)
                    if not isinstance(request, DenoiseRequest):  # (on every rank alike)
                        raise ValueError(f"calls[{index}]: a request of two experts does not run in a stream")
                    request.scheduler = copy.deepcopy(request.scheduler)  # its own: the next call sets the timesteps
                    requests.append(request)
                finals = self._denoise_stream(requests)
                stopped = self.engine.stream_stopped  # the same on every rank: nothing after the loop runs for them
                for index, (recipe, final) in enumerate(zip(recipes, finals, strict=True)):
                    if index in stopped:
                        results.append(RequestCancelled(stopped[index], len(requests[index].timesteps)))
                        continue
                    self._decode_shape = decode_shapes[index]
                    results.append(self._finish(recipe, final, span))
        finally:
            if self._cancellation is not None:
                self._cancellation.conditions = None
        if self._callback_error is not None:
            raise self._callback_error
        return results

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

    # --------------------------------------------------------------------------- what the families' checks share
    def _default_size(self, height: int | None, width: int | None) -> tuple[int, int]:
        """``height``/``width``, or diffusers' default where not given (``default_sample_size * vae_scale_factor``)."""
        side = self.default_sample_size * self.spec.vae_scale_factor
        return height or side, width or side

    @staticmethod
    def _batch_size(prompt, prompt_embeds) -> int:
        """Prompts in the call, as every diffusers DiT pipeline counts them (after its ``check_inputs``)."""
        if isinstance(prompt, str):
            return 1
        return len(prompt) if isinstance(prompt, list) else prompt_embeds.shape[0]

    @staticmethod
    def _refuse(**unsupported) -> None:
        """Raise naming the first diffusers argument given a value xfuse cannot honour (each with its reason)."""
        for name, (value, default, why) in unsupported.items():
            # a tensor, array or image is never a default (comparing it would be elementwise, or ambiguous)
            plain = isinstance(value, (type(None), bool, int, float, str, tuple, list, dict))
            if value is not default and (not plain or value != default):
                raise ValueError(f"{name} is not supported by PipeFusion ({why}); leave it at {default!r}")

    def _band_decode_shape(self, recipe: CallRecipe) -> tuple[int, ...] | None:
        """The (B, C, h, w) latents (a video's (B, C, frames, h, w)) every rank decodes a band of in this call, or
        ``None`` where rank 0 decodes alone; the same on every rank, without communication (``ConfigError`` for
        ``vae_parallel: on`` with fewer latent rows than ranks)."""
        if self.band_decode is None or recipe.output_type == "latent":
            return None
        factor = self.spec.vae_scale_factor
        rows, cols = recipe.height // factor, recipe.width // factor
        video = self._vae_class in VIDEO_BAND_DECODED_VAES
        world = self.context.world_size
        if not decodes_in_parallel(self.parallel, world, recipe.height, recipe.width, rows, video=video):
            return None
        batch = recipe.batch_size * recipe.num_images_per_prompt
        return self.band_decode.latent_shape(batch, recipe.latent_frames, rows, cols)

    def _decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Rank 0: diffusers' ``vae.decode(latents, return_dict=False)[0]`` — over every rank's band of the latent
        when this call decodes in parallel (exact: ``xfuse.parallel.vae_decode``)."""
        if self._decode_shape is None:
            return self.pipeline.vae.decode(latents, return_dict=False)[0]
        if tuple(latents.shape) != self._decode_shape:
            raise RuntimeError(
                f"the latents to decode are {tuple(latents.shape)}, the ranks expect {self._decode_shape}"
            )
        return self.band_decode.decode(latents, self._decode_shape)

    def _latents_shape(self, recipe: CallRecipe) -> tuple[int, ...]:
        """The shape of the ``latents`` argument diffusers' pipeline takes for this request."""
        vae, batch = self.spec.vae_scale_factor, recipe.batch_size * recipe.num_images_per_prompt
        return (batch, self.stage.config.in_channels, recipe.height // vae, recipe.width // vae)

    # ------------------------------------------------------------------------------- the driver's steps, in order
    def _begin_call(self) -> None:
        self._interrupt, self._callback_error, self._stopped, self._steps_run = False, None, None, 0
        if self._cancellation is not None:
            self._cancellation.begin_call()
        self._decode_peak = None  # what this rank's part of the call's decode added at its peak
        self._cache_counts = (0, 0)  # (steps computed, skipped) by step caching in this call
        for channels in self.context.all_channels:
            channels.counters.reset()  # rank_stats() reports the last call

    def _grid(self, request: DenoiseRequest) -> PatchGrid:
        """The request's patch grid: the step's first patch carries the plan's streams (an MMDiT's text) through
        every block, so patches are cut by cost."""
        latents = request.latents  # (B, C, H, W) as the engine sees them (FLUX's packed tokens, a video's frames)
        lead_tokens = sum(shape[1] for shape in request.stream_shapes.values())  # (B, T, hidden) each
        height, width = latents.shape[-2:]
        return patch_grid(height, width, self.parallel.resolved_num_patches, self.stage.patch_size, lead_tokens)

    def _size_buffers(self, shape: tuple) -> None:
        """Keep the pooled receive buffers for requests of ``shape``; a new shape drops those of the last one."""
        if shape != self._buffer_shape:
            for channels in self.context.all_channels:
                channels.reset_buffers()
            self._buffer_shape = shape

    def _denoise_stream(self, requests: list[DenoiseRequest]) -> list[torch.Tensor | None]:
        """The engine's stream of ``requests`` (``PipeFusionEngine.denoise_stream``), one progress bar on rank 0."""
        grids = [self._grid(request) for request in requests]
        self._size_buffers(tuple((g.token_rows, g.token_cols, g.cost_tokens, tuple(r.latents.shape), r.latents.dtype)
                                 for g, r in zip(grids, requests, strict=True)))  # fmt: skip
        total = sum(len(request.timesteps) for request in requests)
        progress = self.pipeline.progress_bar(total=total) if self.context.is_output else None
        if progress is not None:
            for request in requests:
                request.on_progress = lambda step: progress.update()
        try:
            finals = self.engine.denoise_stream(requests, grids, self._tracer, self._cancellation)
        finally:
            if progress is not None:
                progress.close()
        self._steps_run += total
        if self.engine.cache is not None:
            self._check_cache_decisions(self.engine.stream_cache_decisions)
        return finals

    def _denoise(self, request: DenoiseRequest, engine: PipeFusionEngine | None = None):
        """The engine's (``self.engine``'s unless given) denoising loop with a progress bar on rank 0; the final
        latents on rank 0, else ``None``."""
        latents = request.latents  # (B, C, H, W) as the engine sees them (FLUX's packed tokens, a video's frames)
        grid = self._grid(request)
        shape = (grid.token_rows, grid.token_cols, grid.cost_tokens, tuple(latents.shape), latents.dtype)
        self._size_buffers(shape)  # a new request shape: drop the receive buffers sized for the last one
        # One update per step the engine runs (a second-order scheduler's steps are its timesteps).
        progress = self.pipeline.progress_bar(total=len(request.timesteps)) if self.context.is_output else None
        if progress is not None:
            request.on_progress = lambda step: progress.update()
        engine = engine or self.engine
        framed = contextlib.nullcontext()
        if self.compiler is not None:
            latents_shape = "x".join(map(str, latents.shape))
            framed = self.compiler.request(engine, shape, self._compile_bounds(), f"latents {latents_shape}")
        try:
            with framed:
                final = engine.denoise(request, grid, self._tracer, self._cancellation)
        finally:
            if progress is not None:
                progress.close()
        if engine.stopped_at is not None:  # on every rank alike: nothing after the loop runs
            self._stopped = self._steps_run + engine.stopped_at
            return None
        self._steps_run += len(request.timesteps)
        if engine.cache is not None:
            self._check_cache_decisions([engine.cache_decisions])  # two experts: two runs in one call
        return final

    def _check_cache_decisions(self, runs: list[list[bool]]) -> None:
        """Count step caching's decisions of the runs just made (each a request's, by step) and check that every
        rank of a pipeline group took the same ones (each its first task's)."""
        for decisions in runs:
            computed, skipped = _counts(decisions)
            self._cache_counts = (self._cache_counts[0] + computed, self._cache_counts[1] + skipped)
        if self.context.world_size > 1:
            gathered: list = [None] * self.context.world_size
            dist.all_gather_object(gathered, (self.context.cfg_rank, runs), group=self.context.control_group)
            for index in range(len(runs)):
                check_decisions([(group, per_run[index]) for group, per_run in gathered])

    # ------------------------------------------------------------------- what the families' requests share
    def _cfg_split(self, tensors: dict[str, torch.Tensor], half: int):
        """With ``cfg_degree: 2``: this CFG group's half of every [uncond | cond] batched tensor, and the
        ``(cfg_rank, exchange)`` pair a request uses to swap noise predictions. Otherwise the tensors as they are."""
        cfg_half = self._cfg_half()
        if cfg_half is None:
            return tensors, None
        rank = cfg_half[0]
        return {k: v[rank * half : (rank + 1) * half] for k, v in tensors.items()}, cfg_half

    def _cfg_half(self):
        """With ``cfg_degree: 2``: ``(cfg_rank, exchange)``, this CFG group's half (0: uncond, 1: cond) and how a
        request swaps noise predictions with the other group; ``None`` otherwise."""
        if self.parallel.cfg_degree == 1:
            return None
        return self.context.cfg_rank, self.collectives.cfg_exchange

    def _observer(self) -> bool:
        """Whether this rank runs step callbacks: the rank that steps the scheduler, in CFG group 0."""
        context = self.context
        return context.cfg_rank == 0 and context.pipe_rank == self.plan.output_rank and context.sp_rank == 0
