"""Fault injection for failure drills (and xfuse's own fault tests), driven by ``XFUSE_FAULT="kind:rank:step"``.

``kind`` is ``kill`` (the rank SIGKILLs itself), ``stall`` (it sleeps for an hour) or ``raise`` (a RuntimeError
inside its forward). The fault fires when global rank ``rank`` starts its first block on a patch (or the whole
image) of diffusion step ``step``. ``xfuse generate`` installs it when the variable is set.
"""

from __future__ import annotations

import os
import signal
import time

from xfuse.stderr import clock, write_stderr

KINDS = ("kill", "stall", "raise")


def parse(spec: str) -> tuple[str, int, int]:
    try:
        kind, rank, step = spec.split(":")
        if kind not in KINDS:
            raise ValueError
        return kind, int(rank), int(step)
    except ValueError:
        raise ValueError(f"XFUSE_FAULT must be KIND:RANK:STEP with KIND in {KINDS} (got {spec!r})") from None


def install(stage, warmup_steps: int, num_patches: int, rank: int, spec: str | None = None) -> bool:
    """Arm the fault of ``spec`` (default: ``$XFUSE_FAULT``) on ``stage`` if it targets ``rank``."""
    spec = spec or os.environ.get("XFUSE_FAULT")
    if not spec:
        return False
    kind, target, step = parse(spec)
    if target != rank:
        return False
    calls = {"n": 0}
    begin = stage.begin_request

    def begin_request(*args, **kwargs):  # a new request: count its tasks from zero
        calls["n"] = 0
        return begin(*args, **kwargs)

    def pre_hook(module, args):
        n = calls["n"]
        calls["n"] += 1
        current = n if n < warmup_steps else warmup_steps + (n - warmup_steps) // num_patches
        if current != step:
            return
        write_stderr(f"[xfuse-fault {clock()}] rank {rank}: {kind} at step {step}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stall":
            time.sleep(3600)
        else:
            raise RuntimeError(f"injected fault: rank {rank} raised in its forward at step {step}")

    stage.begin_request = begin_request
    stage.blocks[stage.block_ids[0]].register_forward_pre_hook(pre_hook)
    return True
