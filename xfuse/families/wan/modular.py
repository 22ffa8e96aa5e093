"""Wan's modular pipelines (``diffusers.WanModularPipeline`` of ``WanBlocks``, 2.1, and of ``Wan22Blocks``, 2.2's two
experts) on xfuse's loop: what ``WanDenoiseStep``'s and ``Wan22DenoiseStep``'s block state is to the engine
(``xfuse.modular.parallelize`` replaces those steps).

The step's inputs are ``WanLoopDenoiser``'s: the latents (B, C, F, H, W) in float32, the transformer's ``dtype``, the
prompt's and the negative prompt's UMT5 embeddings, which its guider (``ClassifierFreeGuidance``) batches as a
conditional and an unconditional call; xfuse batches them [negative, positive] in one transformer batch (or one per
CFG group), combined as the guider combines them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xfuse.families.wan.stage import denoise_request as wan_request
from xfuse.modular import classifier_free_guidance
from xfuse.parallel.video_layout import VideoLayout

CFG_BATCH = True  # the guider's conditional and unconditional calls: one batch, split by parallel.cfg_degree


def _guidance_scale(guider) -> float:
    """The guider's scale; with no rescaling (``WanLoopDenoiser``'s guider has none by default, and xfuse's Wan loop
    does not rescale)."""
    scale, rescale = classifier_free_guidance(guider, "modular Wan denoise step")
    if rescale != 0.0:
        raise ValueError(f"guider.guidance_rescale: xfuse's modular Wan denoise step runs 0.0 only (got {rescale})")
    return scale


def loop_inputs(block_state, components) -> dict[str, torch.Tensor]:
    """The tensors of the step's block state the loop reads (rank 0's are broadcast to every rank), after the
    refusals every rank makes alike: attention kwargs, a guider xfuse's loop does not combine as it does."""
    if getattr(block_state, "attention_kwargs", None):
        raise ValueError("attention_kwargs: not run by xfuse's modular Wan denoise step (a LoRA scale is set with "
                         "set_adapters); pass None")  # fmt: skip
    scale = _guidance_scale(components.guider)
    if getattr(components, "guider_2", None) is not None:  # Wan 2.2's low-noise expert's: a batch of the same rows
        if (_guidance_scale(components.guider_2) == 1.0) != (scale == 1.0):
            raise ValueError("guider_2.guidance_scale: must be 1 exactly where guider.guidance_scale is (xfuse runs "
                             "both experts on one CFG batch)")  # fmt: skip
    inputs = {"latents": block_state.latents, "prompt_embeds": block_state.prompt_embeds.to(block_state.dtype)}
    if scale != 1.0:  # the guider's unconditional call
        inputs["negative_prompt_embeds"] = block_state.negative_prompt_embeds.to(block_state.dtype)
    return inputs


def denoise_request(pipe, inputs: dict[str, torch.Tensor], block_state, components):
    """The engine's request for ``WanDenoiseStep``'s loop, and how the engine's final grid becomes the step's
    ``latents`` (B, C, F, H, W), as ``WanLoopAfterDenoiser`` leaves them."""
    latents = inputs["latents"]  # (B, C, F, H, W), float32
    scale = _guidance_scale(components.guider)
    batch, _, frames, height, width = latents.shape
    layout = VideoLayout(pipe.parallel.video_patches, frames, height, width, pipe.stage.patch_size)
    keys = ("prompt_embeds",) if scale == 1.0 else ("negative_prompt_embeds", "prompt_embeds")
    text, cfg_half = pipe._cfg_split({"prompt_embeds": torch.cat([inputs[k] for k in keys])}, batch)

    def run(stage, latents, first: int, last: int, expert_scale: float | None):
        return wan_request(  # mirrors ``diffusers.modular_pipelines.wan.denoise.WanLoopDenoiser.__call__``
            stage,
            latents=latents,
            layout=layout,
            timesteps=block_state.timesteps[first:last],
            scheduler=components.scheduler,
            prompt_embeds=text["prompt_embeds"],
            guidance_scale=scale,
            expert_guidance_scale=expert_scale,
            cfg_half=cfg_half,
        )

    # mirrors ``diffusers.modular_pipelines.wan.denoise.Wan22LoopDenoiser.__call__`` with two experts: the high-noise
    # one and its guider while t >= the boundary, then the low-noise one's
    two = pipe.stage_2 is not None
    boundary = components.config.boundary_ratio * components.num_train_timesteps if two else None
    low_scale = _guidance_scale(components.guider_2) if two else None
    request = pipe.expert_runs(run, latents, block_state.timesteps, boundary, low_scale, layout)
    back: Callable[[torch.Tensor], torch.Tensor] = lambda grid: layout.from_grid(grid).to(latents.dtype)  # noqa: E731
    return request, back
