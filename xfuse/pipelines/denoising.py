"""Denoising one request on the engine (``DenoisingMixin._denoise``, the driver's step 7): the request's patch grid,
the pooled receive buffers kept for one request shape, the engine's loop with a progress bar on rank 0 (a compiled
stage's new shapes compiled inside ``XfuseConfig.longest_wait_s``), and step caching's decisions counted and checked
alike on every rank of a pipeline group.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from xfuse.parallel.engine import PipeFusionEngine
from xfuse.parallel.patch_grid import PatchGrid, patch_grid
from xfuse.parallel.request import DenoiseRequest
from xfuse.parallel.step_cache import check_decisions


def _counts(decisions: list[bool]) -> tuple[int, int]:
    """(steps computed, steps skipped) of a run's caching decisions."""
    return sum(decisions), len(decisions) - sum(decisions)


class DenoisingMixin:
    """``PipeFusionPipelineBase``'s denoising of one request (module docstring)."""

    def _grid(self, request: DenoiseRequest) -> PatchGrid:
        """The request's patch grid: the step's first patch carries the plan's streams (an MMDiT's text) through
        every block, so patches are cut by cost."""
        latents = request.latents  # (B, C, H, W) as the engine sees them (FLUX's packed tokens, a video's frames)
        lead_tokens = sum(shape[1] for shape in request.stream_shapes.values())  # (B, T, hidden) each
        height, width = latents.shape[-2:]
        return patch_grid(height, width, self.parallel.resolved_num_patches, self.stage.patch_size, lead_tokens)

    def _size_buffers(self, shape: tuple) -> None:
        """Keep the pooled receive buffers for requests of ``shape``; a new shape drops those of the last one."""
        if shape != self._buffer_shape:
            for channels in self.context.all_channels:
                channels.reset_buffers()
            self._buffer_shape = shape

    def _denoise(self, request: DenoiseRequest, engine: PipeFusionEngine | None = None):
        """The engine's (``self.engine``'s unless given) denoising loop with a progress bar on rank 0; the final
        latents on rank 0, else ``None``."""
        latents = request.latents  # (B, C, H, W) as the engine sees them (FLUX's packed tokens, a video's frames)
        grid = self._grid(request)
        shape = (grid.token_rows, grid.token_cols, grid.cost_tokens, tuple(latents.shape), latents.dtype)
        self._size_buffers(shape)  # a new request shape: drop the receive buffers sized for the last one
        # One update per step the engine runs (a second-order scheduler's steps are its timesteps).
        progress = self.pipeline.progress_bar(total=len(request.timesteps)) if self.context.is_output else None
        if progress is not None:
            request.on_progress = lambda step: progress.update()
        engine = engine or self.engine
        framed = contextlib.nullcontext()
        if self.compiler is not None:
            latents_shape = "x".join(map(str, latents.shape))
            framed = self.compiler.request(engine, shape, self._compile_bounds(), f"latents {latents_shape}")
        try:
            with framed:
                final = engine.denoise(request, grid, self._tracer, self._cancellation)
        finally:
            if progress is not None:
                progress.close()
        if engine.stopped_at is not None:  # on every rank alike: nothing after the loop runs
            self._stopped = self._steps_run + engine.stopped_at
            return None
        self._steps_run += len(request.timesteps)
        if engine.cache is not None:
            self._check_cache_decisions([engine.cache_decisions])  # two experts: two runs in one call
        return final

    def _check_cache_decisions(self, runs: list[list[bool]]) -> None:
        """Count step caching's decisions of the runs just made (each a request's, by step) and check that every
        rank of a pipeline group took the same ones (each its first task's)."""
        for decisions in runs:
            computed, skipped = _counts(decisions)
            self._cache_counts = (self._cache_counts[0] + computed, self._cache_counts[1] + skipped)
        if self.context.world_size > 1:
            gathered: list = [None] * self.context.world_size
            dist.all_gather_object(gathered, (self.context.cfg_rank, runs), group=self.context.control_group)
            for index in range(len(runs)):
                check_decisions([(group, per_run[index]) for group, per_run in gathered])

    @contextlib.contextmanager
    def _compile_bounds(self):
        """While a request compiles new shapes: every wait for a message on every rank, and this rank's host
        deadline, bounded by ``XfuseConfig.longest_wait_s`` (every rank decides alike: the request's shape is the
        same everywhere). Nothing is bounded until it is entered: ``StageCompiler`` enters it for compiling
        requests only, and a request of a compiled shape keeps the plain ``comm.timeout_s``."""
        with contextlib.ExitStack() as stack:
            for channels in self.context.all_channels:
                stack.enter_context(channels.bounded_by(self.config.longest_wait_s))
            if self.context.host_deadline is not None:
                stack.enter_context(self.context.host_deadline.bounded_by(self.config.longest_wait_s))
            yield
