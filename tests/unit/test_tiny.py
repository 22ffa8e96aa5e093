"""Tests of `xfuse.families.hunyuandit.presets`: offline, seeded, save/load-stable tiny HunyuanDiT pipelines."""

import json
import os

import numpy as np
import pytest
import torch
from diffusers import HunyuanDiTPipeline

from xfuse.families.hunyuandit.presets import (
    DEFAULT_SIZE,
    PRESETS,
    build_tiny_pipeline,
    build_tiny_transformer,
    save_tiny_pipeline,
    tiny_transformer_config,
)
from xfuse.families.registry import HUNYUANDIT, PRESET_MODELS

MODULES = ("transformer", "vae", "text_encoder", "text_encoder_2")
PROMPT = "A photo of a cute cat in the snow, 一只猫"


def _generate(pipeline: HunyuanDiTPipeline) -> np.ndarray:
    pipeline.set_progress_bar_config(disable=True)
    return pipeline(
        PROMPT,
        height=64,
        width=64,
        num_inference_steps=2,
        use_resolution_binning=False,  # the tiny size is not one of the 10 supported shapes
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _public(config) -> dict:
    # `from_pretrained` adds bookkeeping keys (`_name_or_path`, `_class_name`, `_diffusers_version`).
    return {key: value for key, value in config.items() if not key.startswith("_")}


@pytest.fixture(scope="module")
def pipeline() -> HunyuanDiTPipeline:
    return build_tiny_pipeline("tiny", seed=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "hunyuandit", "tiny", seed=0)


@pytest.fixture(scope="module")
def reloaded(saved) -> HunyuanDiTPipeline:
    return HunyuanDiTPipeline.from_pretrained(saved, local_files_only=True)


def test_same_seed_same_weights(pipeline):
    again = build_tiny_pipeline("tiny", seed=0)
    for name in MODULES:
        assert _same_state(getattr(pipeline, name), getattr(again, name)), name


def test_different_seed_different_weights(pipeline):
    other = build_tiny_pipeline("tiny", seed=1)
    for name in MODULES:
        assert not _same_state(getattr(pipeline, name), getattr(other, name)), name


def test_transformer_matches_pipeline_transformer(pipeline):
    assert _same_state(build_tiny_transformer("tiny", seed=0), pipeline.transformer)


def test_global_rng_untouched():
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    build_tiny_pipeline("tiny", seed=7)
    assert torch.equal(torch.get_rng_state(), state)


def test_modules_in_eval_mode(pipeline):
    for name in MODULES:
        assert not getattr(pipeline, name).training, name


def test_saved_layout(saved):
    for folder in ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"):
        assert os.path.isdir(os.path.join(saved, folder)), folder
    with open(os.path.join(saved, "model_index.json")) as f:
        index = json.load(f)
    assert index["_class_name"] == "HunyuanDiTPipeline"
    assert index["transformer"] == ["diffusers", "HunyuanDiT2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["scheduler"] == ["diffusers", "DDPMScheduler"]
    assert index["text_encoder"] == ["transformers", "BertModel"]
    assert index["tokenizer"] == ["transformers", "BertTokenizer"]
    assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    assert index["tokenizer_2"] == ["transformers", "T5Tokenizer"]
    assert index["requires_safety_checker"] is False


def test_round_trip_weights_and_tokenizers(pipeline, reloaded):
    for name in MODULES:
        assert _same_state(getattr(pipeline, name), getattr(reloaded, name)), name
    assert _public(reloaded.transformer.config) == _public(pipeline.transformer.config)
    assert reloaded.tokenizer(PROMPT).input_ids == pipeline.tokenizer(PROMPT).input_ids
    assert reloaded.tokenizer_2(PROMPT).input_ids == pipeline.tokenizer_2(PROMPT).input_ids
    assert reloaded.tokenizer.model_max_length == 77
    assert reloaded.tokenizer_2.model_max_length == 256


def test_round_trip_generation(pipeline, reloaded):
    image = _generate(pipeline)
    assert image.shape == (1, 64, 64, 3)
    assert np.isfinite(image).all() and image.std() > 0
    np.testing.assert_array_equal(image, _generate(reloaded))


def test_tokenizers_know_the_prompt(pipeline):
    # Prompts must become real token ids, not a run of unknown tokens, or the text conditioning is degenerate.
    bert = pipeline.tokenizer(PROMPT).input_ids
    t5 = pipeline.tokenizer_2(PROMPT).input_ids
    assert pipeline.tokenizer.unk_token_id not in bert
    assert pipeline.tokenizer_2.unk_token_id not in t5
    assert t5[-1] == pipeline.tokenizer_2.eos_token_id
    assert bert[0] == pipeline.tokenizer.cls_token_id and bert[-1] == pipeline.tokenizer.sep_token_id


def test_scheduler_is_hunyuandit_like(pipeline):
    config = pipeline.scheduler.config
    assert (config.beta_schedule, config.beta_start, config.beta_end) == ("scaled_linear", 0.00085, 0.03)
    assert (config.steps_offset, config.prediction_type, config.clip_sample) == (1, "v_prediction", False)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_config(preset):
    config = tiny_transformer_config(preset)
    assert config["hidden_size"] == config["num_attention_heads"] * config["attention_head_dim"]
    assert config["attention_head_dim"] % 4 == 0
    assert config["cross_attention_dim_t5"] % 8 == 0
    assert (config["text_len"], config["text_len_t5"]) == (77, 256)
    assert (config["in_channels"], config["patch_size"], config["learn_sigma"]) == (4, 2, True)
    assert config["use_style_cond_and_image_meta_size"] is False
    # The pipeline's default height/width is `sample_size * vae_scale_factor`.
    assert config["sample_size"] * 8 == DEFAULT_SIZE[preset] == PRESETS[preset]["default_size"]


def test_preset_sizes():
    assert tiny_transformer_config("tiny")["num_layers"] >= 16  # folded placement at degree 8
    assert tiny_transformer_config("small")["num_layers"] >= 8
    assert tiny_transformer_config("bytes40")["num_layers"] == 40
    full = tiny_transformer_config("dit-g2")  # the released HunyuanDiT-v1.2 transformer's shape
    assert (full["num_layers"], full["hidden_size"], full["num_attention_heads"], full["sample_size"]) == (
        40,
        1408,
        16,
        128,
    )


def test_pipeline_defaults_and_text_widths(pipeline):
    assert pipeline.vae_scale_factor == 8
    assert pipeline.default_sample_size * pipeline.vae_scale_factor == DEFAULT_SIZE["tiny"]
    assert pipeline.text_encoder.config.hidden_size == pipeline.transformer.config.cross_attention_dim
    assert pipeline.text_encoder_2.config.d_model == pipeline.transformer.config.cross_attention_dim_t5


def test_default_size_generation(pipeline):
    # No height/width: the preset's default size. Binning must stay off, it would snap 256 px up to 1024 px.
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(
        PROMPT,
        num_inference_steps=1,
        use_resolution_binning=False,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert image.shape == (1, DEFAULT_SIZE["tiny"], DEFAULT_SIZE["tiny"], 3)


def test_transformer_forward_default_size(pipeline):
    # One CFG-batched denoising step at the preset's default size, with the inputs the pipeline builds.
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    model = pipeline.transformer
    latent = DEFAULT_SIZE["tiny"] // 8
    grid = latent // model.config.patch_size
    rope = get_2d_rotary_pos_embed(model.inner_dim // model.num_heads, ((0, 0), (grid, grid)), (grid, grid))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        out = model(
            torch.randn(2, 4, latent, latent, generator=generator),
            torch.tensor([999.0, 999.0]),
            encoder_hidden_states=torch.randn(2, 77, model.config.cross_attention_dim, generator=generator),
            text_embedding_mask=torch.ones(2, 77, dtype=torch.long),
            encoder_hidden_states_t5=torch.randn(2, 256, model.config.cross_attention_dim_t5, generator=generator),
            text_embedding_mask_t5=torch.ones(2, 256, dtype=torch.long),
            image_meta_size=torch.zeros(2, 6),
            style=torch.zeros(2, dtype=torch.long),
            image_rotary_emb=rope,
            return_dict=False,
        )[0]
    assert out.shape == (2, 8, latent, latent)  # learn_sigma: 2 x 4 channels
    assert torch.isfinite(out).all()


def test_overrides():
    config = tiny_transformer_config("tiny", num_layers=4, num_attention_heads=4)
    assert (config["num_layers"], config["num_attention_heads"], config["hidden_size"]) == (4, 4, 64)
    model = build_tiny_transformer("tiny", seed=0, num_layers=4, sample_size=8)
    assert len(model.blocks) == 4 and model.config.sample_size == 8
    assert build_tiny_pipeline("tiny", seed=0, sample_size=8).default_sample_size == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_layers": 7}, "even"),
        ({"attention_head_dim": 6}, "divisible by 4"),
        ({"cross_attention_dim_t5": 36}, "divisible by 8"),
        ({"hidden_size": 48}, "hidden_size"),
        ({"text_len": 64}, "77"),
    ],
)
def test_invalid_overrides(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_transformer_config("tiny", **overrides)


def test_override_keys_are_the_model_arguments():
    import inspect

    from diffusers import HunyuanDiT2DModel

    from xfuse.families.hunyuandit.presets import _TRANSFORMER_ARGS

    assert _TRANSFORMER_ARGS == set(inspect.signature(HunyuanDiT2DModel.__init__).parameters) - {"self"}


def test_unknown_override_key():
    with pytest.raises(TypeError, match="num_blocks"):
        tiny_transformer_config("tiny", num_blocks=4)


@pytest.mark.parametrize(
    "call",
    [
        lambda: tiny_transformer_config("huge"),
        lambda: build_tiny_transformer("huge"),
        lambda: build_tiny_pipeline("huge"),
        lambda: save_tiny_pipeline("/nonexistent/never-written", "huge"),
    ],
)
def test_unknown_preset(call):
    with pytest.raises(ValueError, match="huge") as info:
        call()
    assert str(info.value).startswith("model: ")
    for name in ("tiny", "small", "bytes40"):
        assert name in str(info.value)


def test_presets_match_config():
    assert tuple(PRESETS) == HUNYUANDIT.presets and set(PRESETS) <= set(PRESET_MODELS)
