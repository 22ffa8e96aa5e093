"""The families xfuse runs, collected from their folders, and the lookups from a ``model`` value to its family.

Each family is one folder under ``xfuse/families/`` whose ``spec.py`` describes it (``xfuse.families.spec``);
adding a family is one more folder and one more line in ``FAMILIES`` below. Reading the registry does not import
diffusers (torch comes in with the specs' sequence-parallel checks).

A run's ``model`` is resolved here once (:func:`resolve`): ``xfuse generate`` and ``xfuse serve`` make one
:class:`ResolvedModel` from the config and hand it to ``xfuse.build`` and the server and its loop, which read it and
look nothing up again.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from functools import cache, cached_property

from xfuse.errors import ConfigError
from xfuse.families.flux.spec import FLUX
from xfuse.families.flux2.spec import FLUX2, FLUX2_KLEIN
from xfuse.families.folder import (
    SHIPPED_MODELS,
    folder_config,
    pipeline_transformers,
    resolve_model,
    text_encoder_components,
)
from xfuse.families.hunyuandit.spec import HUNYUANDIT
from xfuse.families.ltx.spec import LTX
from xfuse.families.pixart.spec import PIXART_SIGMA
from xfuse.families.qwenimage.spec import QWEN_IMAGE
from xfuse.families.sd3.spec import STABLE_DIFFUSION_3
from xfuse.families.spec import ModelSpec
from xfuse.families.wan.spec import WAN
from xfuse.families.zimage.spec import Z_IMAGE

FAMILIES: tuple[ModelSpec, ...] = (
    HUNYUANDIT,
    PIXART_SIGMA,
    STABLE_DIFFUSION_3,
    FLUX,
    WAN,
    FLUX2,
    FLUX2_KLEIN,
    QWEN_IMAGE,
    Z_IMAGE,
    LTX,
)


def _by_name(kind: str, entries) -> dict[str, ModelSpec]:
    """``name -> spec``, refusing a name that two families claim: a new family folder must bring new names, or the
    later family would silently take the other's presets or folders."""
    table: dict[str, ModelSpec] = {}
    for name, spec in entries:
        if name in table:
            raise ValueError(f"{kind} {name!r} is claimed by two families: {table[name].name} and {spec.name}")
        table[name] = spec
    return table


def _lookups(families: tuple[ModelSpec, ...]) -> tuple[dict[str, ModelSpec], ...]:
    """The registry's tables, built once when it loads: by family name, preset, diffusers pipeline class and xfuse
    pipeline class (``ModelSpec.pipeline_name``)."""
    return (
        _by_name("family name", ((spec.name, spec) for spec in families)),
        _by_name("preset", ((preset, spec) for spec in families for preset in spec.presets)),
        _by_name(
            "diffusers pipeline",
            ((name, spec) for spec in families for name in (spec.diffusers_pipeline, spec.image_to_video) if name),
        ),
        _by_name("xfuse pipeline", ((name, spec) for spec in families for name in spec.pipeline_names)),
    )


MODEL_SPECS, PRESET_MODELS, _BY_PIPELINE, PIPELINE_SPECS = _lookups(FAMILIES)


@dataclass(frozen=True)
class ResolvedModel:
    """A ``model`` value (a preset, a shipped model or a local diffusers folder) resolved against the registry: what
    a run needs to know of its model before and after the weights load, looked up once (:func:`resolve`).

    ``name``: the value as the config gives it. ``spec``: the model's own spec (:func:`model_spec`). ``preset``: a
    built-in random-weight model (every rank builds it from its seed) rather than a folder. ``transformer`` (its
    transformer config, no weights loaded) and ``native_side`` (the pixels of the default image side) are read on first
    use and kept: a folder's ``transformer/config.json`` is read once, where the run first needs it."""

    name: str
    spec: ModelSpec
    preset: bool

    @property
    def video(self) -> bool:
        """A video family's model (``ModelSpec.video``: Wan): its requests are clips."""
        return self.spec.video

    @cached_property
    def transformer(self) -> dict:
        """The transformer config (:func:`transformer_config`)."""
        return _transformer_config(self.name, self.spec)

    @cached_property
    def native_side(self) -> int:
        """The default image side in pixels: the diffusers pipeline's, from the transformer config."""
        return self.spec.default_side(self.transformer)


def resolve(model: str) -> ResolvedModel:
    """``model`` (a config's ``model`` value) resolved once: its family, its own spec, whether it is a preset. A
    ``ConfigError`` naming ``model`` where it is none of the presets, shipped models or diffusers folders xfuse runs."""
    family = _family(model)
    spec = family if family.vae_factor_key is None else family.for_vae(vae_config(model))
    return ResolvedModel(name=model, spec=spec, preset=model in PRESET_MODELS)


def model_spec(model: str) -> ModelSpec:
    """The spec of ``model``: its family's, with its own VAE's spatial factor where the family reads it from the VAE
    (Wan 2.2 TI2V-5B's VAE: 16 px, see ``ModelSpec.for_vae``)."""
    return resolve(model).spec


def _family(model: str) -> ModelSpec:
    """The family of ``model``: a preset name, or a local diffusers folder (from its ``model_index.json``)."""
    if model in PRESET_MODELS:
        return PRESET_MODELS[model]
    model = resolve_model(model)
    index = os.path.join(model, "model_index.json")
    families = ", ".join(f"{s.diffusers_pipeline} ({s.name})" for s in MODEL_SPECS.values())
    if not os.path.isfile(index):
        raise ConfigError(
            "model",
            f"must be one of the presets {', '.join(PRESET_MODELS)}, a shipped model ({', '.join(SHIPPED_MODELS)}) "
            "or a local diffusers folder with "
            f"model_index.json of one of {families} (not found: {index!r})",
        )
    with open(index) as f:
        class_name = json.load(f).get("_class_name")
    if class_name not in _BY_PIPELINE:
        raise ConfigError(
            "model",
            f"{model!r} is a {class_name} folder; xfuse runs {families} (got _class_name={class_name!r})",
        )
    return _BY_PIPELINE[class_name]


def transformer_config(model: str) -> dict:
    """The transformer config of ``model`` without loading weights (a preset name or a local folder)."""
    return _transformer_config(model, _family(model))


def _transformer_config(model: str, spec: ModelSpec) -> dict:
    if model in PRESET_MODELS:
        return spec.preset_transformer_config(model)
    config = folder_config(model, "transformer")
    if config is None:
        path = os.path.join(resolve_model(model), "transformer", "config.json")
        raise ConfigError("model", f"{model!r} has no transformer/config.json (not found: {path!r})")
    return config


def vae_config(model: str) -> dict | None:
    """The VAE config of ``model`` without loading weights: a folder's ``vae/config.json`` (``None`` when it has
    none), or a preset's (its family's ``presets.preset_vae_config``: the arguments its builder makes the VAE with)."""
    if model in PRESET_MODELS:
        return PRESET_MODELS[model].preset_builders().preset_vae_config(model)
    return folder_config(model, "vae")


def text_encoder_configs(model: str) -> dict[str, dict]:
    """``{component: transformers config.json}`` of ``model``'s text encoders, without loading weights: a folder's
    ``text_encoder*/config.json``; a released-shape preset's released ones (its family's
    ``presets.RELEASED_TEXT_ENCODERS``); another preset's own small ones, read from the preset built once."""
    if model in PRESET_MODELS:
        released = getattr(_family(model).preset_builders(), "RELEASED_TEXT_ENCODERS", {})
        return released[model] if model in released else _built_text_encoder_configs(model)
    configs = {name: folder_config(model, name) for name in text_encoder_components(model)}
    return {name: config for name, config in configs.items() if config is not None}


@cache
def _built_text_encoder_configs(preset: str) -> dict[str, dict]:
    from xfuse.families.common.text_encoders import built_text_encoder_configs

    return built_text_encoder_configs(_family(preset).build_preset_pipeline(preset))


def transformer_count(model: str) -> int:
    """Transformers of ``model``'s pipeline that every rank keeps its blocks of: 2 for a two-expert pipeline (a
    folder's ``pipeline_transformers``, or a preset built with one: Wan 2.2 A14B), else 1."""
    if model in PRESET_MODELS:
        preset = getattr(_family(model).preset_builders(), "PRESETS", {}).get(model, {})
        return 2 if preset.get("boundary_ratio") is not None else 1
    return len(pipeline_transformers(resolve_model(model)))


def model_is_preset(model: str) -> bool:
    """True if ``model`` names a built-in random-weight preset rather than a folder (or a shipped model)."""
    return model in PRESET_MODELS


def load_pipeline(model: str, torch_dtype=None, diffusers_pipeline: str | None = None, components: dict | None = None):
    """The family's diffusers pipeline on CPU: built from a preset, or loaded from a local folder. As
    ``diffusers_pipeline`` where it is another of the family's pipelines on the same components (a preset as
    ``WanImageToVideoPipeline``: the preset's components and settings given to that class; diffusers' ``from_pipe``
    would also cast every component to one dtype). ``components``: more of that pipeline's components (a ControlNet
    pipeline's ``controlnet``)."""
    import diffusers

    spec = _family(model)
    name = diffusers_pipeline or spec.diffusers_pipeline
    if model in PRESET_MODELS:
        import torch

        pipe = spec.build_preset_pipeline(model)  # built in float32
        pipe = pipe if torch_dtype in (None, torch.float32) else pipe.to(dtype=torch_dtype)
        if type(pipe).__name__ == name and not components:
            return pipe
        other = getattr(diffusers, name)
        accepted = inspect.signature(other.__init__).parameters
        given = {**dict(pipe.config), **pipe.components}  # settings (boundary_ratio, expand_timesteps), then modules
        return other(**{key: value for key, value in given.items() if key in accepted}, **(components or {}))
    return getattr(diffusers, name).from_pretrained(
        resolve_model(model),
        dtype=torch_dtype,
        local_files_only=True,  # torch_dtype= is deprecated there
        **(components or {}),
    )
