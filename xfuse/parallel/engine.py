"""The PipeFusion driver: one generic loop that runs a rank's share of the schedule.

Model-agnostic: it calls a *stage* (``begin_request``, ``embed``, ``run_segment``, ``head``; see
``xfuse.families.hunyuandit.stage.HunyuanDiTStage``) and receives the model-specific parts of a request as callables
(per-step conditioning, classifier-free guidance). The order of work and of every message is the pure schedule of
``xfuse.parallel.schedule``; this file only executes it.

Who owns what: the embedding rank (0) turns latent rows into hidden states; the output rank runs the output layer
and ``scheduler.step`` (folded: rank 0 again; linear: the last rank, which sends the stepped latent rows back to
rank 0 as the next step's model input, and the final latents at the end; ``xfuse.parallel.rank_latents`` keeps what
those two ranks hold between tasks). Every rank gets the initial latents and computes its own conditioning, so no
conditioning crosses ranks. A request's model-specific inputs: ``xfuse.parallel.request.DenoiseRequest``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any

import torch

from xfuse.comm.p2p import P2PChannels, PendingRecv, PendingSend, Recv, Send
from xfuse.config import CacheConfig
from xfuse.parallel.cancellation import Cancellation
from xfuse.parallel.control_routing import ControlRouting
from xfuse.parallel.patch_grid import PatchGrid
from xfuse.parallel.rank_latents import RankLatents
from xfuse.parallel.request import DenoiseRequest
from xfuse.parallel.request_state import RequestStates
from xfuse.parallel.request_stream import RequestStream, build_stream
from xfuse.parallel.schedule import (
    COLLECT,
    Action,
    Message,
    Schedule,
    StreamShape,
    Task,
    batch_parts,
    build_schedule,
    decision_points,
    protocol,
    stop_points,
)
from xfuse.parallel.stage import Stage
from xfuse.parallel.stage_plan import StagePlan
from xfuse.parallel.step_cache import CachedSegments, StepCache, first_pipelined_step
from xfuse.parallel.trace import COMM, COMPUTE, LOOP, Tracer, null_span
from xfuse.runtime.host_deadline import HostDeadline

MAX_CACHED_PROGRAMS = 8  # request shapes (steps, warm-up, patches, batch parts, patch costs) whose programs are kept


class PipeFusionEngine:
    """Runs pipeline rank ``pipe_rank``'s share of PipeFusion denoising.

    Args:
        stage: this rank's share of the model (a family's adapter: the ``Stage`` protocol).
        plan, grid: the stage plan and patch grid (the grid is for the request's latent size).
        channels: point-to-point channels; ``group_ranks[i]`` is the global rank of pipeline rank i.
        warmup_steps: whole-image steps (exact, no stale K/V) before patches are pipelined.
        lookahead: tasks whose receives are posted ahead (≤ ``comm.max_inflight``).
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
        lookahead: int = 2,
        cache: CacheConfig | None = None,
        host_deadline: HostDeadline | None = None,
    ):
        if plan.degree > 1 and channels is None:
            raise ValueError("a pipeline of more than one rank needs channels")
        self.stage, self.plan, self.channels = stage, plan, channels
        self.pipe_rank, self.group_ranks = pipe_rank, list(group_ranks)
        self.warmup_steps, self.lookahead = warmup_steps, lookahead
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
            program = protocol(schedule, self.pipe_rank, self.lookahead)
            return schedule, program, self._messages(schedule), _stop_indices(schedule, program, 1)

        return self._cached(key, build)

    def _messages(self, schedule: Schedule | RequestStream) -> dict:
        """Each task's message lists (receives, sends), computed once per request shape, not on every use."""
        return {t: (schedule.recvs(t), schedule.sends(t)) for t in schedule.orders[self.pipe_rank]}

    def _stream_program(self, shapes: tuple[StreamShape, ...]):
        flags = self.cache is not None  # each step's first task hands its caching decision on

        def build():
            stream = build_stream(self.plan, list(shapes), step_flags=flags)
            program = protocol(stream, self.pipe_rank, self.lookahead)
            return stream, program, self._messages(stream), _stop_indices(stream, program, len(shapes))

        return self._cached(("stream", shapes, flags), build)

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
            # With caching, a whole-image step's decision is on its whole batch, as diffusers' on one call: no parts.
            parts = 1 if self.cache is not None else batch_parts(request.model_batch, self.plan.degree)
            if request.control is not None and self.cache is not None:
                raise ValueError("step caching with ControlNet residuals is not supported")
            control_ranks = () if request.control is None else request.control.ranks(self.plan)
            schedule, program, messages, stops = self._program(len(request.timesteps), grid, parts, control_ranks)
            if self._states is not None:
                self._states.use(0)  # a request alone runs in the stage's own state
            run = _Run(self, request, grid, schedule, messages, tracer)
            self.stopped_at = None
            executor = _Executor(self, [run], program)
            if cancellation is not None:
                cancellation.begin_run()
                reads, decides = stops
                executor.stops = _Stops(cancellation, reads, decides, self.host_deadline)
            aged = contextlib.nullcontext() if self.host_deadline is None else self.host_deadline.request(run.describe)
            try:
                with aged:
                    executor.execute()
            finally:
                self.stopped_at = None if executor.stops is None else executor.stops.stopped.get(0)
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
                # with caching a whole-image step's decision is on its whole batch (``denoise``): no parts
                1 if self.cache is not None else batch_parts(request.model_batch, self.plan.degree),
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
                    runs.append(_Run(self, request, grid, stream.requests[index], own, tracer, in_stream=True))
                executor = _Executor(self, runs, program, self._states)
                if cancellation is not None:
                    cancellation.begin_run()
                    executor.stops = _Stops(cancellation, reads, decides, self.host_deadline)
                deadline = self.host_deadline
                aged = contextlib.nullcontext() if deadline is None else deadline.request(runs[0].describe)
                with aged:
                    executor.execute()
            finally:
                self._states.use(0)
            self.stopped_at, self.cache_decisions = None, []
            self.stream_stopped = {} if executor.stops is None else dict(executor.stops.stopped)
            for run in runs:
                decisions = {} if run.cache is None else run.cache.decisions
                self.stream_cache_decisions.append([decisions.get(s, True) for s in range(run.schedule.num_steps)])
            # a stopped request's state (its run) is dropped with it
            return [None if i in self.stream_stopped else run.latents.finish() for i, run in enumerate(runs)]


class _Run:
    """State of one request on one rank (kept off the engine so requests never share it)."""

    def __init__(
        self,
        engine: PipeFusionEngine,
        request: DenoiseRequest,
        grid: PatchGrid,
        schedule: Schedule,
        messages: dict,
        tracer: Tracer | None = None,
        in_stream: bool = False,
    ):
        self.engine, self.request, self.grid, self.schedule = engine, request, grid, schedule
        self.in_stream = in_stream  # one of several requests in flight (its labels name it)
        self.recv_msgs = {t: r for t, (r, _) in messages.items()}  # task -> messages it receives, in order
        self.send_msgs = {t: s for t, (_, s) in messages.items()}  # task -> messages it sends, in order
        self.span = tracer.span if tracer is not None else null_span
        self.plan, self.stage, self.pipe_rank = engine.plan, engine.stage, engine.pipe_rank
        self.latents = RankLatents(request, grid, schedule, self.plan, self.pipe_rank)
        self.token_cols = grid.token_cols
        # (hidden, streams) handed to this same rank's next segment
        self.local: dict[Task, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.skips: dict[tuple, dict[int, torch.Tensor]] = {}  # (step, patch) -> producer block -> output
        self.conds: dict[int, Any] = {}
        self.recvs: dict[Message, PendingRecv] = {}
        self.sends: dict[Task, list[PendingSend]] = {}
        self.outgoing: dict[Task, dict[Message, torch.Tensor]] = {}
        self.stage.begin_request(grid)
        self.whole_tokens = self.stage.hidden_tokens(None)  # of the whole image: the request's (read in its state)
        control = request.control
        self.controls: ControlRouting | None = None  # with a ControlNet: this rank's share of its residuals
        if control is not None:
            first_blocks = self.plan.route[schedule.first_hop(self.pipe_rank)].blocks
            self.controls = ControlRouting(control, self.plan, self.pipe_rank, first_blocks)
            if control.begin_request is not None and self.pipe_rank == self.plan.embed_rank:
                control.begin_request(grid)
        self.cache: StepCache | None = None
        self.cached: CachedSegments | None = None  # with step caching: how this rank runs or skips its segments
        if engine.cache is not None:
            first = first_pipelined_step(self.schedule.num_steps, self.schedule.warmup_steps, grid.num_patches)
            self.cache = StepCache(engine.cache, grid.num_tokens, first)
            self.cached = CachedSegments(self.cache, self.stage, self.plan, self.pipe_rank)

    def _shape(self, m: Message) -> tuple:
        lat = self.request.latents
        rows = lat.shape[2] if m.patch is None else self.grid[m.patch].num_rows * self.grid.patch_size
        if m.kind == "latent":
            return (lat.shape[0], lat.shape[1], rows, lat.shape[3])  # (B, C, rows, W)
        if m.kind == "cache":
            return (1,)  # the step's caching decision: 1 computed, 0 skipped
        batch = self.request.model_batch if m.part is None else self.latents.part_size
        if m.kind in self.plan.streams:  # (B_model, ...), a batch part's rows of it (an SP rank: its chunk)
            return (batch, *self.stage.stream_shape(m.kind, self.request.stream_shapes[m.kind])[1:])
        # the tokens held: all, or an SP chunk (of the whole image: this request's, whichever request's state is in)
        held = self.whole_tokens if m.patch is None else self.stage.hidden_tokens(self.grid[m.patch])
        hidden = (batch, held.stop - held.start, self.stage.hidden_size)  # (B_model or a part's rows, tokens, hidden)
        if m.kind == "control":  # the receiver's residuals stacked: (residuals, B, tokens, hidden)
            assert self.controls is not None
            return (len(self.controls.samples[m.dst]), *hidden)
        return hidden

    # --- communication --------------------------------------------------------------------------------------
    def send(self, m: Message, tensor: torch.Tensor) -> Send:
        return Send(self.engine.group_ranks[m.dst], m.channel, tensor, m.step, m.patch, m.part)

    def recv(self, m: Message) -> Recv:
        dtype = self.request.latents.dtype
        if m.kind != "latent":
            dtype = self.request.hidden_dtype or dtype
        return Recv(self.engine.group_ranks[m.src], m.channel, self._shape(m), dtype, m.step, m.patch, m.part)

    def _received(self, task: Task) -> dict[Message, torch.Tensor]:
        received = {}
        for m in self.recv_msgs[task]:
            with self.span(f"recv {m.channel} from r{m.src}", COMM, step=m.step, patch=m.patch):
                received[m] = self.recvs[m].wait()
        return received

    def _release(self, task: Task) -> None:
        for m in self.recv_msgs[task]:
            self.recvs.pop(m).release()

    def compute(self, task: Task) -> None:
        """Run ``task`` on the messages it received (waited for here, right before use), then release them."""
        self._compute(task, self._received(task))
        self._release(task)

    def describe(self, place) -> str:
        """A host deadline's place, (action, task), in words (formatted only when reported)."""
        action, task = place
        return self._label(task) if action == Action.COMPUTE else f"the wait for the sends of {self._label(task)}"

    def _label(self, task: Task) -> str:
        where = "whole" if task.patch is None else f"p{task.patch}"
        if task.part is not None:
            where += f" b{task.part}"  # batch part
        who = f"request {task.request} " if self.in_stream else ""
        if task.hop == COLLECT:
            return f"{who}s{task.step - 1} {where} collect"
        blocks = self.plan.route[task.hop].blocks
        return f"{who}s{task.step} {where} blocks {blocks[0]}-{blocks[-1]}"

    def _cond(self, step: int):
        if step not in self.conds:
            self.conds.pop(step - 2, None)  # at most two steps are in flight on a rank
            self.conds[step] = self.request.conditioning(step, self.request.timesteps[step])
        return self.conds[step]

    def _compute(self, task: Task, received: dict[Message, torch.Tensor]) -> None:
        """One task: gather its inputs, run the model on them (the only part traced as compute), route outputs."""
        plan, step, patch = self.plan, task.step, task.patch
        by_kind: dict[str, list[tuple[Message, torch.Tensor]]] = {}
        for m, tensor in received.items():
            by_kind.setdefault(m.kind, []).append((m, tensor))
        if task.hop == COLLECT:  # linear: the final latents arrive from the output rank
            ((_, tensor),) = by_kind["latent"]
            self.latents.write_rows(patch, tensor)
            return
        key = (step, patch, task.part)
        skips = self.skips.setdefault(key, {})
        for m, tensor in by_kind.get("skip", []):
            skips[m.block] = tensor
        for _, tensor in by_kind.get("control", []):  # this rank's residuals of the patch, in sample order
            assert self.controls is not None
            self.controls.keep(key, received=tensor)
        # One patch covers the whole image: nothing is ever stale, so run it as a whole-image pass (no K/V copy).
        band = None if patch is None or self.grid.num_patches == 1 else self.grid[patch]
        streams: dict[str, torch.Tensor] = {}  # the plan's streams, for the step's first patch only
        rows: torch.Tensor | None = None
        hidden: torch.Tensor | None = None
        if task.hop == 0:
            if task.part in (None, 0):  # a batch part after the first reads the first's input
                rows = self.latents.model_input_rows(step, patch, by_kind.get("latent"))
        elif "hidden" in by_kind:
            hidden = by_kind["hidden"][0][1]
            streams = {kind: by_kind[kind][0][1] for kind in plan.streams if kind in by_kind}
        else:
            hidden, streams = self.local.pop(Task(step, patch, task.hop - 1, task.part, task.request))
        # Whole-image K/V are read only by the first pipelined step: only the last warm-up step stores them (with
        # caching every computed one does, as the last may be skipped).
        keep_kv = band is not None or (
            self.grid.num_patches > 1
            and (step == self.schedule.warmup_steps - 1 < self.schedule.num_steps - 1 or self.cache is not None)
        )
        last_hop = task.hop == len(plan.route) - 1
        self.stage.begin_task(step, patch)
        control = self.request.control
        residuals: list[torch.Tensor] = []  # hop 0 with ControlNet: every residual of the control model's pass
        stepped: torch.Tensor | None = None  # the output rank's stepped rows, once a step's last part is in
        which = {"request": task.request} if self.in_stream else {}
        with self.span(self._label(task), COMPUTE, step=step, patch=patch, hop=task.hop, **which):
            cond = self._cond(step)  # the step's conditioning (timestep embedding): model work, once per step
            part = None if task.part is None else self.latents.part(task.part)
            if part is not None:
                cond = self.stage.batch_part(cond, part)
            if task.hop == 0:  # (B_model or a part's rows, C, h, W) -> (same, tokens, D)
                model_input = self.latents.transformer_input(task, rows)
                hidden = self.stage.embed(model_input, band)
                if self.controls is not None:
                    assert control is not None and control.compute is not None, "the embedding rank runs it"
                    residuals = control.compute(step, model_input, band, part, keep_kv)
                    self.controls.keep(key, residuals)
            assert hidden is not None  # embedded at hop 0; received, or kept by this rank, after it
            hidden = self._segment(task, hidden, cond, band, skips, keep_kv, streams, key, by_kind.get("cache"))
            if last_hop:  # the output layer, then guidance and the scheduler's step on the output rank
                stepped = self.latents.step(task, self.stage.head(hidden, cond, self.token_cols, band))
        outgoing = {}
        for m in self.send_msgs[task]:
            if m.kind == "hidden":
                outgoing[m] = hidden.contiguous()
            elif m.kind == "skip":
                outgoing[m] = skips.pop(m.block).contiguous()
            elif m.kind in plan.streams:
                outgoing[m] = streams[m.kind].contiguous()
            elif m.kind == "cache":
                assert self.cache is not None
                computed = self.cache.decisions[step]
                outgoing[m] = hidden.new_full((1,), 1.0 if computed else 0.0)
            elif m.kind == "control":  # (the receiver's residuals, B, tokens, hidden)
                assert self.controls is not None
                outgoing[m] = self.controls.message(residuals, m.dst)
        if not skips:  # every skip of this patch consumed or sent
            self.skips.pop(key, None)
        if stepped is not None:
            next_rows = self.latents.route_stepped(step, patch, stepped)
            for m in self.send_msgs[task]:
                if m.kind == "latent":
                    outgoing[m] = next_rows.contiguous()
        elif not last_hop and plan.route[task.hop + 1].rank == self.pipe_rank:
            self.local[task] = (hidden, streams)  # picked up by this rank's next segment
        if outgoing:
            self.outgoing[task] = outgoing

    def _segment(self, task: Task, hidden, cond, band, skips, keep_kv, streams, key, flag) -> torch.Tensor:
        """The task's segment: run by the stage, with the ControlNet residuals its blocks add; under step caching as
        ``CachedSegments`` runs or skips it (``flag``: the step's decision, where it came with the task)."""
        if self.cached is not None:
            return self.cached.run(task, hidden, cond, band, skips, keep_kv, streams, flag)
        segment = self.plan.route[task.hop]
        if self.controls is None:  # the families without a ControlNet pipeline take no ``controls``
            return self.stage.run_segment(hidden, segment, cond, band, skips, keep_kv, streams)
        controls = self.controls.take(key, segment.blocks)
        return self.stage.run_segment(hidden, segment, cond, band, skips, keep_kv, streams, controls=controls)


class _Executor:
    """Runs a rank's ``program`` (``xfuse.parallel.schedule.protocol``) over the runs of the requests in it: one
    request alone, or a stream of them (``Task.request`` indexes ``runs``; each task's work is its request's run,
    in its request's stage state, switched by ``states``). A slot's sends and the receives posted after it go out
    in one coalesced exchange, whichever requests they belong to, in the program's order: messages between two
    ranks match in issue order."""

    def __init__(self, engine: PipeFusionEngine, runs: list[_Run], program, states: RequestStates | None = None):
        self.engine, self.runs, self.program, self.states = engine, runs, program, states
        self.stops: _Stops | None = None  # with cancellation (a request alone): where this rank learns if it stops

    def _use(self, request: int) -> None:
        if self.states is not None:
            self.states.use(request)

    def execute(self) -> None:
        program, stops, deadline = self.program, self.stops, self.engine.host_deadline
        pipe_rank = self.engine.pipe_rank
        last_of_step = [{t.step: t for t in run.schedule.orders[pipe_rank] if t.hop != COLLECT} for run in self.runs]
        prepare: tuple[int, int] | None = None  # (request, pipelined step) whose per-step work is due after the sends

        def runs(index: int) -> bool:  # with cancellation: the turn at ``index`` taken, whether its action runs
            return stops is None or stops.runs(index, program[index][1])

        i = 0
        while i < len(program):
            if not runs(i):  # a stopped request: no task of the step it stopped before, or a later one, runs
                i += 1
                continue
            action, task = program[i]
            if prepare is not None and action not in (Action.SEND, Action.POST):
                request, step = prepare
                if stops is None or stops.reaches(step, request):
                    with self.runs[request].span(f"s{step} prepare", COMPUTE, step=step, prepare=True):
                        self._use(request)
                        self.engine.stage.prepare_step(self.runs[request]._cond(step))
                prepare = None
            if action in (Action.SEND, Action.POST):  # coalesce a task's sends with the next posts: one batch call
                send_tasks: list[Task] = []
                post_tasks: list[Task] = []
                while i < len(program) and program[i][0] in (Action.SEND, Action.POST):
                    if stops is not None and stops.may_wait(i):  # what is collected goes before a wait
                        self._exchange(send_tasks, post_tasks)
                        send_tasks, post_tasks = [], []
                    if not runs(i):
                        i += 1
                        continue
                    (send_tasks if program[i][0] == Action.SEND else post_tasks).append(program[i][1])
                    i += 1
                self._exchange(send_tasks, post_tasks)
                continue
            run = self.runs[task.request]
            if action == Action.WAIT_SEND and task in run.sends:
                with run.span("send wait", COMM, step=task.step, patch=task.patch):
                    for handle in run.sends.pop(task):
                        handle.wait()
                if deadline is not None:
                    deadline.beat((Action.WAIT_SEND, task))
            elif action == Action.COMPUTE:
                self._use(task.request)
                run.compute(task)
                if deadline is not None:
                    deadline.beat((Action.COMPUTE, task))
                if last_of_step[task.request].get(task.step) == task:
                    if run.request.on_progress is not None:
                        run.request.on_progress(task.step)
                    # the next step's first patch need not carry its per-step work: done here, after this task's
                    # sends, while the other ranks compute (pipelined steps: patch passes on the whole batch)
                    if run.cache is None and run.schedule.warmup_steps <= task.step + 1 < run.schedule.num_steps:
                        prepare = (task.request, task.step + 1)
            # WAIT_RECV is folded into COMPUTE: the buffers are waited for right before use.
            i += 1
        for request, stop in {} if stops is None else stops.stopped.items():
            if self.runs[request].recvs or self.runs[request].sends:  # the stop points guarantee neither
                raise RuntimeError(f"request {request}, stopped before step {stop}, left messages in flight")

    def _exchange(self, send_tasks: list[Task], post_tasks: list[Task]) -> None:
        """Issue ``send_tasks``' outgoing messages and post ``post_tasks``' receives in one coalesced call."""
        sends: list[Send] = []
        send_owner: list[Task] = []
        for task in send_tasks:
            run = self.runs[task.request]
            for m, tensor in run.outgoing.pop(task, {}).items():
                if self.stops is not None and not self.stops.reaches(m.needed_at, task.request):
                    continue  # a stopped request runs no task of that step: nobody receives it
                sends.append(run.send(m, tensor))
                send_owner.append(task)
        recvs: list[Recv] = []
        posted: list[Message] = []
        for task in post_tasks:
            for m in self.runs[task.request].recv_msgs[task]:
                recvs.append(self.runs[task.request].recv(m))
                posted.append(m)
        if not sends and not recvs:
            return
        channels = self.engine.channels
        assert channels is not None  # messages flow only between ranks, and then the engine has channels
        send_handles, recv_handles = channels.exchange(sends, recvs)
        for task, sent in zip(send_owner, send_handles, strict=True):
            self.runs[task.request].sends.setdefault(task, []).append(sent)
        for m, received in zip(posted, recv_handles, strict=True):
            self.runs[m.request].recvs[m] = received


def _by_index(points: dict[tuple[int, int], int]) -> dict[int, tuple[tuple[int, int], ...]]:
    """``{(request, step): program index}`` -> ``{program index: its (request, step)s, ascending}``."""
    by_index: dict[int, list[tuple[int, int]]] = {}
    for stop, index in sorted(points.items()):
        by_index.setdefault(index, []).append(stop)
    return {index: tuple(stops) for index, stops in by_index.items()}


def _stop_indices(graph: Schedule | RequestStream, program, requests: int):
    """Where this rank reads (any rank) and decides (the decider) whether each request stops before each step:
    ``{program index: ((request, step), ...)}`` each (``stop_points``, ``decision_points``)."""
    reads, decides = {}, {}
    for request in range(requests):
        for stop, index in stop_points(graph, program, request).items():
            reads[(request, stop)] = index
        for stop, index in decision_points(graph, program, request).items():
            decides[(request, stop)] = index
    return _by_index(reads), _by_index(decides)


class _Stops:
    """One run's cancellation on one rank (a request alone, or each request of a stream): at which program indices
    it learns whether a request stops before a step (``reads``; ``xfuse.parallel.schedule.stop_points``), where the
    decider decides (``decides``), and the step each stopped request stopped before (``stopped``)."""

    def __init__(self, cancellation: Cancellation, reads: dict, decides: dict, deadline: HostDeadline | None = None):
        self.cancellation = cancellation
        self.deadline = deadline  # a wait for the decider is bounded by comm.timeout_s: not the host's stall
        self.reads = reads
        self.decides = decides if cancellation.is_decider else {}
        self.decided: dict[int, int] = {}  # the decider's: request -> the step it decided to stop it before
        self.stopped: dict[int, int] = {}  # request -> the step it stopped before
        self._turned = -1  # the last index whose turn was taken: a decision is taken once

    def may_wait(self, index: int) -> bool:
        """Whether the turn at ``index`` may wait for the decider (so what this rank has to send goes first)."""
        if self.cancellation.is_decider:
            return False
        return any(request not in self.stopped for request, _ in self.reads.get(index, ()))

    def turn(self, index: int) -> None:
        """At program ``index``: the decider decides the steps due here; then every rank learns the ones due."""
        if index <= self._turned:
            return
        self._turned = index
        for request, stop in self.decides.get(index, ()):
            if request not in self.decided and self.cancellation.decide(stop, request):
                self.decided[request] = stop  # nothing further is decided for it
        for request, stop in self.reads.get(index, ()):
            if request in self.stopped:
                continue
            if self.cancellation.is_decider:
                stopping = self.decided.get(request) == stop
            else:
                with contextlib.nullcontext() if self.deadline is None else self.deadline.in_wait():
                    stopping = self.cancellation.read(stop, request)
            if stopping:
                self.stopped[request] = stop

    def runs(self, index: int, task: Task) -> bool:
        """Take the turn at program ``index`` (once); whether its action, on ``task``, runs."""
        self.turn(index)
        return self.reaches(task.step, task.request)

    def reaches(self, step: int, request: int = 0) -> bool:
        """Whether ``request`` runs ``step`` (all of them, unless it stopped before this one or an earlier one)."""
        stopped = self.stopped.get(request)
        return stopped is None or step < stopped
