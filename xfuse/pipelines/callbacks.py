"""diffusers' ``callback_on_step_end`` on a PipeFusion pipeline: run on the rank that steps the scheduler (its
``_observer``), on copies of the tensors it names; a change it returns, or the interrupt flag it sets, cannot be applied
while later patches are in flight, so the loop finishes and the call raises it (``_run``) on every rank.
"""

from __future__ import annotations

import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback


def callback_tensor_inputs(callback, tensor_inputs: list[str]) -> list[str]:
    """The tensors a ``callback_on_step_end`` reads: a diffusers callback object names its own."""
    if isinstance(callback, (PipelineCallback, MultiPipelineCallbacks)):
        return callback.tensor_inputs
    return tensor_inputs


def step_end_callback(pipe, callback, tensor_inputs, timesteps, named: dict, latents_view=None):
    """The engine's ``on_step_end`` for diffusers' ``callback_on_step_end`` (``None`` when there is none or this
    rank does not step the scheduler): the callback reads copies of the tensors ``named`` (name -> tensor; the
    latents are filled in per step, through ``latents_view`` into the shape diffusers' loop has them). After a
    refused change the loop finishes without further callbacks and ``_run`` raises."""
    if callback is None or not pipe._observer():
        return None

    def on_step_end(step, current):
        if pipe._callback_error is None:
            latents = current.clone() if latents_view is None else latents_view(current)
            pipe._callback_error = run_callback(
                pipe, callback, tensor_inputs, step, timesteps[step], dict(named, latents=latents)
            )

    return on_step_end


def run_callback(pipe, callback, tensor_inputs, step, t, names: dict) -> ValueError | None:
    """Run the user's callback on the tensors; return the error to raise if it changed any."""
    kwargs = {k: names[k] for k in tensor_inputs}
    given = dict(kwargs)
    outputs = callback(pipe, step, t, kwargs) or {}
    for key, value in outputs.items():
        original = given.get(key)
        if value is not original and not (
            isinstance(value, torch.Tensor) and original is not None and torch.equal(value, original)
        ):
            return ValueError(
                f"callback_on_step_end returned a changed {key!r} at step {step}: PipeFusion "
                "cannot apply it (later patches are already in flight)"
            )
    if pipe._interrupt:
        return ValueError("callback_on_step_end set the pipeline's interrupt flag: PipeFusion cannot stop mid-pipeline")
    return None
