"""Randomly initialised Stable Diffusion 3 / 3.5 pipelines built offline (the ``sd3-*`` / ``sd35-*`` presets).

The released checkpoints (SD3-medium 2 B, SD3.5-medium 2.5 B, SD3.5-large 8.1 B parameters, each with CLIP-L,
OpenCLIP-bigG and a 4.7 B-parameter T5-XXL) cannot be downloaded here. The presets keep their structure:

- ``SD3Transformer2DModel``: MMDiT joint blocks (image and text in one softmax, the last block ``context_pre_only``),
  patch size 2, a cropped sin-cos position table (``pos_embed_max_size``), AdaLN from timestep + pooled text;
  ``sd35-*`` adds SD3.5-medium's image-only ``attn2`` in the first blocks and per-head RMSNorm on q/k;
- the three text encoders in the pipeline's own wiring: two ``CLIPTextModelWithProjection`` (hidden states
  concatenated then zero-padded to the T5 width, projections concatenated into the pooled vector) and a T5 encoder,
  with in-memory ``CLIPTokenizer``s (byte-level BPE) and a ``T5Tokenizer`` (``xfuse.models.tiny``'s vocabulary);
- an ``AutoencoderKL`` with scale factor 8, no quant convs and SD3's ``scaling_factor`` / ``shift_factor``;
- SD3's ``FlowMatchEulerDiscreteScheduler`` (shift 3.0, no dynamic shifting).

``sd3-tiny`` / ``sd35-tiny`` are for tests, ``sd3-small`` for CPU speed measurements. ``sd3-medium``,
``sd3.5-medium`` and ``sd3.5-large`` have the released transformer shapes (random weights) for ``xfuse plan`` and
GPU timings; their text encoders are 2 layers deep at the released widths and their VAE is tiny with the released 16
latent channels, so the pipeline runs end to end. Weights depend only on the seed (see ``xfuse.models.tiny``).
"""

from __future__ import annotations

import os
from typing import Any

from xfuse.errors import ConfigError
from xfuse.models.tiny import _WORDS, _divisor_heads, _seeded, _t5_vocab, tiny_t5_encoder

# Pixels per latent row/column: AutoencoderKL with four levels (three 2x downsamplings), as the released VAE.
_VAE_SCALE_FACTOR = 8
# CLIP's context (the pipeline pads both CLIP prompts to the tokenizer's model_max_length) and the T5 tokenizer's
# limit in the released repository (the pipeline's own default max_sequence_length is 256).
_CLIP_MAX_LENGTH = 77
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
    # The released transformers (scripts/convert_sd3_to_diffusers.py: heads = blocks, head dim 64).
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


def _clip_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary and merges for CLIP: every byte, plus whole-word tokens for ``tiny._WORDS``."""
    from tokenizers import pre_tokenizers

    # All 256 byte symbols, bare and word-final, so any text encodes without the unknown token (which is CLIP's end
    # token: an unknown piece would otherwise end the prompt for the pooler, which takes the first end token).
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|startoftext|>", "<|endoftext|>", *alphabet, *(char + "</w>" for char in alphabet)]
    # The merges are learnt by plain BPE training on the listed words (most frequent pair first, ties by the pair
    # itself, so the result is fixed): encoding replays training, so every listed word becomes one token, which
    # hand-ordered merge chains do not guarantee (one word's merge can split another word first).
    words = [[*word[:-1], word[-1] + "</w>"] for word in _WORDS if word.isalpha()]  # CLIP splits digits off
    merges: list[tuple[str, str]] = []
    while True:
        counts: dict[tuple[str, str], int] = {}
        for word in words:
            for pair in zip(word, word[1:]):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        pair = min(counts, key=lambda p: (-counts[p], p))
        merges.append(pair)
        if pair[0] + pair[1] not in tokens:  # two pairs can spell the same token; keep the ids dense
            tokens.append(pair[0] + pair[1])
        words = [_merge(word, pair) for word in words]
    return {token: index for index, token in enumerate(tokens)}, merges


def _merge(word: list[str], pair: tuple[str, str]) -> list[str]:
    merged, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            merged.append(word[i] + word[i + 1])
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return merged


def clip_tokenizer(pad_token: str = "<|endoftext|>"):
    """A ``CLIPTokenizer`` built in memory (transformers 5 takes the vocabulary and merges as Python objects)."""
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab()
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=_CLIP_MAX_LENGTH)


def clip_text_encoder(width: int, tokenizer, seed: int, component: str, *, with_projection: bool, hidden_act: str):
    """A 2-layer CLIP text encoder of ``width`` (projection to ``width`` too), seeded per component."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=4 * width,
        projection_dim=width,
        num_hidden_layers=2,  # SD3 reads hidden_states[-2], so one layer would leave only the embeddings
        # The released CLIPs' 64-wide heads where the width allows, else 16-wide ones.
        num_attention_heads=_divisor_heads(width, 64 if width % 64 == 0 else 16),
        max_position_embeddings=_CLIP_MAX_LENGTH,
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        attention_dropout=0.0,
        dropout=0.0,
        # The pooler takes the first end token; ids from the tokenizer, not CLIP's legacy eos id 2 (argmax rule).
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model_class = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    with _seeded(seed, component):
        return model_class(config).eval()


def flow_vae(latent_channels: int, sample_size: int, seed: int, *, scaling_factor: float, shift_factor: float):
    """A tiny ``AutoencoderKL`` with scale factor 8 and the latent layout and normalisation of SD3 / FLUX's VAE."""
    from diffusers import AutoencoderKL

    # Four levels -> scale factor 8, which the pipelines derive from block_out_channels. The released SD3 and FLUX
    # VAEs have no quant convs and normalise latents with a shift as well as a scale.
    with _seeded(seed, "vae"):
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16),
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=4,
            sample_size=sample_size,
            scaling_factor=scaling_factor,
            shift_factor=shift_factor,
            use_quant_conv=False,
            use_post_quant_conv=False,
            force_upcast=False,
        )
    return vae.eval()


def build_preset_pipeline(preset: str = "sd3-tiny", seed: int = 0):
    """A complete, randomly initialised ``diffusers.StableDiffusion3Pipeline`` (CPU, float32, eval mode)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import T5Tokenizer

    config = preset_transformer_config(preset)
    base = PRESETS[preset]
    with _seeded(seed, "transformer"):
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
    tokenizer_3 = T5Tokenizer(vocab=_t5_vocab(), extra_ids=0, model_max_length=_T5_MAX_LENGTH)
    text_encoder_3 = tiny_t5_encoder(config["joint_attention_dim"], len(_t5_vocab()), seed, "text_encoder_3")
    vae = flow_vae(
        config["in_channels"], base["default_size"], seed, scaling_factor=_SD3_VAE_SCALING, shift_factor=_SD3_VAE_SHIFT
    )
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
