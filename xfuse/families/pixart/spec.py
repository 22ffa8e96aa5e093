"""PixArt-Σ's ``ModelSpec``: the facts xfuse's planner, checks and CLI read, written beside the family's code."""

from __future__ import annotations

from types import ModuleType

from xfuse.families.spec import ModelSpec, no_skips


def _pipeline_class() -> type:
    from xfuse.families.pixart.pipeline import PipeFusionPixArtSigmaPipeline

    return PipeFusionPixArtSigmaPipeline


def _stage_class() -> type:
    from xfuse.families.pixart.stage import PixArtStage

    return PixArtStage


def _preset_builders() -> ModuleType:
    from xfuse.families.pixart import presets

    return presets


PIXART_SIGMA = ModelSpec(
    name="pixart-sigma",
    diffusers_pipeline="PixArtSigmaPipeline",
    diffusers_transformer="PixArtTransformer2DModel",
    pipeline_class=_pipeline_class,
    stage_class=_stage_class,
    preset_builders=_preset_builders,
    presets=("pixart-tiny", "pixart-small"),
    vae_scale_factor=8,
    text_lengths=(300,),  # T5 (PixArtSigmaPipeline's default max_sequence_length)
    skip_pairs=no_skips,
    default_placement="linear",
    resolution_binning=True,
    crosses_per_patch="hidden states at each hand-off; with linear placement the stepped latent rows back to rank 0 "
    "(the T5 text is static: projected once per request on every rank)",
)
