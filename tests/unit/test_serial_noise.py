"""Pipelined steps draw a stochastic scheduler's noise as serial diffusers does (``scheduler_state.SerialNoise``):
each patch's ``step`` on its rows, stepped in order over several steps, equals diffusers' ``step`` on the whole
latent with the same generator, and leaves the generator where serial's is."""

import diffusers
import pytest
import torch

from xfuse.parallel.patch_grid import patch_grid
from xfuse.parallel.scheduler_state import SerialNoise, draws_serial_noise, patch_schedulers

# (scheduler, config overrides, step keywords): every stochastic scheduler diffusers ships that the families accept
STOCHASTIC = [
    ("DDPMScheduler", {}, {}),
    ("EulerAncestralDiscreteScheduler", {}, {}),
    ("LCMScheduler", {}, {}),
    ("DDIMScheduler", {}, {"eta": 1.0}),
    ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}, {}),
    ("TCDScheduler", {}, {"eta": 0.3}),
]


def make(name, overrides, steps):
    scheduler = getattr(diffusers, name)(**overrides)
    scheduler.set_timesteps(steps)
    return scheduler


@pytest.mark.parametrize("name,overrides,step_kwargs", STOCHASTIC, ids=[s[0] for s in STOCHASTIC])
@pytest.mark.parametrize("batch_generators", [False, True])
def test_patch_steps_draw_serials_noise(name, overrides, step_kwargs, batch_generators):
    """Three patches cut by cost (one inside a row) over 4 steps, with one generator or a list of them (a batch of
    2): the stepped latent and the generators' states equal serial diffusers'."""
    steps, shape = 4, (2, 4, 16, 12)  # (B, C, H, W): 8 x 6 tokens of patch size 2
    gen = torch.Generator().manual_seed(1)
    model_outputs = [torch.randn(shape, generator=gen) for _ in range(steps)]
    start = torch.randn(shape, generator=gen)

    def generators():
        if batch_generators:
            return [torch.Generator().manual_seed(seed) for seed in (5, 6)]
        return torch.Generator().manual_seed(5)

    serial_gen, serial = generators(), make(name, overrides, steps)
    expected = start.clone()
    for i, t in enumerate(serial.timesteps):
        expected = serial.step(model_outputs[i], t, expected, generator=serial_gen, **step_kwargs).prev_sample

    grid = patch_grid(16, 12, 3, 2, lead_tokens=5)
    assert not all(band.whole_rows for band in grid)
    scheduler, patch_gen = make(name, overrides, steps), generators()
    schedulers = patch_schedulers(scheduler, torch.Size(shape), [band.latent_rows for band in grid])
    noise, latents = SerialNoise(scheduler, shape[2]), start.clone()
    for i, t in enumerate(scheduler.timesteps):
        for band, patch_scheduler in zip(grid, schedulers, strict=True):
            rows = band.latent_rows
            with noise.rows_of(i, rows):
                out = patch_scheduler.step(
                    model_outputs[i][:, :, rows], t, latents[:, :, rows], generator=patch_gen, **step_kwargs
                ).prev_sample
            band.copy_pixels(latents[:, :, rows], out)
    assert torch.allclose(latents, expected, rtol=1e-6, atol=1e-6)
    serial_states = [g.get_state() for g in (serial_gen if batch_generators else [serial_gen])]
    patch_states = [g.get_state() for g in (patch_gen if batch_generators else [patch_gen])]
    assert all(torch.equal(a, b) for a, b in zip(serial_states, patch_states, strict=True))
    module = __import__(type(scheduler).__module__, fromlist=["randn_tensor"])
    assert module.randn_tensor is noise._randn  # diffusers' own again after every patch


class _Scheduler:
    """A scheduler whose module (this test module) has no ``randn_tensor``: it would draw some other way."""


@pytest.mark.parametrize("name", [s[0] for s in STOCHASTIC] + ["FlowMatchEulerDiscreteScheduler"])
def test_schedulers_drawing_through_randn_tensor_are_recognised(name):
    assert draws_serial_noise(getattr(diffusers, name)())
    assert not draws_serial_noise(_Scheduler())
