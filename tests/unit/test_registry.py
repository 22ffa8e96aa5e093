"""The registry, for every family it holds (no per-family code): a preset, a folder's ``model_index.json`` and the
VAE config the planner reads all lead to the family's facts, and anything else is refused naming ``model``."""

import json

import pytest

from xfuse.errors import ConfigError
from xfuse.families.registry import FAMILIES, load_pipeline, model_spec, vae_config

IDS = [spec.name for spec in FAMILIES]


@pytest.mark.parametrize("spec", FAMILIES, ids=IDS)
def test_every_preset_and_pipeline_class_leads_to_its_family(spec, tmp_path):
    for preset in spec.presets:
        assert model_spec(preset).name == spec.name, preset
    # its own pipeline and its image-to-video one (a ControlNet pipeline is the base folder plus a ControlNet)
    for pipeline in filter(None, (spec.diffusers_pipeline, spec.image_to_video)):
        folder = tmp_path / pipeline
        (folder / "vae").mkdir(parents=True)
        (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
        # a family that reads its VAE factor from the VAE (Wan 2.2's 16 px) finds the first preset's
        (folder / "vae" / "config.json").write_text(json.dumps(vae_config(spec.presets[0])))
        assert model_spec(str(folder)) == model_spec(spec.presets[0]), pipeline


def test_a_pipeline_no_family_runs_is_refused_naming_the_families(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ConfigError, match=r"^model: .* is a StableDiffusionPipeline folder; xfuse runs") as err:
        model_spec(str(tmp_path))
    for spec in FAMILIES:
        assert spec.diffusers_pipeline in str(err.value)


@pytest.mark.parametrize("spec", FAMILIES, ids=IDS)
def test_a_presets_vae_config_is_the_one_its_builder_makes(spec):
    """What ``xfuse plan`` costs the decode from (no torch) is the VAE the preset's pipeline really has."""
    preset = spec.presets[0]
    planned = vae_config(preset)
    built = dict(load_pipeline(preset).vae.config)
    given = {key: value for key, value in planned.items() if not key.startswith("_")}
    as_json = lambda config: json.loads(json.dumps(config))  # noqa: E731 - tuples and lists alike
    assert as_json({key: built[key] for key in given}) == as_json(given)


# A preset whose transformer is this large is a released shape: its text encoders must be described by their
# published configs (``RELEASED_TEXT_ENCODERS``), not read by building the preset (a full-size random model).
RELEASED_PARAMETERS = 500e6


@pytest.mark.parametrize("spec", FAMILIES, ids=IDS)
def test_every_released_shape_describes_its_text_encoders_and_a_small_preset_its_built_ones(spec):
    """``xfuse plan`` counts every preset's text encoders: a released shape's from the family's table (a new family
    cannot forget one), a small preset's as its builder makes them (the classes and widths of the built pipeline)."""
    import diffusers
    import torch

    from xfuse.families.registry import text_encoder_configs, transformer_config

    released = getattr(spec.preset_builders(), "RELEASED_TEXT_ENCODERS", {})
    for preset in spec.presets:
        config = {k: v for k, v in transformer_config(preset).items() if not k.startswith("_")}
        with torch.device("meta"):
            model = getattr(diffusers, spec.diffusers_transformer)(**config)
        large = sum(p.numel() for p in model.parameters()) > RELEASED_PARAMETERS
        assert (preset in released) == large, preset
    small = spec.presets[0]
    built = load_pipeline(small)
    configs = text_encoder_configs(small)
    assert configs and all(configs[name]["architectures"] == [type(getattr(built, name)).__name__] for name in configs)
