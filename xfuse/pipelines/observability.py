"""What a pipeline reports of its calls (``ObservabilityMixin``): the trace of the calls since ``enable_trace`` (each
rank's events, and every rank's merged into one Chrome/Perfetto file), and each rank's statistics of the last call
(bytes sent by kind, step caching's steps, peak memory, the decode's).
"""

from __future__ import annotations

from xfuse.parallel.trace import Tracer, write_trace
from xfuse.runtime.peak import peak_cuda_mib, peak_rss_mib


class ObservabilityMixin:
    """``PipeFusionPipelineBase``'s traces and statistics (module docstring)."""

    def enable_trace(self, enabled: bool = True) -> None:
        """Record a timeline of the following calls (compute per segment and patch, communication waits)."""
        self._tracer = Tracer(self.context.rank) if enabled else None

    def trace_events(self) -> list[dict]:
        """This rank's recorded trace events (Chrome trace format) since ``enable_trace()``."""
        if self._tracer is None:
            raise ValueError("trace_events: call enable_trace() before the calls to record")
        return list(self._tracer.events)

    def write_trace(self, path: str) -> int | None:
        """Collective: merge every rank's timeline into one Chrome/Perfetto trace at ``path`` (written by global
        rank 0, which gets the number of events; the others get ``None``)."""
        if self._tracer is None:
            raise ValueError("write_trace: call enable_trace() before the calls to record")
        mine = self._tracer.metadata() + self._tracer.events
        gathered = self.collectives.gather(mine)
        return write_trace(path, gathered) if gathered is not None else None

    def local_stats(self) -> dict:
        """This rank's bytes sent in the last call by kind (``hidden``, ``skip``, ``latent``, ``cfg``), with step
        caching the last call's (steps computed, steps skipped) (``cache_steps``; every patch of a step takes its
        step's branch), its peak memory (``peak_rss_mib``: the process's peak resident memory; ``peak_cuda_mib``: the
        peak CUDA allocation) and what its part of the last call's VAE decode added at its peak (``decode_peak``:
        ``(what was measured, MiB)``, ``xfuse.runtime.peak``; ``None`` where this rank did not decode)."""
        sent: dict[str, int] = {}
        for channels in self.context.all_channels:
            for kind, nbytes in channels.counters.sent_bytes.items():
                sent[kind] = sent.get(kind, 0) + nbytes
        return dict(
            sent=sent,
            cache_steps=self._cache_counts if self.engine.cache is not None else None,
            peak_rss_mib=peak_rss_mib(),
            peak_cuda_mib=peak_cuda_mib(self.context.device) if self.context.device.type == "cuda" else None,
            decode_peak=None if self._decode_peak is None else (self._decode_peak.kind, self._decode_peak.mib),
        )

    def rank_stats(self) -> list[dict] | None:
        """Every rank's `local_stats`. Collective: call it on every rank; global rank 0 gets the list indexed by
        rank, the others ``None``."""
        return self.collectives.gather(self.local_stats())

    @property
    def decode_ranks(self) -> int:
        """The ranks the last call's VAE decode ran on (1: rank 0 alone; see ``parallel.vae_parallel``)."""
        return 1 if self._decode_shape is None else self.context.world_size
