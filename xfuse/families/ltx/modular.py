"""LTX-Video's modular pipeline (``diffusers.LTXModularPipeline`` of ``LTXBlocks``, text-to-video) on xfuse's loop:
what ``LTXDenoiseStep``'s block state is to the engine (``xfuse.modular.parallelize`` replaces that step), through the
generic family (LTX-Video has no hand-written stage).

The step's inputs are ``LTXLoopDenoiser``'s: the packed latents (B, frames * rows * cols, C) in float32, the
transformer's ``dtype``, the prompt's and the negative prompt's T5 embeddings and attention masks, which its guider
(``ClassifierFreeGuidance``) batches as a conditional and an unconditional call (xfuse: one CFG batch [negative,
positive], split by ``parallel.cfg_degree``), the video's pixel size and frames, and the RoPE's interpolation scale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xfuse.families.common.packed import grid_to_packed
from xfuse.families.ltx.pipeline import denoise_request as ltx_request
from xfuse.modular import classifier_free_guidance

CFG_BATCH = True  # the guider's conditional and unconditional calls: one batch, split by parallel.cfg_degree
STEP = "modular LTX denoise step"
TEXT = ("prompt_embeds", "prompt_attention_mask")  # the guider's fields, each with its negative_ twin


def loop_inputs(block_state, components) -> dict[str, torch.Tensor]:
    """The tensors of the step's block state the loop reads (rank 0's are broadcast to every rank), after the
    refusals every rank makes alike: attention kwargs, a guider xfuse's loop does not combine as it does."""
    if getattr(block_state, "attention_kwargs", None):
        raise ValueError(f"attention_kwargs: not run by xfuse's {STEP} (a LoRA scale is set with set_adapters); "
                         "pass None")  # fmt: skip
    scale, _ = classifier_free_guidance(components.guider, STEP)
    names = TEXT + (tuple(f"negative_{name}" for name in TEXT) if scale != 1.0 else ())
    return {name: getattr(block_state, name) for name in ("latents", *names)}


def denoise_request(pipe, inputs: dict[str, torch.Tensor], block_state, components):
    """The engine's request for ``LTXDenoiseStep``'s loop, and how the engine's final grid becomes the step's packed
    ``latents``, as ``LTXLoopAfterDenoiser`` leaves them."""
    latents = inputs["latents"]  # (B, frames * rows * cols, C), float32
    dtype = block_state.dtype  # the transformer's
    scale, rescale = classifier_free_guidance(components.guider, STEP)
    # mirrors ``diffusers.modular_pipelines.ltx.denoise.LTXLoopDenoiser.__call__``: the latent video's size
    frames = (block_state.num_frames - 1) // components.vae_temporal_compression_ratio + 1
    rows = block_state.height // components.vae_spatial_compression_ratio
    cols = block_state.width // components.vae_spatial_compression_ratio
    keys = [(f"negative_{name}", name) if scale != 1.0 else (name,) for name in TEXT]
    batched = {name: torch.cat([inputs[k] for k in pair]) for name, pair in zip(TEXT, keys, strict=True)}
    text, cfg_half = pipe._cfg_split(batched, latents.shape[0])
    request = ltx_request(  # mirrors ``diffusers.modular_pipelines.ltx.denoise.LTXLoopDenoiser.__call__``
        pipe.stage,
        packed=latents,
        size=(frames, rows, cols),
        text=text,
        rope_interpolation_scale=block_state.rope_interpolation_scale,
        timesteps=block_state.timesteps,
        scheduler=components.scheduler,
        cfg_scale=scale,
        guidance_rescale=rescale,
        cfg_half=cfg_half,
        dtype=dtype,
        timestep=lambda t: t.to(dtype),
    )
    back: Callable[[torch.Tensor], torch.Tensor] = lambda grid: grid_to_packed(grid).to(latents.dtype)  # noqa: E731
    return request, back
