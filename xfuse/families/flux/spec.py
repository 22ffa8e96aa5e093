"""FLUX.1's ``ModelSpec``: the facts xfuse's planner, checks and CLI read, written beside the family's code."""

from __future__ import annotations

from xfuse.families.common.flops import attention_flops, linear_flops, mmdit_joint_flops
from xfuse.families.generic.forward_plan import ForwardPlan
from xfuse.families.spec import ModelSpec, no_skips
from xfuse.parallel.control import interval_samples


def _flux_blocks(config: dict) -> int:
    """FLUX's double-stream blocks (``num_layers``) then its single-stream blocks, indexed as one chain."""
    return config["num_layers"] + config["num_single_layers"]


def flux_block_flops(config: dict, block: int, queries: int, keys: int, text: int, text_queries: bool) -> float:
    """FLOPs of FLUX block ``block`` of the chain (``_flux_blocks``) for one batch element (``ModelSpec.block_flops``):
    a double-stream ``FluxTransformerBlock`` (an MMDiT joint block), then single-stream ``FluxSingleTransformerBlock``s
    over [text, image] tokens: 3-chunk modulation, q/k/v and the 4x MLP input side by side, one output projection
    of both (5 x width -> width)."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    if block < config["num_layers"]:
        return mmdit_joint_flops(d, queries, keys, text, text_queries, context_out=True, modulations=6)
    tokens = queries + (text if text_queries else 0)
    flops = linear_flops(1, d, 3 * d) + linear_flops(tokens, d, 3 * d) + linear_flops(tokens, d, 4 * d)
    return flops + attention_flops(tokens, keys + text, d) + linear_flops(tokens, 5 * d, d)


def flux_control_samples(config: dict, control: dict) -> dict[int, int]:
    """Which ControlNet residual each block adds (``ModelSpec.control_samples``): mirrors
    ``diffusers.FluxTransformer2DModel.forward``'s ``interval_control`` lines (rounded up; the double blocks take
    the ControlNet's double-block residuals, the single blocks its single-block ones, numbered after them)."""
    doubles, singles = config["num_layers"], config["num_single_layers"]
    control_doubles, control_singles = control["num_layers"], control.get("num_single_layers", 0)
    samples = interval_samples(range(doubles), 0, doubles, control_doubles, ceil=True)
    return samples | interval_samples(range(doubles, doubles + singles), doubles, singles, control_singles,
                                      control_doubles, ceil=True)  # fmt: skip


FLUX = ModelSpec(
    name="flux",
    diffusers_pipeline="FluxPipeline",
    diffusers_transformer="FluxTransformer2DModel",
    package=__package__,  # pipeline.py, stage.py, presets.py (and controlnet.py) beside this file
    stage_name="FluxStage",
    hand_written="compile.mode and ControlNet run on this stage only; parallel.adapter: generic runs the rest, exact "
    "(1.02x its time at degree 2)",
    presets=("flux-tiny", "flux-small", "flux-dev", "flux-schnell"),
    vae_scale_factor=8,
    text_lengths=(512,),  # T5 (max_sequence_length); the CLIP prompt gives only the pooled vector
    skip_pairs=no_skips,
    default_placement="linear",
    crosses_per_patch="hidden states at each hand-off, plus the text stream (B, T5 tokens, hidden) with the step's "
    "first patch only (it owns the text update; later patches reuse its text K/V); with linear placement the "
    "stepped packed latent rows back to rank 0",
    block_flops=flux_block_flops,
    num_blocks=_flux_blocks,
    packing=2,
    streams=("text",),
    distilled_guidance=True,
    native_side=lambda config: 128 * 8,  # FluxPipeline.default_sample_size x its VAE factor
    controlnet="FluxControlNetPipeline",
    control_samples=flux_control_samples,
    modular_denoise=("FluxDenoiseStep",),
    forward=ForwardPlan(
        blocks=("transformer_blocks", "single_transformer_blocks"),
        block_returns=("encoder_hidden_states", "hidden_states"),
        latent_layout="packed",
        context=(":encoder_hidden_states", ":txt_ids"),
        text_stream="encoder_hidden_states",
    ),
)
