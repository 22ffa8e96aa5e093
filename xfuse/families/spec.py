"""``ModelSpec``: what xfuse knows about one family of diffusers DiTs (in the spirit of torchtitan's ``ModelSpec``).

Each family folder (``xfuse/families/<name>/spec.py``) writes its spec beside the code it names; the registry
(``xfuse.families.registry``) collects them. A spec holds what the planner, the request checks, the cost model,
``xfuse plan`` and the CLI need to know about a family: its diffusers classes, its long skips, the VAE scale factor,
its text lengths, its presets and its default placement. A spec is facts only and imports none of its family's code:
it finds the family's adapter, pipeline and preset builders by convention in its own package (``stage.py``,
``pipeline.py``, ``presets.py``, ``controlnet.py``), imported by name on first use. So nothing a family folder holds
imports back through its spec, reading a spec (the config, the planners, ``xfuse plan``) imports neither torch nor
diffusers, and the engine, schedule and comm layer never see one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from types import ModuleType
from typing import Any

from xfuse.errors import ConfigError
from xfuse.families.generic.forward_plan import ForwardPlan
from xfuse.parallel.control import control_split
from xfuse.parallel.patch_grid import check_sequence_chunks, patch_grid
from xfuse.parallel.stage_plan import StagePlan, stage_plan
from xfuse.runtime.heap import collector_paused


@cache
def _forward_stage(spec: ModelSpec) -> type:
    """One ``ForwardStage`` class per spec, found by name as a family's own modules are (``ModelSpec._module``)."""
    with collector_paused():
        return importlib.import_module("xfuse.families.generic.stage").forward_stage(spec)


def no_skips(num_blocks: int) -> tuple[tuple[int, int], ...]:
    """Families whose blocks are a plain chain."""
    return ()


@dataclass(frozen=True)
class ModelSpec:
    """What xfuse knows about one family of diffusers DiTs.

    Attributes:
        name: family id (``xfuse plan`` and the docs use it).
        diffusers_pipeline: the diffusers pipeline class name, as ``model_index.json``'s ``_class_name`` has it.
        diffusers_transformer: the diffusers transformer class name (``transformer/config.json``).
        package: the family's package (``__package__`` of its ``spec.py``), which holds ``pipeline.py`` (the xfuse
            pipeline classes, named ``PipeFusion`` + diffusers' names), ``stage.py`` (the adapter), ``presets.py``
            (``preset_transformer_config(name)``, ``build_preset_pipeline(name, seed)``,
            ``save_preset_pipeline(path, name, seed)``) and, with a ControlNet pipeline, ``controlnet.py``.
        stage_name: the adapter class in ``stage.py`` (the ``Stage`` the engine calls); ``None``: the family has no
            hand-written stage, its stage is the generic one (``forward``, which it must then have).
        modular_denoise: the denoise steps of diffusers' modular pipelines for this transformer (``FluxDenoiseStep``;
            Wan's of 2.1 and of 2.2's two experts) that ``xfuse.parallelize`` replaces with xfuse's loop; the family's
            ``modular.py`` maps such a step's block state to the engine's request (empty: no modular pipeline).
        hand_written: why the family keeps a hand-written stage (``stage_name``), in one line: what the generic family
            cannot run of it (``docs/models.md`` lists them); ``None`` exactly where ``stage_name`` is.
        presets: built-in random-weight models of this family (``model: <preset>``); the first is the smallest, the
            one the conformance suite (``tests/multirank/test_conformance.py``) runs the family's contract on.
        vae_scale_factor: pixels per latent row/column (``2 ** (len(vae.block_out_channels) - 1)``).
        text_lengths: tokens the pipeline pads each text encoder's prompt to (its ``max_sequence_length``s); with
            ``text_padded`` False, the most a prompt may have.
        cfg_above: ``guidance_scale`` above this batches [uncond, cond] (diffusers' ``do_classifier_free_guidance``:
            ``> 1``; ZImagePipeline's ``> 0``).
        negative_prompt_guides: the pipeline's classifier-free guidance is true CFG whose default scale is above 1
            (Qwen-Image's ``true_cfg_scale`` 4.0): a request with a negative prompt batches [negative, positive],
            one without does not, whatever ``guidance_scale`` (``cfg_batch``).
        text_padded: the pipeline pads every prompt to ``text_lengths`` (False: a prompt keeps its own length, as
            Qwen-Image's; prompts of different lengths in one batch are padded to the longest and masked).
        skip_pairs: ``num_blocks -> ((producer, consumer), ...)``, the long skips between blocks; raises
            ``ConfigError("model", ...)`` for a block count the family cannot have.
        default_placement: used when ``parallel.placement`` is not set. Long skips: ``balanced`` (folded's route, which
            keeps the skips on-rank, with per-rank totals even to one block; where folded is already even it is
            folded's plan, elsewhere a few skips cross one rank down, and the performance model predicts it faster
            than folded at every degree); without long skips a folded route only adds hand-offs: ``linear``.
        crosses_per_patch: what one patch sends between ranks, for the docs and ``xfuse plan``.
        num_blocks: ``transformer config -> number of blocks`` the plan places (FLUX: double + single blocks).
        packing: latent pixels per side the pipeline folds into one transformer input token before the model
            (FLUX packs 2x2 latents; the engine's latent grid is then ``vae_scale_factor * packing`` px per row).
        streams: hand-off tensors a step's first patch carries besides the hidden state (an MMDiT's text stream;
            its length is ``sum(text_lengths)`` at the defaults).
        distilled_guidance: ``guidance_scale`` never batches [uncond, cond] (FLUX.1-dev embeds it, schnell ignores
            it; their CFG is ``true_cfg_scale``): the transformer batch is not doubled by it.
        native_side: ``transformer config -> pixels`` of the default image side (what the diffusers pipeline
            uses when no size is given).
        resolution_binning: the diffusers pipeline takes ``use_resolution_binning`` (the CLI and serve turn it off).
        attentions_of_block: ``(transformer config, block) -> `` the attention modules in that block that mix
            image tokens, each holding a whole-image K/V buffer (SD3.5's dual-attention blocks have 2).
        block_flops: ``(transformer config, block, queries, keys, text, text_queries) -> `` FLOPs of that block for
            one batch element on a pass of ``queries`` image tokens attending to ``keys`` image tokens and the
            prompt's ``text`` tokens (``text_queries``: an MMDiT's text stream is computed in this pass; the step's
            first patch), as ``xfuse.families.common.flops`` counts them. The performance model costs tasks by it.
        vae_temporal_factor: video frames per latent frame (1: an image family; Wan: 4, and its pipeline takes
            ``num_frames`` = 4k + 1). The engine sees a video's latent frames stacked as one tall image
            (``xfuse.parallel.video_layout``).
        native_frames: frames of the diffusers pipeline's default clip (``num_frames``; 1 for an image family).
        native_width: pixels of the pipeline's default width where it is not its default height (Wan: 832).
        token_patch: ``transformer config -> `` latent rows (and columns) per token, the engine's patch size
            (Wan's ``patch_size`` is (1, p, p): p).
        num_heads: ``transformer config -> `` attention heads (``num_attention_heads``; Z-Image's ``n_heads``).
        width: ``transformer config -> `` the hidden states' width, heads x head dim (Z-Image's ``dim``).
        image_to_video: the diffusers pipeline of the family's image-to-video on the same transformers, which xfuse
            also runs (Wan: ``WanImageToVideoPipeline``, for Wan 2.2 TI2V); its xfuse class (``PipeFusion`` + the
            name) is in ``pipeline.py`` too.
        vae_factor_key: the VAE config's field holding its spatial factor, for a family whose releases use VAEs of
            different factors (``AutoencoderKLWan``'s ``scale_factor_spatial``: 8 for Wan 2.1's VAE, 16 for Wan
            2.2's, as ``WanPipeline`` reads it); ``vae_scale_factor`` is then the factor of a pipeline without a VAE.
            ``for_vae`` gives the spec of one model.
        controlnet: the diffusers ControlNet pipeline on the family's transformer (``FluxControlNetPipeline``), which
            xfuse also runs; its xfuse class (``PipeFusion`` + the name) is in ``controlnet.py``.
        control_samples: ``(transformer config, ControlNet config) -> {block: residual}``: which of a ControlNet's
            residuals each transformer block adds (its transformer forward's ``interval_control`` rule); the
            ControlNet config needs only its block counts (``num_layers``, FLUX's ``num_single_layers``).
        forward: how the generic family runs the transformer's own forward (``xfuse.families.generic``): the family
            can run as a ``ForwardStage`` (``forward_stage_class``) with no hand-written stage; ``None``: it cannot.
    """

    name: str
    diffusers_pipeline: str
    diffusers_transformer: str
    package: str
    stage_name: str | None
    presets: tuple[str, ...]
    vae_scale_factor: int
    text_lengths: tuple[int, ...]
    skip_pairs: Callable[[int], tuple[tuple[int, int], ...]]
    default_placement: str
    crosses_per_patch: str
    block_flops: Callable[[dict, int, int, int, int, bool], float]
    num_blocks: Callable[[dict], int] = lambda config: config["num_layers"]
    packing: int = 1
    streams: tuple[str, ...] = ()
    distilled_guidance: bool = False
    cfg_above: float = 1.0
    negative_prompt_guides: bool = False
    text_padded: bool = True
    native_side: Callable[[dict], int] | None = None
    attentions_of_block: Callable[[dict, int], int] = lambda config, block: 1
    resolution_binning: bool = False
    vae_temporal_factor: int = 1
    native_frames: int = 1
    native_width: int | None = None
    token_patch: Callable[[dict], int] = lambda config: config["patch_size"]
    num_heads: Callable[[dict], int] = lambda config: config["num_attention_heads"]
    width: Callable[[dict], int] = lambda config: config["num_attention_heads"] * config["attention_head_dim"]
    vae_factor_key: str | None = None
    image_to_video: str | None = None
    controlnet: str | None = None
    control_samples: Callable[[dict, dict], dict[int, int]] | None = None
    forward: ForwardPlan | None = None
    hand_written: str | None = None
    modular_denoise: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.stage_name is None and self.forward is None:
            raise ValueError(f"the {self.name} family needs a stage: a stage_name or a ForwardPlan (forward)")
        if (self.stage_name is None) != (self.hand_written is None):
            raise ValueError(f"the {self.name} family's hand-written stage needs its reason (hand_written), in one "
                             "line, and only a hand-written stage has one")  # fmt: skip

    @property
    def pipeline_name(self) -> str:
        """The xfuse class's name: ``PipeFusion`` + diffusers' pipeline name (``from xfuse import <it>``)."""
        return f"PipeFusion{self.diffusers_pipeline}"

    @property
    def diffusers_pipelines(self) -> tuple[str, ...]:
        """The diffusers pipelines xfuse runs for this family: its own, its image-to-video, its ControlNet's."""
        return tuple(name for name in (self.diffusers_pipeline, self.image_to_video, self.controlnet) if name)

    @property
    def pipeline_names(self) -> tuple[str, ...]:
        """The xfuse classes of this family (``from xfuse import <name>``): its pipeline's, then its image-to-video
        and ControlNet pipelines'."""
        return tuple(f"PipeFusion{name}" for name in self.diffusers_pipelines)

    def _module(self, name: str) -> ModuleType:
        """The family's module ``name`` (``pipeline``, ``stage``, ``presets``, ``controlnet``), imported on first use
        (torch and diffusers with it, without the garbage collector's passes over them: ``collector_paused``)."""
        with collector_paused():
            return importlib.import_module(f"{self.package}.{name}")

    def modular(self) -> ModuleType:
        """The family's ``modular.py``: what ``xfuse.parallelize`` runs a modular pipeline's denoise step by."""
        return self._module("modular")

    def pipeline_class(self) -> type:
        """The xfuse pipeline class (a ``PipeFusionPipelineBase``): ``pipeline_name`` in ``pipeline.py``."""
        return self.pipeline_class_named(self.pipeline_name)

    def pipeline_class_named(self, name: str) -> type:
        """The xfuse class ``name`` (one of ``pipeline_names``): the ControlNet pipeline's from ``controlnet.py``, the
        others from ``pipeline.py``."""
        if name not in self.pipeline_names:
            raise ValueError(f"{name!r} is not a pipeline of the {self.name} family ({', '.join(self.pipeline_names)})")
        module = "controlnet" if self.controlnet is not None and name == f"PipeFusion{self.controlnet}" else "pipeline"
        return getattr(self._module(module), name)

    def stage_class(self) -> type:
        """The adapter class (the ``Stage`` the engine calls): ``stage_name`` in the family's ``stage.py``, or the
        generic one (``forward_stage_class``) for a family without a hand-written stage."""
        if self.stage_name is None:
            return self.forward_stage_class()
        return getattr(self._module("stage"), self.stage_name)

    def forward_stage_class(self) -> type:
        """The generic family's ``Stage`` for this family's transformer: a ``ForwardStage`` reading ``forward``."""
        if self.forward is None:
            raise ValueError(f"the {self.name} family has no ForwardPlan: it runs only its hand-written stage")
        return _forward_stage(self)

    def runs_generic(self, parallel) -> bool:
        """Whether a rank's share runs as the generic family's stage under ``parallel`` (a ParallelConfig): asked for
        (``parallel.adapter: generic``), or the family's only stage (no hand-written one)."""
        return parallel.adapter == "generic" or self.stage_name is None

    def adapter_class(self, parallel) -> type:
        """The ``Stage`` class of a rank's share under ``parallel``: the family's own stage, or the generic family's
        (``forward_stage_class``) where it ``runs_generic``."""
        return self.forward_stage_class() if self.runs_generic(parallel) else self.stage_class()

    def check_adapter(self, config, controlnet: bool = False) -> None:
        """Raise :class:`ConfigError` where ``config`` (an XfuseConfig) asks the generic stage (``runs_generic``) of
        what it does not run: a family without a ``ForwardPlan``, compiled passes or a ControlNet (``controlnet``),
        naming the key to change (``parallel.adapter``; ``compile.mode`` for a family whose only stage is the generic
        one). Run at load, before any communication, the same on every rank."""
        parallel = config.parallel
        if not self.runs_generic(parallel):
            return
        if self.forward is None:
            why = f"the {self.name} family has no ForwardPlan (its spec says how the generic adapter runs its forward)"
        elif config.compile.enabled:
            if self.stage_name is None:
                raise ConfigError("compile.mode", f"must be 'off' for the {self.name} family: its only stage is the "
                                  f"generic one, whose passes run eagerly (got {config.compile.mode!r})")  # fmt: skip
            why = "the generic adapter runs its passes eagerly (compile.mode off)"
        elif controlnet:
            why = "the generic adapter adds no ControlNet residuals"
        else:
            return
        raise ConfigError("parallel.adapter", f"must be 'family' here: {why} (got {parallel.adapter!r})")

    @property
    def compiles(self) -> bool:
        """Whether ``compile.mode`` can compile the family's own stage: a hand-written one; the generic family's
        passes run eagerly (``check_adapter`` refuses compiling them by name)."""
        return self.stage_name is not None

    def preset_builders(self) -> ModuleType:
        """The family's ``presets.py``."""
        return self._module("presets")

    def for_vae(self, vae_config: dict | None) -> ModelSpec:
        """This spec for a model whose VAE has ``vae_config`` (``None``: no VAE): the same spec, or one with the
        VAE's own spatial factor where the family reads it from the VAE (``vae_factor_key``)."""
        factor = None if vae_config is None or self.vae_factor_key is None else vae_config.get(self.vae_factor_key)
        if factor is None or factor == self.vae_scale_factor:
            return self
        return replace(self, vae_scale_factor=int(factor))

    def cfg_batch(self, guidance_scale: float, negative_prompt: str | None) -> int:
        """The transformer batch per image of a request that ``xfuse generate`` or ``xfuse serve`` makes (they pass
        ``guidance_scale`` and the negative prompt, never ``true_cfg_scale``): 2 where the pipeline batches
        [uncond, cond] (``guidance_scale > cfg_above``; none for an embedded guidance; a negative prompt where it
        turns on true CFG), else 1."""
        if self.negative_prompt_guides:
            return 2 if negative_prompt is not None else 1
        return 2 if guidance_scale > self.cfg_above and not self.distilled_guidance else 1

    @property
    def latent_scale(self) -> int:
        """Pixels per row (and column) of the latent the engine steps: the VAE factor times the packing."""
        return self.vae_scale_factor * self.packing

    def default_side(self, config: dict) -> int:
        """Pixels of the default image side for a transformer ``config`` (diffusers' ``default_sample_size``)."""
        if self.native_side is not None:
            return self.native_side(config)
        return config["sample_size"] * self.vae_scale_factor

    def default_width(self, config: dict) -> int:
        """Pixels of the default image width: the default side, or a video pipeline's own (Wan: 832 x 480)."""
        return self.native_width if self.native_width is not None else self.default_side(config)

    def placement(self, parallel) -> str:
        """``parallel.placement``, or this family's default when it is not set."""
        return parallel.placement or self.default_placement

    def plan(self, num_blocks: int, parallel, control_blocks: int = 0) -> StagePlan:
        """The stage plan of a ``num_blocks``-block model of this family under ``parallel`` (a ParallelConfig).
        ``control_blocks``: a ControlNet of that many blocks runs on the embedding rank; a linear plan without a
        ``stage_split`` then gives that rank as many fewer transformer blocks (``xfuse.parallel.control``)."""
        placement, split = self.placement(parallel), parallel.stage_split
        degree = parallel.pipefusion_degree
        if control_blocks and split is None and placement == "linear" and 1 < degree <= num_blocks:
            split = control_split(num_blocks, degree, control_blocks)
        return stage_plan(num_blocks, degree, placement, split, skips=self.skip_pairs(num_blocks), streams=self.streams)

    def latent_frames(self, num_frames: int | None) -> int:
        """Latent frames of a ``num_frames`` clip (``None``: the pipeline's default; an image family: 1): the VAE keeps
        the first frame and folds every ``vae_temporal_factor`` after it into one."""
        frames = self.native_frames if num_frames is None else num_frames
        return (frames - 1) // self.vae_temporal_factor + 1

    def pixel_frames(self, latent_frames: int) -> int:
        """Frames the VAE decodes ``latent_frames`` into (the inverse of :meth:`latent_frames` on ``4k + 1``)."""
        return (latent_frames - 1) * self.vae_temporal_factor + 1

    def check_num_frames(self, num_frames, key: str = "num_frames") -> None:
        """Raise :class:`ConfigError` naming ``key`` for a ``num_frames`` this family's VAE cannot take (Wan: 4k + 1;
        diffusers rounds it with a warning instead)."""
        step = self.vae_temporal_factor
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1 or num_frames % step != 1:
            below = max(1, (num_frames - 1) // step * step + 1) if isinstance(num_frames, int) else 1
            raise ConfigError(
                key,
                f"must be {step}k + 1 ({self.diffusers_pipeline}'s VAE keeps the first frame and folds every {step} "
                f"after it into one latent frame), e.g. {below} or {below + step} (got {num_frames!r})",
            )

    @property
    def video(self) -> bool:
        """Whether the family generates video (its pipeline takes ``num_frames`` and returns ``frames``)."""
        return self.vae_temporal_factor > 1

    def check_layout(
        self,
        parallel,
        *,
        num_blocks: int,
        patch_size: int,
        height: int,
        width: int,
        num_heads: int | None = None,
        latent_frames: int = 1,
    ) -> None:
        """Check that this family runs ``parallel`` (a ParallelConfig) on a ``num_blocks``-block model with
        ``num_heads`` attention heads for a ``height`` x ``width`` px image (a video: ``latent_frames`` of them, which
        the engine stacks into one image); raise :class:`ConfigError` naming the key otherwise.

        Run before any communication, the same on every rank (the world size is ``xfuse.runtime.world``'s check).
        The block placement and the patch grid are validated by the pure planners themselves.
        """
        self.skip_pairs(num_blocks)  # the family's own rule on its block count
        multiple = self.latent_scale * patch_size
        packing = f" x packing {self.packing}" if self.packing > 1 else ""
        for name, value in (("height", height), ("width", width)):
            if isinstance(value, bool) or not isinstance(value, int) or value < multiple or value % multiple:
                lower = max(multiple, (value // multiple) * multiple) if isinstance(value, int) else multiple
                raise ConfigError(
                    f"generation.{name}",
                    f"must be a positive multiple of {multiple} pixels (VAE factor {self.vae_scale_factor}{packing} "
                    f"x patch size {patch_size}), e.g. {lower} or {lower + multiple} (got {value!r})",
                )
        self.plan(num_blocks, parallel)
        grid = patch_grid(
            latent_frames * (height // self.latent_scale),
            width // self.latent_scale,
            parallel.resolved_num_patches,
            patch_size,
        )
        ulysses = parallel.ulysses_degree
        if num_heads is not None and ulysses > num_heads:
            raise ConfigError(
                "parallel.ulysses_degree",
                f"must be at most the model's {num_heads} attention heads (each Ulysses rank attends with at least "
                f"one of them; a degree that does not divide them gives some ranks one head more), or use "
                f"parallel.ring_degree (got {ulysses})",
            )
        check_sequence_chunks(grid, ulysses, parallel.ring_degree)

    def preset_transformer_config(self, preset: str) -> dict:
        return self.preset_builders().preset_transformer_config(preset)

    def build_preset_pipeline(self, preset: str, seed: int = 0) -> Any:
        return self.preset_builders().build_preset_pipeline(preset, seed)

    def save_preset_pipeline(self, path: str, preset: str, seed: int = 0) -> str:
        """Build preset ``preset`` and ``save_pretrained`` it as a diffusers folder at ``path``."""
        return self.preset_builders().save_preset_pipeline(path, preset, seed)
