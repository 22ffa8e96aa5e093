"""Tiny, randomly initialised HunyuanDiT pipelines built offline.

The real HunyuanDiT checkpoint (DiT-g/2, ~1.5 B parameters plus a BERT and an mT5 text encoder) cannot be downloaded
on this project's machines and would be far too slow on CPU anyway. Tests and CPU benchmarks therefore use complete
[`~diffusers.HunyuanDiTPipeline`] objects whose every component is built from a config with random weights:

- `transformer`: a [`~diffusers.HunyuanDiT2DModel`] with the real block structure (patch size 2, learned sigma, long
  skips, 2D RoPE, v1.2 conditioning) but few, narrow blocks;
- `text_encoder` / `tokenizer`: a tiny [`~transformers.BertModel`] and a [`~transformers.BertTokenizer`] built from a
  small in-memory word-piece vocabulary;
- `text_encoder_2` / `tokenizer_2`: a tiny mT5-style [`~transformers.T5EncoderModel`] and a
  [`~transformers.T5Tokenizer`] built from an in-memory list of Unigram `(piece, score)` pairs;
- `vae`: a tiny [`~diffusers.AutoencoderKL`] with four resolution levels, so the VAE scale factor is 8 as the
  pipeline assumes;
- `scheduler`: a [`~diffusers.DDPMScheduler`] with HunyuanDiT's sampling configuration.

Nothing here touches the network, and every weight of every component is a pure function of `seed`: each component
is initialised under its own seed (derived from `seed` and the component's name) inside a forked RNG, so the
caller's global RNG state is left untouched and, for example, `build_tiny_transformer(p, s)` equals the transformer
of `build_tiny_pipeline(p, s)`.

Presets (see `PRESETS`):

- `"tiny"`: for tests; 16 blocks (folded placement at degree 8 needs at least 16), hidden 32;
- `"small"`: for CPU benchmarks; 16 blocks, hidden 256, 512 px by default;
- `"bytes40"`: 40 blocks like the released checkpoint with a tiny hidden size, for counting communication volume.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from xfuse.errors import ConfigError
from xfuse.families.common.presets import (
    CHARS,
    SDXL_VAE_SCALING,
    WORDS,
    divisor_heads,
    released_vae,
    seeded,
    t5_encoder,
    t5_vocab,
    tiny_vae,
    tiny_vae_config,
)
from xfuse.families.common.text_encoders import CHINESE_ROBERTA_LARGE, MT5_XL
from xfuse.families.hunyuandit.spec import HUNYUANDIT

if TYPE_CHECKING:
    from diffusers import HunyuanDiT2DModel, HunyuanDiTPipeline

# torch, diffusers and transformers are imported inside the builders: reading a preset's config (plan checks, the
# CLI) must stay cheap, importing diffusers alone costs seconds per process.

__all__ = [
    "DEFAULT_SIZE",
    "PRESETS",
    "build_preset_pipeline",
    "build_tiny_pipeline",
    "build_tiny_transformer",
    "preset_transformer_config",
    "preset_vae_config",
    "save_tiny_pipeline",
    "tiny_transformer_config",
]

# Settings shared by every preset. They follow the released HunyuanDiT-v1.2 transformer config, except for the sizes
# that the presets shrink. `text_len` / `text_len_t5` must stay 77 / 256: the pipeline pads the BERT and T5 prompts
# to exactly these lengths and the model's learned text padding parameter is sized from them.
_COMMON_TRANSFORMER_KWARGS: dict[str, Any] = {
    "in_channels": 4,
    "patch_size": 2,
    "activation_fn": "gelu-approximate",
    "mlp_ratio": 4.3637,
    "learn_sigma": True,
    "norm_type": "layer_norm",
    "text_len": HUNYUANDIT.text_lengths[0],
    "text_len_t5": HUNYUANDIT.text_lengths[1],
    # v1.2 dropped the style and image-size conditioning; the pipeline still passes `style` / `image_meta_size`
    # and the model simply ignores them.
    "use_style_cond_and_image_meta_size": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    # Tests: one transformer forward at batch 2, 256 px (32x32 latent), 1 thread takes ~0.04 s.
    "tiny": {
        **_COMMON_TRANSFORMER_KWARGS,
        "num_layers": 16,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "cross_attention_dim": 32,
        "cross_attention_dim_t5": 32,
        "pooled_projection_dim": 32,
        "default_size": 256,
    },
    # Benchmarks: one transformer forward at batch 2, 512 px (64x64 latent, 1024 tokens), 1 thread takes ~1.8 s.
    "small": {
        **_COMMON_TRANSFORMER_KWARGS,
        "num_layers": 16,
        "num_attention_heads": 4,
        "attention_head_dim": 64,
        "cross_attention_dim": 64,
        "cross_attention_dim_t5": 64,
        "pooled_projection_dim": 64,
        "default_size": 512,
    },
    # Communication accounting: the released block count (40, so 19 long-skip pairs) with a tiny width; byte counts
    # scale linearly in the hidden size, so they can be rescaled to the real 1408.
    "bytes40": {
        **_COMMON_TRANSFORMER_KWARGS,
        "num_layers": 40,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "cross_attention_dim": 32,
        "cross_attention_dim_t5": 32,
        "pooled_projection_dim": 32,
        "default_size": 256,
    },
    # The released transformer's shape (DiT-g/2, ~1.5 B parameters) with random weights: `xfuse plan` figures and
    # GPU timings of the real configuration. Its text encoders stay tiny (2 layers at the real widths).
    "dit-g2": {
        **_COMMON_TRANSFORMER_KWARGS,
        "num_layers": 40,
        "num_attention_heads": 16,
        "attention_head_dim": 88,
        "cross_attention_dim": 1024,
        "cross_attention_dim_t5": 2048,
        "pooled_projection_dim": 1024,
        "default_size": 1024,
    },
}

# Default image size in pixels of each preset; the pipeline's default height/width is
# `transformer.config.sample_size * vae_scale_factor`, and `tiny_transformer_config` sets `sample_size` to match.
DEFAULT_SIZE: dict[str, int] = {name: preset["default_size"] for name, preset in PRESETS.items()}

# Keys of a preset that are not `HunyuanDiT2DModel` arguments.
_NON_TRANSFORMER_KEYS = frozenset({"default_size"})

# The `HunyuanDiT2DModel.__init__` arguments (diffusers 0.42), listed so that overrides can be checked without
# importing diffusers.
_TRANSFORMER_ARGS = frozenset(
    {
        "num_attention_heads",
        "attention_head_dim",
        "in_channels",
        "patch_size",
        "activation_fn",
        "sample_size",
        "hidden_size",
        "num_layers",
        "mlp_ratio",
        "learn_sigma",
        "cross_attention_dim",
        "norm_type",
        "cross_attention_dim_t5",
        "pooled_projection_dim",
        "text_len",
        "text_len_t5",
        "use_style_cond_and_image_meta_size",
    }
)

_VAE_SCALE_FACTOR = HUNYUANDIT.vae_scale_factor

# Prompt lengths the pipeline pads to; recorded as the tokenizers' `model_max_length`.
_BERT_MAX_LENGTH, _T5_MAX_LENGTH = HUNYUANDIT.text_lengths


# The released-shape presets' text encoders (HunyuanDiT's Chinese RoBERTa-wwm-ext-large (BERT) and mT5-XL's encoder),
# for xfuse plan's memory (the small presets' are the built ones).
RELEASED_TEXT_ENCODERS: dict[str, dict[str, dict[str, Any]]] = {
    "dit-g2": {"text_encoder": CHINESE_ROBERTA_LARGE, "text_encoder_2": MT5_XL}
}


def _check_preset(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        # Same error type and "model: ..." prefix as the config's own check of its `model` key.
        raise ConfigError("model", f"unknown preset {preset!r}; allowed presets: {', '.join(PRESETS)}")
    return PRESETS[preset]


def tiny_transformer_config(preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    r"""
    The [`~diffusers.HunyuanDiT2DModel`] constructor arguments of a preset.

    Args:
        preset (`str`, defaults to `"tiny"`):
            One of the keys of `PRESETS`.
        **overrides:
            `HunyuanDiT2DModel` arguments replacing the preset's. `hidden_size` defaults to
            `num_attention_heads * attention_head_dim` and `sample_size` to the preset's default image size divided by
            the VAE scale factor (8), unless given here.

    Returns:
        `dict`: keyword arguments for `HunyuanDiT2DModel(**config)`.

    Raises:
        `ValueError`: for an unknown preset (a `ConfigError` for the key `model`), or for a configuration that
            HunyuanDiT or its pipeline cannot run: a hidden size other than heads x head dim, a head dim not
            divisible by 4 (2D RoPE splits it in four), a T5 width not divisible by 8 (the attention pooler has 8
            heads), an odd block count (the long skips then pop one more tensor than they push), or text lengths
            other than 77 / 256.
        `TypeError`: for an override that is not a `HunyuanDiT2DModel` argument.
    """
    base = _check_preset(preset)
    unknown = sorted(set(overrides) - _TRANSFORMER_ARGS)
    if unknown:
        raise TypeError(f"Not HunyuanDiT2DModel arguments: {unknown}.")

    config = {key: value for key, value in base.items() if key not in _NON_TRANSFORMER_KEYS}
    config["sample_size"] = base["default_size"] // _VAE_SCALE_FACTOR
    config.update(overrides)
    if "hidden_size" not in overrides:
        config["hidden_size"] = config["num_attention_heads"] * config["attention_head_dim"]
    _validate_transformer_config(config)
    return config


def _validate_transformer_config(config: dict[str, Any]) -> None:
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    # The patch embedding projects to `hidden_size` but the blocks are built with `heads * head_dim`: a mismatch
    # only fails at the first forward.
    if config["hidden_size"] != heads * head_dim:
        raise ValueError(
            f"hidden_size ({config['hidden_size']}) must equal num_attention_heads x attention_head_dim "
            f"({heads} x {head_dim} = {heads * head_dim})."
        )
    if head_dim % 4 != 0:
        raise ValueError(f"attention_head_dim ({head_dim}) must be divisible by 4 for HunyuanDiT's 2D RoPE.")
    if config["cross_attention_dim_t5"] % 8 != 0:
        raise ValueError(
            f"cross_attention_dim_t5 ({config['cross_attention_dim_t5']}) must be divisible by 8 "
            "(the T5 attention pooler uses 8 heads)."
        )
    if config["num_layers"] < 2 or config["num_layers"] % 2 != 0:
        raise ValueError(f"num_layers ({config['num_layers']}) must be even and at least 2 (long skip pairs).")
    if (config["text_len"], config["text_len_t5"]) != (_BERT_MAX_LENGTH, _T5_MAX_LENGTH):
        raise ValueError(
            f"text_len / text_len_t5 must be {_BERT_MAX_LENGTH} / {_T5_MAX_LENGTH}: HunyuanDiTPipeline pads the "
            "prompts to exactly these lengths."
        )


def build_tiny_transformer(preset: str = "tiny", seed: int = 0, **overrides: Any) -> HunyuanDiT2DModel:
    r"""
    Build a randomly initialised [`~diffusers.HunyuanDiT2DModel`] from a preset.

    Args:
        preset (`str`, defaults to `"tiny"`):
            One of the keys of `PRESETS`.
        seed (`int`, defaults to 0):
            Seed of the weights; the same `(preset, seed, overrides)` always gives the same weights, equal to those of
            the transformer of `build_tiny_pipeline(preset, seed, **overrides)`.
        **overrides:
            `HunyuanDiT2DModel` arguments replacing the preset's, see [`tiny_transformer_config`].

    Returns:
        `HunyuanDiT2DModel`: in eval mode, float32, on CPU.
    """
    from diffusers import HunyuanDiT2DModel

    config = tiny_transformer_config(preset, **overrides)
    with seeded(seed, "transformer"):
        model = HunyuanDiT2DModel(**config)
    return model.eval()


def _bert_vocab(extra_words: tuple[str, ...] = ()) -> dict[str, int]:
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens += list(CHARS)
    # Word-piece continuations let unknown English words split into known pieces instead of `[UNK]`.
    tokens += ["##" + char for char in CHARS if char.isalnum() and char.isascii()]
    tokens += [word for word in dict.fromkeys(WORDS + list(extra_words)) if word not in tokens]
    return {token: index for index, token in enumerate(tokens)}


def _build_tokenizers(extra_words: tuple[str, ...] = ()):
    from transformers import BertTokenizer, T5Tokenizer

    # Both are `tokenizers`-backed in transformers 5, which accept an in-memory vocabulary and save a tokenizer.json
    # that `from_pretrained` reloads without sentencepiece or a vocab file.
    tokenizer = BertTokenizer(vocab=_bert_vocab(extra_words), model_max_length=_BERT_MAX_LENGTH)
    # mT5 (unlike T5) has no sentinel `<extra_id_*>` tokens; leaving them out also keeps the vocabulary dense.
    tokenizer_2 = T5Tokenizer(vocab=t5_vocab(extra_words), extra_ids=0, model_max_length=_T5_MAX_LENGTH)
    return tokenizer, tokenizer_2


def _build_text_encoders(transformer_config: dict[str, Any], vocab_size: int, vocab_size_2: int, seed: int):
    from transformers import BertConfig, BertModel

    bert_width = transformer_config["cross_attention_dim"]
    bert_config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=bert_width,
        num_hidden_layers=2,
        num_attention_heads=divisor_heads(bert_width, 16),
        intermediate_size=4 * bert_width,
        max_position_embeddings=128,  # >= the 77 tokens the pipeline feeds
        # No dropout: the pipeline never calls `eval()` on its components, so prompt embeddings must be
        # deterministic even if a caller switches a module to train mode.
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )
    with seeded(seed, "text_encoder"):
        text_encoder = BertModel(bert_config)
    text_encoder_2 = t5_encoder(transformer_config["cross_attention_dim_t5"], vocab_size_2, seed, "text_encoder_2")
    return text_encoder.eval(), text_encoder_2


def _build_scheduler():
    from diffusers import DDPMScheduler

    # HunyuanDiT's sampling configuration: a v-prediction model trained on a scaled-linear schedule with a larger
    # final beta than Stable Diffusion's 0.012.
    return DDPMScheduler(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.03,
        prediction_type="v_prediction",
        clip_sample=False,
        steps_offset=1,
        timestep_spacing="leading",
        variance_type="fixed_small",
    )


def preset_vae_config(preset: str = "tiny") -> dict[str, Any]:
    """The ``AutoencoderKL`` arguments of a preset's VAE (no torch): the SDXL VAE's layout (4 latent channels,
    quant convs, a scale), sized for the preset's default image; tiny, or the release's widths."""
    return released_vae(_vae_config(tiny_transformer_config(preset)["sample_size"]), preset in RELEASED_TEXT_ENCODERS)


def _vae_config(sample_size: int) -> dict[str, Any]:
    return tiny_vae_config(sample_size * _VAE_SCALE_FACTOR, scaling_factor=SDXL_VAE_SCALING)


def build_tiny_pipeline(
    preset: str = "tiny", seed: int = 0, extra_words: tuple[str, ...] = (), **transformer_overrides: Any
) -> HunyuanDiTPipeline:
    r"""
    Build a complete, randomly initialised [`~diffusers.HunyuanDiTPipeline`] offline.

    The text encoders are sized from the transformer config (BERT width = `cross_attention_dim`, T5 `d_model` =
    `cross_attention_dim_t5`), so transformer overrides of those widths stay consistent. No safety checker.

    Args:
        preset (`str`, defaults to `"tiny"`):
            One of the keys of `PRESETS`.
        seed (`int`, defaults to 0):
            Seed of all weights of all components; the global RNG state is left unchanged.
        extra_words (`tuple[str, ...]`, defaults to `()`):
            Whole words added after the built-in vocabulary of both tokenizers (e.g. a training set's caption words,
            so that they are single tokens instead of spellings); the built-in token ids do not move.
        **transformer_overrides:
            `HunyuanDiT2DModel` arguments replacing the preset's, see [`tiny_transformer_config`].

    Returns:
        `HunyuanDiTPipeline`: on CPU, float32, every module in eval mode. Its default image size is
        `DEFAULT_SIZE[preset]` (unless `sample_size` is overridden).
    """
    from diffusers import HunyuanDiTPipeline

    transformer = build_tiny_transformer(preset, seed, **transformer_overrides)
    tokenizer, tokenizer_2 = _build_tokenizers(extra_words)
    text_encoder, text_encoder_2 = _build_text_encoders(
        dict(transformer.config), len(tokenizer), len(tokenizer_2), seed
    )
    vae = tiny_vae(_vae_config(transformer.config.sample_size), seed)
    return HunyuanDiTPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        scheduler=_build_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )


def save_tiny_pipeline(path: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> str:
    r"""
    Build a tiny pipeline and `save_pretrained` it, in the HunyuanDiT-v1.2-Diffusers folder layout.

    The folder then loads with `HunyuanDiTPipeline.from_pretrained(path, local_files_only=True)`.

    Args:
        path (`str` or `os.PathLike`):
            Target folder (created if missing).
        preset (`str`, defaults to `"tiny"`):
            One of the keys of `PRESETS`.
        seed (`int`, defaults to 0):
            Seed of all weights.

    Returns:
        `str`: `path`.
    """
    pipeline = build_tiny_pipeline(preset, seed)
    path = os.fspath(path)
    pipeline.save_pretrained(path, safe_serialization=True)
    return path


# The preset hooks of ``HUNYUANDIT`` (``ModelSpec.preset_builders``).
preset_transformer_config = tiny_transformer_config
build_preset_pipeline = build_tiny_pipeline
save_preset_pipeline = save_tiny_pipeline
