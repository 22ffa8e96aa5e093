"""Qwen-Image's ``ModelSpec``: the facts xfuse's planner, checks and CLI read, written beside the family's code."""

from __future__ import annotations

from xfuse.families.common.flops import attention_flops, linear_flops
from xfuse.families.spec import ModelSpec, no_skips


def qwen_image_block_flops(config: dict, block: int, queries: int, keys: int, text: int, text_queries: bool) -> float:
    """FLOPs of one ``QwenImageTransformerBlock`` for one batch element (``ModelSpec.block_flops``): an MMDiT
    double-stream block (per stream q/k/v, output projection and a 4x GELU MLP; one softmax over [text, image]) whose
    two modulations (``img_mod``, ``txt_mod``: 6 x width each) are the block's own, both computed from ``temb`` on
    every pass, the text's too where the pass carries no text tokens."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    tokens = queries + (text if text_queries else 0)
    per_token = linear_flops(1, d, 3 * d) + linear_flops(1, d, d) + 2 * linear_flops(1, d, 4 * d)
    return tokens * per_token + 2 * linear_flops(1, d, 6 * d) + attention_flops(tokens, keys + text, d)


QWEN_IMAGE = ModelSpec(
    name="qwen-image",
    diffusers_pipeline="QwenImagePipeline",
    diffusers_transformer="QwenImageTransformer2DModel",
    package=__package__,  # pipeline.py, stage.py, presets.py beside this file
    stage_name="QwenImageStage",
    hand_written="diffusers' apply_rotary_emb_qwen cannot rotate zero text tokens (a reshape by -1), and a later "
    "patch carries none (it attends to the step's text K/V)",
    presets=("qwen-image-tiny", "qwen-image-small", "qwen-image"),
    vae_scale_factor=8,
    # QwenImagePipeline's max_sequence_length: a prompt keeps its own length (the chat template's 34 leading tokens
    # dropped), at most this; the planner costs the longest
    text_lengths=(512,),
    text_padded=False,
    skip_pairs=no_skips,
    default_placement="linear",
    crosses_per_patch="hidden states at each hand-off, plus the text stream (B, prompt tokens, hidden) with the step's "
    "first patch only (it owns the text update; later patches reuse its text K/V); with linear placement the "
    "stepped packed latent rows back to rank 0. With true CFG (true_cfg_scale > 1 and a negative prompt) the batch "
    "is [negative, positive], the shorter text padded and masked, which parallel.cfg_degree 2 splits (each group "
    "its own text, unpadded)",
    block_flops=qwen_image_block_flops,
    packing=2,
    # the pipeline packs 2 x 2 latents into a token (its transformer's patch_size 2): the engine's grid is the tokens
    token_patch=lambda config: 1,
    streams=("text",),
    distilled_guidance=True,  # guidance_scale never batches [uncond, cond]: its CFG is true_cfg_scale
    negative_prompt_guides=True,  # true_cfg_scale defaults to 4.0: a negative prompt turns CFG on
    native_side=lambda config: 128 * 8,  # QwenImagePipeline.default_sample_size x its VAE factor
)
