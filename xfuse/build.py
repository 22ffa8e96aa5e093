"""The configured pipeline on this rank, and the keyword arguments of one image request.

``xfuse generate`` and ``xfuse serve`` both build their pipeline and call it through here, so a served request and a
``generate`` run with the same prompt, size, steps, guidance and seed make the same call and the same image.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from xfuse.config import XfuseConfig
from xfuse.runtime.handshake import flatten
from xfuse.runtime.heap import freeze_startup_heap, keep_freed_heap

if TYPE_CHECKING:
    from xfuse.families.spec import ModelSpec


def build_pipeline(config: XfuseConfig, *, sections: tuple[str, ...] = ("generation",)):
    """Load ``config.model`` with its family's PipeFusion pipeline on this rank (joining the world).

    Every rank must agree on the model and on the config ``sections`` named: they are compared at start-up
    (``xfuse.runtime.handshake``) with the parallel, comm and runtime settings.
    """
    import torch

    from xfuse.families.registry import load_pipeline, model_is_preset, model_spec, resolve_model

    dtype = getattr(torch, config.runtime.dtype)
    device = None if config.runtime.device == "auto" else config.runtime.device
    pipeline_class = model_spec(config.model).pipeline_class()  # the family, from the preset or model_index.json
    whole = config.to_dict()
    fingerprint = flatten("", {"model": config.model, **{name: whole[name] for name in sections}})
    common = dict(parallel=config.parallel, comm=config.comm, device=device, fingerprint=fingerprint)
    if model_is_preset(config.model):  # built-in random-weight model: every rank builds the same one from its seed
        pipe = pipeline_class.from_pipe(load_pipeline(config.model, dtype), **common)
    else:
        pipe = pipeline_class.from_pretrained(resolve_model(config.model), torch_dtype=dtype, **common)
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
