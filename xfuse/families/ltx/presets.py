"""Randomly initialised LTX-Video pipelines built offline (the ``ltx-*`` presets).

The released LTX-Video (a 1.9 B-parameter transformer, the T5-XXL encoder and a 0.4 B-parameter causal video VAE)
cannot be downloaded here. The presets keep its structure:

- ``LTXVideoTransformer3DModel``: one token per latent pixel of every latent frame (patch 1 x 1 x 1), blocks of
  self-attention over all the video's tokens with 3-axis RoPE and q/k RMSNorm across heads, cross-attention to the
  projected T5 text under its attention mask, and a GELU MLP, modulated by a per-block table plus the embedded
  timestep;
- the pipeline's text wiring: a ``T5EncoderModel`` whose states, padded to ``max_sequence_length`` (128) tokens with
  their attention mask, are the text every block cross-attends to (an in-memory ``T5Tokenizer`` of
  ``xfuse.families.common.presets``' vocabulary);
- an ``AutoencoderKLLTXVideo`` with the release's factors: 32 px per latent row / column (a 4 x 4 patch and three 2x
  downsamplings) and 8x time compression (``1 + 8k`` frames -> ``1 + k`` latent frames);
- a ``FlowMatchEulerDiscreteScheduler`` with dynamic shifting, its ``mu`` computed by LTXPipeline from the video's
  tokens (shift 0.95 at 1024 tokens to 2.05 at 4096, as recalled of the release's scheduler, not checked against its
  folder here; without a terminal sigma, whose stretch diffusers divides by zero at one step).

``ltx-tiny`` is for tests, ``ltx-small`` for CPU speed measurements, ``ltx-video`` has the released transformer's
shape (diffusers' ``LTXVideoTransformer3DModel`` defaults) and VAE's (``AutoencoderKLLTXVideo``'s, LTX-Video 0.9.0's)
for ``xfuse plan``; its text encoder is 2 layers deep at the released width 4096. Weights depend only on the seed.
"""

from __future__ import annotations

import os
from typing import Any

from xfuse.errors import ConfigError
from xfuse.families.common.presets import seeded, t5_encoder, t5_vocab
from xfuse.families.common.text_encoders import T5_XXL

_T5_MAX_LENGTH = 128  # LTXPipeline's default max_sequence_length

# Keys of a preset that are not ``LTXVideoTransformer3DModel`` arguments.
_NON_TRANSFORMER_KEYS = frozenset({"default_size", "vae"})

# Rules the pipeline relies on: caption_channels == the T5 width; cross_attention_dim == the width (heads x head
# dim: the projected text's); in_channels == the VAE's latent channels. Videos: height and width multiples of 32 px,
# 1 + 8k frames. ``default_size`` is (height, width, num_frames).
PRESETS: dict[str, dict[str, Any]] = {
    # Tests: 4 blocks of 2 heads x 16, 8 latent channels; a 256 x 192 px, 17-frame video is 3 latent frames of 8 x 6
    # tokens.
    "ltx-tiny": {
        "num_layers": 4,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "in_channels": 8,
        "cross_attention_dim": 32,
        "caption_channels": 32,
        "default_size": (256, 192, 17),
    },
    # CPU speed: 16 blocks of width 256 (4 heads of 64), as ``wan-small``, on the release's 128 latent channels; a
    # 256 x 352 px, 25-frame video is 4 latent frames of 8 x 11 tokens (352 tokens).
    "ltx-small": {
        "num_layers": 16,
        "num_attention_heads": 4,
        "attention_head_dim": 64,
        "in_channels": 128,
        "cross_attention_dim": 256,
        "caption_channels": 32,
        "default_size": (256, 352, 25),
    },
    # The released transformer: 28 blocks of 32 heads x 64 (width 2048) on 128 latent channels, T5-XXL's 4096-wide
    # text; 512 x 704 px, 161 frames (LTXPipeline's defaults).
    "ltx-video": {
        "num_layers": 28,
        "num_attention_heads": 32,
        "attention_head_dim": 64,
        "in_channels": 128,
        "cross_attention_dim": 2048,
        "caption_channels": 4096,
        "default_size": (512, 704, 161),
        "vae": "released",
    },
}
DEFAULT_SIZE: dict[str, tuple[int, int, int]] = {name: preset["default_size"] for name, preset in PRESETS.items()}

# The released-shape preset's text encoder, for xfuse plan's memory (the small presets' are the built ones).
RELEASED_TEXT_ENCODERS: dict[str, dict[str, dict[str, Any]]] = {"ltx-video": {"text_encoder": T5_XXL}}


def preset_transformer_config(preset: str = "ltx-tiny") -> dict[str, Any]:
    """The ``LTXVideoTransformer3DModel`` constructor arguments of a preset."""
    if preset not in PRESETS:
        raise ConfigError("model", f"unknown LTX preset {preset!r}; allowed presets: {', '.join(PRESETS)}")
    config = {k: v for k, v in PRESETS[preset].items() if k not in _NON_TRANSFORMER_KEYS}
    return config | {"out_channels": config["in_channels"], "patch_size": 1, "patch_size_t": 1}


def preset_vae_config(preset: str = "ltx-tiny") -> dict[str, Any]:
    """The ``AutoencoderKLLTXVideo`` config of a preset's VAE (``_class_name`` included, as its ``config.json`` has
    it): the release's layout (a 4 x 4 patch, three spatio-temporal 2x levels and a last level without) at 8 channels
    a level and one residual block each; the released preset's at the release's widths (the class's defaults)."""
    config: dict[str, Any] = {"latent_channels": preset_transformer_config(preset)["in_channels"]}
    if PRESETS[preset].get("vae") != "released":
        config |= {"block_out_channels": (8, 8, 8, 8), "decoder_block_out_channels": (8, 8, 8, 8),
                   "layers_per_block": (1, 1, 1, 1, 1), "decoder_layers_per_block": (1, 1, 1, 1, 1)}  # fmt: skip
    return {"_class_name": "AutoencoderKLLTXVideo", **config}


def _build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                           base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                                           max_image_seq_len=4096)  # fmt: skip


def build_preset_pipeline(preset: str = "ltx-tiny", seed: int = 0):
    """A complete, randomly initialised ``diffusers.LTXPipeline`` (CPU, float32, eval mode)."""
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline, LTXVideoTransformer3DModel
    from transformers import T5Tokenizer

    config = preset_transformer_config(preset)
    with seeded(seed, "transformer"):
        transformer = LTXVideoTransformer3DModel(**config).eval()
    vocab = t5_vocab()
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=_T5_MAX_LENGTH)
    text_encoder = t5_encoder(config["caption_channels"], len(vocab), seed, "text_encoder")
    vae_config = {k: v for k, v in preset_vae_config(preset).items() if k != "_class_name"}
    with seeded(seed, "vae"):
        vae = AutoencoderKLLTXVideo(**vae_config).eval()
    return LTXPipeline(scheduler=_build_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                       transformer=transformer)  # fmt: skip


def save_preset_pipeline(path: str | os.PathLike, preset: str = "ltx-tiny", seed: int = 0) -> str:
    """``save_pretrained`` the preset into ``path`` (loads with ``LTXPipeline.from_pretrained``)."""
    path = os.fspath(path)
    build_preset_pipeline(preset, seed).save_pretrained(path, safe_serialization=True)
    return path
