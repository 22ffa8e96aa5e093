"""FLUX.2's ``ModelSpec``s: the facts xfuse's planner, checks and CLI read, written beside the family's code.

Two pipelines run the same ``Flux2Transformer2DModel`` with different text encoders and guidance: ``Flux2Pipeline``
(FLUX.2 [dev]: Mistral Small, guidance embedded) and ``Flux2KleinPipeline`` (FLUX.2 [klein]: Qwen3, classifier-free
guidance unless the model is step-distilled). Each is a spec of its own, sharing this folder's stage and presets.
"""

from __future__ import annotations

from dataclasses import replace

from xfuse.families.common.flops import attention_flops, linear_flops
from xfuse.families.generic.forward_plan import ForwardPlan
from xfuse.families.spec import ModelSpec, no_skips


def _flux2_blocks(config: dict) -> int:
    """FLUX.2's double-stream blocks (``num_layers``) then its single-stream blocks, indexed as one chain."""
    return config["num_layers"] + config["num_single_layers"]


def flux2_block_flops(config: dict, block: int, queries: int, keys: int, text: int, text_queries: bool) -> float:
    """FLOPs of FLUX.2 block ``block`` of the chain (``_flux2_blocks``) for one batch element
    (``ModelSpec.block_flops``). The modulation is the transformer's, computed once per step outside the blocks
    (``Flux2Modulation``), so a block is its projections, SwiGLU MLP (``mlp_ratio`` x width) and attention:

    * ``Flux2TransformerBlock`` (double stream): per stream q/k/v and output projection, ``linear_in`` to twice the
      MLP width and ``linear_out`` back; the text stream only where it is computed (``text_queries``);
    * ``Flux2SingleTransformerBlock`` over [text, image]: one fused ``to_qkv_mlp_proj`` (q/k/v and both MLP halves)
      and one ``to_out`` of [attention, MLP] back to the width."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = int(d * config.get("mlp_ratio", 3.0))
    tq = text if text_queries else 0
    if block < config["num_layers"]:
        per_token = linear_flops(1, d, 3 * d) + linear_flops(1, d, d) + linear_flops(1, d, 2 * mlp)
        per_token += linear_flops(1, mlp, d)
        return (queries + tq) * per_token + attention_flops(queries + tq, keys + text, d)
    tokens = queries + tq
    flops = linear_flops(tokens, d, 3 * d + 2 * mlp) + linear_flops(tokens, d + mlp, d)
    return flops + attention_flops(tokens, keys + text, d)


FLUX2 = ModelSpec(
    name="flux2",
    diffusers_pipeline="Flux2Pipeline",
    diffusers_transformer="Flux2Transformer2DModel",
    package=__package__,  # pipeline.py, stage.py, presets.py beside this file
    stage_name="Flux2Stage",
    hand_written="compile.mode runs on this stage only; parallel.adapter: generic runs the rest, exact (its single "
    "blocks: ForwardPlan.joined)",
    presets=("flux2-tiny", "flux2-small", "flux2-dev"),
    vae_scale_factor=8,
    text_lengths=(512,),  # Flux2Pipeline's max_sequence_length: the prompt is always padded to it
    skip_pairs=no_skips,
    default_placement="linear",
    crosses_per_patch="hidden states at each hand-off, plus the text stream (B, 512, hidden) with the step's first "
    "patch only (it owns the text update; later patches reuse its text K/V); with linear placement the stepped "
    "patchified latent rows back to rank 0",
    block_flops=flux2_block_flops,
    num_blocks=_flux2_blocks,
    packing=2,
    streams=("text",),
    distilled_guidance=True,  # FLUX.2 [dev] embeds guidance_scale; it has no CFG batch
    native_side=lambda config: 128 * 8,  # Flux2Pipeline.default_sample_size x its VAE factor
    forward=ForwardPlan(
        blocks=("transformer_blocks", "single_transformer_blocks"),
        block_returns=("encoder_hidden_states", "hidden_states"),
        latent_layout="packed",
        context=(":encoder_hidden_states", ":txt_ids"),
        text_stream="encoder_hidden_states",
        joined=("single_transformer_blocks",),  # its forward joins [text, image] before them
    ),
)

FLUX2_KLEIN = replace(
    FLUX2,
    name="flux2-klein",
    diffusers_pipeline="Flux2KleinPipeline",
    stage_name="Flux2KleinStage",
    hand_written="compile.mode runs on this stage only; parallel.adapter: generic runs the rest, exact (its single "
    "blocks: ForwardPlan.joined)",
    presets=("flux2-klein-tiny", "flux2-klein-4b", "flux2-klein-9b"),
    crosses_per_patch="hidden states at each hand-off, plus the text stream (B, 512, hidden) with the step's first "
    "patch only (it owns the text update; later patches reuse its text K/V); with linear placement the stepped "
    "patchified latent rows back to rank 0. With classifier-free guidance (guidance_scale > 1, not step-distilled) "
    "the batch is [negative, positive], which parallel.cfg_degree 2 splits",
    distilled_guidance=False,  # guidance_scale batches [negative, positive] unless the model is step-distilled
)
