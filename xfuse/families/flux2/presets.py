"""Randomly initialised FLUX.2 [dev] and [klein] pipelines built offline (the ``flux2-*`` presets).

The released FLUX.2 [dev] (a 32 B-parameter transformer and Mistral Small 3.x, a 24 B-parameter text encoder) cannot
be downloaded here. The presets keep its structure:

- ``Flux2Transformer2DModel``: double-stream blocks then single-stream "parallel" blocks (q/k/v fused with the SwiGLU
  MLP's input projection), modulation shared by every block and computed once per step from the timestep and the
  distilled guidance scale, 4-axis RoPE over (t, row, column, l) ids, patchified latents (``in_channels`` = 4 x the
  VAE's latent channels), no pooled text;
- the pipeline's text wiring: a ``Mistral3ForConditionalGeneration`` whose hidden states of layers 10, 20 and 30
  (``Flux2Pipeline``'s ``text_encoder_out_layers``) are stacked into the text tokens, so ``joint_attention_dim`` is 3 x
  its width and it has 30 layers (thin ones: one head), with an in-memory byte-level tokenizer and a chat template
  of Mistral's form ([SYSTEM_PROMPT] ... [INST] ... [/INST]) where the release has a ``PixtralProcessor``;
- an ``AutoencoderKLFlux2`` with scale factor 8 (``AutoencoderKL``'s encoder and decoder) whose BatchNorm running
  statistics, seeded here rather than left at 0 and 1, (de)normalise the patchified latents;
- FLUX.1-dev's ``FlowMatchEulerDiscreteScheduler`` configuration, as the release ships it (resolution-dependent shift;
  ``Flux2Pipeline`` computes its ``mu`` with ``compute_empirical_mu``).

FLUX.2 [klein] (``Flux2KleinPipeline``) has the same transformer without the guidance embedding and a Qwen3 text
encoder (``Qwen3ForCausalLM``, layers 9, 18 and 27 stacked: 27 thin layers here) with a chat template of Qwen's form;
the released 4 B and 9 B are step-distilled (``is_distilled``: no classifier-free guidance), the tiny preset is not,
so that its guidance batch [negative, positive] is exercised.

``flux2-tiny`` and ``flux2-klein-tiny`` are for tests, ``flux2-small`` for CPU speed measurements, ``flux2-dev`` and
``flux2-klein-4b`` / ``-9b`` have the released transformer shapes (random weights) for ``xfuse plan`` and GPU timings.
Weights depend only on the seed (see ``xfuse.families.common.presets``).
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
from xfuse.families.common.text_encoders import MISTRAL_SMALL_3, QWEN3_4B, QWEN3_8B

# The pipelines' defaults: the text is padded to 512 tokens and the hidden states of these layers are stacked
# (Flux2Pipeline's Mistral, Flux2KleinPipeline's Qwen3).
_MAX_LENGTH = 512
_TEXT_LAYERS = {"mistral": (10, 20, 30), "qwen3": (9, 18, 27)}

# Keys of a preset that are not ``Flux2Transformer2DModel`` arguments.
_NON_TRANSFORMER_KEYS = frozenset({"default_size", "text_encoder", "is_distilled"})

# Rules the pipeline relies on: sum(axes_dims_rope) == attention_head_dim, joint_attention_dim == 3 x the text
# encoder's width (three stacked layers), in_channels == 4 x the VAE's latent channels (2 x 2 patchified).
PRESETS: dict[str, dict[str, Any]] = {
    # Tests: 2 double + 3 single blocks, so stage splits fall inside either kind, and dev's guidance embedding.
    "flux2-tiny": {
        "num_layers": 2,
        "num_single_layers": 3,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "axes_dims_rope": (4, 4, 4, 4),
        "in_channels": 16,  # 4 latent channels
        "joint_attention_dim": 48,  # 3 x a 16-wide text encoder
        "timestep_guidance_channels": 32,
        "default_size": 256,
    },
    # CPU speed: 12 blocks of width 256 (4 heads of 64) and the release's 32 latent channels, its 1:6 ratio of double
    # to single blocks rounded.
    "flux2-small": {
        "num_layers": 2,
        "num_single_layers": 10,
        "num_attention_heads": 4,
        "attention_head_dim": 64,
        "axes_dims_rope": (16, 16, 16, 16),
        "in_channels": 128,
        "joint_attention_dim": 96,
        "timestep_guidance_channels": 256,
        "default_size": 256,
    },
    # The released transformer (diffusers' defaults are its config): 8 double + 48 single blocks of 48 heads x 128,
    # Mistral Small's 5120-wide states stacked three deep.
    "flux2-dev": {
        "num_layers": 8,
        "num_single_layers": 48,
        "num_attention_heads": 48,
        "attention_head_dim": 128,
        "axes_dims_rope": (32, 32, 32, 32),
        "in_channels": 128,
        "joint_attention_dim": 15360,
        "timestep_guidance_channels": 256,
        "default_size": 1024,
    },
    # Tests: FLUX.2 [klein]'s pipeline on flux2-tiny's transformer without the guidance embedding, not distilled.
    "flux2-klein-tiny": {
        "num_layers": 2,
        "num_single_layers": 3,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "axes_dims_rope": (4, 4, 4, 4),
        "in_channels": 16,
        "joint_attention_dim": 48,
        "timestep_guidance_channels": 32,
        "default_size": 256,
        "text_encoder": "qwen3",
        "is_distilled": False,
    },
    # The released [klein] transformers (step-distilled): 5 + 20 blocks of 24 x 128 over Qwen3-4B's 2560-wide states,
    # and 8 + 24 blocks of 32 x 128 over Qwen3-8B's 4096-wide ones.
    "flux2-klein-4b": {
        "num_layers": 5,
        "num_single_layers": 20,
        "num_attention_heads": 24,
        "attention_head_dim": 128,
        "axes_dims_rope": (32, 32, 32, 32),
        "in_channels": 128,
        "joint_attention_dim": 7680,
        "timestep_guidance_channels": 256,
        "default_size": 1024,
        "text_encoder": "qwen3",
        "is_distilled": True,
    },
    "flux2-klein-9b": {
        "num_layers": 8,
        "num_single_layers": 24,
        "num_attention_heads": 32,
        "attention_head_dim": 128,
        "axes_dims_rope": (32, 32, 32, 32),
        "in_channels": 128,
        "joint_attention_dim": 12288,
        "timestep_guidance_channels": 256,
        "default_size": 1024,
        "text_encoder": "qwen3",
        "is_distilled": True,
    },
}


def preset_transformer_config(preset: str = "flux2-tiny") -> dict[str, Any]:
    """The ``Flux2Transformer2DModel`` constructor arguments of a preset."""
    if preset not in PRESETS:
        raise ConfigError("model", f"unknown FLUX.2 preset {preset!r}; allowed presets: {', '.join(PRESETS)}")
    config = {k: v for k, v in PRESETS[preset].items() if k not in _NON_TRANSFORMER_KEYS}
    klein = PRESETS[preset].get("text_encoder") == "qwen3"  # [klein] has no guidance embedding
    config.update(patch_size=1, out_channels=None, mlp_ratio=3.0, rope_theta=2000, guidance_embeds=not klein)
    return config


def preset_vae_config(preset: str = "flux2-tiny") -> dict[str, Any]:
    """The ``AutoencoderKLFlux2`` arguments of a preset's VAE (no torch): ``AutoencoderKL``'s layout with quant
    convs, as the release, and no scale or shift (the BatchNorm statistics normalise the latents); tiny, or the
    release's widths."""
    config = tiny_vae_config(PRESETS[preset]["default_size"], latent_channels=PRESETS[preset]["in_channels"] // 4)
    config.pop("force_upcast")  # not an AutoencoderKLFlux2 argument: it never upcasts
    return {"_class_name": "AutoencoderKLFlux2", **released_vae(config, preset in RELEASED_TEXT_ENCODERS)}


def _tokenizer(kind: str):
    """The text encoder's byte-level tokenizer with a chat template of the release's form: Mistral's (system prompt,
    then the user's instruction) or Qwen3's (the user's turn, then the assistant's with thinking off)."""
    return byte_level_tokenizer(_SPECIALS[kind], _MAX_LENGTH, _CHAT_TEMPLATES[kind])


# bos, eos, unk, pad, then the template's markers.
_SPECIALS = {
    "mistral": ["<s>", "</s>", "<unk>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"],
    "qwen3": QWEN3_SPECIALS,
}


_CHAT_TEMPLATES = {
    # The messages Flux2Pipeline builds (a system message and the prompt, each a list of {"type": "text"} parts) as
    # Mistral's instruct format writes them.
    "mistral": (
        "{{ bos_token }}{% for m in messages %}"
        "{% set text = m['content'] if m['content'] is string else "
        "m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
        "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
        "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    "qwen3": QWEN3_CHAT_TEMPLATE,  # Flux2KleinPipeline's one user message, the generation prompt, thinking off
}


# The released text encoders: Mistral Small 3.x (FLUX.2 [dev]'s), Qwen3-4B / Qwen3-8B ([klein] 4B / 9B's).
RELEASED_TEXT_ENCODERS: dict[str, dict[str, dict[str, Any]]] = {
    "flux2-dev": {"text_encoder": MISTRAL_SMALL_3},
    "flux2-klein-4b": {"text_encoder": QWEN3_4B},
    "flux2-klein-9b": {"text_encoder": QWEN3_8B},
}

_TEXT_ENCODER_CLASSES = {"mistral": "Mistral3ForConditionalGeneration", "qwen3": "Qwen3ForCausalLM"}


def _text_encoder_config(kind: str, width: int, tokenizer):
    """The built text encoder's config: ``width`` wide, as deep as the deepest layer the pipeline reads, one head a
    layer; Mistral 3 with a tiny Pixtral vision tower the text path never runs, or Qwen3."""
    from transformers import Mistral3Config, Qwen3Config

    layers = max(_TEXT_LAYERS[kind])
    if kind == "qwen3":
        return Qwen3Config(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, head_dim=width,
                           num_attention_heads=1, num_key_value_heads=1, num_hidden_layers=layers,
                           max_position_embeddings=_MAX_LENGTH, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    text = {"model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": width, "intermediate_size": 2 * width,
            "head_dim": width, "num_attention_heads": 1, "num_key_value_heads": 1,
            "num_hidden_layers": layers, "max_position_embeddings": _MAX_LENGTH, "rms_norm_eps": 1e-5,
            "rope_theta": 1e9, "sliding_window": None, "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
    vision = {"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 1,
              "intermediate_size": 16, "image_size": 32, "patch_size": 16, "num_channels": 3}  # fmt: skip
    return Mistral3Config(text_config=text, vision_config=vision, image_token_index=tokenizer.unk_token_id,
                          vision_feature_layer=-1)  # fmt: skip


def _text_encoder(kind: str, width: int, tokenizer, seed: int):
    """The built text encoder (:func:`_text_encoder_config`): a ``Mistral3ForConditionalGeneration`` or a
    ``Qwen3ForCausalLM``."""
    import transformers

    config = _text_encoder_config(kind, width, tokenizer)
    with seeded(seed, "text_encoder"):
        return getattr(transformers, _TEXT_ENCODER_CLASSES[kind])(config).eval()


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.1-dev's, which the FLUX.2 release ships: the shift grows with the image's token count.
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096)  # fmt: skip


def build_preset_pipeline(preset: str = "flux2-tiny", seed: int = 0):
    """A complete, randomly initialised ``diffusers.Flux2Pipeline`` (a [klein] preset: ``Flux2KleinPipeline``) on CPU,
    float32, eval mode."""
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel

    config = preset_transformer_config(preset)
    with seeded(seed, "transformer"):
        transformer = Flux2Transformer2DModel(**config).eval()
    kind = PRESETS[preset].get("text_encoder", "mistral")
    tokenizer = _tokenizer(kind)
    text_encoder = _text_encoder(kind, config["joint_attention_dim"] // len(_TEXT_LAYERS[kind]), tokenizer, seed)
    vae_config = {k: v for k, v in preset_vae_config(preset).items() if not k.startswith("_")}
    with seeded(seed, "vae"):
        vae = AutoencoderKLFlux2(**vae_config).eval()
        vae.bn.running_mean.copy_(0.5 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(0.5 + torch.rand_like(vae.bn.running_var))
    components = dict(scheduler=_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      transformer=transformer)  # fmt: skip
    if kind == "qwen3":
        return Flux2KleinPipeline(**components, is_distilled=PRESETS[preset]["is_distilled"])
    return Flux2Pipeline(**components)


def save_preset_pipeline(path: str | os.PathLike, preset: str = "flux2-tiny", seed: int = 0) -> str:
    """``save_pretrained`` the preset into ``path`` (loads with its pipeline class's ``from_pretrained``)."""
    path = os.fspath(path)
    build_preset_pipeline(preset, seed).save_pretrained(path, safe_serialization=True)
    return path
