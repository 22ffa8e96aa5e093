"""The PipeFusion driver: one generic loop that runs a rank's share of the schedule.

Model-agnostic: it calls a *stage* (``begin_request``, ``embed``, ``run_segment``, ``head``; see
``xfuse.families.hunyuandit.stage.HunyuanDiTStage``) and receives the model-specific parts of a request as callables
(per-step conditioning, classifier-free guidance). The order of work and of every message is the pure schedule of
``xfuse.parallel.schedule``; this file builds (and keeps) a rank's program for each request shape and runs it:
``xfuse.parallel.executor`` carries the program out, ``xfuse.parallel.request_run`` computes each task of a request,
``xfuse.parallel.stops`` says where a cancelled request stops.

Who owns what: the embedding rank (0) turns latent rows into hidden states; the output rank runs the output layer
and ``scheduler.step`` (folded: rank 0 again; linear: the last rank, which sends the stepped latent rows back to
rank 0 as the next step's model input, and the final latents at the end; ``xfuse.parallel.rank_latents`` keeps what
those two ranks hold between tasks). Every rank gets the initial latents and computes its own conditioning, so no
conditioning crosses ranks. A request's model-specific inputs: ``xfuse.parallel.request.DenoiseRequest``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

from xfuse.comm.p2p import P2PChannels
from xfuse.config import CacheConfig
from xfuse.parallel.cancellation import Cancellation
from xfuse.parallel.executor import ProgramExecutor
from xfuse.parallel.patch_grid import PatchGrid
from xfuse.parallel.protocol import protocol
from xfuse.parallel.request import DenoiseRequest
from xfuse.parallel.request_run import RequestRun
from xfuse.parallel.request_state import RequestStates
from xfuse.parallel.request_stream import RequestStream, build_stream
from xfuse.parallel.schedule import Schedule, StreamShape, batch_parts, build_schedule
from xfuse.parallel.stage import Stage
from xfuse.parallel.stage_plan import StagePlan
from xfuse.parallel.stops import RunStops, stop_indices
from xfuse.parallel.trace import LOOP, Tracer, null_span
from xfuse.runtime.host_deadline import HostDeadline

MAX_CACHED_PROGRAMS = 8  # request shapes (steps, warm-up, patches, batch parts, patch costs) whose programs are kept


class PipeFusionEngine:
    """Runs pipeline rank ``pipe_rank``'s share of PipeFusion denoising.

    Args:
        stage: this rank's share of the model (a family's adapter: the ``Stage`` protocol).
        plan, grid: the stage plan and patch grid (the grid is for the request's latent size).
        channels: point-to-point channels; ``group_ranks[i]`` is the global rank of pipeline rank i.
        warmup_steps: whole-image steps (exact, no stale K/V) before patches are pipelined.
        max_inflight: receive buffers per channel (``comm.max_inflight``): how far ahead receives are posted.
        cache: step caching (``xfuse.parallel.step_cache``); ``None`` or method ``off``: every step computed.

    After each ``denoise``, ``cache_decisions`` holds this rank's per-step caching decisions (True: computed) and
    ``stopped_at`` the step a cancelled request stopped before (``None``: it ran to the end).
    """

    def __init__(
        self,
        stage: Stage,
        plan: StagePlan,
        channels: P2PChannels | None,
        *,
        pipe_rank: int,
        group_ranks: list[int],
        warmup_steps: int,
        max_inflight: int = 2,
        cache: CacheConfig | None = None,
        host_deadline: HostDeadline | None = None,
    ):
        if plan.degree > 1 and channels is None:
            raise ValueError("a pipeline of more than one rank needs channels")
        self.stage, self.plan, self.channels = stage, plan, channels
        self.pipe_rank, self.group_ranks = pipe_rank, list(group_ranks)
        self.warmup_steps, self.max_inflight = warmup_steps, max_inflight
        self.cache = cache if cache is not None and cache.enabled else None
        self.cache_decisions: list[bool] = []
        self.stopped_at: int | None = None
        self.stream_stopped: dict[int, int] = {}  # after denoise_stream: request -> the step it stopped before
        self.stream_cache_decisions: list[list[bool]] = []  # after denoise_stream: each request's cache_decisions
        self.host_deadline = host_deadline  # ages the host between tasks (comm.host_timeout_s)
        # The most recent request shapes' programs, oldest first: a long-lived service meets many step counts.
        self._schedules: OrderedDict[tuple, tuple[Schedule | RequestStream, list, dict, tuple]] = OrderedDict()
        self._states: RequestStates | None = None  # with streams: each request in flight's stage state

    def _cached(self, key: tuple, build):
        """The program of ``key`` (a request's or a stream's shape): built once by ``build()``, the most recent
        ``MAX_CACHED_PROGRAMS`` kept."""
        if key in self._schedules:
            self._schedules.move_to_end(key)
        else:  # pure and cached: computed once per request shape
            while len(self._schedules) >= MAX_CACHED_PROGRAMS:
                self._schedules.popitem(last=False)
            self._schedules[key] = build()
        return self._schedules[key]

    def _program(self, num_steps: int, grid: PatchGrid, parts: int, control_ranks: tuple[int, ...] = ()):
        flags = self.cache is not None
        steps = (num_steps, min(self.warmup_steps, num_steps))
        key = (*steps, grid.num_patches, parts, grid.cost_tokens, flags, control_ranks)

        def build():
            schedule = build_schedule(self.plan, *key)
            program = protocol(schedule, self.pipe_rank, self.max_inflight)
            return schedule, program, self._messages(schedule), stop_indices(schedule, program, 1)

        return self._cached(key, build)

    def _messages(self, schedule: Schedule | RequestStream) -> dict:
        """Each task's message lists (receives, sends), computed once per request shape, not on every use."""
        return {t: (schedule.recvs(t), schedule.sends(t)) for t in schedule.orders[self.pipe_rank]}

    def _stream_program(self, shapes: tuple[StreamShape, ...]):
        flags = self.cache is not None  # each step's first task hands its caching decision on

        def build():
            stream = build_stream(self.plan, list(shapes), step_flags=flags)
            program = protocol(stream, self.pipe_rank, self.max_inflight)
            return stream, program, self._messages(stream), stop_indices(stream, program, len(shapes))

        return self._cached(("stream", shapes, flags), build)

    def _run(
        self,
        request: DenoiseRequest,
        grid: PatchGrid,
        schedule: Schedule,
        messages: dict,
        tracer: Tracer | None,
        in_stream: bool = False,
    ) -> RequestRun:
        """``request``'s run on this rank (``RequestRun``: its own latents, messages and step caching)."""
        return RequestRun(
            request,
            grid,
            schedule,
            messages,
            stage=self.stage,
            plan=self.plan,
            pipe_rank=self.pipe_rank,
            group_ranks=self.group_ranks,
            cache=self.cache,
            tracer=tracer,
            in_stream=in_stream,
        )

    @torch.no_grad()
    def denoise(
        self,
        request: DenoiseRequest,
        grid: PatchGrid,
        tracer: Tracer | None = None,
        cancellation: Cancellation | None = None,
    ) -> torch.Tensor | None:
        """Run the denoising loop; return the final latents on the embedding rank (0), ``None`` elsewhere.

        Whole-image steps go through the route in batch parts where the transformer batch splits
        (``xfuse.parallel.schedule.batch_parts``). With a ``tracer``, every segment computed and every wait on a
        message is recorded on the timeline. With a ``cancellation``, the request may stop before any step after
        the first, on every rank alike (``xfuse.parallel.cancellation``): then ``stopped_at`` says where, and the
        result is ``None`` on every rank.
        """
        span = tracer.span if tracer is not None else null_span
        rows = [band.num_rows for band in grid]
        with span("denoise", LOOP, steps=len(request.timesteps), patch_rows=rows, patch_tokens=grid.cost_tokens):
            parts = batch_parts(request.model_batch, self.plan.degree, cached=self.cache is not None)
            if request.control is not None and self.cache is not None:
                raise ValueError("step caching with ControlNet residuals is not supported")
            control_ranks = () if request.control is None else request.control.ranks(self.plan)
            schedule, program, messages, stops = self._program(len(request.timesteps), grid, parts, control_ranks)
            if self._states is not None:
                self._states.use(0)  # a request alone runs in the stage's own state
            run = self._run(request, grid, schedule, messages, tracer)
            self.stopped_at = None
            run_stops: RunStops | None = None
            if cancellation is not None:
                cancellation.begin_run()
                reads, decides = stops
                run_stops = RunStops(cancellation, reads, decides, self.host_deadline)
            executor = ProgramExecutor([run], program, self.channels, stops=run_stops, host_deadline=self.host_deadline)
            aged = contextlib.nullcontext() if self.host_deadline is None else self.host_deadline.request(run.describe)
            try:
                with aged:
                    executor.execute()
            finally:
                self.stopped_at = None if run_stops is None else run_stops.stopped.get(0)
                decisions = {} if run.cache is None else run.cache.decisions
                self.cache_decisions = [decisions.get(step, True) for step in range(len(request.timesteps))]
            # a stopped request's state (this run) is dropped with it; the buffers stay for the next request
            return None if self.stopped_at is not None else run.latents.finish()

    @torch.no_grad()
    def denoise_stream(
        self,
        requests: list[DenoiseRequest],
        grids: list[PatchGrid],
        tracer: Tracer | None = None,
        cancellation: Cancellation | None = None,
    ) -> list[torch.Tensor | None]:
        """Denoise ``requests`` (on ``grids``, in arrival order) as one stream through the pipeline
        (``xfuse.parallel.request_stream``): a request's tasks enter the route while the one before it fills,
        drains, or runs its whole-image steps. Each request keeps its own latents, scheduler, generator and stage
        state (``xfuse.parallel.request_state``), so each result is the request's alone, bit for bit. Returns each
        request's final latents on the embedding rank (0), ``None`` elsewhere.

        With a ``cancellation``, each request may stop before any of its steps after the first, on every rank alike,
        while the others run on (the decider asks each request's condition, ``Cancellation.conditions``): then
        ``stream_stopped`` maps it to the step it stopped before, and its result is ``None`` on every rank.

        With step caching each request decides its own steps on its own residuals (``StepCache`` per request);
        ``stream_cache_decisions`` holds each request's decisions after the call.

        Every rank of the pipeline calls it with the same requests' shapes. Not with a ControlNet (its residuals
        travel per patch of one request: ``ControlRouting``).
        """
        if not requests or len(requests) != len(grids):
            raise ValueError(f"a stream needs one grid per request (got {len(requests)} requests, {len(grids)} grids)")
        self.stream_stopped, self.stream_cache_decisions = {}, []
        if len(requests) == 1:
            final = self.denoise(requests[0], grids[0], tracer, cancellation)
            if self.stopped_at is not None:
                self.stream_stopped = {0: self.stopped_at}
            self.stream_cache_decisions = [self.cache_decisions]
            return [final]
        if any(request.control is not None for request in requests):
            raise ValueError("a stream of several requests does not run with ControlNet residuals")
        if self._states is None:
            self._states = RequestStates(self.stage.request_state_holders())
        shapes = tuple(
            StreamShape(
                len(request.timesteps),
                min(self.warmup_steps, len(request.timesteps)),
                batch_parts(request.model_batch, self.plan.degree, cached=self.cache is not None),
                grid.cost_tokens,
            )
            for request, grid in zip(requests, grids, strict=True)
        )
        span = tracer.span if tracer is not None else null_span
        stream, program, messages, (reads, decides) = self._stream_program(shapes)
        with span("denoise", LOOP, requests=len(requests), steps=[shape.num_steps for shape in shapes]):
            runs = []
            try:
                for index, (request, grid) in enumerate(zip(requests, grids, strict=True)):
                    self._states.use(index)  # its ``begin_request`` starts its own state
                    own = {task: lists for task, lists in messages.items() if task.request == index}
                    runs.append(self._run(request, grid, stream.requests[index], own, tracer, in_stream=True))
                run_stops: RunStops | None = None
                if cancellation is not None:
                    cancellation.begin_run()
                    run_stops = RunStops(cancellation, reads, decides, self.host_deadline)
                deadline = self.host_deadline
                executor = ProgramExecutor(
                    runs, program, self.channels, states=self._states, stops=run_stops, host_deadline=deadline
                )
                aged = contextlib.nullcontext() if deadline is None else deadline.request(runs[0].describe)
                with aged:
                    executor.execute()
            finally:
                self._states.use(0)
            self.stopped_at, self.cache_decisions = None, []
            self.stream_stopped = {} if run_stops is None else dict(run_stops.stopped)
            for run in runs:
                decisions = {} if run.cache is None else run.cache.decisions
                self.stream_cache_decisions.append([decisions.get(s, True) for s in range(run.schedule.num_steps)])
            # a stopped request's state (its run) is dropped with it
            return [None if i in self.stream_stopped else run.latents.finish() for i, run in enumerate(runs)]
