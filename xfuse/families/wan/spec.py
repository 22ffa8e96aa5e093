"""Wan's ``ModelSpec``: the facts xfuse's planner, checks and CLI read, written beside the family's code."""

from __future__ import annotations

from xfuse.families.common.flops import cross_attention_block_flops
from xfuse.families.generic.forward_plan import ForwardPlan
from xfuse.families.spec import ModelSpec, no_skips


def wan_block_flops(config: dict, block: int, queries: int, keys: int, text: int, text_queries: bool) -> float:
    """FLOPs of Wan's ``WanTransformerBlock`` for one batch element (``ModelSpec.block_flops``): self-attention over
    the video's tokens, cross-attention over the projected UMT5 text (already ``width`` wide) and the MLP
    (``ffn_dim``); its modulation is a table plus the step's projected timestep, not a linear per block."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    return cross_attention_block_flops(d, queries, keys, text, text_width=d, ffn=config["ffn_dim"])


WAN = ModelSpec(
    name="wan",
    diffusers_pipeline="WanPipeline",
    diffusers_transformer="WanTransformer3DModel",
    package=__package__,  # pipeline.py, stage.py, presets.py (and controlnet.py) beside this file
    stage_name="WanStage",
    modular_denoise=("WanDenoiseStep", "Wan22DenoiseStep"),
    hand_written="compile.mode and Wan 2.2 TI2V's per-token timesteps run on this stage only; parallel.adapter: "
    "generic runs the rest, exact",
    presets=(
        "wan-tiny",
        "wan-small",
        "wan2.1-t2v-1.3b",
        "wan2.1-t2v-14b",
        "wan2.2-tiny",
        "wan2.2-t2v-a14b",
        "wan2.2-ti2v-tiny",
        "wan2.2-ti2v-5b",
    ),
    vae_scale_factor=8,  # AutoencoderKLWan (Wan 2.1): 8 px per latent row and column, 4 frames per latent frame
    image_to_video="WanImageToVideoPipeline",  # Wan 2.2 TI2V-5B: one transformer for both
    vae_factor_key="scale_factor_spatial",  # Wan 2.2's VAE (TI2V-5B): 16 px; WanPipeline reads it from the VAE
    vae_temporal_factor=4,
    native_frames=81,  # WanPipeline's default num_frames
    token_patch=lambda config: config["patch_size"][1],  # (1, p, p): one latent frame by p x p
    text_lengths=(512,),  # UMT5 (WanPipeline's max_sequence_length)
    skip_pairs=no_skips,
    default_placement="linear",
    block_flops=wan_block_flops,
    native_side=lambda config: 480,  # WanPipeline's default height
    native_width=832,  # and width
    crosses_per_patch="hidden states at each hand-off; with linear placement the stepped latent rows (of every frame "
    "the patch covers) back to rank 0 (the UMT5 text is static: projected once per request on every rank)",
    forward=ForwardPlan(blocks=("blocks",), block_returns=("hidden_states",), latent_layout="video"),
)
