"""Randomly initialised FLUX.1 pipelines built offline (the ``flux-*`` presets).

The released FLUX.1-dev / -schnell (a 12 B-parameter transformer, CLIP-L and a 4.7 B-parameter T5-XXL) cannot be
downloaded here. The presets keep their structure:

- ``FluxTransformer2DModel``: double-stream blocks (separate image / text weights, one joint softmax over
  [text, image]) followed by single-stream blocks, 3-axis RoPE over (0, row, column) ids with per-head q/k RMSNorm,
  2x2-packed latents (``patch_size`` 1, ``in_channels`` = 4 x the VAE's latent channels), AdaLN from timestep,
  pooled CLIP text and (dev only) the distilled guidance scale;
- the pipeline's text wiring: a ``CLIPTextModel`` whose pooled output conditions the blocks and a T5 encoder whose
  states are the text tokens, with an in-memory ``CLIPTokenizer`` and ``T5Tokenizer``
  (``xfuse.families.common.presets``);
- an ``AutoencoderKL`` with scale factor 8, no quant convs and FLUX's ``scaling_factor`` / ``shift_factor``;
- the released ``FlowMatchEulerDiscreteScheduler`` configurations: dev's resolution-dependent shift for the
  guidance-embedding presets, schnell's fixed shift 1 for ``flux-schnell``.

``flux-tiny`` is for tests, ``flux-small`` for CPU speed measurements, ``flux-dev`` / ``flux-schnell`` have the released
transformer shape (random weights) for ``xfuse plan`` and GPU timings; their text encoders are 2 layers deep at the
released widths and their VAE is tiny with the released 16 latent channels, so the pipeline runs end to end. Weights
depend only on the seed (see ``xfuse.families.common.presets``).

``FluxTransformer2DModel`` has no ``sample_size`` and ``FluxPipeline`` always defaults to 1024 px, so a preset's
default size is only recorded here (``DEFAULT_SIZE``): callers pass ``height`` / ``width`` explicitly.
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
from xfuse.families.common.text_encoders import CLIP_L, T5_XXL

# The T5 tokenizer's limit in the released repositories, and FluxPipeline's default max_sequence_length.
_T5_MAX_LENGTH = 512
# The released FLUX.1 VAE's latent normalisation: latents = (z - shift) * scale.
_FLUX_VAE_SCALING, _FLUX_VAE_SHIFT = 0.3611, 0.1159

# Keys of a preset that are not ``FluxTransformer2DModel`` arguments.
_NON_TRANSFORMER_KEYS = frozenset({"default_size"})

# Rules the pipeline relies on: sum(axes_dims_rope) == attention_head_dim (RoPE covers the whole head) with even
# entries, joint_attention_dim == the T5 width, pooled_projection_dim == the CLIP width (FLUX pools CLIP's
# pooler_output, not a projection), in_channels == 4 x the VAE's latent channels (2x2 packing).
PRESETS: dict[str, dict[str, Any]] = {
    # Tests: 2 double + 3 single blocks, so stage splits can fall inside either kind, and dev's guidance embedding.
    "flux-tiny": {
        "num_layers": 2,
        "num_single_layers": 3,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "axes_dims_rope": (4, 4, 8),
        "in_channels": 16,  # 4 latent channels
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "guidance_embeds": True,
        "default_size": 256,
    },
    # CPU speed: 12 blocks of width 256 (4 heads of 64, the release's RoPE split halved) and the release's 16 latent
    # channels; the release's 1:2 ratio of double to single blocks.
    "flux-small": {
        "num_layers": 4,
        "num_single_layers": 8,
        "num_attention_heads": 4,
        "attention_head_dim": 64,
        "axes_dims_rope": (8, 28, 28),
        "in_channels": 64,
        "joint_attention_dim": 32,
        "pooled_projection_dim": 32,
        "guidance_embeds": True,
        "default_size": 256,
    },
    # The released transformers: 19 double + 38 single blocks of 24 heads x 128.
    "flux-dev": {
        "num_layers": 19,
        "num_single_layers": 38,
        "num_attention_heads": 24,
        "attention_head_dim": 128,
        "axes_dims_rope": (16, 56, 56),
        "in_channels": 64,
        "joint_attention_dim": 4096,
        "pooled_projection_dim": 768,
        "guidance_embeds": True,
        "default_size": 1024,
    },
    # schnell is timestep-distilled without a guidance input; otherwise the same transformer.
    "flux-schnell": {
        "num_layers": 19,
        "num_single_layers": 38,
        "num_attention_heads": 24,
        "attention_head_dim": 128,
        "axes_dims_rope": (16, 56, 56),
        "in_channels": 64,
        "joint_attention_dim": 4096,
        "pooled_projection_dim": 768,
        "guidance_embeds": False,
        "default_size": 1024,
    },
}

# Default image size in pixels of each preset (not in the transformer config: FLUX has no sample_size).
DEFAULT_SIZE: dict[str, int] = {name: preset["default_size"] for name, preset in PRESETS.items()}


# The released-shape presets' text encoders (FLUX.1's CLIP-L and T5-XXL's encoder), for xfuse plan's memory (the small
# presets' are the built ones).
RELEASED_TEXT_ENCODERS: dict[str, dict[str, dict[str, Any]]] = {
    **dict.fromkeys(("flux-dev", "flux-schnell"), {"text_encoder": CLIP_L, "text_encoder_2": T5_XXL})
}


def preset_transformer_config(preset: str = "flux-tiny") -> dict[str, Any]:
    """The ``FluxTransformer2DModel`` constructor arguments of a preset."""
    if preset not in PRESETS:
        raise ConfigError("model", f"unknown FLUX preset {preset!r}; allowed presets: {', '.join(PRESETS)}")
    config = {k: v for k, v in PRESETS[preset].items() if k not in _NON_TRANSFORMER_KEYS}
    config["patch_size"] = 1  # the 2x2 patches are packed by the pipeline, not embedded by the model
    config["out_channels"] = config["in_channels"]
    return config


def preset_vae_config(preset: str = "flux-tiny") -> dict[str, Any]:
    """The ``AutoencoderKL`` arguments of a preset's VAE (no torch): FLUX.1's layout, 16 latent channels packed
    2 x 2 into the transformer's, no quant convs, a scale and a shift; tiny, or the release's widths."""
    config = tiny_vae_config(
        PRESETS[preset]["default_size"],
        latent_channels=preset_transformer_config(preset)["in_channels"] // 4,
        scaling_factor=_FLUX_VAE_SCALING,
        shift_factor=_FLUX_VAE_SHIFT,
        quant_convs=False,
    )
    return released_vae(config, preset in RELEASED_TEXT_ENCODERS)


def _build_scheduler(guidance_embeds: bool):
    from diffusers import FlowMatchEulerDiscreteScheduler

    if guidance_embeds:
        # FLUX.1-dev's: the shift grows with the image's token count (mu from 0.5 at 256 tokens to 1.15 at 4096).
        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000,
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        )
    # FLUX.1-schnell's: no shift (its few steps were distilled on the plain schedule).
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def build_preset_pipeline(preset: str = "flux-tiny", seed: int = 0):
    """A complete, randomly initialised ``diffusers.FluxPipeline`` (CPU, float32, eval mode)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from transformers import T5Tokenizer

    config = preset_transformer_config(preset)
    with seeded(seed, "transformer"):
        transformer = FluxTransformer2DModel(**config).eval()
    tokenizer = clip_tokenizer()  # CLIP-L's: pads with the end token
    # CLIP-L (quick-GELU) without the projection head: FLUX conditions on pooler_output.
    text_encoder = clip_text_encoder(
        config["pooled_projection_dim"], tokenizer, seed, "text_encoder", with_projection=False, hidden_act="quick_gelu"
    )
    tokenizer_2 = T5Tokenizer(vocab=t5_vocab(), extra_ids=0, model_max_length=_T5_MAX_LENGTH)
    text_encoder_2 = t5_encoder(config["joint_attention_dim"], len(t5_vocab()), seed, "text_encoder_2")
    vae = tiny_vae(preset_vae_config(preset), seed)
    return FluxPipeline(
        scheduler=_build_scheduler(config["guidance_embeds"]),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def save_preset_pipeline(path: str | os.PathLike, preset: str = "flux-tiny", seed: int = 0) -> str:
    """``save_pretrained`` the preset into ``path`` (loads with ``FluxPipeline.from_pretrained``)."""
    path = os.fspath(path)
    build_preset_pipeline(preset, seed).save_pretrained(path, safe_serialization=True)
    return path
