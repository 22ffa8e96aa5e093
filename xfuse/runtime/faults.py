"""Fault injection for failure drills (and xfuse's own fault tests), driven by ``XFUSE_FAULT="kind:rank:step"``.

``kind`` is ``kill`` (the rank SIGKILLs itself), ``stall`` (it sleeps for an hour: a host blocked where Python's
other threads still run, as inside a CUDA kernel launch behind a device queue that does not drain), ``freeze`` (it
sleeps for an hour inside a C call that holds the interpreter lock: no Python thread of the process runs again) or
``raise`` (a RuntimeError inside its forward). The fault fires when global rank ``rank`` starts its first block on the
first pass of diffusion step ``step``: patch 0, or the whole image (its first batch part when the step is streamed in
parts). With ``step`` ``decode`` it fires when the rank starts its band of a band-parallel VAE decode (the decoder's
first convolution); with ``text`` when it starts its layers of a split text encoder (``parallel.text_encoder:
split``). ``slow_compile:RANK:SECONDS`` makes the rank's first ``torch.compile`` of a frame take ``SECONDS`` longer
(with ``compile.mode: regional``: a compile that runs long, inside the compiler, where the compile bound counts it).
``xfuse generate`` installs it when the variable is set.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

from xfuse.comm.errors import describe_place
from xfuse.stderr import clock, write_stderr

KINDS = ("kill", "stall", "freeze", "raise")
SLOW_COMPILE = "slow_compile"  # its third field is seconds, not a step


DECODE = "decode"  # the step of a fault in the VAE decode
TEXT = "text"  # the step of a fault in a split text encoder


def parse(spec: str) -> tuple[str, int, int | str]:
    try:
        kind, rank, step = spec.split(":")
        if kind not in (*KINDS, SLOW_COMPILE):
            raise ValueError
        return kind, int(rank), step if step in (DECODE, TEXT) and kind != SLOW_COMPILE else int(step)
    except ValueError:
        raise ValueError(
            f"XFUSE_FAULT must be KIND:RANK:STEP with KIND in {KINDS} and STEP a step, {DECODE!r} or {TEXT!r}, or "
            f"{SLOW_COMPILE}:RANK:SECONDS (got {spec!r})"
        ) from None


def _fire(kind: str, rank: int, place: str) -> None:
    write_stderr(f"[xfuse-fault {clock()}] rank {rank}: {kind} at {place}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stall":
        time.sleep(3600)
    elif kind == "freeze":  # libc's sleep through a PyDLL: called without releasing the interpreter lock
        ctypes.PyDLL(None).sleep(3600)
    else:
        raise RuntimeError(f"injected fault: rank {rank} raised in its forward at {place}")


def install(stage, rank: int, spec: str | None = None, vae=None, text=None) -> bool:
    """Arm the fault of ``spec`` (default: ``$XFUSE_FAULT``) on ``stage`` (for a ``decode`` fault on ``vae``, this
    rank's VAE; for a ``text`` fault on ``text``, its split text encoders' ``TextGroup``) if it targets ``rank``.

    The step is counted from what the engine hands the stage for each pass (``run_segment``'s band and the
    conditioning's batch part), not from a number of passes per step: a whole-image step takes one pass per batch
    part, a pipelined one one per patch, and the parts depend on the request's batch."""
    spec = spec or os.environ.get("XFUSE_FAULT")
    if not spec:
        return False
    kind, target, step = parse(spec)
    if target != rank:
        return False
    if kind == SLOW_COMPILE:
        _slow_first_compile(rank, int(step))
        return True
    if step == DECODE:
        if vae is None:
            raise ValueError(f"XFUSE_FAULT={spec!r}: rank {rank} holds no VAE (parallel.vae_parallel is off)")
        vae.decoder.conv_in.register_forward_pre_hook(lambda module, args: _fire(kind, rank, "the VAE decode"))
        return True
    if step == TEXT:
        if text is None:
            raise ValueError(f"XFUSE_FAULT={spec!r}: rank {rank} runs no split text encoder (parallel.text_encoder)")
        for encoder in text.encoders.values():
            encoder.first_layer.register_forward_pre_hook(lambda *_: _fire(kind, rank, "the text encoder"))
        return True
    now = {"step": -1, "pass": (None, None)}  # the step of the first block's last pass; this run_segment's pass
    begin, run_segment = stage.begin_request, stage.run_segment

    def begin_request(*args, **kwargs):  # a new request: count its steps from zero
        now["step"] = -1
        return begin(*args, **kwargs)

    def run_segment_noting_the_pass(hidden, segment, cond, band, *args, **kwargs):
        now["pass"] = (band, getattr(cond, "part", None))  # read by the first block's pre-hook inside this call
        return run_segment(hidden, segment, cond, band, *args, **kwargs)

    def pre_hook(module, args):
        # The rank's first block runs one segment, which sees its passes in (step, patch, part) order.
        band, part = now["pass"]
        if (band.index if band is not None else getattr(part, "index", 0)) != 0:
            return  # not a step's first pass
        now["step"] += 1
        if now["step"] != step:
            return
        _fire(kind, rank, describe_place(step, None if band is None else band.index, getattr(part, "index", None)))

    stage.begin_request = begin_request
    stage.run_segment = run_segment_noting_the_pass
    stage.blocks[stage.block_ids[0]].register_forward_pre_hook(pre_hook)
    return True


def _slow_first_compile(rank: int, seconds: int) -> None:
    """A dynamo start-of-compile callback that sleeps ``seconds`` once (``CompileWatch``'s clock starts before it)."""
    from torch._dynamo.callback import callback_handler

    fired = []

    def slow(args) -> None:  # left registered (removing it while dynamo iterates its callbacks would skip one)
        if fired:
            return
        fired.append(True)
        write_stderr(f"[xfuse-fault {clock()}] rank {rank}: slow_compile: {seconds} s more in its first compile")
        time.sleep(seconds)

    callback_handler.register_start_callback(slow)
