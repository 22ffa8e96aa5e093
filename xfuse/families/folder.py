"""Reading a local diffusers folder without loading weights: its components' classes, its transformer and VAE
configs, and the trained models shipped inside the package.

A leaf: it imports no family spec, so the generic pipeline code (``xfuse.pipelines``) reads folders through it without
reaching up into the registry (``xfuse.families.registry``, which reads presets through the specs and folders
through this).
"""

from __future__ import annotations

import json
import os

from xfuse.errors import ConfigError

# Trained models shipped inside the package (diffusers folders in xfuse/assets/): ``model: shapes`` is that folder.
# The image models are trained on ``xfuse.assets.shapes_world``'s captioned scenes by scripts/train_tiny.py, on one
# VAE: ``shapes`` a HunyuanDiT (its folder also holds the attribute classifier), ``shapes-pixart`` a PixArt-Σ. The
# video model ``shapes-video`` (a Wan 2.1 text-to-video model with its own Wan VAE and clip classifier) on
# ``xfuse.assets.shapes_video_world``'s captioned clips by scripts/train_video.py.
_ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
SHIPPED_IMAGE_MODELS = ("shapes", "shapes-pixart")
SHIPPED_MODELS: dict[str, str] = {name: os.path.join(_ASSETS, name) for name in (*SHIPPED_IMAGE_MODELS, "shapes-video")}


def resolve_model(model: str) -> str:
    """A shipped model's folder for its name; any other ``model`` (a preset or a folder) unchanged."""
    return SHIPPED_MODELS.get(model, model)


def folder_config(folder: str, component: str) -> dict | None:
    """A diffusers folder's ``<component>/config.json`` (``None`` where it has none)."""
    path = os.path.join(resolve_model(folder), component, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def component_class(folder: str, name: str) -> str | None:
    """The class of a diffusers folder's component ``name`` as its ``model_index.json`` lists it (``[library, class]``;
    ``None`` where it names none)."""
    index = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index):
        raise ConfigError("model", f"{folder!r} is not a diffusers folder (not found: {index!r})")
    with open(index) as f:
        entry = json.load(f).get(name)
    return entry[1] if entry and entry[0] is not None else None


def pipeline_transformers(folder: str) -> tuple[str, ...]:
    """The transformer components of a diffusers folder's pipeline, as its ``model_index.json`` lists them:
    ``transformer``, and ``transformer_2`` where it names one (Wan 2.2's second expert). Every rank loads its blocks of
    each."""
    second = component_class(folder, "transformer_2")
    return ("transformer", "transformer_2") if second is not None else ("transformer",)


def text_encoder_components(folder: str) -> list[str]:
    """A diffusers folder's text encoders that are transformers models, as its ``model_index.json`` lists them
    (``text_encoder``, ``text_encoder_2``, ...)."""
    index = os.path.join(resolve_model(folder), "model_index.json")
    with open(index) as f:
        entries = json.load(f)
    return [name for name, entry in entries.items()
            if name.startswith("text_encoder") and isinstance(entry, list) and entry[0] == "transformers"]  # fmt: skip
