"""``merge_patch_schedulers``: per-patch scheduler copies put back together continue exactly as the serial scheduler
(a two-expert Wan request hands the first expert's state to the second this way)."""

import copy

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from xfuse.parallel.patch_grid import patch_grid
from xfuse.parallel.scheduler_state import merge_patch_schedulers, patch_schedulers

SCHEDULERS = {
    "unipc_flow": lambda: UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
    ),
    "dpm_2m": DPMSolverMultistepScheduler,
    "flow_euler": FlowMatchEulerDiscreteScheduler,
}
STEPS, SPLIT_AT, MERGE_AT = 8, 2, 5


def run(make, merge: bool):
    """Steps 0 … SPLIT_AT-1 whole, SPLIT_AT … MERGE_AT-1 patch by patch (3 patches, cuts inside token rows), the rest
    whole again from the merged scheduler (``merge=False``: from the scheduler as it was before the split)."""
    scheduler = make()
    scheduler.set_timesteps(STEPS)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 12, 8, generator=g)
    outputs = [torch.randn(1, 4, 12, 8, generator=g) for _ in range(STEPS)]  # the model's, one per step
    grid = patch_grid(12, 8, 3, 2, lead_tokens=5)
    assert not grid[0].whole_rows  # a token row shared by two patches
    patches = None
    for step, t in enumerate(scheduler.timesteps):
        if SPLIT_AT <= step < MERGE_AT:
            if patches is None:
                patches = patch_schedulers(scheduler, latents.shape, [band.latent_rows for band in grid])
            for band, patch in zip(grid, patches, strict=True):
                rows = band.latent_rows
                stepped = patch.step(outputs[step][:, :, rows], t, latents[:, :, rows].clone(), return_dict=False)[0]
                band.copy_pixels(latents[:, :, rows], stepped)
            continue
        if step == MERGE_AT and merge:
            merge_patch_schedulers(scheduler, patches, list(grid))
        elif step == MERGE_AT:  # the bug the merge prevents: the counters are behind, the history is the warm-up's
            scheduler = copy.deepcopy(scheduler)
        latents = scheduler.step(outputs[step], t, latents, return_dict=False)[0]
    return latents


def serial(make):
    scheduler = make()
    scheduler.set_timesteps(STEPS)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 12, 8, generator=g)
    outputs = [torch.randn(1, 4, 12, 8, generator=g) for _ in range(STEPS)]
    for step, t in enumerate(scheduler.timesteps):
        latents = scheduler.step(outputs[step], t, latents, return_dict=False)[0]
    return latents


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_merged_patch_schedulers_continue_as_the_serial_one(name):
    make = SCHEDULERS[name]
    expected = serial(make)
    assert torch.allclose(run(make, merge=True), expected, rtol=0, atol=1e-6)
    assert (run(make, merge=False) - expected).abs().max() > 1e-3  # without the merge it does not
