"""Randomly initialised Wan 2.1 / 2.2 pipelines built offline (the ``wan-*`` / ``wan2.1-*`` / ``wan2.2-*`` presets).

The released Wan2.1-T2V-1.3B / -14B (a 1.3 B / 14 B-parameter transformer, the 5.7 B-parameter UMT5-XXL encoder and a
127 M-parameter causal video VAE) cannot be downloaded here. The presets keep their structure:

- ``WanTransformer3DModel``: (1, 2, 2) patches of the latent video (one token per latent frame x 2x2 latent pixels),
  blocks of self-attention over all the video's tokens with 3-axis RoPE (each head split into frame / row / column
  parts) and q/k RMSNorm across heads, cross-attention to the projected UMT5 text (``cross_attn_norm``: LayerNorm on
  its queries) and a GELU MLP, modulated by a per-block table plus the timestep's projection;
- the pipeline's text wiring: a ``UMT5EncoderModel`` whose last hidden states, cut at each prompt's length and
  zero-padded to ``max_sequence_length`` (512) tokens, are the text every block cross-attends to, with an in-memory
  ``T5Tokenizer`` (``xfuse.families.common.presets``' vocabulary; the release uses UMT5's 256 k-piece one);
- an ``AutoencoderKLWan`` with the release's factors: 8 px per latent row / column and causal 4x time compression
  (``1 + 4k`` frames -> ``1 + k`` latent frames), its per-channel ``latents_mean`` / ``latents_std`` being the
  release's first ``z_dim`` values;
- the released ``UniPCMultistepScheduler`` configuration (flow prediction on flow sigmas, ``flow_shift`` 3.0 as
  diffusers' conversion script writes it for the Wan2.1-T2V folders, Wan's setting for 480p; for 720p Wan uses 5.0:
  ``UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=5.0)``).

``wan-tiny`` (and ``wan2.2-tiny``, two experts; ``wan2.2-ti2v-tiny``, TI2V on a 16 px VAE) is for tests,
``wan-small`` for CPU speed measurements, ``wan2.1-t2v-1.3b`` / ``wan2.1-t2v-14b`` / ``wan2.2-t2v-a14b`` (two experts
of the 14B's shape) / ``wan2.2-ti2v-5b`` (Wan 2.2's VAE, 48 latent channels) have the released
transformer shapes (random weights; diffusers' ``scripts/convert_wan_to_diffusers.py`` configs) and the released
VAEs' (Wan 2.1's 127 M-parameter one; the 5B's Wan 2.2 VAE, 48 latent channels, a 256-wide decoder) for ``xfuse
plan`` and GPU timings; their text encoder is 2 layers deep at the released width 4096. Weights depend only on the
seed (see ``xfuse.families.common.presets``).

``WanTransformer3DModel`` has no ``sample_size`` and ``WanPipeline`` always defaults to 480 x 832 px and 81 frames, so a
preset's default video size is only recorded here (``DEFAULT_SIZE``): callers pass ``height`` / ``width`` /
``num_frames`` explicitly.
"""

from __future__ import annotations

import os
from typing import Any

from xfuse.errors import ConfigError
from xfuse.families.common.presets import seeded, t5_encoder, t5_vocab
from xfuse.families.common.text_encoders import UMT5_XXL

# WanPipeline's default max_sequence_length: prompts are cut to, and their states zero-padded to, 512 tokens.
_T5_MAX_LENGTH = 512
# The released Wan 2.1 VAE's per-channel latent statistics (AutoencoderKLWan's defaults): the pipeline decodes
# latents / (1 / std) + mean. A VAE with fewer latent channels takes the first ones.
_WAN_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
_WAN_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip

# The released Wan 2.2 VAE's (TI2V-5B's: 48 latent channels) statistics, as diffusers' conversion script writes them.
_WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
_WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip

# Keys of a preset that are not ``WanTransformer3DModel`` arguments.
_NON_TRANSFORMER_KEYS = frozenset({"default_size", "boundary_ratio", "flow_shift", "expand_timesteps"})

# Every Wan 2.1 text-to-video transformer shares these (diffusers' conversion configs for T2V-1.3B and T2V-14B; an
# image-to-video transformer would add ``image_dim`` / ``added_kv_proj_dim``).
_COMMON: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "freq_dim": 256,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}

# Rules the pipeline relies on: the RoPE splits each head into h = w = 2 * (attention_head_dim // 6) channels for rows
# and columns and the rest for frames, all even and positive (16 -> 8 + 4 + 4, 64 -> 24 + 20 + 20, 128 -> 44 + 42 +
# 42); text_dim == the UMT5 width; in_channels == the VAE's z_dim. Videos: height and width multiples of 16 px (VAE
# factor 8 x patch 2), 1 + 4k frames. ``default_size`` is (height, width, num_frames).
PRESETS: dict[str, dict[str, Any]] = {
    # Tests: 4 blocks of 2 heads x 16, 4 latent channels; a 128 x 224 px, 9-frame video (the release's aspect ratio)
    # is 3 latent frames of 8 x 14 tokens.
    "wan-tiny": {
        "num_layers": 4,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "in_channels": 4,
        "text_dim": 32,
        "ffn_dim": 64,
        "default_size": (128, 224, 9),
    },
    # CPU speed: 16 blocks of width 256 (4 heads of 64), the block count and width of ``sd3-small`` and
    # ``pixart-small``, with an MLP 4x as wide and the release's 16 latent channels; a 192 x 336 px, 17-frame video
    # is 5 latent frames of 12 x 21 tokens (1260 tokens).
    "wan-small": {
        "num_layers": 16,
        "num_attention_heads": 4,
        "attention_head_dim": 64,
        "in_channels": 16,
        "text_dim": 32,
        "ffn_dim": 1024,
        "default_size": (192, 336, 17),
    },
    # The released transformers: 30 blocks of 12 heads x 128 (width 1536) and 40 blocks of 40 heads x 128 (width 5120).
    "wan2.1-t2v-1.3b": {
        "num_layers": 30,
        "num_attention_heads": 12,
        "attention_head_dim": 128,
        "in_channels": 16,
        "text_dim": 4096,
        "ffn_dim": 8960,
        "default_size": (480, 832, 81),
    },
    "wan2.1-t2v-14b": {
        "num_layers": 40,
        "num_attention_heads": 40,
        "attention_head_dim": 128,
        "in_channels": 16,
        "text_dim": 4096,
        "ffn_dim": 13824,
        "default_size": (480, 832, 81),
    },
}

# Wan 2.2's two experts (Wan2.2-T2V-A14B): a high-noise and a low-noise transformer of the 14B's shape, the first for
# timesteps >= boundary_ratio x 1000 (0.875), its UniPC shift 12 (the release's T2V config: sample_shift 12.0, boundary
# 0.875, guidance 4.0 high / 3.0 low); the release's Wan 2.1 VAE. Tests of the two experts: wan-tiny's shape twice
# (each expert its own seed), the release's boundary and shift.
_TWO_EXPERTS = {"boundary_ratio": 0.875, "flow_shift": 12.0}
PRESETS["wan2.2-t2v-a14b"] = {**PRESETS["wan2.1-t2v-14b"], **_TWO_EXPERTS}
PRESETS["wan2.2-tiny"] = {**PRESETS["wan-tiny"], **_TWO_EXPERTS}

# Wan 2.2 TI2V-5B: one transformer of 30 blocks of 24 heads x 128 (width 3072) on the Wan 2.2 VAE's 48 latent
# channels (16 px per latent pixel, so a token is 32 x 32 px), every token with its own timestep
# (``expand_timesteps``; image-to-video gives the first latent frame's tokens timestep 0); the release's shift 5 and
# 1280 x 704 px, 121 frames (24 fps). Tests: wan-tiny's blocks on 8 latent channels, a 128 x 224 px, 9-frame clip (3
# latent frames of 4 x 7 tokens).
_TI2V = {"expand_timesteps": True, "flow_shift": 5.0}
PRESETS["wan2.2-ti2v-5b"] = {
    "num_layers": 30,
    "num_attention_heads": 24,
    "attention_head_dim": 128,
    "in_channels": 48,
    "text_dim": 4096,
    "ffn_dim": 14336,
    "default_size": (704, 1280, 121),
    **_TI2V,
}
PRESETS["wan2.2-ti2v-tiny"] = {**PRESETS["wan-tiny"], "in_channels": 8, **_TI2V}

# Default video size of each preset: (height, width, num_frames) (not in the transformer config: Wan has no
# sample_size).
DEFAULT_SIZE: dict[str, tuple[int, int, int]] = {name: preset["default_size"] for name, preset in PRESETS.items()}


# The released-shape presets' text encoders (Wan 2.1 / 2.2's UMT5-XXL encoder), for xfuse plan's memory (the small
# presets' are the built ones).
RELEASED_TEXT_ENCODERS: dict[str, dict[str, dict[str, Any]]] = {
    **dict.fromkeys(
        ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-t2v-a14b", "wan2.2-ti2v-5b"), {"text_encoder": UMT5_XXL}
    )
}


def preset_transformer_config(preset: str = "wan-tiny") -> dict[str, Any]:
    """The ``WanTransformer3DModel`` constructor arguments of a preset."""
    if preset not in PRESETS:
        raise ConfigError("model", f"unknown Wan preset {preset!r}; allowed presets: {', '.join(PRESETS)}")
    config = {k: v for k, v in PRESETS[preset].items() if k not in _NON_TRANSFORMER_KEYS} | _COMMON
    config["out_channels"] = config["in_channels"]
    return config


def preset_vae_config(preset: str = "wan-tiny") -> dict[str, Any]:
    """The ``AutoencoderKLWan`` config of a preset's VAE (``_class_name`` included, as its ``config.json`` has it)."""
    return {"_class_name": "AutoencoderKLWan", **_vae_config(preset)}


def _vae_config(preset: str) -> dict[str, Any]:
    # The release's layout (four levels: 8x spatial, 4x temporal compression; no attention outside the mid blocks) at
    # a 24th of its width (base_dim 4 instead of 96) and one residual block per level instead of two. Wan's VAE
    # decodes latent frame by frame through full-resolution causal 3D convolutions, so even this one costs seconds on
    # CPU at wan-small's default size (base_dim 8 would double it). Wan 2.2's (the TI2V presets'): the same levels
    # with residual shortcuts on 2 x 2 patches of the frames (12 channels in and out), so 16 px per latent pixel.
    z_dim = preset_transformer_config(preset)["in_channels"]
    wan22 = PRESETS[preset].get("expand_timesteps", False)
    mean, std = (_WAN22_LATENTS_MEAN, _WAN22_LATENTS_STD) if wan22 else (_WAN_LATENTS_MEAN, _WAN_LATENTS_STD)
    config = {
        "base_dim": 4,
        "z_dim": z_dim,
        "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 1,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
        "dropout": 0.0,
        "latents_mean": list(mean[:z_dim]),
        "latents_std": list(std[:z_dim]),
        "scale_factor_temporal": 4,
        "scale_factor_spatial": 8,
    }
    if wan22:
        config |= {"is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2}
        config |= {"scale_factor_spatial": 16}
    return config | RELEASED_VAE_WIDTHS.get(preset, {})


# The released VAEs' widths (the diffusers folders' vae/config.json: Wan2.1-T2V-*-Diffusers, also Wan 2.2 A14B's;
# Wan2.2-TI2V-5B-Diffusers), for the released-shape presets: the decode's memory and time in xfuse plan are theirs.
_WAN21_VAE = {"base_dim": 96, "num_res_blocks": 2}
_WAN22_VAE = {"base_dim": 160, "decoder_base_dim": 256, "num_res_blocks": 2}
RELEASED_VAE_WIDTHS: dict[str, dict[str, Any]] = {
    "wan2.1-t2v-1.3b": _WAN21_VAE,
    "wan2.1-t2v-14b": _WAN21_VAE,
    "wan2.2-t2v-a14b": _WAN21_VAE,
    "wan2.2-ti2v-5b": _WAN22_VAE,
}


def _build_scheduler(flow_shift: float = 3.0):
    from diffusers import UniPCMultistepScheduler

    # The Wan2.1-T2V diffusers folders' scheduler (480p's shift; see the module docstring for 720p's); every other
    # setting is UniPC's default, as diffusers' conversion script leaves it (order 2, bh2, linspace, final sigma 0).
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=flow_shift
    )


def build_preset_pipeline(
    preset: str = "wan-tiny",
    seed: int = 0,
    extra_words: tuple[str, ...] = (),
    vae_overrides: dict[str, Any] | None = None,
    **transformer_overrides: Any,
):
    """A complete, randomly initialised ``diffusers.WanPipeline`` (CPU, float32, eval mode).

    ``extra_words``: whole words added after the built-in vocabulary of the tokenizer (a training set's caption words,
    one token each; the built-in ids do not move). ``vae_overrides`` and ``transformer_overrides``: constructor
    arguments of ``AutoencoderKLWan`` and ``WanTransformer3DModel`` replacing the preset's (``out_channels`` follows
    ``in_channels``, the VAE's ``z_dim`` the transformer's ``in_channels``)."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import T5Tokenizer

    config, boundary = preset_transformer_config(preset) | transformer_overrides, PRESETS[preset].get("boundary_ratio")
    config["out_channels"] = config["in_channels"]
    with seeded(seed, "transformer"):
        transformer = WanTransformer3DModel(**config).eval()
    experts = {}
    if boundary is not None:  # Wan 2.2: the low-noise expert, same shape, its own weights
        with seeded(seed, "transformer_2"):
            experts = {"transformer_2": WanTransformer3DModel(**config).eval(), "boundary_ratio": boundary}
    vocab = t5_vocab(extra_words)
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=_T5_MAX_LENGTH)
    text_encoder = t5_encoder(config["text_dim"], len(vocab), seed, "text_encoder", umt5=True)
    vae_config = _vae_config(preset) | {"z_dim": config["in_channels"]} | (vae_overrides or {})
    with seeded(seed, "vae"):
        vae = AutoencoderKLWan(**vae_config).eval()
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=_build_scheduler(PRESETS[preset].get("flow_shift", 3.0)),
        transformer=transformer,
        expand_timesteps=PRESETS[preset].get("expand_timesteps", False),
        **experts,
    )


def save_preset_pipeline(path: str | os.PathLike, preset: str = "wan-tiny", seed: int = 0) -> str:
    """``save_pretrained`` the preset into ``path`` (loads with ``WanPipeline.from_pretrained``)."""
    path = os.fspath(path)
    build_preset_pipeline(preset, seed).save_pretrained(path, safe_serialization=True)
    return path
