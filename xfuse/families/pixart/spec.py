"""PixArt-Σ's ``ModelSpec``: the facts xfuse's planner, checks and CLI read, written beside the family's code."""

from __future__ import annotations

from xfuse.families.common.flops import cross_attention_block_flops
from xfuse.families.spec import ModelSpec, no_skips


def pixart_block_flops(config: dict, block: int, queries: int, keys: int, text: int, text_queries: bool) -> float:
    """FLOPs of PixArt's ``BasicTransformerBlock`` (``ada_norm_single``: its modulation is a table, not a linear) for
    one batch element (``ModelSpec.block_flops``): self-attention, cross-attention over the projected T5 text
    (``cross_attention_dim`` wide) and the 4x MLP."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    return cross_attention_block_flops(d, queries, keys, text, text_width=config["cross_attention_dim"], ffn=4 * d)


PIXART_SIGMA = ModelSpec(
    name="pixart-sigma",
    diffusers_pipeline="PixArtSigmaPipeline",
    diffusers_transformer="PixArtTransformer2DModel",
    package=__package__,  # pipeline.py, stage.py, presets.py (and controlnet.py) beside this file
    stage_name="PixArtStage",
    hand_written="diffusers declares no _cp_plan for it, and its cross-attention takes the text's mask (the generic "
    "route refuses masks)",
    presets=("pixart-tiny", "pixart-small"),
    vae_scale_factor=8,
    text_lengths=(300,),  # T5 (PixArtSigmaPipeline's default max_sequence_length)
    skip_pairs=no_skips,
    default_placement="linear",
    resolution_binning=True,
    block_flops=pixart_block_flops,
    crosses_per_patch="hidden states at each hand-off; with linear placement the stepped latent rows back to rank 0 "
    "(the T5 text is static: projected once per request on every rank)",
)
