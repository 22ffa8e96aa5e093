"""FLUX.1's modular pipeline (``diffusers.FluxModularPipeline``) on xfuse's loop: what ``FluxDenoiseStep``'s block
state is to the engine (``xfuse.modular.parallelize`` replaces that step).

The step's inputs are ``FluxLoopDenoiser``'s: the packed latents, the prompt's T5 and pooled CLIP embeddings, the
embedded guidance (FLUX.1-dev) and the RoPE ids, with the timesteps and the scheduler the pipeline's
``FluxSetTimestepsStep`` set. The modular FLUX.1 pipeline has no true CFG (one transformer batch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xfuse.families.common.packed import grid_to_packed, packed_to_grid
from xfuse.families.flux.stage import denoise_request as flux_request

CFG_BATCH = False  # FluxLoopDenoiser makes one transformer call a step (no true CFG)
LOOP_INPUTS = ("latents", "prompt_embeds", "pooled_prompt_embeds", "txt_ids", "img_ids", "guidance")


def loop_inputs(block_state, components) -> dict[str, torch.Tensor]:
    """The tensors of the step's block state the loop reads (rank 0's are broadcast to every rank)."""
    if getattr(block_state, "joint_attention_kwargs", None):
        raise ValueError("joint_attention_kwargs: not run by xfuse's modular FLUX.1 denoise step (a LoRA scale is "
                         "set with set_adapters); pass None")  # fmt: skip
    return {name: getattr(block_state, name) for name in LOOP_INPUTS if getattr(block_state, name) is not None}


def denoise_request(pipe, inputs: dict[str, torch.Tensor], block_state, components):
    """The engine's request for ``FluxDenoiseStep``'s loop, and how the engine's final grid becomes the step's
    ``latents`` (packed, as ``FluxLoopAfterDenoiser`` leaves them)."""
    latents = inputs["latents"]  # (B, rows * cols, C4), packed
    ids = inputs["img_ids"]  # (rows * cols, 3): (0, row, col) per packed token, row-major
    cols = int(ids[:, 2].max()) + 1
    rows = latents.shape[1] // cols
    request = flux_request(  # mirrors ``diffusers.modular_pipelines.flux.denoise.FluxLoopDenoiser.__call__``
        pipe.stage,
        latents=packed_to_grid(latents, rows).contiguous(),  # (B, C4, rows, cols)
        timesteps=block_state.timesteps,
        scheduler=components.scheduler,
        prompt_embeds=inputs["prompt_embeds"],
        pooled_prompt_embeds=inputs["pooled_prompt_embeds"],
        text_ids=inputs["txt_ids"],
        latent_image_ids=ids,
        guidance_value=inputs.get("guidance"),
    )
    back: Callable[[torch.Tensor], torch.Tensor] = lambda grid: grid_to_packed(grid).to(latents.dtype)  # noqa: E731
    return request, back
