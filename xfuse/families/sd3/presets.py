"""Randomly initialised Stable Diffusion 3 / 3.5 pipelines built offline (the ``sd3-*`` / ``sd35-*`` presets).

The released checkpoints (SD3-medium 2 B, SD3.5-medium 2.5 B, SD3.5-large 8.1 B parameters, each with CLIP-L,
OpenCLIP-bigG and a 4.7 B-parameter T5-XXL) cannot be downloaded here. The presets keep their structure:

- ``SD3Transformer2DModel``: MMDiT joint blocks (image and text in one softmax, the last block ``context_pre_only``),
  patch size 2, a cropped sin-cos position table (``pos_embed_max_size``), AdaLN from timestep + pooled text;
  ``sd35-*`` adds SD3.5-medium's image-only ``attn2`` in the first blocks and per-head RMSNorm on q/k;
- the three text encoders in the pipeline's own wiring: two ``CLIPTextModelWithProjection`` (hidden states
  concatenated then zero-padded to the T5 width, projections concatenated into the pooled vector) and a T5 encoder,
  with in-memory ``CLIPTokenizer``s (byte-level BPE) and a ``T5Tokenizer`` (``xfuse.families.common.presets``);
- an ``AutoencoderKL`` with scale factor 8, no quant convs and SD3's ``scaling_factor`` / ``shift_factor``;
- SD3's ``FlowMatchEulerDiscreteScheduler`` (shift 3.0, no dynamic shifting).

``sd3-tiny`` / ``sd35-tiny`` are for tests, ``sd3-small`` for CPU speed measurements. ``sd3-medium``, ``sd3.5-medium``
and ``sd3.5-large`` have the released transformer shapes (random weights) for ``xfuse plan`` and GPU timings; their text
encoders are 2 layers deep at the released widths and their VAE is tiny with the released 16 latent channels, so the
pipeline runs end to end. Weights depend only on the seed (see ``xfuse.families.common.presets``).
"""

from __future__ import annotations

import os
from typing import Any

from xfuse.errors import ConfigError
from xfuse.families.common.presets import (
    clip_text_encoder,
    clip_tokenizer,
    released_vae,
    seeded,
    t5_encoder,
    t5_vocab,
    tiny_vae,
    tiny_vae_config,
)
from xfuse.families.common.text_encoders import CLIP_G_PROJECTION, CLIP_L_PROJECTION, T5_XXL

# Pixels per latent row/column: AutoencoderKL with four levels (three 2x downsamplings), as the released VAE.
_VAE_SCALE_FACTOR = 8
# CLIP's context (the pipeline pads both CLIP prompts to the tokenizer's model_max_length) and the T5 tokenizer's
# limit in the released repository (the pipeline's own default max_sequence_length is 256).
CLIP_MAX_LENGTH = 77
_T5_MAX_LENGTH = 512
# The released SD3 / SD3.5 VAE's latent normalisation: latents = (z - shift) * scale.
_SD3_VAE_SCALING, _SD3_VAE_SHIFT = 1.5305, 0.0609

# Keys of a preset that are not ``SD3Transformer2DModel`` arguments. ``clip_widths`` are the hidden sizes (= the
# projection sizes, as in both released CLIPs) of CLIP-L and CLIP-bigG; they fix ``pooled_projection_dim``.
_NON_TRANSFORMER_KEYS = frozenset({"default_size", "clip_widths"})

# The tiny presets keep the released width ratios of the text side: T5 width = 2 x the two CLIP widths together
# (4096 = 2 x (768 + 1280)), so the CLIP hidden states are zero-padded as in the release rather than cropped.
# ``pos_embed_max_size`` keeps the release's ratio to the default token grid (SD3: 192 = 3 x 64 tokens, SD3.5-medium:
# 384 = 6 x 64), so the tiny presets take images up to 768 px (sd3) / 1536 px (sd35) per side.
PRESETS: dict[str, dict[str, Any]] = {
    # SD3-medium structure: plain joint blocks.
    "sd3-tiny": {
        "num_layers": 4,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "in_channels": 16,
        "joint_attention_dim": 128,
        "clip_widths": (32, 32),
        "pos_embed_max_size": 48,
        "dual_attention_layers": (),
        "qk_norm": None,
        "default_size": 256,
    },
    # SD3.5-medium structure: attn2 (image-only self-attention) in blocks 0-1, RMSNorm q/k everywhere.
    "sd35-tiny": {
        "num_layers": 4,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "in_channels": 16,
        "joint_attention_dim": 128,
        "clip_widths": (32, 32),
        "pos_embed_max_size": 96,
        "dual_attention_layers": (0, 1),
        "qk_norm": "rms_norm",
        "default_size": 256,
    },
    # CPU speed: 16 SD3-medium blocks of width 256, the block count and width of HunyuanDiT's ``small``.
    "sd3-small": {
        "num_layers": 16,
        "num_attention_heads": 4,
        "attention_head_dim": 64,
        "in_channels": 16,
        "joint_attention_dim": 128,
        "clip_widths": (32, 32),
        "pos_embed_max_size": 48,
        "dual_attention_layers": (),
        "qk_norm": None,
        "default_size": 256,
    },
    # The released transformers (diffusers' scripts/convert_sd3_to_diffusers.py: heads = blocks, head dim 64).
    "sd3-medium": {
        "num_layers": 24,
        "num_attention_heads": 24,
        "attention_head_dim": 64,
        "in_channels": 16,
        "joint_attention_dim": 4096,
        "clip_widths": (768, 1280),
        "pos_embed_max_size": 192,
        "dual_attention_layers": (),
        "qk_norm": None,
        "default_size": 1024,
    },
    "sd3.5-medium": {
        "num_layers": 24,
        "num_attention_heads": 24,
        "attention_head_dim": 64,
        "in_channels": 16,
        "joint_attention_dim": 4096,
        "clip_widths": (768, 1280),
        "pos_embed_max_size": 384,
        "dual_attention_layers": tuple(range(13)),
        "qk_norm": "rms_norm",
        "default_size": 1024,
    },
    "sd3.5-large": {
        "num_layers": 38,
        "num_attention_heads": 38,
        "attention_head_dim": 64,
        "in_channels": 16,
        "joint_attention_dim": 4096,
        "clip_widths": (768, 1280),
        "pos_embed_max_size": 192,
        "dual_attention_layers": (),
        "qk_norm": "rms_norm",
        "default_size": 1024,
    },
}

# Default image size in pixels of each preset (the pipeline's default is ``sample_size * vae_scale_factor``).
DEFAULT_SIZE: dict[str, int] = {name: preset["default_size"] for name, preset in PRESETS.items()}


# The released-shape presets' text encoders (SD3 / SD3.5's CLIP-L and OpenCLIP bigG (with projections) and T5-XXL's
# encoder), for xfuse plan's memory (the small presets' are the built ones).
_SD3_TEXT = {"text_encoder": CLIP_L_PROJECTION, "text_encoder_2": CLIP_G_PROJECTION, "text_encoder_3": T5_XXL}
RELEASED_TEXT_ENCODERS: dict[str, dict[str, dict[str, Any]]] = {
    **dict.fromkeys(("sd3-medium", "sd3.5-medium", "sd3.5-large"), _SD3_TEXT)
}


def _check_preset(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ConfigError("model", f"unknown SD3 preset {preset!r}; allowed presets: {', '.join(PRESETS)}")
    return PRESETS[preset]


def preset_transformer_config(preset: str = "sd3-tiny") -> dict[str, Any]:
    """The ``SD3Transformer2DModel`` constructor arguments of a preset."""
    base = _check_preset(preset)
    config = {k: v for k, v in base.items() if k not in _NON_TRANSFORMER_KEYS}
    config["patch_size"] = 2
    config["out_channels"] = base["in_channels"]
    # The text stream runs at the block width, and the pooled vector is the two CLIP projections side by side.
    config["caption_projection_dim"] = base["num_attention_heads"] * base["attention_head_dim"]
    config["pooled_projection_dim"] = sum(base["clip_widths"])
    config["sample_size"] = base["default_size"] // _VAE_SCALE_FACTOR
    return config


def preset_vae_config(preset: str = "sd3-tiny") -> dict[str, Any]:
    """The ``AutoencoderKL`` arguments of a preset's VAE (no torch): SD3's layout, no quant convs, a scale and a
    shift; tiny, or the release's widths."""
    config = tiny_vae_config(
        _check_preset(preset)["default_size"],
        latent_channels=preset_transformer_config(preset)["in_channels"],
        scaling_factor=_SD3_VAE_SCALING,
        shift_factor=_SD3_VAE_SHIFT,
        quant_convs=False,
    )
    return released_vae(config, preset in RELEASED_TEXT_ENCODERS)


def build_preset_pipeline(preset: str = "sd3-tiny", seed: int = 0):
    """A complete, randomly initialised ``diffusers.StableDiffusion3Pipeline`` (CPU, float32, eval mode)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import T5Tokenizer

    config = preset_transformer_config(preset)
    base = PRESETS[preset]
    with seeded(seed, "transformer"):
        transformer = SD3Transformer2DModel(**config).eval()
    clip_l_width, clip_g_width = base["clip_widths"]
    tokenizer = clip_tokenizer()
    # The released CLIP-bigG tokenizer pads with "!" rather than the end token.
    tokenizer_2 = clip_tokenizer(pad_token="!")
    # CLIP-L uses quick-GELU, OpenCLIP-bigG exact GELU.
    text_encoder = clip_text_encoder(
        clip_l_width, tokenizer, seed, "text_encoder", with_projection=True, hidden_act="quick_gelu"
    )
    text_encoder_2 = clip_text_encoder(
        clip_g_width, tokenizer_2, seed, "text_encoder_2", with_projection=True, hidden_act="gelu"
    )
    tokenizer_3 = T5Tokenizer(vocab=t5_vocab(), extra_ids=0, model_max_length=_T5_MAX_LENGTH)
    text_encoder_3 = t5_encoder(config["joint_attention_dim"], len(t5_vocab()), seed, "text_encoder_3")
    vae = tiny_vae(preset_vae_config(preset), seed)
    # SD3's and SD3.5's released sampling configuration: a fixed shift of 3, no resolution-dependent shift.
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )


def save_preset_pipeline(path: str | os.PathLike, preset: str = "sd3-tiny", seed: int = 0) -> str:
    """``save_pretrained`` the preset into ``path`` (loads with ``StableDiffusion3Pipeline.from_pretrained``)."""
    path = os.fspath(path)
    build_preset_pipeline(preset, seed).save_pretrained(path, safe_serialization=True)
    return path
