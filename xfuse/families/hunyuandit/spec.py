"""HunyuanDiT's ``ModelSpec``: the facts xfuse's planner, checks and CLI read, written beside the family's code."""

from __future__ import annotations

from xfuse.errors import ConfigError
from xfuse.families.common.flops import attention_flops, linear_flops
from xfuse.families.spec import ModelSpec


def hunyuandit_skip_pairs(num_blocks: int) -> tuple[tuple[int, int], ...]:
    """(producer, consumer) pairs of HunyuanDiT's long skips, as ``diffusers.HunyuanDiT2DModel.forward`` wires them:
    block ``k < B/2 - 1`` feeds block ``B-1-k``."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2 or num_blocks % 2:
        raise ConfigError(
            "model",
            f"has {num_blocks} transformer blocks; HunyuanDiT's long skips pair block k with block N-1-k, so it "
            f"needs an even block count >= 2 (got num_layers={num_blocks!r})",
        )
    half = num_blocks // 2
    return tuple((k, num_blocks - 1 - k) for k in range(half - 1))


def hunyuandit_block_flops(config: dict, block: int, queries: int, keys: int, text: int, text_queries: bool) -> float:
    """FLOPs of ``HunyuanDiTBlock`` ``block`` for one batch element (``ModelSpec.block_flops``): AdaLayerNormShift,
    self-attention, cross-attention over the text (BERT and projected mT5, ``cross_attention_dim`` wide), the MLP
    (``int(width * mlp_ratio)`` inner, as ``HunyuanDiT2DModel.__init__`` builds it) and, in the blocks past the
    middle, the long skip's ``skip_linear`` (2 x width -> width)."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    inner, cross = int(d * config["mlp_ratio"]), config["cross_attention_dim"]
    flops = linear_flops(1, d, d)  # norm1's shift, once per sample
    flops += linear_flops(queries, d, 4 * d) + attention_flops(queries, keys, d)  # self: q, k, v, out
    flops += linear_flops(queries, d, 2 * d) + linear_flops(text, cross, 2 * d) + attention_flops(queries, text, d)
    flops += linear_flops(queries, d, inner) + linear_flops(queries, inner, d)
    if block > config["num_layers"] // 2:
        flops += linear_flops(queries, 2 * d, d)
    return flops


HUNYUANDIT = ModelSpec(
    name="hunyuandit",
    diffusers_pipeline="HunyuanDiTPipeline",
    diffusers_transformer="HunyuanDiT2DModel",
    package=__package__,  # pipeline.py, stage.py, presets.py (and controlnet.py) beside this file
    stage_name="HunyuanDiTStage",
    hand_written="its long skips (block N - 1 - k adds block k's output) cross the hand-offs, and diffusers declares "
    "no _cp_plan for it",
    presets=("tiny", "small", "bytes40", "dit-g2"),
    vae_scale_factor=8,  # the SDXL AutoencoderKL: 4 levels, 3 downsamplings
    text_lengths=(77, 256),  # BERT, mT5
    skip_pairs=hunyuandit_skip_pairs,
    default_placement="balanced",
    resolution_binning=True,
    block_flops=hunyuandit_block_flops,
    crosses_per_patch="hidden states at each hand-off; with linear placement also the long skips that cross ranks "
    "and the stepped latent rows back to rank 0; with balanced placement the few long skips its even split cannot "
    "keep on one rank (at most one per pair of neighbouring ranks, with the return hand-off)",
)
