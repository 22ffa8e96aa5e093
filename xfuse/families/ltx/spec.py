"""LTX-Video's ``ModelSpec``: the facts xfuse's planner, checks and CLI read, and the ``ForwardPlan`` the generic family
runs its transformer by (it has no hand-written stage)."""

from __future__ import annotations

from xfuse.families.common.flops import cross_attention_block_flops
from xfuse.families.generic.forward_plan import ForwardPlan
from xfuse.families.spec import ModelSpec, no_skips


def ltx_block_flops(config: dict, block: int, queries: int, keys: int, text: int, text_queries: bool) -> float:
    """FLOPs of ``LTXVideoTransformerBlock`` for one batch element (``ModelSpec.block_flops``): self-attention over the
    video's tokens, cross-attention over the projected T5 text (already ``width`` wide), a 4x GELU MLP; its
    modulation is a table plus the step's embedded timestep, not a linear per block."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    return cross_attention_block_flops(d, queries, keys, text, text_width=d, ffn=4 * d)


LTX = ModelSpec(
    name="ltx",
    diffusers_pipeline="LTXPipeline",
    diffusers_transformer="LTXVideoTransformer3DModel",
    package=__package__,  # pipeline.py, presets.py beside this file
    stage_name=None,  # the generic family's stage, from ``forward``
    modular_denoise=("LTXDenoiseStep",),
    presets=("ltx-tiny", "ltx-small", "ltx-video"),
    vae_scale_factor=32,  # AutoencoderKLLTXVideo: 32 px per latent row and column, 8 frames per latent frame
    vae_temporal_factor=8,
    native_frames=161,  # LTXPipeline's default num_frames
    native_side=lambda config: 512,  # LTXPipeline's default height
    native_width=704,  # and width
    text_lengths=(128,),  # T5 (LTXPipeline's max_sequence_length), with its attention mask
    skip_pairs=no_skips,
    default_placement="linear",
    block_flops=ltx_block_flops,
    crosses_per_patch="hidden states at each hand-off; with linear placement the stepped packed latent rows (of every "
    "frame the patch covers) back to rank 0 (the T5 text is read whole by every pass's cross-attention)",
    forward=ForwardPlan(
        blocks=("transformer_blocks",),
        block_returns=("hidden_states",),
        latent_layout="packed",  # LTXPipeline packs (B, C, F, H, W) into (B, F * H * W, C) tokens, frame-major
        uncut=(":encoder_hidden_states", ":encoder_attention_mask"),  # cross-attention's: every pass reads all of it
    ),
)
