"""One request's model-specific inputs to the PipeFusion engine (``xfuse.parallel.engine``), as a family's pipeline
prepares them on every rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from xfuse.parallel.control import ControlResiduals


@dataclass
class DenoiseRequest:
    """The model-specific inputs of one denoising loop, as the pipeline prepares them on every rank.

    Attributes:
        latents: (B, C, H, W) initial latents (already scaled by ``init_noise_sigma``), identical on every rank.
        timesteps: the scheduler's timesteps after ``set_timesteps``.
        scheduler: this rank's scheduler (a diffusers ``SchedulerMixin``), after ``set_timesteps``.
        conditioning: ``conditioning(step_index, t) -> cond`` for this rank's stage.
        model_input: ``model_input(rows, where)``: latent rows (B, C, h, W), the rows ``where`` of the latent ->
            transformer input rows (e.g. doubled for CFG; an image-to-video's conditioning frame put in).
        guide: ``guide(output_rows, step, patch)`` -> noise prediction rows (B, C, h, W) (drops learned sigma,
            applies CFG; ``patch`` is None for a whole-image step).
        extra_step_kwargs: keyword arguments of ``scheduler.step`` (``eta``, ``generator``).
        generator: the user's generator (the one in ``extra_step_kwargs``); per-patch generators are derived from
            it only for a scheduler whose noise cannot be drawn as serial's (``scheduler_state.draws_serial_noise``).
        model_batch: batch of the transformer input.
        on_step_end: called on the output rank as ``on_step_end(step, latents)`` once every patch of ``step`` has
            been stepped (``latents`` is then exactly the latent after that step; no patch is further yet).
        on_progress: called on every rank as ``on_progress(step)`` when this rank finished its last task of
            ``step``.
        stream_shapes: the shape of each of the plan's streams (the hand-off tensors a step's first patch carries
            besides the hidden state, e.g. an MMDiT's text ``(B_model, T, hidden)``), taken from this request's
            tensors by the family's adapter.
        hidden_dtype: dtype of the hidden states (and streams) handed between ranks, where it is not the latents'
            (Wan steps float32 latents with a bfloat16 transformer); ``None``: the latents' dtype.
        control: ControlNet residuals (``xfuse.parallel.control``): computed on the embedding rank with each hop-0
            task, added after the blocks that take them; ``None``: no ControlNet.
    """

    latents: torch.Tensor
    timesteps: torch.Tensor
    scheduler: Any
    conditioning: Callable[[int, torch.Tensor], Any]
    model_input: Callable[[torch.Tensor, slice], torch.Tensor]
    guide: Callable[[torch.Tensor, int, int | None], torch.Tensor]
    model_batch: int
    extra_step_kwargs: dict = field(default_factory=dict)
    generator: torch.Generator | None = None
    on_step_end: Callable[[int, torch.Tensor], None] | None = None
    on_progress: Callable[[int], None] | None = None
    stream_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    hidden_dtype: torch.dtype | None = None
    control: ControlResiduals | None = None
