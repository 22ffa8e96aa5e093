"""Randomly initialised Qwen-Image pipelines built offline (the ``qwen-image-*`` presets).

The released Qwen-Image (a 20 B-parameter transformer and Qwen2.5-VL-7B, an 8.3 B-parameter text encoder) cannot be
downloaded here. The presets keep its structure:

- ``QwenImageTransformer2DModel``: double-stream MMDiT blocks only, each with its own image and text modulation,
  complex 3-axis RoPE (``QwenEmbedRope``, rows and columns centred), packed 2 x 2 latents (``in_channels`` = 4 x the
  VAE's latent channels), ``joint_attention_dim`` = the text encoder's width;
- the pipeline's text wiring: a ``Qwen2_5_VLForConditionalGeneration`` whose last hidden state, the chat template's
  first 34 tokens dropped (``QwenImagePipeline.prompt_template_encode_start_idx``), is the text, each prompt at its own
  length; with an in-memory byte-level tokenizer (Qwen's ``<|im_start|>`` / ``<|im_end|>`` markers one token each)
  where the release has a ``Qwen2Tokenizer``, so the 34 dropped tokens are the template's first 34 bytes here;
- an ``AutoencoderKLQwenImage`` (Wan's causal 3-D VAE, one frame) with the release's factors (8 px per latent row and
  column) and per-channel latent statistics (diffusers' defaults, the release's, cut to the preset's channels);
- ``FlowMatchEulerDiscreteScheduler`` with dynamic, exponential time shifting as the release's
  ``scheduler_config.json`` sets it (``QwenImagePipeline`` computes its ``mu`` from the image's token count).

``qwen-image-tiny`` is for tests, ``qwen-image-small`` for CPU speed measurements, ``qwen-image`` has the released
transformer shape (random weights) for ``xfuse plan`` and GPU timings. Weights depend only on the seed (see
``xfuse.families.common.presets``).
"""

from __future__ import annotations

import os
from typing import Any

from xfuse.errors import ConfigError
from xfuse.families.common.presets import byte_level_tokenizer, seeded
from xfuse.families.common.text_encoders import QWEN2_5_VL_7B

# QwenImagePipeline tokenizes with max_length = tokenizer_max_length (1024) + the 34 template tokens it drops.
_MAX_LENGTH = 1024 + 34
_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|unk|>", "<|endoftext|>"]  # bos, eos, unk, pad (as the tokenizer's)

# Keys of a preset that are not ``QwenImageTransformer2DModel`` arguments.
_NON_TRANSFORMER_KEYS = frozenset({"default_size", "text_layers"})

# Rules the pipeline relies on: sum(axes_dims_rope) == attention_head_dim, joint_attention_dim == the text encoder's
# width, in_channels == 4 x the VAE's latent channels (2 x 2 packed) == 4 x out_channels.
PRESETS: dict[str, dict[str, Any]] = {
    # Tests: 4 blocks (pp3 and pp4 splits), 2 heads (Ulysses 2), a 32-wide text encoder of 4 layers (split pp4).
    "qwen-image-tiny": {
        "num_layers": 4,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "axes_dims_rope": (4, 6, 6),
        "in_channels": 16,  # 4 latent channels
        "out_channels": 4,
        "joint_attention_dim": 32,
        "text_layers": 4,
        "default_size": 256,
    },
    # CPU speed: 12 blocks of width 256 (4 heads of 64) and the release's 16 latent channels.
    "qwen-image-small": {
        "num_layers": 12,
        "num_attention_heads": 4,
        "attention_head_dim": 64,
        "axes_dims_rope": (16, 24, 24),
        "in_channels": 64,
        "out_channels": 16,
        "joint_attention_dim": 128,
        "text_layers": 4,
        "default_size": 256,
    },
    # The released transformer (diffusers' defaults are its config): 60 blocks of 24 heads x 128 over Qwen2.5-VL-7B's
    # 3584-wide states.
    "qwen-image": {
        "num_layers": 60,
        "num_attention_heads": 24,
        "attention_head_dim": 128,
        "axes_dims_rope": (16, 56, 56),
        "in_channels": 64,
        "out_channels": 16,
        "joint_attention_dim": 3584,
        "text_layers": 28,
        "default_size": 1024,
    },
}

# The released text encoder: Qwen2.5-VL-7B-Instruct (its vision tower included: the pipeline loads the whole model).
RELEASED_TEXT_ENCODERS: dict[str, dict[str, dict[str, Any]]] = {"qwen-image": {"text_encoder": QWEN2_5_VL_7B}}


def preset_transformer_config(preset: str = "qwen-image-tiny") -> dict[str, Any]:
    """The ``QwenImageTransformer2DModel`` constructor arguments of a preset."""
    if preset not in PRESETS:
        raise ConfigError("model", f"unknown Qwen-Image preset {preset!r}; allowed presets: {', '.join(PRESETS)}")
    config = {k: v for k, v in PRESETS[preset].items() if k not in _NON_TRANSFORMER_KEYS}
    return config | {"patch_size": 2, "guidance_embeds": False}


# The released VAE's per-channel latent statistics (AutoencoderKLQwenImage's defaults).
_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517, -0.3632,
                 -0.1922, -0.9497, 0.2503, -0.2921)  # fmt: skip
_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579, 1.6382,
                1.1253, 2.8251, 1.916)  # fmt: skip


def preset_vae_config(preset: str = "qwen-image-tiny") -> dict[str, Any]:
    """The ``AutoencoderKLQwenImage`` config of a preset's VAE (``_class_name`` included, as its ``config.json`` has
    it): the release's four levels (8x spatial compression; the 4x temporal one unused by one frame); the
    released-shape preset's at the release's width (base_dim 96, two residual blocks per level: 127 M parameters,
    what ``xfuse plan`` counts), the others at a 24th of it (base_dim 4) with one residual block per level."""
    z_dim = PRESETS[preset]["out_channels"]
    base_dim, res_blocks = (96, 2) if preset in RELEASED_TEXT_ENCODERS else (4, 1)
    return {"_class_name": "AutoencoderKLQwenImage", "base_dim": base_dim, "z_dim": z_dim, "dim_mult": [1, 2, 4, 4],
            "num_res_blocks": res_blocks, "attn_scales": [], "temperal_downsample": [False, True, True],
            "dropout": 0.0, "latents_mean": list(_LATENTS_MEAN[:z_dim]),
            "latents_std": list(_LATENTS_STD[:z_dim])}  # fmt: skip


def _text_encoder(width: int, layers: int, tokenizer, seed: int):
    """A ``Qwen2_5_VLForConditionalGeneration`` ``width`` wide, ``layers`` deep (two heads, one K/V head, Qwen2.5-VL's
    multimodal RoPE sections scaled down) with a one-block vision tower the text path never runs."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = width // 2
    sections = [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]  # the release's 16:24:24 of head_dim / 2
    text = {"hidden_size": width, "intermediate_size": 2 * width, "num_hidden_layers": layers,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": len(tokenizer),
            "max_position_embeddings": 2 * _MAX_LENGTH, "rope_scaling": {"type": "mrope", "mrope_section": sections},
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id}  # fmt: skip
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": width,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}  # fmt: skip
    with seeded(seed, "text_encoder"):
        return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision)).eval()


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
                                           max_image_seq_len=8192, shift_terminal=0.02,
                                           time_shift_type="exponential")  # fmt: skip


def build_preset_pipeline(preset: str = "qwen-image-tiny", seed: int = 0):
    """A complete, randomly initialised ``diffusers.QwenImagePipeline`` on CPU, float32, eval mode."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

    config = preset_transformer_config(preset)
    with seeded(seed, "transformer"):
        transformer = QwenImageTransformer2DModel(**config).eval()
    tokenizer = byte_level_tokenizer(_SPECIALS, _MAX_LENGTH)
    text_encoder = _text_encoder(config["joint_attention_dim"], PRESETS[preset]["text_layers"], tokenizer, seed)
    vae_config = {k: v for k, v in preset_vae_config(preset).items() if not k.startswith("_")}
    with seeded(seed, "vae"):
        vae = AutoencoderKLQwenImage(**vae_config).eval()
    return QwenImagePipeline(scheduler=_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)  # fmt: skip


def save_preset_pipeline(path: str | os.PathLike, preset: str = "qwen-image-tiny", seed: int = 0) -> str:
    """``save_pretrained`` the preset into ``path`` (loads with ``QwenImagePipeline.from_pretrained``)."""
    path = os.fspath(path)
    build_preset_pipeline(preset, seed).save_pretrained(path, safe_serialization=True)
    return path
