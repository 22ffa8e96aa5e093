"""Per-patch scheduler state and noise for pipelined steps.

Pipelined steps call ``scheduler.step`` once per patch, at different times. Schedulers keep state between steps: a
step counter (all) and, for multistep solvers such as ``DPMSolverMultistepScheduler``, the previous model outputs,
which are whole-latent tensors. Each patch therefore gets its own copy of the scheduler whose whole-latent tensors
are cut to the patch's rows; the counters advance independently and identically.

Stochastic schedulers (DDPM, Euler ancestral, LCM, DDIM with ``eta > 0``, the SDE variants of DPM-Solver++, …) draw
their noise inside ``step`` through diffusers' ``randn_tensor``, once per step with the model output's shape. Serial
diffusers draws it for the whole latent from the user's generator; ``SerialNoise`` makes the patches' steps draw
exactly that (the step's first patch draws the whole latent's noise, every patch steps with its rows of it), so the
noise realisation, and the generator's state after the call, are serial's. A scheduler whose module draws otherwise
(``DPMSolverSDEScheduler``'s Brownian tree, seeded per call) keeps per-patch generators (``patch_generators``).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

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


def _merge(whole, parts: list, bands: list):
    """``whole``'s value rebuilt from the patches' values of it: a tensor that each patch holds for its covering rows
    (B, C, rows, W) from every patch's own pixels (``PatchBand.copy_pixels``: a token row two patches share keeps each
    one's own part); lists and tuples item by item; anything else (counters, timestep lists, tables) is the same in
    every patch: the first patch's."""

    def rows_of(value, band) -> bool:
        rows = band.latent_rows.stop - band.latent_rows.start
        return isinstance(value, torch.Tensor) and value.dim() >= 3 and value.shape[2] == rows

    if all(rows_of(part, band) for part, band in zip(parts, bands, strict=True)):
        shape = (*parts[0].shape[:2], bands[-1].latent_rows.stop, *parts[0].shape[3:])  # the whole latent's
        like = isinstance(whole, torch.Tensor) and tuple(whole.shape) == shape
        merged = whole.clone() if like else parts[0].new_zeros(shape)
        for band, part in zip(bands, parts, strict=True):
            band.copy_pixels(merged[:, :, band.latent_rows], part)
        return merged
    if isinstance(parts[0], list | tuple) and all(len(p) == len(parts[0]) for p in parts):
        olds = (
            list(whole) if isinstance(whole, list | tuple) and len(whole) == len(parts[0]) else [None] * len(parts[0])
        )
        return type(parts[0])(_merge(old, [p[i] for p in parts], bands) for i, old in enumerate(olds))
    return copy.deepcopy(parts[0])


def merge_patch_schedulers(scheduler, patches: list, bands: list) -> None:
    """The inverse of ``patch_schedulers``: ``scheduler`` takes the state its per-patch copies reached, each
    whole-latent tensor assembled from every patch's own pixels (``bands``: the grid's ``PatchBand``s, in order). After
    a pipelined run the scheduler is then where serial diffusers' is (its step index, a multistep solver's history),
    so a later run on the same latents (the next expert of a two-expert model) continues from it."""
    for name, value in vars(scheduler).items():
        setattr(scheduler, name, _merge(value, [vars(p)[name] for p in patches], bands))


def patch_generators(generator: torch.Generator | None, count: int, device) -> list[torch.Generator | None]:
    """Generators for per-patch scheduler noise, derived deterministically from the user's ``generator``.

    Draws ``count`` seeds from ``generator`` (advancing it, as any consumer of a generator does). Without a
    generator, the patches draw from torch's global RNG like diffusers does.
    """
    if generator is None:
        return [None] * count
    seeds = torch.randint(0, 2**62, (count,), generator=generator, device=generator.device).tolist()
    return [torch.Generator(device=device).manual_seed(seed) for seed in seeds]


def draws_serial_noise(scheduler) -> bool:
    """Whether ``scheduler``'s noise can be drawn as serial diffusers draws it and cut per patch (``SerialNoise``):
    its module draws through diffusers' ``randn_tensor``."""
    module = sys.modules.get(type(scheduler).__module__)
    return module is not None and callable(getattr(module, "randn_tensor", None))


class SerialNoise:
    """The noise of pipelined ``scheduler.step`` calls as serial diffusers draws it, cut per patch.

    While a patch of step ``s`` steps (``rows_of``), the scheduler module's ``randn_tensor`` is replaced: the step's
    first draw request draws the whole latent's noise (the patch's shape with the latent's height), from the same
    generator (or list of generators) with the same device and dtype, as serial diffusers' step would; every patch
    of ``s`` gets its rows of it. Patches of a step are stepped in order and each draws as many tensors as serial's
    step, so the draws happen once per step, in step order, and the generator ends where serial's does.
    """

    def __init__(self, scheduler, latent_height: int):
        self._module = sys.modules[type(scheduler).__module__]
        self._randn = self._module.randn_tensor  # diffusers' own, restored after every patch's step
        self._height = latent_height
        self._step: int | None = None
        self._draws: list[torch.Tensor] = []  # the step's whole-latent draws, in the order the scheduler asked

    @contextmanager
    def rows_of(self, step: int, rows: slice) -> Iterator[None]:
        """For one patch's ``scheduler.step`` of ``step``: noise draws give ``rows`` (latent rows) of the step's
        whole-latent draws."""
        if step != self._step:
            self._step, self._draws = step, []
        index = 0

        def randn_rows(shape, generator=None, device=None, dtype=None, layout=None) -> torch.Tensor:
            nonlocal index
            if index == len(self._draws):  # the step's first patch: the whole latent's noise, as serial draws it
                whole = (shape[0], shape[1], self._height, *shape[3:])  # (B, C, h, W) -> (B, C, H, W)
                self._draws.append(self._randn(whole, generator=generator, device=device, dtype=dtype, layout=layout))
            noise = self._draws[index][:, :, rows]  # (B, C, H, W) -> (B, C, h, W): the patch's rows
            index += 1
            return noise

        setattr(self._module, "randn_tensor", randn_rows)  # noqa: B010  (a module's global, replaced for one call)
        try:
            yield
        finally:
            setattr(self._module, "randn_tensor", self._randn)  # noqa: B010


class PatchStepping:
    """The output rank's ``scheduler.step`` of pipelined steps, one patch at a time: built at the request's first
    pipelined step from its scheduler (each patch a copy with its whole-latent state cut to the patch's rows,
    ``patch_schedulers``), its step keywords and generator; a stochastic scheduler's noise drawn as serial diffusers
    draws it (``SerialNoise``: the user's generator, one whole-latent draw per step, each patch its rows), or for a
    scheduler that draws otherwise from per-patch generators derived from the user's (``patch_generators``)."""

    def __init__(self, scheduler, extra_step_kwargs: dict, generator, latent_shape: torch.Size, bands: list, device):
        count, self.bands = len(bands), bands
        self.serial_noise: SerialNoise | None = None
        if draws_serial_noise(scheduler):
            self.serial_noise = SerialNoise(scheduler, latent_shape[2])
            self.kwargs = [extra_step_kwargs] * count
        else:  # the seeds are drawn from the user's generator first, before any patch steps
            gens = patch_generators(generator, count, device)
            self.kwargs = [
                {**extra_step_kwargs, "generator": g} if "generator" in extra_step_kwargs else extra_step_kwargs
                for g in gens
            ]
        self.schedulers = patch_schedulers(scheduler, latent_shape, [band.latent_rows for band in bands])

    def step(self, patch: int, step: int, noise: torch.Tensor, t, sample: torch.Tensor) -> torch.Tensor:
        """``scheduler.step`` of ``patch`` at ``step`` on its (B, C, h, W) ``sample`` rows: its stepped rows."""
        drawing = (
            nullcontext()
            if self.serial_noise is None
            else self.serial_noise.rows_of(step, self.bands[patch].latent_rows)
        )
        with drawing:
            return self.schedulers[patch].step(noise, t, sample, **self.kwargs[patch], return_dict=False)[0]

    def merge_into(self, scheduler) -> None:
        """End of the request: the request's scheduler left where serial diffusers' is (``merge_patch_schedulers``)."""
        merge_patch_schedulers(scheduler, self.schedulers, self.bands)
