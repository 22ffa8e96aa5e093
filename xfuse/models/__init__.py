"""Model families: their specs (``registry``), adapters (one ``Stage`` per family) and built-in presets."""

from xfuse.models.registry import (
    HUNYUANDIT,
    MODEL_SPECS,
    PIXART_SIGMA,
    PRESET_MODELS,
    ModelSpec,
    load_pipeline,
    model_spec,
    transformer_config,
)

__all__ = [
    "HUNYUANDIT",
    "MODEL_SPECS",
    "PIXART_SIGMA",
    "PRESET_MODELS",
    "ModelSpec",
    "load_pipeline",
    "model_spec",
    "transformer_config",
]
