"""Randomly initialised Z-Image pipelines built offline (the ``z-image-*`` presets).

The released Z-Image-Turbo (a 6 B-parameter transformer and Qwen3-4B as its text encoder) cannot be downloaded here.
The presets keep its structure:

- ``ZImageTransformer2DModel``: single-stream blocks over [image, caption] with the same modulation for every token,
  two noise refiner blocks (image only, modulated) and two context refiner blocks (caption only, unmodulated) before
  the main layers, learned pad tokens for the image and the caption (each padded to a multiple of 32), per-head RMS
  norm of q and k, complex 3-axis RoPE over (caption-or-frame, row, column) ids, 2 x 2 patches, a head count the
  Ulysses degrees 4 and 8 do not divide (the release's 30; the tiny preset's 6, which 4 does not divide);
- the pipeline's text wiring: a ``Qwen3ForCausalLM`` whose second-to-last hidden state at each prompt's own tokens
  is its caption (``cap_feat_dim`` = its width), with an in-memory byte-level tokenizer and Qwen3's chat template
  (thinking on, as ``ZImagePipeline`` applies it);
- an ``AutoencoderKL`` of FLUX.1's form (16 latent channels in the release, a scale and a shift, no quant convs);
- ``FlowMatchEulerDiscreteScheduler`` with a fixed shift of 3, as the release's ``scheduler_config.json`` sets it
  (``ZImagePipeline`` passes a ``mu`` the scheduler then does not use).

``z-image-tiny`` is for tests (CFG at the pipeline's default ``guidance_scale`` 5), ``z-image-small`` for CPU speed
measurements, ``z-image-turbo`` has the released transformer shape (random weights) for ``xfuse plan`` and GPU
timings. Weights depend only on the seed (see ``xfuse.families.common.presets``).
"""

from __future__ import annotations

import os
from typing import Any

from xfuse.errors import ConfigError
from xfuse.families.common.presets import (
    QWEN3_CHAT_TEMPLATE,
    QWEN3_SPECIALS,
    byte_level_tokenizer,
    released_vae,
    seeded,
    tiny_vae_config,
)
from xfuse.families.common.text_encoders import QWEN3_4B

_MAX_LENGTH = 512  # ZImagePipeline's max_sequence_length: the tokenizer pads to it, the valid tokens are kept
# FLUX.1's VAE (Z-Image's): its latent scale and shift.
_VAE_SCALING, _VAE_SHIFT = 0.3611, 0.1159

# Keys of a preset that are not ``ZImageTransformer2DModel`` arguments.
_NON_TRANSFORMER_KEYS = frozenset({"default_size", "text_layers"})

# Rules the model relies on: sum(axes_dims) == dim / n_heads, cap_feat_dim == the text encoder's width.
PRESETS: dict[str, dict[str, Any]] = {
    # Tests: 2 refiner + 4 main blocks, 6 heads of 16 (Ulysses 4 splits them 2, 2, 1, 1), a 32-wide 4-layer Qwen3.
    "z-image-tiny": {
        "in_channels": 4,
        "dim": 96,
        "n_layers": 4,
        "n_refiner_layers": 2,
        "n_heads": 6,
        "n_kv_heads": 6,
        "cap_feat_dim": 32,
        "axes_dims": [4, 6, 6],
        "text_layers": 4,
        "default_size": 256,
    },
    # CPU speed: 2 refiner + 10 main blocks of width 256 (4 heads of 64), the release's 16 latent channels.
    "z-image-small": {
        "in_channels": 16,
        "dim": 256,
        "n_layers": 10,
        "n_refiner_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 4,
        "cap_feat_dim": 128,
        "axes_dims": [16, 24, 24],
        "text_layers": 4,
        "default_size": 512,
    },
    # The released Z-Image-Turbo transformer (diffusers' defaults are its config): 2 refiner + 30 main blocks of
    # width 3840 (30 heads of 128) over Qwen3-4B's 2560-wide states.
    "z-image-turbo": {
        "in_channels": 16,
        "dim": 3840,
        "n_layers": 30,
        "n_refiner_layers": 2,
        "n_heads": 30,
        "n_kv_heads": 30,
        "cap_feat_dim": 2560,
        "axes_dims": [32, 48, 48],
        "text_layers": 36,
        "default_size": 1024,
    },
}

RELEASED_TEXT_ENCODERS: dict[str, dict[str, dict[str, Any]]] = {"z-image-turbo": {"text_encoder": QWEN3_4B}}


def preset_transformer_config(preset: str = "z-image-tiny") -> dict[str, Any]:
    """The ``ZImageTransformer2DModel`` constructor arguments of a preset."""
    if preset not in PRESETS:
        raise ConfigError("model", f"unknown Z-Image preset {preset!r}; allowed presets: {', '.join(PRESETS)}")
    config = {k: v for k, v in PRESETS[preset].items() if k not in _NON_TRANSFORMER_KEYS}
    return config | {"all_patch_size": (2,), "all_f_patch_size": (1,), "norm_eps": 1e-5, "qk_norm": True,
                     "rope_theta": 256.0, "t_scale": 1000.0, "axes_lens": [1024, 512, 512]}  # fmt: skip


def preset_vae_config(preset: str = "z-image-tiny") -> dict[str, Any]:
    """The ``AutoencoderKL`` arguments of a preset's VAE (no torch): FLUX.1's layout, a scale and a shift; the
    released-shape preset's at the release's width (84 M parameters, what ``xfuse plan`` counts), the others tiny."""
    config = tiny_vae_config(PRESETS[preset]["default_size"], latent_channels=PRESETS[preset]["in_channels"],
                             scaling_factor=_VAE_SCALING, shift_factor=_VAE_SHIFT, quant_convs=False)  # fmt: skip
    return released_vae(config, preset in RELEASED_TEXT_ENCODERS)


def _text_encoder(width: int, layers: int, tokenizer, seed: int):
    """A ``Qwen3ForCausalLM`` ``width`` wide, ``layers`` deep, one head a layer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, head_dim=width,
                         num_attention_heads=1, num_key_value_heads=1, num_hidden_layers=layers,
                         max_position_embeddings=_MAX_LENGTH, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)  # fmt: skip
    with seeded(seed, "text_encoder"):
        return Qwen3ForCausalLM(config).eval()


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def build_preset_pipeline(preset: str = "z-image-tiny", seed: int = 0):
    """A complete, randomly initialised ``diffusers.ZImagePipeline`` on CPU, float32, eval mode."""
    import torch
    from diffusers import AutoencoderKL, ZImagePipeline, ZImageTransformer2DModel

    config = preset_transformer_config(preset)
    with seeded(seed, "transformer"):
        transformer = ZImageTransformer2DModel(**config).eval()
        # the learned pad tokens start at zero in diffusers; random here, so that a lost pad token shows
        for token in (transformer.x_pad_token, transformer.cap_pad_token):
            torch.nn.init.normal_(token, std=0.5)
    tokenizer = byte_level_tokenizer(QWEN3_SPECIALS, _MAX_LENGTH, QWEN3_CHAT_TEMPLATE)
    text_encoder = _text_encoder(config["cap_feat_dim"], PRESETS[preset]["text_layers"], tokenizer, seed)
    with seeded(seed, "vae"):
        vae = AutoencoderKL(**preset_vae_config(preset)).eval()
    return ZImagePipeline(scheduler=_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)  # fmt: skip


def save_preset_pipeline(path: str | os.PathLike, preset: str = "z-image-tiny", seed: int = 0) -> str:
    """``save_pretrained`` the preset into ``path`` (loads with ``ZImagePipeline.from_pretrained``)."""
    path = os.fspath(path)
    build_preset_pipeline(preset, seed).save_pretrained(path, safe_serialization=True)
    return path
