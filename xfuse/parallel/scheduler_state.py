"""Per-patch scheduler state for pipelined steps.

Pipelined steps call ``scheduler.step`` once per patch, at different times. Schedulers keep state between steps: a
step counter (all) and, for multistep solvers such as ``DPMSolverMultistepScheduler``, the previous model outputs,
which are whole-latent tensors. Each patch therefore gets its own copy of the scheduler whose whole-latent tensors
are cut to the patch's rows; the counters advance independently and identically.
"""

from __future__ import annotations

import copy

import torch


def _slice(value, full_shape: torch.Size, rows: slice):
    if isinstance(value, torch.Tensor) and value.shape == full_shape:
        return value[:, :, rows].clone()  # (B, C, H, W) -> (B, C, rows, W)
    if isinstance(value, list):
        return [_slice(v, full_shape, rows) for v in value]
    if isinstance(value, tuple):
        return tuple(_slice(v, full_shape, rows) for v in value)
    return value


def patch_schedulers(scheduler, full_shape: torch.Size, row_slices: list[slice]) -> list:
    """One copy of ``scheduler`` per patch, every whole-latent tensor of its state cut to that patch's rows."""
    copies = []
    for rows in row_slices:
        patch = copy.copy(scheduler)
        for name, value in vars(scheduler).items():
            setattr(patch, name, _slice(copy.deepcopy(value), full_shape, rows))
        copies.append(patch)
    return copies


def patch_generators(generator: torch.Generator | None, count: int, device) -> list[torch.Generator | None]:
    """Generators for per-patch scheduler noise, derived deterministically from the user's ``generator``.

    Draws ``count`` seeds from ``generator`` (advancing it, as any consumer of a generator does). Without a
    generator, the patches draw from torch's global RNG like diffusers does.
    """
    if generator is None:
        return [None] * count
    seeds = torch.randint(0, 2**62, (count,), generator=generator, device=generator.device).tolist()
    return [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
