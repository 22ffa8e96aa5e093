"""The configured pipeline on this rank, and the keyword arguments of one image request.

``xfuse generate`` and ``xfuse serve`` both build their pipeline and call it through here, so a served request and a
``generate`` run with the same prompt, size, steps, guidance and seed make the same call and the same image.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xfuse.config import XfuseConfig
from xfuse.runtime.heap import freeze_startup_heap, keep_freed_heap

if TYPE_CHECKING:
    from xfuse.families.spec import ModelSpec


def build_pipeline(config: XfuseConfig):
    """Load ``config.model`` with its family's PipeFusion pipeline on this rank (joining the world).

    Every rank must hold the same ``config``: it is compared at start-up (``xfuse.runtime.handshake``).
    """
    from xfuse.families.registry import load_pipeline, model_is_preset, model_spec, resolve_model

    pipeline_class = model_spec(config.model).pipeline_class()  # the family, from the preset or model_index.json
    if model_is_preset(config.model):  # built-in random-weight model: every rank builds the same one from its seed
        pipe = pipeline_class.from_pipe(load_pipeline(config.model, config.runtime.torch_dtype()), config=config)
    else:
        pipe = pipeline_class.from_pretrained(resolve_model(config.model), config=config)
    freeze_startup_heap()
    keep_freed_heap()
    return pipe


def default_size(config: XfuseConfig) -> tuple[int, int]:
    """(width, height) in pixels when a request names none: ``generation.width/height``, else the model's own."""
    from xfuse.families.registry import model_spec, transformer_config

    native = model_spec(config.model).default_side(transformer_config(config.model))
    return config.generation.width or native, config.generation.height or native


def image_call_kwargs(
    *,
    prompt: str,
    negative_prompt: str | None,
    width: int,
    height: int,
    num_inference_steps: int,
    guidance_scale: float,
    seed: int,
    num_images: int = 1,
    spec: ModelSpec,
) -> dict[str, Any]:
    """The pipeline call for one request: the diffusers arguments every family takes (and, for a ``spec`` whose
    pipeline bins sizes, binning off)."""
    import torch

    return dict(
        prompt=prompt,
        # None: the family's own default (HunyuanDiT's None, PixArt's "": PixArt cannot take None)
        **({} if negative_prompt is None else {"negative_prompt": negative_prompt}),
        height=height,
        width=width,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        num_images_per_prompt=num_images,
        generator=torch.Generator().manual_seed(seed),
        # the size asked for, not the nearest of the model's trained sizes
        **({"use_resolution_binning": False} if spec.resolution_binning else {}),
    )
