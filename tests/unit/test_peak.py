"""``xfuse.runtime.peak``: what a phase adds to the process's memory at its peak, and the process's peak kept across
the reset the measurement needs (Linux: ``/proc/self/clear_refs``)."""

import mmap

import pytest
import torch

from xfuse.runtime import peak


def touch_fresh_pages(mib: int) -> None:
    """Fault in ``mib`` MiB of new anonymous pages and unmap them. Their own mapping, not ``malloc``: the test
    worker's heap may hold freed memory already resident that would serve a tensor without a page faulted in (an
    earlier test in the worker that ran ``xfuse.build``'s ``keep_freed_heap``)."""
    mapping = mmap.mmap(-1, mib << 20)
    pages = torch.frombuffer(mapping, dtype=torch.uint8)
    pages.fill_(1)
    del pages  # the buffer's export released, so the mapping can close
    mapping.close()


@pytest.mark.skipif(not peak.reset_rss_peak(), reason="/proc/self/clear_refs is not writable here (not Linux)")
def test_a_phase_under_an_earlier_larger_peak_is_measured_and_the_process_peak_kept():
    touch_fresh_pages(96)  # the process's peak before the phase
    before = peak.peak_rss_mib()
    with peak.phase_peak(torch.device("cpu")) as measured:
        touch_fresh_pages(48)  # under the earlier peak
    assert measured.kind == "resident"
    assert 46 <= measured.mib <= 56  # an unreset peak reads 96 more or less, a missing one 0
    assert peak.peak_rss_mib() >= before  # the reset lowered VmHWM, not the process's peak as reported
