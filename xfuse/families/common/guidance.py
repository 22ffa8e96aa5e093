"""Classifier-free guidance of one patch's noise prediction, as the diffusers DiT pipelines combine it."""

from __future__ import annotations

from collections.abc import Callable

import torch


def do_classifier_free_guidance(guidance_scale: float) -> bool:
    """Whether a diffusers DiT pipeline batches [uncond, cond]: its ``do_classifier_free_guidance`` property."""
    return guidance_scale > 1


def cfg_batch(latents: torch.Tensor, guidance_scale: float, cfg_half=None):
    """The transformer batch and the request's ``model_input``: the latent rows twice ([uncond | cond]) when CFG
    runs batched on this rank, once without CFG or with CFG parallelism (each group runs its half)."""
    copies = 2 if do_classifier_free_guidance(guidance_scale) and cfg_half is None else 1

    def model_input(rows: torch.Tensor, where: slice = slice(None)) -> torch.Tensor:
        return torch.cat([rows] * copies) if copies > 1 else rows  # (B, C, h, W) -> (copies*B, C, h, W)

    return latents.shape[0] * copies, model_input


def guidance(
    guidance_scale: float,
    cfg_half=None,
    *,
    learned_sigma: bool,
    guidance_rescale: float = 0.0,
    batched: bool | None = None,
    keep_cond_norm: bool = False,
) -> Callable[[torch.Tensor, int, int | None], torch.Tensor]:
    """The request's ``guide(output, step, patch)``: transformer output rows -> the noise the scheduler steps with.

    ``learned_sigma``: the transformer predicts noise and variance; only the noise half of the channels is kept
    (guidance is elementwise, so splitting before or after it, as HunyuanDiT and PixArt do, gives the same numbers).
    With CFG batched, the output is [uncond | cond]. With CFG parallelism (``cfg_half=(cfg_rank, exchange)``) it
    is this rank's half (0: uncond, 1: cond) and ``exchange(noise, step, patch)`` returns the other half's rows.
    ``guidance_rescale`` needs whole-image statistics: pipelines allow it in whole-image steps only. ``batched``:
    whether the output is [uncond | cond] when that is not ``guidance_scale > 1`` (Wan 2.2's second expert combines
    with its own ``guidance_scale_2`` the batch the first expert's scale decided). ``keep_cond_norm``: each token's
    guided prediction rescaled to the conditional prediction's norm over the channels, as ``QwenImagePipeline``
    combines them (per token: a patch's rows are combined as the whole image's).
    """
    do_cfg = do_classifier_free_guidance(guidance_scale) if batched is None else batched
    if guidance_rescale > 0.0:
        from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import rescale_noise_cfg

    def guide(output: torch.Tensor, step: int, patch) -> torch.Tensor:
        noise = output.chunk(2, dim=1)[0] if learned_sigma else output  # (B, 2C, h, W) -> (B, C, h, W)
        if not do_cfg:
            return noise
        if cfg_half is None:
            uncond, cond = noise.chunk(2)
        else:
            cfg_rank, exchange = cfg_half
            other = exchange(noise.contiguous(), step, patch)
            uncond, cond = (noise, other) if cfg_rank == 0 else (other, noise)
        guided = uncond + guidance_scale * (cond - uncond)
        if keep_cond_norm:  # as QwenImagePipeline.__call__: comb_pred * (cond_norm / noise_norm), over channels
            guided = guided * (torch.norm(cond, dim=1, keepdim=True) / torch.norm(guided, dim=1, keepdim=True))
        if guidance_rescale > 0.0:
            guided = rescale_noise_cfg(guided, cond, guidance_rescale=guidance_rescale)
        return guided

    return guide
