"""``PipeFusionPipelineBase``: what every family's PipeFusion pipeline shares under torchrun.

Every rank runs the same script. Global rank 0 keeps the text encoders, tokenizers, VAE and safety checker; it
encodes the prompts and broadcasts the embeddings, and it decodes and returns the images. Every rank loads and keeps
only the transformer blocks of its stage. This class builds a loaded pipeline (the model's handshake, the stage, its
compiler, the engine, this rank's share of the decode) and holds what the families' checks and requests share; its
mixins hold the rest, one concern a module: ``loading`` (``from_pretrained`` / ``from_pipe``), ``call_driver`` (the one
``__call__`` driver, ``_run``, that puts the call's steps in order), ``denoising`` (the engine's loop), ``stream``
(``run_stream``), ``cancellation`` and ``observability`` (traces and statistics); beside them ``collectives`` (rank 0's
broadcasts and gathers, the shared generator, the CFG exchange) and ``callbacks`` (diffusers'
``callback_on_step_end``). A family's subclass holds its diffusers ``__call__`` signature and argument checks, and hands
``_run`` a :class:`~xfuse.pipelines.call_driver.CallRecipe`: how to encode its prompts, set its timesteps, draw its
latents, build the engine's request and decode.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from xfuse.config import (
    CommConfig,
    ParallelConfig,
    XfuseConfig,
)
from xfuse.errors import ConfigError
from xfuse.families.spec import ModelSpec
from xfuse.parallel.cancellation import Cancellation
from xfuse.parallel.engine import PipeFusionEngine
from xfuse.parallel.sequence import SequenceParallel
from xfuse.parallel.sequence_stage import SequenceParallelStage
from xfuse.parallel.trace import Tracer
from xfuse.parallel.vae_decode import (
    BAND_DECODED_VAES,
    VIDEO_BAND_DECODED_VAES,
    ParallelVAEDecode,
    decodes_in_parallel,
    world_decodes,
)
from xfuse.parallel.video_vae_decode import band_decoder
from xfuse.pipelines.call_driver import CallDriverMixin, CallRecipe
from xfuse.pipelines.cancellation import CancellationMixin
from xfuse.pipelines.collectives import Collectives
from xfuse.pipelines.denoising import DenoisingMixin
from xfuse.pipelines.loading import LoadingMixin
from xfuse.pipelines.observability import ObservabilityMixin
from xfuse.pipelines.stage_compiler import StageCompiler
from xfuse.pipelines.stream import StreamMixin
from xfuse.pipelines.text_placement import place_text_encoders, text_components
from xfuse.pipelines.text_placement import text_placement as resolve_text_placement
from xfuse.runtime.compile_cache import CompileCache
from xfuse.runtime.handshake import config_hash, handshake
from xfuse.runtime.peak import PhasePeak
from xfuse.runtime.world import ParallelContext


class PipeFusionPipelineBase(
    LoadingMixin, CallDriverMixin, StreamMixin, DenoisingMixin, CancellationMixin, ObservabilityMixin
):
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
        stage_class = self.spec.adapter_class(self.parallel)
        self.stage = (stage or stage_class(pipeline.transformer, self.plan, context.pipe_rank)).to(context.device)
        pipeline.transformer = None  # the stage owns what is left of it
        self.compiler: StageCompiler | None = None  # any compile.mode but off
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
        """``compile.mode``'s compiler of this rank's stage, with ``compile.cache_dir``'s folder for this
        torch, model, dtype, device, backend and ``dynamic``."""
        section, cache = self.config.compile, None
        if section.cache_dir is not None:
            cache = CompileCache(section.cache_dir, torch=torch.__version__, family=self.spec.name,
                                 model_config_hash=model_config_hash, dtype=str(dtype),
                                 device=self.context.device.type, backend=section.backend,
                                 dynamic=section.dynamic)  # fmt: skip
        monitor, patches = self.context.monitor, self.parallel.resolved_num_patches
        return StageCompiler(section, self.context.rank, monitor, patches, cache, self.context.device)

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
        if self.compiler is not None:  # the graph modes: each pass after a request's first of its kind one graph
            engine_stage = self.compiler.engine_stage(engine_stage)
        return PipeFusionEngine(
            engine_stage,
            self.plan,
            context.channels,
            pipe_rank=context.pipe_rank,
            group_ranks=context.pipe_ranks,
            warmup_steps=self.parallel.warmup_steps,
            max_inflight=self.comm.max_inflight,
            cache=self.config.cache,
            host_deadline=context.host_deadline,
        )

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

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def scheduler(self):
        return self.pipeline.scheduler

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    def set_progress_bar_config(self, **kwargs) -> None:
        self.pipeline.set_progress_bar_config(**kwargs)

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
