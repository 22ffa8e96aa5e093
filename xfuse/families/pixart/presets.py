"""Tiny, randomly initialised PixArt-Σ pipelines built offline (the ``pixart-tiny`` preset for tests, ``pixart-small``
for CPU speed measurements).

The real PixArt-Sigma-XL-2 (28 blocks of width 1152, a 4.7 B-parameter T5-XXL) cannot be downloaded here. The preset
keeps its structure: ``PixArtTransformer2DModel`` with AdaLN-single, learned sigma, patch size 2 and a sin-cos position
table; a T5 encoder and tokenizer (tiny, from ``xfuse.families.common.presets``' offline vocabulary); an
``AutoencoderKL`` with scale factor 8; and PixArt-Σ's ``DPMSolverMultistepScheduler`` (DPM-Solver++ 2M, whose state
PipeFusion keeps per patch). Weights depend only on the seed (see ``xfuse.families.common.presets``).
"""

from __future__ import annotations

import os
from typing import Any

from xfuse.errors import ConfigError
from xfuse.families.common.presets import SDXL_VAE_SCALING, seeded, t5_encoder, t5_vocab, tiny_vae, tiny_vae_config
from xfuse.families.pixart.spec import PIXART_SIGMA

# 8 blocks: folded placement (which PixArt allows, though it defaults to linear) reaches degree 4.
PRESETS: dict[str, dict[str, Any]] = {
    "pixart-tiny": {
        "num_layers": 8,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "caption_channels": 32,  # the T5 width
        "default_size": 256,
    },
    # CPU speed: 16 blocks of width 256, the block count and width of HunyuanDiT's ``small`` and ``sd3-small``.
    "pixart-small": {
        "num_layers": 16,
        "num_attention_heads": 4,
        "attention_head_dim": 64,
        "caption_channels": 32,
        "default_size": 512,
    },
}

# Follows the released PixArt-Sigma-XL-2-1024-MS transformer config, except for the sizes the preset shrinks.
_COMMON = {
    "in_channels": 4,
    "out_channels": 8,  # learned sigma
    "patch_size": 2,
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "norm_type": "ada_norm_single",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "num_embeds_ada_norm": 1000,
    "use_additional_conditions": False,
}


def preset_transformer_config(preset: str = "pixart-tiny", **overrides: Any) -> dict[str, Any]:
    """The ``PixArtTransformer2DModel`` constructor arguments of a preset; ``overrides`` replace the preset's sizes
    (``num_layers``, ``num_attention_heads``, ``attention_head_dim``, ``caption_channels``, ``default_size``)."""
    if preset not in PRESETS:
        raise ConfigError("model", f"unknown PixArt preset {preset!r}; allowed presets: {', '.join(PRESETS)}")
    unknown = sorted(set(overrides) - set(PRESETS[preset]))
    if unknown:
        raise ConfigError("model", f"unknown PixArt preset sizes {unknown}; allowed: {', '.join(PRESETS[preset])}")
    base = PRESETS[preset] | overrides
    config = {k: v for k, v in base.items() if k != "default_size"} | _COMMON
    config["cross_attention_dim"] = base["num_attention_heads"] * base["attention_head_dim"]
    config["sample_size"] = base["default_size"] // PIXART_SIGMA.vae_scale_factor
    return config


def preset_vae_config(preset: str = "pixart-tiny") -> dict[str, Any]:
    """The ``AutoencoderKL`` arguments of a preset's tiny VAE (no torch): the SDXL VAE's layout (4 latent channels,
    quant convs, a scale)."""
    return _vae_config(preset_transformer_config(preset)["sample_size"])


def _vae_config(sample_size: int) -> dict[str, Any]:
    return tiny_vae_config(sample_size * PIXART_SIGMA.vae_scale_factor, scaling_factor=SDXL_VAE_SCALING)


def build_preset_pipeline(
    preset: str = "pixart-tiny", seed: int = 0, extra_words: tuple[str, ...] = (), **overrides: Any
):
    """A complete, randomly initialised ``diffusers.PixArtSigmaPipeline`` (CPU, float32, eval mode); ``extra_words``
    are whole words added to the tokenizer's vocabulary (see ``xfuse.families.hunyuandit.presets.build_tiny_pipeline``),
    ``overrides`` the preset's sizes (see ``preset_transformer_config``)."""
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel
    from transformers import T5Tokenizer

    config = preset_transformer_config(preset, **overrides)
    with seeded(seed, "transformer"):
        transformer = PixArtTransformer2DModel(**config).eval()
    (max_length,) = PIXART_SIGMA.text_lengths
    vocab = t5_vocab(extra_words)
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=max_length)
    text_encoder = t5_encoder(config["caption_channels"], len(vocab), seed, "text_encoder")
    # PixArt-Σ's sampling configuration: DPM-Solver++ 2M on SD's linear-beta epsilon schedule.
    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000,
        beta_schedule="linear",
        beta_start=0.0001,
        beta_end=0.02,
        prediction_type="epsilon",
        solver_order=2,
        algorithm_type="dpmsolver++",
        lower_order_final=True,
    )
    return PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=tiny_vae(_vae_config(config["sample_size"]), seed),  # the overrides' size
        transformer=transformer,
        scheduler=scheduler,
    )


def save_preset_pipeline(path: str | os.PathLike, preset: str = "pixart-tiny", seed: int = 0) -> str:
    """``save_pretrained`` the preset into ``path`` (loads with ``PixArtSigmaPipeline.from_pretrained``)."""
    path = os.fspath(path)
    build_preset_pipeline(preset, seed).save_pretrained(path, safe_serialization=True)
    return path
