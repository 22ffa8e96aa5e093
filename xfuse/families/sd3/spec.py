"""SD3 / SD3.5's ``ModelSpec``: the facts xfuse's planner, checks and CLI read, written beside the family's code."""

from __future__ import annotations

from xfuse.families.common.flops import attention_flops, linear_flops, mmdit_joint_flops
from xfuse.families.spec import ModelSpec, no_skips
from xfuse.parallel.control import interval_samples


def sd3_block_flops(config: dict, block: int, queries: int, keys: int, text: int, text_queries: bool) -> float:
    """FLOPs of ``JointTransformerBlock`` ``block`` for one batch element (``ModelSpec.block_flops``): the joint
    attention of the MMDiT (the last block is ``context_pre_only``: no text output projection or MLP) and, in SD3.5's
    ``dual_attention_layers``, the second image-only self-attention with its 9-chunk modulation."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    dual = block in (config.get("dual_attention_layers") or ())
    last = block == config["num_layers"] - 1
    flops = mmdit_joint_flops(d, queries, keys, text, text_queries, context_out=not last, modulations=9 if dual else 6)
    if dual:
        flops += linear_flops(queries, d, 4 * d) + attention_flops(queries, keys, d)
    return flops


def sd3_control_samples(config: dict, control: dict) -> dict[int, int]:
    """Which ControlNet residual each block adds (``ModelSpec.control_samples``): mirrors
    ``diffusers.SD3Transformer2DModel.forward``'s ``interval_control`` lines (a float interval; only blocks with
    ``context_pre_only False``, which ``SD3Transformer2DModel.__init__`` makes all but the last)."""
    num_layers = config["num_layers"]
    return interval_samples(range(num_layers - 1), 0, num_layers, control["num_layers"], ceil=False)


STABLE_DIFFUSION_3 = ModelSpec(
    name="sd3",
    diffusers_pipeline="StableDiffusion3Pipeline",
    diffusers_transformer="SD3Transformer2DModel",
    package=__package__,  # pipeline.py, stage.py, presets.py (and controlnet.py) beside this file
    stage_name="SD3Stage",
    hand_written="diffusers declares no _cp_plan for SD3Transformer2DModel",
    presets=("sd3-tiny", "sd35-tiny", "sd3-small", "sd3-medium", "sd3.5-medium", "sd3.5-large"),
    vae_scale_factor=8,
    text_lengths=(77, 256),  # CLIP-L and CLIP-G (side by side, one sequence), T5 (max_sequence_length)
    skip_pairs=no_skips,
    default_placement="linear",
    crosses_per_patch="hidden states at each hand-off, plus the text stream (B, 77 + T5 tokens, hidden) with the "
    "step's first patch only (it owns the text update; later patches reuse its text K/V); with linear placement "
    "the stepped latent rows back to rank 0",
    block_flops=sd3_block_flops,
    streams=("text",),
    # SD3.5-medium's blocks listed in dual_attention_layers add an image-only self-attention (attn2)
    attentions_of_block=lambda config, block: 2 if block in (config.get("dual_attention_layers") or ()) else 1,
    controlnet="StableDiffusion3ControlNetPipeline",
    control_samples=sd3_control_samples,
)
