"""The flow-matching pipelines' timesteps, as they set them (FluxPipeline, QwenImagePipeline, ZImagePipeline): a
shift ``mu`` from the whole image's token count, then the scheduler's timesteps for the sigmas."""

from __future__ import annotations

from types import ModuleType

import torch


def shifted_timesteps(pipeline_module: ModuleType, scheduler, num_inference_steps: int, device, sigmas,
                      image_tokens: int) -> torch.Tensor:  # fmt: skip
    """The lines of the pipelines' ``__call__`` that set the timesteps, with the pipeline module's own copies of
    ``calculate_shift`` and ``retrieve_timesteps`` (``pipeline_module``: e.g. ``diffusers.pipelines.flux.
    pipeline_flux``): ``mu`` from ``image_tokens`` (the whole image's, never a band's) and the scheduler config's
    sequence lengths and shifts, ``sigmas`` (``None``: the scheduler's own spacing), then ``set_begin_index(0)``."""
    config = scheduler.config
    mu = pipeline_module.calculate_shift(
        image_tokens,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    steps = pipeline_module.retrieve_timesteps(scheduler, num_inference_steps, device, sigmas=sigmas, mu=mu)[0]
    scheduler.set_begin_index(0)
    return steps
