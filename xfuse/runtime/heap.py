"""How a process xfuse owns (``xfuse generate``, ``xfuse serve``'s ranks) keeps its memory between requests, and
what Python's garbage collector costs it.

Both memory settings are process-wide, so only those processes apply them (``xfuse.build.build_pipeline``); the
pipeline classes leave a user's own process alone. :func:`collector_paused` restores the collector as it found it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import platform
from collections.abc import Iterator

# mallopt(3) parameters (glibc's <malloc.h>).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit hosts (4 MiB * sizeof(long)); a larger value is refused.
MMAP_THRESHOLD_MAX = 32 << 20
# mallopt takes an int: the largest trim threshold it can be given, i.e. never trim on free.
TRIM_NEVER = 2**31 - 1


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside the block, as it was after: for importing a family's modules
    (``xfuse.families.spec.ModelSpec``), which imports diffusers and transformers with them, and for the whole
    start-up of a process xfuse owns, to its built pipeline (``xfuse generate``, ``xfuse serve``'s ranks), whose
    :func:`freeze_startup_heap` collects once what start-up left: with the collector on through it, ``xfuse generate``
    of the tiny preset at degree 1 took 2.9-3.3 user-s, 2.5-2.7 off.

    Those imports allocate some 700,000 objects and leave almost no garbage, yet every 700 allocations start a
    collection, and the older generations' collections walk everything imported so far: a quarter of a rank's start-up
    CPU. Importing HunyuanDiT's pipeline with diffusers and transformers took 3.7-4.3 CPU-s with the collector on and
    2.7-3.1 off on this project's 2-core machine, every ``torchrun`` rank and every ``xfuse serve`` worker paying it.
    What the imports do allocate as garbage is collected by the next collection after the block.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_startup_heap() -> None:
    """Exempt everything alive now (the libraries, the model's modules) from Python's garbage collector.

    After torch, transformers and diffusers are imported and a pipeline is loaded, a full collection walks some
    400,000 objects: 150 ms on one core of the CPU machine of docs/performance.md, and the collector runs one in the
    middle of a denoising loop every few requests, on whichever rank it likes. A pause on one rank stalls every rank
    behind it in the pipeline. Frozen objects are never scanned again (``gc.freeze``; vLLM's engine does the same
    after start-up), so later collections only see what requests create.
    """
    gc.collect()  # what start-up left as garbage is freed, not frozen
    gc.freeze()


def keep_freed_heap() -> bool:
    """Make glibc keep the memory a denoising pass frees for the next pass instead of returning it to the kernel.

    torch's CPU tensors come from ``malloc``. glibc serves a block above its mmap threshold with a fresh ``mmap``
    and unmaps it on free, and trims the top of its heap once more than the trim threshold is free there; both
    thresholds adapt only up to a point, and a DiT block's activations keep crossing them. Every pass then gets
    its activations as new pages that the kernel must fault in and zero: on the CPU machine of docs/performance.md, 8
    blocks of the ``small`` preset on a 512 px image (1,024 tokens, CFG batch 2) took 17,744 minor page faults per
    pass, every pass, and a 20-step degree-1 loop 727,000 faults and 1.1 s of system time in 11.6 s. With the mmap
    threshold at glibc's ceiling (``MMAP_THRESHOLD_MAX``) and no trimming on free: 0 faults per pass after the
    first, 15,000 per loop, 0.15 s of system time, the loop 5-7 % faster at degrees 1 and 2.

    Called once the model is loaded: what loading freed is handed back first (``malloc_trim``), so the process
    keeps from then on the largest heap a request needed (the peak resident size it reached anyway), not what
    loading needed. Blocks above 32 MiB (activations of large models at large sizes) are still mapped per use. On
    CUDA the activations are not on this heap; only host-side work is affected.

    Returns:
        `bool`: whether both settings were applied (False where the C library is not glibc).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the process's own C library
    libc.malloc_trim(0)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_NEVER)
    )
