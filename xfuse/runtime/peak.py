"""The memory one phase of a call (the VAE decode) adds on this rank at its peak, and the process's peak around it.

On CUDA: the peak allocation during the phase above the allocation at its start (``torch.cuda`` memory statistics;
their peak is reset for the phase, and the process's peak before it kept). On CPU: the peak resident size during the
phase above the resident size at its start — Linux's ``VmHWM`` after resetting it with ``/proc/self/clear_refs``
(the process's earlier peak kept), so a phase under an earlier, larger peak is still measured. It counts what the
phase touched in the process's memory; where the allocator reuses memory freed earlier in the call, the phase adds
less than it allocated. Where ``clear_refs`` cannot be written (not Linux, or a locked-down container), the CPU
figure is ``None``.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_seen_rss_mib = 0.0  # the process's peak resident size before the last reset (clear_refs lowers ru_maxrss)
_cuda_peaks: dict[int, int] = {}  # per device: the peak allocation before the last phase reset it


def peak_rss_mib() -> float:
    """The process's peak resident size, MiB, over its life (resets by :func:`phase_peak` included)."""
    return max(_seen_rss_mib, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def status_mib(key: str) -> float:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``: kB) in MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def reset_rss_peak() -> bool:
    """Lower the process's resident-size high-water mark (``VmHWM``) to its current size, remembering the earlier peak
    (:func:`peak_rss_mib`); False where ``/proc/self/clear_refs`` cannot be written."""
    global _seen_rss_mib
    _seen_rss_mib = peak_rss_mib()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # the resident-size high-water mark back to the current size (Linux >= 4.0)
        return True
    except OSError:
        return False


@dataclass
class PhasePeak:
    """What :func:`phase_peak` measured: ``kind``, what (``"CUDA allocated"`` or ``"resident"``), and ``mib``, the
    phase's peak above its start (``None``: not measurable here, or the phase has not ended)."""

    kind: str
    mib: float | None = None


@contextlib.contextmanager
def phase_peak(device: torch.device) -> Iterator[PhasePeak]:
    """Measure the memory the body adds at its peak on ``device`` (module docstring)."""
    if device.type == "cuda":
        result = PhasePeak("CUDA allocated")
        start = torch.cuda.memory_allocated(device)
        before = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            yield result
        finally:
            result.mib = (torch.cuda.max_memory_allocated(device) - start) / 2**20
            index = device.index or 0  # the process's peak stays the larger: the reset dropped the earlier one
            _cuda_peaks[index] = max(_cuda_peaks.get(index, 0), before)
        return
    result = PhasePeak("resident")
    measurable = reset_rss_peak()
    start = status_mib("VmRSS") if measurable else 0.0
    try:
        yield result
    finally:
        if measurable:
            result.mib = status_mib("VmHWM") - start


def peak_cuda_mib(device: torch.device) -> float:
    """The process's peak CUDA allocation on ``device``, MiB (resets by :func:`phase_peak` included)."""
    return max(_cuda_peaks.get(device.index or 0, 0), torch.cuda.max_memory_allocated(device)) / 2**20
