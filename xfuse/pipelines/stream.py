"""The stream entry point: ``StreamMixin.run_stream`` runs several calls as one stream through the pipeline. Each
call's family ``__call__`` hands its recipe over instead of running it (``CallDriverMixin._run`` collects it); the calls
are checked and prepared one after another, denoised together by the engine (``PipeFusionEngine.denoise_stream``), then
finished one after another, each as the call alone finishes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from xfuse.errors import RequestCancelled
from xfuse.parallel.request import DenoiseRequest
from xfuse.parallel.trace import CALL, null_span
from xfuse.pipelines.call_driver import CallRecipe


class StreamMixin:
    """``PipeFusionPipelineBase``'s stream of calls (module docstring)."""

    @torch.no_grad()
    def run_stream(
        self, calls: Sequence[dict[str, Any]], stop_if: Sequence[Callable[[], bool] | None] | None = None
    ) -> list[Any]:
        """Run several calls as one stream through the pipeline: ``calls[i]`` are the keyword arguments of one
        ``__call__``; returns what each call returns, in order (rank 0's outputs, ``None`` elsewhere).

        The calls' tasks are scheduled together (``xfuse.parallel.request_stream``): the next call's patches enter
        the first stage while the one before it drains the last, and one call's whole-image steps share the ranks
        with another's patches. Each call keeps its own scheduler (a copy taken after its timesteps are set),
        generator, latents and stale K/V, so each output is the one the call alone returns, bit for bit; the calls
        are prepared (text, latents) one after another, denoised together, then decoded one after another. Every
        rank calls it with the same calls. Calls of one size, or of several (each keeps its own buffers).

        ``stop_if`` (global rank 0, with ``enable_cancellation()`` on every rank): one condition per call (``None``:
        never stopped), asked once per step of its call as ``cancel_if``'s is; a call whose condition holds stops
        before its next step on every rank while the others run on, and its entry in the result is the
        ``RequestCancelled`` every rank gets alike (returned, not raised).

        Refused before any communication: a ControlNet, a compiled stage and sequence parallelism;
        a call of two experts (Wan 2.2) on every rank alike once the calls are prepared. Run those one at a time.
        """
        if not calls:
            raise ValueError("run_stream needs at least one call")
        if stop_if is not None and len(stop_if) != len(calls):
            raise ValueError(f"stop_if needs one condition (or None) per call: {len(stop_if)} for {len(calls)} calls")
        if stop_if is not None and self._cancellation is None:
            raise RuntimeError("run_stream's stop_if needs enable_cancellation() on every rank first")
        if self._control_blocks(self.pipeline):
            raise ValueError("run_stream does not run ControlNet pipelines: call them one at a time")
        if self.compiler is not None:
            raise ValueError("run_stream does not run compiled stages (compile.mode: off)")
        self.engine.stage.request_state_holders()  # raises where the stage cannot keep several requests
        recipes: list[CallRecipe] = []
        self._recipes = recipes
        try:
            for call in calls:
                self(**call)  # the family's own checks, then _run collects the recipe
        finally:
            self._recipes = None
        decode_shapes = []
        for recipe in recipes:
            self._check_call(recipe)
            decode_shapes.append(self._decode_shape)
        self._begin_call()
        span = self._tracer.span if self._tracer is not None else null_span
        results: list[Any] = []
        if self._cancellation is not None:
            self._cancellation.conditions = list(stop_if) if stop_if is not None else [None] * len(recipes)
        try:
            with self.context.monitor.guard(), span("call", CALL, calls=len(recipes)):
                requests = []
                for index, recipe in enumerate(recipes):
                    request, _ = self._prepare(recipe, span)
                    if not isinstance(request, DenoiseRequest):  # (on every rank alike)
                        raise ValueError(f"calls[{index}]: a request of two experts does not run in a stream")
                    request.scheduler = copy.deepcopy(request.scheduler)  # its own: the next call sets the timesteps
                    requests.append(request)
                finals = self._denoise_stream(requests)
                stopped = self.engine.stream_stopped  # the same on every rank: nothing after the loop runs for them
                for index, (recipe, final) in enumerate(zip(recipes, finals, strict=True)):
                    if index in stopped:
                        results.append(RequestCancelled(stopped[index], len(requests[index].timesteps)))
                        continue
                    self._decode_shape = decode_shapes[index]
                    results.append(self._finish(recipe, final, span))
        finally:
            if self._cancellation is not None:
                self._cancellation.conditions = None
        if self._callback_error is not None:
            raise self._callback_error
        return results

    def _denoise_stream(self, requests: list[DenoiseRequest]) -> list[torch.Tensor | None]:
        """The engine's stream of ``requests`` (``PipeFusionEngine.denoise_stream``), one progress bar on rank 0."""
        grids = [self._grid(request) for request in requests]
        self._size_buffers(tuple((g.token_rows, g.token_cols, g.cost_tokens, tuple(r.latents.shape), r.latents.dtype)
                                 for g, r in zip(grids, requests, strict=True)))  # fmt: skip
        total = sum(len(request.timesteps) for request in requests)
        progress = self.pipeline.progress_bar(total=total) if self.context.is_output else None
        if progress is not None:
            for request in requests:
                request.on_progress = lambda step: progress.update()
        try:
            finals = self.engine.denoise_stream(requests, grids, self._tracer, self._cancellation)
        finally:
            if progress is not None:
                progress.close()
        self._steps_run += total
        if self.engine.cache is not None:
            self._check_cache_decisions(self.engine.stream_cache_decisions)
        return finals
