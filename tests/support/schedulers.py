"""Schedulers for the tests: diffusers' by name, or a test's own class."""

from diffusers import DDPMScheduler

from xfuse.families.hunyuandit.reference import swap_scheduler


class PerPatchNoiseDDPM(DDPMScheduler):
    """DDPM defined in a module without diffusers' ``randn_tensor``: to xfuse (``draws_serial_noise``) a scheduler
    that draws its noise some other way (as ``DPMSolverSDEScheduler``'s Brownian tree does), whose pipelined steps
    keep per-patch generators. The draws themselves are DDPM's."""


def use_scheduler(pipe, scheduler):
    """``pipe`` with ``scheduler``: a diffusers scheduler's name, or a scheduler class, built from its config."""
    if isinstance(scheduler, str):
        return swap_scheduler(pipe, scheduler)
    pipe.scheduler = scheduler.from_config(pipe.scheduler.config)
    return pipe
