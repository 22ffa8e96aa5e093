"""Z-Image's ``ModelSpec``: the facts xfuse's planner, checks and CLI read, written beside the family's code."""

from __future__ import annotations

from xfuse.families.common.flops import attention_flops, linear_flops
from xfuse.families.spec import ModelSpec, no_skips

# ZImageTransformer2DModel pads the image's tokens and each caption's to a multiple of this (SEQ_MULTI_OF)
SEQUENCE_MULTIPLE = 32


def _z_image_blocks(config: dict) -> int:
    """The noise refiner's blocks (image-only attention) then the main layers (over [image, caption]), one chain."""
    return config["n_refiner_layers"] + config["n_layers"]


def z_image_block_flops(config: dict, block: int, queries: int, keys: int, text: int, text_queries: bool) -> float:
    """FLOPs of block ``block`` of the chain (``_z_image_blocks``) for one batch element (``ModelSpec.block_flops``),
    as diffusers runs it: a ``ZImageTransformerBlock`` (q/k/v and output projection without bias, a SwiGLU MLP of
    ``dim / 3 * 8``, its modulation a linear of the 256-wide ``adaln_input`` to 4 x width once per sample). A noise
    refiner block attends over the image and its pad tokens (up to a multiple of 32: ``keys`` is the whole image's
    tokens), the caption not; a main layer over the image and the stream (``text``: the image's pad tokens and the
    padded caption). xfuse's refiner passes also carry the caption tokens (kept out of every softmax and not updated):
    not counted."""
    d = config["dim"]
    hidden = int(d / 3 * 8)
    per_token = linear_flops(1, d, 3 * d) + linear_flops(1, d, d) + 2 * linear_flops(1, d, hidden)
    per_token += linear_flops(1, hidden, d)
    if block < config["n_refiner_layers"]:
        text = (-keys) % SEQUENCE_MULTIPLE  # the image's pad tokens
    tokens = queries + (text if text_queries else 0)
    modulation = linear_flops(1, min(d, 256), 4 * d)
    return tokens * per_token + modulation + attention_flops(tokens, keys + text, d)


Z_IMAGE = ModelSpec(
    name="z-image",
    diffusers_pipeline="ZImagePipeline",
    diffusers_transformer="ZImageTransformer2DModel",
    package=__package__,  # pipeline.py, stage.py, presets.py beside this file
    stage_name="ZImageStage",
    hand_written="diffusers declares no _cp_plan for it; its forward pads text and image into one sequence per sample",
    presets=("z-image-tiny", "z-image-small", "z-image-turbo"),
    vae_scale_factor=8,
    # ZImagePipeline's max_sequence_length: a prompt keeps its own length (its valid tokens), at most this
    text_lengths=(512,),
    text_padded=False,
    skip_pairs=no_skips,
    default_placement="linear",
    crosses_per_patch="hidden states at each hand-off, plus the stream (B, the image's pad tokens + the padded "
    "caption, hidden) with the step's first patch only (it owns the stream's update; later patches reuse its K/V); "
    "with linear placement the stepped latent rows back to rank 0. With CFG (guidance_scale > 0) the batch is "
    "[negative, positive], the shorter caption padded and masked, which parallel.cfg_degree 2 splits",
    block_flops=z_image_block_flops,
    num_blocks=_z_image_blocks,
    streams=("text",),
    cfg_above=0.0,  # ZImagePipeline.do_classifier_free_guidance: guidance_scale > 0
    native_side=lambda config: 1024,  # ZImagePipeline's default height and width
    token_patch=lambda config: config["all_patch_size"][0],
    num_heads=lambda config: config["n_heads"],
    width=lambda config: config["dim"],
)
