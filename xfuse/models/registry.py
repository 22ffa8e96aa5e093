"""Every model family xfuse runs, each described once by a :class:`ModelSpec` (in the spirit of torchtitan's).

A spec holds what the planner, the config checks, the cost model, ``xfuse plan`` and the CLI need to know about a
family: its diffusers classes, its long skips, the VAE scale factor, its text lengths, its presets and its default
placement. It names the family's adapter and pipeline classes by import path, so this module (like the config and
the planners that read it) imports neither torch nor diffusers. The engine, schedule and comm layer never see a spec.

Adding a family: write its adapter (``xfuse/models/<family>.py``, a ``Stage``), its pipeline class
(``xfuse/pipelines/<family>.py``, a ``PipeFusionPipelineBase``), its presets, and one ``ModelSpec`` below.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from xfuse.errors import ConfigError
from xfuse.parallel.stage_plan import StagePlan, stage_plan


def _import(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ModelSpec:
    """What xfuse knows about one family of diffusers DiTs.

    Attributes:
        name: family id (``xfuse plan`` and the README use it).
        diffusers_pipeline: the diffusers pipeline class name, as ``model_index.json``'s ``_class_name`` has it.
        diffusers_transformer: the diffusers transformer class name (``transformer/config.json``).
        pipeline: ``module:Class`` of the xfuse pipeline (a ``PipeFusionPipelineBase``).
        stage: ``module:Class`` of the adapter (the ``Stage`` the engine calls).
        presets: built-in random-weight models of this family (``model: <preset>``).
        preset_module: module with ``preset_transformer_config(name)`` and ``build_preset_pipeline(name, seed)``.
        vae_scale_factor: pixels per latent row/column (``2 ** (len(vae.block_out_channels) - 1)``).
        text_lengths: tokens the pipeline pads each text encoder's prompt to (its ``max_sequence_length``s).
        skip_pairs: ``num_layers -> ((producer, consumer), ...)``, the long skips between blocks; raises
            ``ConfigError("model", ...)`` for a block count the family cannot have.
        default_placement: used when ``parallel.placement`` is not set. Long skips: ``balanced`` (folded's route, which
            keeps the skips on-rank, with per-rank totals even to one block; where folded is already even it is
            folded's plan, elsewhere a few skips cross one rank down, and the performance model predicts it faster
            than folded at every degree); without long skips a folded route only adds hand-offs: ``linear``.
        crosses_per_patch: what one patch sends between ranks, for the README and ``xfuse plan``.
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
    """

    name: str
    diffusers_pipeline: str
    diffusers_transformer: str
    pipeline: str
    stage: str
    presets: tuple[str, ...]
    preset_module: str
    vae_scale_factor: int
    text_lengths: tuple[int, ...]
    skip_pairs: Callable[[int], tuple[tuple[int, int], ...]]
    default_placement: str
    crosses_per_patch: str
    num_blocks: Callable[[dict], int] = lambda config: config["num_layers"]
    packing: int = 1
    streams: tuple[str, ...] = ()
    distilled_guidance: bool = False
    native_side: Callable[[dict], int] | None = None
    attentions_of_block: Callable[[dict, int], int] = lambda config, block: 1
    resolution_binning: bool = False

    @property
    def latent_scale(self) -> int:
        """Pixels per row (and column) of the latent the engine steps: the VAE factor times the packing."""
        return self.vae_scale_factor * self.packing

    def default_side(self, config: dict) -> int:
        """Pixels of the default image side for a transformer ``config`` (diffusers' ``default_sample_size``)."""
        if self.native_side is not None:
            return self.native_side(config)
        return config["sample_size"] * self.vae_scale_factor

    def placement(self, parallel) -> str:
        """``parallel.placement``, or this family's default when it is not set."""
        return parallel.placement or self.default_placement

    def plan(self, num_layers: int, parallel) -> StagePlan:
        """The stage plan of a ``num_layers``-block model of this family under ``parallel`` (a ParallelConfig)."""
        skips = self.skip_pairs(num_layers)
        return stage_plan(
            num_layers,
            parallel.pipefusion_degree,
            self.placement(parallel),
            parallel.stage_split,
            skips=skips,
            streams=self.streams,
        )

    def pipeline_class(self):
        """The xfuse pipeline class (imports torch and diffusers)."""
        return _import(self.pipeline)

    def stage_class(self):
        """The adapter class (imports torch and diffusers)."""
        return _import(self.stage)

    def preset_transformer_config(self, preset: str) -> dict:
        return importlib.import_module(self.preset_module).preset_transformer_config(preset)

    def build_preset_pipeline(self, preset: str, seed: int = 0):
        return importlib.import_module(self.preset_module).build_preset_pipeline(preset, seed)


def no_skips(num_layers: int) -> tuple[tuple[int, int], ...]:
    """Families whose blocks are a plain chain."""
    return ()


def hunyuandit_skip_pairs(num_layers: int) -> tuple[tuple[int, int], ...]:
    """(producer, consumer) pairs of HunyuanDiT's long skips, as ``HunyuanDiT2DModel.forward`` wires them: block
    ``k < B/2 - 1`` feeds block ``B-1-k``."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 2 or num_layers % 2:
        raise ConfigError(
            "model",
            f"has {num_layers} transformer blocks; HunyuanDiT's long skips pair block k with block N-1-k, so it "
            f"needs an even block count >= 2 (got num_layers={num_layers!r})",
        )
    half = num_layers // 2
    return tuple((k, num_layers - 1 - k) for k in range(half - 1))


HUNYUANDIT = ModelSpec(
    name="hunyuandit",
    diffusers_pipeline="HunyuanDiTPipeline",
    diffusers_transformer="HunyuanDiT2DModel",
    pipeline="xfuse.pipelines.hunyuandit:PipeFusionHunyuanDiTPipeline",
    stage="xfuse.models.hunyuandit:HunyuanDiTStage",
    presets=("tiny", "small", "bytes40", "dit-g2"),
    preset_module="xfuse.models.tiny",
    vae_scale_factor=8,  # the SDXL AutoencoderKL: 4 levels, 3 downsamplings
    text_lengths=(77, 256),  # BERT, mT5
    skip_pairs=hunyuandit_skip_pairs,
    default_placement="balanced",
    resolution_binning=True,
    crosses_per_patch="hidden states at each hand-off; with linear placement also the long skips that cross ranks "
    "and the stepped latent rows back to rank 0; with balanced placement the few long skips its even split cannot "
    "keep on one rank (at most one per pair of neighbouring ranks, with the return hand-off)",
)

PIXART_SIGMA = ModelSpec(
    name="pixart-sigma",
    diffusers_pipeline="PixArtSigmaPipeline",
    diffusers_transformer="PixArtTransformer2DModel",
    pipeline="xfuse.pipelines.pixart:PipeFusionPixArtSigmaPipeline",
    stage="xfuse.models.pixart:PixArtStage",
    presets=("pixart-tiny",),
    preset_module="xfuse.models.tiny_pixart",
    vae_scale_factor=8,
    text_lengths=(300,),  # T5 (PixArtSigmaPipeline's default max_sequence_length)
    skip_pairs=no_skips,
    default_placement="linear",
    resolution_binning=True,
    crosses_per_patch="hidden states at each hand-off; with linear placement the stepped latent rows back to rank 0 "
    "(the T5 text is static: projected once per request on every rank)",
)

STABLE_DIFFUSION_3 = ModelSpec(
    name="sd3",
    diffusers_pipeline="StableDiffusion3Pipeline",
    diffusers_transformer="SD3Transformer2DModel",
    pipeline="xfuse.pipelines.sd3:PipeFusionStableDiffusion3Pipeline",
    stage="xfuse.models.sd3:SD3Stage",
    presets=("sd3-tiny", "sd35-tiny", "sd3-small", "sd3-medium", "sd3.5-medium", "sd3.5-large"),
    preset_module="xfuse.models.tiny_sd3",
    vae_scale_factor=8,
    text_lengths=(77, 256),  # CLIP-L and CLIP-G (side by side, one sequence), T5 (max_sequence_length)
    skip_pairs=no_skips,
    default_placement="linear",
    crosses_per_patch="hidden states at each hand-off, plus the text stream (B, 77 + T5 tokens, hidden) with the "
    "step's first patch only (it owns the text update; later patches reuse its text K/V); with linear placement "
    "the stepped latent rows back to rank 0",
    streams=("text",),
    # SD3.5-medium's blocks listed in dual_attention_layers add an image-only self-attention (attn2)
    attentions_of_block=lambda config, block: 2 if block in (config.get("dual_attention_layers") or ()) else 1,
)


def _flux_blocks(config: dict) -> int:
    """FLUX's double-stream blocks (``num_layers``) then its single-stream blocks, indexed as one chain."""
    return config["num_layers"] + config["num_single_layers"]


FLUX = ModelSpec(
    name="flux",
    diffusers_pipeline="FluxPipeline",
    diffusers_transformer="FluxTransformer2DModel",
    pipeline="xfuse.pipelines.flux:PipeFusionFluxPipeline",
    stage="xfuse.models.flux:FluxStage",
    presets=("flux-tiny", "flux-small", "flux-dev", "flux-schnell"),
    preset_module="xfuse.models.tiny_flux",
    vae_scale_factor=8,
    text_lengths=(512,),  # T5 (max_sequence_length); the CLIP prompt gives only the pooled vector
    skip_pairs=no_skips,
    default_placement="linear",
    crosses_per_patch="hidden states at each hand-off, plus the text stream (B, T5 tokens, hidden) with the step's "
    "first patch only (it owns the text update; later patches reuse its text K/V); with linear placement the "
    "stepped packed latent rows back to rank 0",
    num_blocks=_flux_blocks,
    packing=2,
    streams=("text",),
    distilled_guidance=True,
    native_side=lambda config: 128 * 8,  # FluxPipeline.default_sample_size x its VAE factor
)

MODEL_SPECS: dict[str, ModelSpec] = {spec.name: spec for spec in (HUNYUANDIT, PIXART_SIGMA, STABLE_DIFFUSION_3, FLUX)}
PRESET_MODELS: dict[str, ModelSpec] = {preset: spec for spec in MODEL_SPECS.values() for preset in spec.presets}
# Trained models shipped inside the package (diffusers folders): ``model: shapes`` is that folder. Both are trained
# on xfuse.shapes' captioned scenes by scripts/train_tiny.py, on one VAE: ``shapes`` a HunyuanDiT (its folder also
# holds the attribute classifier), ``shapes-pixart`` a PixArt-Σ.
SHIPPED_MODELS: dict[str, str] = {
    name: os.path.join(os.path.dirname(os.path.abspath(__file__)), name) for name in ("shapes", "shapes-pixart")
}


def resolve_model(model: str) -> str:
    """A shipped model's folder for its name; any other ``model`` (a preset or a folder) unchanged."""
    return SHIPPED_MODELS.get(model, model)


_BY_PIPELINE = {spec.diffusers_pipeline: spec for spec in MODEL_SPECS.values()}


def model_spec(model: str) -> ModelSpec:
    """The family of ``model``: a preset name, or a local diffusers folder (from its ``model_index.json``)."""
    if model in PRESET_MODELS:
        return PRESET_MODELS[model]
    model = resolve_model(model)
    index = os.path.join(model, "model_index.json")
    families = ", ".join(f"{s.diffusers_pipeline} ({s.name})" for s in MODEL_SPECS.values())
    if not os.path.isfile(index):
        raise ConfigError(
            "model",
            f"must be one of the presets {', '.join(PRESET_MODELS)}, a shipped model ({', '.join(SHIPPED_MODELS)}) "
            "or a local diffusers folder with "
            f"model_index.json of one of {families} (not found: {index!r})",
        )
    with open(index) as f:
        class_name = json.load(f).get("_class_name")
    if class_name not in _BY_PIPELINE:
        raise ConfigError(
            "model",
            f"{model!r} is a {class_name} folder; xfuse runs {families} (got _class_name={class_name!r})",
        )
    return _BY_PIPELINE[class_name]


def transformer_config(model: str) -> dict:
    """The transformer config of ``model`` without loading weights (a preset name or a local folder)."""
    spec = model_spec(model)
    if model in PRESET_MODELS:
        return spec.preset_transformer_config(model)
    model = resolve_model(model)
    path = os.path.join(model, "transformer", "config.json")
    if not os.path.isfile(path):
        raise ConfigError("model", f"{model!r} has no transformer/config.json (not found: {path!r})")
    with open(path) as f:
        return json.load(f)


def load_pipeline(model: str, torch_dtype=None):
    """The family's diffusers pipeline on CPU: built from a preset, or loaded from a local folder."""
    spec = model_spec(model)
    if model in PRESET_MODELS:
        import torch

        pipe = spec.build_preset_pipeline(model)  # built in float32
        return pipe if torch_dtype in (None, torch.float32) else pipe.to(dtype=torch_dtype)
    import diffusers

    return getattr(diffusers, spec.diffusers_pipeline).from_pretrained(
        resolve_model(model), torch_dtype=torch_dtype, local_files_only=True
    )
