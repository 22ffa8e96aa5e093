"""Cancelling a pipeline's calls between two denoising steps (``CancellationMixin``): ``enable_cancellation`` on every
rank, then global rank 0's ``cancel_if`` condition decides for every rank (the protocol:
``xfuse.parallel.cancellation``; a stream's calls each with their own condition: ``stream``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from xfuse.parallel.cancellation import Cancellation
from xfuse.runtime.monitor import default_store


class CancellationMixin:
    """``PipeFusionPipelineBase``'s cancellation (module docstring)."""

    def enable_cancellation(self, enabled: bool = True) -> None:
        """Let a call stop between two denoising steps when global rank 0's ``cancel_if`` condition holds (``xfuse
        serve`` does, for a client that went away). Call it on every rank alike, before the calls it applies to:
        every rank then learns at each step whether the call goes on (``xfuse.parallel.cancellation``; one store
        round trip per step and rank)."""
        if not enabled:
            self._cancellation = None
            return
        self._cancellation = Cancellation(
            rank=self.context.rank,
            world_size=self.context.world_size,
            store=default_store() if self.context.world_size > 1 else None,
            timeout_s=self.comm.timeout_s,
        )

    @contextlib.contextmanager
    def cancel_if(self, condition: Callable[[], bool]):
        """On global rank 0 (other ranks follow its decisions; elsewhere the condition is never asked): the calls
        made inside stop before the next step once ``condition()`` returns True, raising ``RequestCancelled`` on
        every rank. Asked once per step, from the calling thread; needs ``enable_cancellation()``."""
        if self._cancellation is None:
            raise RuntimeError("cancel_if needs enable_cancellation() on every rank first")
        self._cancellation.condition = condition
        try:
            yield
        finally:
            self._cancellation.condition = None
