"""Model adapters and the models xfuse can load: a local diffusers folder, or a built-in tiny preset."""

from __future__ import annotations

import json
import os

from xfuse.config import PRESET_MODELS, ConfigError


def transformer_config(model: str) -> dict:
    """The ``HunyuanDiT2DModel`` config of ``model`` without loading weights (a preset name or a local folder)."""
    if model in PRESET_MODELS:
        from xfuse.models.tiny import tiny_transformer_config

        return tiny_transformer_config(model)
    path = os.path.join(model, "transformer", "config.json")
    if not os.path.isfile(path):
        raise ConfigError(
            "model",
            f"must be one of the presets {', '.join(PRESET_MODELS)} or a local diffusers HunyuanDiT folder with "
            f"transformer/config.json (not found: {path!r})",
        )
    with open(path) as f:
        return json.load(f)


def load_pipeline(model: str, torch_dtype=None):
    """A diffusers ``HunyuanDiTPipeline`` on CPU: built from a preset, or loaded from a local folder."""
    if model in PRESET_MODELS:
        import torch

        from xfuse.models.tiny import build_tiny_pipeline

        pipe = build_tiny_pipeline(model)  # built in float32
        return pipe if torch_dtype in (None, torch.float32) else pipe.to(dtype=torch_dtype)
    transformer_config(model)  # a clear error for a folder that is not a HunyuanDiT pipeline
    from diffusers import HunyuanDiTPipeline

    return HunyuanDiTPipeline.from_pretrained(model, torch_dtype=torch_dtype, local_files_only=True)
