"""The PipeFusion driver: one generic loop that runs a rank's share of the schedule.

Model-agnostic: it calls a *stage* (``begin_request``, ``embed``, ``run_segment``, ``head``; see
``xfuse.families.hunyuandit.stage.HunyuanDiTStage``) and receives the model-specific parts of a request as callables
(per-step conditioning, classifier-free guidance). The order of work and of every message is the pure schedule of
``xfuse.parallel.schedule``; this file only executes it.

Who owns what: the embedding rank (0) turns latent rows into hidden states; the output rank runs the output layer
and ``scheduler.step`` (folded: rank 0 again; linear: the last rank, which sends the stepped latent rows back to
rank 0 as the next step's model input, and the final latents at the end). Every rank gets the initial latents
and computes its own conditioning, so no conditioning crosses ranks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from xfuse.comm.p2p import P2PChannels, PendingRecv, PendingSend, Recv, Send
from xfuse.config import CacheConfig
from xfuse.parallel.control import ControlResiduals
from xfuse.parallel.control_routing import ControlRouting
from xfuse.parallel.patch_grid import PatchBand, PatchGrid
from xfuse.parallel.schedule import COLLECT, Action, Message, Schedule, Task, batch_parts, build_schedule, protocol
from xfuse.parallel.scheduler_state import PatchStepping
from xfuse.parallel.stage import BatchPart, Stage
from xfuse.parallel.stage_plan import StagePlan
from xfuse.parallel.step_cache import CachedSegments, StepCache, first_pipelined_step
from xfuse.parallel.trace import COMM, COMPUTE, LOOP, Tracer, null_span

MAX_CACHED_PROGRAMS = 8  # request shapes (steps, warm-up, patches, batch parts, patch costs) whose programs are kept


@dataclass
class DenoiseRequest:
    """The model-specific inputs of one denoising loop, as the pipeline prepares them on every rank.

    Attributes:
        latents: (B, C, H, W) initial latents (already scaled by ``init_noise_sigma``), identical on every rank.
        timesteps: the scheduler's timesteps after ``set_timesteps``.
        scheduler: this rank's scheduler (a diffusers ``SchedulerMixin``), after ``set_timesteps``.
        conditioning: ``conditioning(step_index, t) -> cond`` for this rank's stage.
        model_input: ``model_input(rows, where)``: latent rows (B, C, h, W), the rows ``where`` of the latent ->
            transformer input rows (e.g. doubled for CFG; an image-to-video's conditioning frame put in).
        guide: ``guide(output_rows, step, patch)`` -> noise prediction rows (B, C, h, W) (drops learned sigma,
            applies CFG; ``patch`` is None for a whole-image step).
        extra_step_kwargs: keyword arguments of ``scheduler.step`` (``eta``, ``generator``).
        generator: the user's generator (the one in ``extra_step_kwargs``); per-patch generators are derived from
            it only for a scheduler whose noise cannot be drawn as serial's (``scheduler_state.draws_serial_noise``).
        model_batch: batch of the transformer input.
        on_step_end: called on the output rank as ``on_step_end(step, latents)`` once every patch of ``step`` has
            been stepped (``latents`` is then exactly the latent after that step; no patch is further yet).
        on_progress: called on every rank as ``on_progress(step)`` when this rank finished its last task of
            ``step``.
        stream_shapes: the shape of each of the plan's streams (the hand-off tensors a step's first patch carries
            besides the hidden state, e.g. an MMDiT's text ``(B_model, T, hidden)``), taken from this request's
            tensors by the family's adapter.
        hidden_dtype: dtype of the hidden states (and streams) handed between ranks, where it is not the latents'
            (Wan steps float32 latents with a bfloat16 transformer); ``None``: the latents' dtype.
        control: ControlNet residuals (``xfuse.parallel.control``): computed on the embedding rank with each hop-0
            task, added after the blocks that take them; ``None``: no ControlNet.
    """

    latents: torch.Tensor
    timesteps: torch.Tensor
    scheduler: Any
    conditioning: Callable[[int, torch.Tensor], Any]
    model_input: Callable[[torch.Tensor, slice], torch.Tensor]
    guide: Callable[[torch.Tensor, int, int | None], torch.Tensor]
    model_batch: int
    extra_step_kwargs: dict = field(default_factory=dict)
    generator: torch.Generator | None = None
    on_step_end: Callable[[int, torch.Tensor], None] | None = None
    on_progress: Callable[[int], None] | None = None
    stream_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    hidden_dtype: torch.dtype | None = None
    control: ControlResiduals | None = None


def _scale_model_input(scheduler, sample: torch.Tensor, t) -> torch.Tensor:
    """``scheduler.scale_model_input`` where the scheduler has one; flow-matching schedulers have none and their
    pipelines (SD3, FLUX) feed the latents as they are."""
    scale = getattr(scheduler, "scale_model_input", None)
    return sample if scale is None else scale(sample, t)


class PipeFusionEngine:
    """Runs pipeline rank ``pipe_rank``'s share of PipeFusion denoising.

    Args:
        stage: this rank's share of the model (a family's adapter: the ``Stage`` protocol).
        plan, grid: the stage plan and patch grid (the grid is for the request's latent size).
        channels: point-to-point channels; ``group_ranks[i]`` is the global rank of pipeline rank i.
        warmup_steps: whole-image steps (exact, no stale K/V) before patches are pipelined.
        lookahead: tasks whose receives are posted ahead (≤ ``comm.max_inflight``).
        cache: step caching (``xfuse.parallel.step_cache``); ``None`` or method ``off``: every step computed.

    After each ``denoise``, ``cache_decisions`` holds this rank's per-step caching decisions (True: computed).
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
    ):
        if plan.degree > 1 and channels is None:
            raise ValueError("a pipeline of more than one rank needs channels")
        self.stage, self.plan, self.channels = stage, plan, channels
        self.pipe_rank, self.group_ranks = pipe_rank, list(group_ranks)
        self.warmup_steps, self.lookahead = warmup_steps, lookahead
        self.cache = cache if cache is not None and cache.enabled else None
        self.cache_decisions: list[bool] = []
        # The most recent request shapes' programs, oldest first: a long-lived service meets many step counts.
        self._schedules: OrderedDict[tuple, tuple[Schedule, list, dict]] = OrderedDict()

    def _program(self, num_steps: int, grid: PatchGrid, parts: int, control_ranks: tuple[int, ...] = ()):
        flags = self.cache is not None
        steps = (num_steps, min(self.warmup_steps, num_steps))
        key = (*steps, grid.num_patches, parts, grid.cost_tokens, flags, control_ranks)
        if key in self._schedules:
            self._schedules.move_to_end(key)
        else:  # pure and cached: computed once per request shape
            while len(self._schedules) >= MAX_CACHED_PROGRAMS:
                self._schedules.popitem(last=False)
            schedule = build_schedule(self.plan, *key)
            # Each task's message lists, computed once per request shape instead of on every use in the loop.
            messages = {t: (schedule.recvs(t), schedule.sends(t)) for t in schedule.orders[self.pipe_rank]}
            self._schedules[key] = (schedule, protocol(schedule, self.pipe_rank, self.lookahead), messages)
        return self._schedules[key]

    @torch.no_grad()
    def denoise(self, request: DenoiseRequest, grid: PatchGrid, tracer: Tracer | None = None) -> torch.Tensor | None:
        """Run the denoising loop; return the final latents on the embedding rank (0), ``None`` elsewhere.

        Whole-image steps go through the route in batch parts where the transformer batch splits
        (``xfuse.parallel.schedule.batch_parts``). With a ``tracer``, every segment computed and every wait on a
        message is recorded on the timeline.
        """
        span = tracer.span if tracer is not None else null_span
        rows = [band.num_rows for band in grid]
        with span("denoise", LOOP, steps=len(request.timesteps), patch_rows=rows, patch_tokens=grid.cost_tokens):
            # With caching, a whole-image step's decision is on its whole batch, as diffusers' on one call: no parts.
            parts = 1 if self.cache is not None else batch_parts(request.model_batch, self.plan.degree)
            if request.control is not None and self.cache is not None:
                raise ValueError("step caching with ControlNet residuals is not supported")
            control_ranks = () if request.control is None else request.control.ranks(self.plan)
            schedule, program, messages = self._program(len(request.timesteps), grid, parts, control_ranks)
            run = _Run(self, request, grid, schedule, messages, tracer)
            try:
                return run.execute(program)
            finally:
                decisions = {} if run.cache is None else run.cache.decisions
                self.cache_decisions = [decisions.get(step, True) for step in range(len(request.timesteps))]


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
    ):
        self.engine, self.request, self.grid, self.schedule = engine, request, grid, schedule
        self.recv_msgs = {t: r for t, (r, _) in messages.items()}  # task -> messages it receives, in order
        self.send_msgs = {t: s for t, (_, s) in messages.items()}  # task -> messages it sends, in order
        self.span = tracer.span if tracer is not None else null_span
        self.plan, self.stage, self.pipe_rank = engine.plan, engine.stage, engine.pipe_rank
        latents = request.latents
        self.latents = latents.clone() if self.pipe_rank in (self.plan.output_rank, self.plan.embed_rank) else None
        self.token_cols = grid.token_cols
        # (hidden, streams) handed to this same rank's next segment
        self.local: dict[Task, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.skips: dict[tuple, dict[int, torch.Tensor]] = {}  # (step, patch) -> producer block -> output
        # (step, patch, part) -> block -> the ControlNet residual added after it, for this rank's blocks
        self.inputs: dict[tuple, torch.Tensor] = {}  # (step, patch) -> model-input latent rows (embedding rank)
        if self.pipe_rank == self.plan.embed_rank:  # step 0's input: the whole latent, scaled once (as diffusers does)
            self.inputs[(0, None)] = _scale_model_input(request.scheduler, self.own_latents, request.timesteps[0])
        self.conds: dict[int, Any] = {}
        self.part_size = request.model_batch // schedule.batch_parts  # transformer batch rows of a batch part
        self.part_input: torch.Tensor | None = None  # a whole-image step's transformer input, read part by part
        self.head_parts: list[torch.Tensor] = []  # output-layer results of a whole-image step's parts so far
        self.recvs: dict[Message, PendingRecv] = {}
        self.sends: dict[Task, list[PendingSend]] = {}
        self.outgoing: dict[Task, dict[Message, torch.Tensor]] = {}
        self.patches: PatchStepping | None = None  # output rank, from the first pipelined step
        if self.pipe_rank == self.plan.output_rank:
            # scheduler.step gets host timesteps and the scheduler keeps its own on the host too: schedulers compare
            # and index them (DDPM's previous_timestep, alphas_cumprod[t]), and on a device every such lookup is a
            # host/device synchronisation per patch. One copy per request instead; the math is unchanged (diffusers'
            # step already reads its coefficient tables on the host).
            self.host_timesteps = request.timesteps.cpu()
            steps_table = getattr(request.scheduler, "timesteps", None)
            if isinstance(steps_table, torch.Tensor) and steps_table.device.type != "cpu":
                request.scheduler.timesteps = steps_table.cpu()
        self.stage.begin_request(grid)
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

    @property
    def own_latents(self) -> torch.Tensor:
        """The whole latent this rank keeps: only the embedding and output ranks keep one (the others never ask)."""
        assert self.latents is not None, f"pipeline rank {self.pipe_rank} keeps no latents"
        return self.latents

    # --- shapes -------------------------------------------------------------------------------------------
    def _rows(self, patch) -> slice:
        return slice(None) if patch is None else self.grid[patch].latent_rows

    def _write_rows(self, patch, rows: torch.Tensor) -> None:
        """Store (B, C, h, W) latent rows of ``patch`` (``None``: the whole latent) in this rank's latents: only the
        patch's own pixels where a patch cut by cost shares a token row with its neighbour."""
        dest = self.own_latents[:, :, self._rows(patch)]  # (B, C, h, W), a view
        if patch is None:
            dest.copy_(rows)
        else:
            self.grid[patch].copy_pixels(dest, rows)

    def _part(self, part: int) -> BatchPart:
        return BatchPart(part, self.schedule.batch_parts, self.part_size)

    def _shape(self, m: Message) -> tuple:
        lat = self.request.latents
        rows = lat.shape[2] if m.patch is None else self.grid[m.patch].num_rows * self.grid.patch_size
        if m.kind == "latent":
            return (lat.shape[0], lat.shape[1], rows, lat.shape[3])  # (B, C, rows, W)
        if m.kind == "cache":
            return (1,)  # the step's caching decision: 1 computed, 0 skipped
        batch = self.request.model_batch if m.part is None else self.part_size
        if m.kind in self.plan.streams:  # (B_model, ...), a batch part's rows of it (an SP rank: its chunk)
            return (batch, *self.stage.stream_shape(m.kind, self.request.stream_shapes[m.kind])[1:])
        held = self.stage.hidden_tokens(None if m.patch is None else self.grid[m.patch])  # all, or an SP chunk
        hidden = (batch, held.stop - held.start, self.stage.hidden_size)  # (B_model or a part's rows, tokens, hidden)
        if m.kind == "control":  # the receiver's residuals stacked: (residuals, B, tokens, hidden)
            assert self.controls is not None
            return (len(self.controls.samples[m.dst]), *hidden)
        return hidden

    # --- communication --------------------------------------------------------------------------------------
    def _exchange(self, send_tasks: list[Task], post_tasks: list[Task]) -> None:
        group, latent_dtype = self.engine.group_ranks, self.request.latents.dtype
        hidden_dtype = self.request.hidden_dtype or latent_dtype
        sends: list[Send] = []
        send_owner: list[Task] = []
        for task in send_tasks:
            for m, tensor in self.outgoing.pop(task, {}).items():
                sends.append(Send(group[m.dst], m.channel, tensor, m.step, m.patch, m.part))
                send_owner.append(task)
        recvs: list[Recv] = []
        posted: list[Message] = []
        for task in post_tasks:
            for m in self.recv_msgs[task]:
                dtype = latent_dtype if m.kind == "latent" else hidden_dtype
                recvs.append(Recv(group[m.src], m.channel, self._shape(m), dtype, m.step, m.patch, m.part))
                posted.append(m)
        if not sends and not recvs:
            return
        assert self.engine.channels is not None  # messages flow only between ranks, and then the engine has channels
        send_handles, recv_handles = self.engine.channels.exchange(sends, recvs)
        for task, handle in zip(send_owner, send_handles, strict=True):
            self.sends.setdefault(task, []).append(handle)
        self.recvs.update(zip(posted, recv_handles, strict=True))

    def _received(self, task: Task) -> dict[Message, torch.Tensor]:
        received = {}
        for m in self.recv_msgs[task]:
            with self.span(f"recv {m.channel} from r{m.src}", COMM, step=m.step, patch=m.patch):
                received[m] = self.recvs[m].wait()
        return received

    def _release(self, task: Task) -> None:
        for m in self.recv_msgs[task]:
            self.recvs.pop(m).release()

    # --- the loop -------------------------------------------------------------------------------------------
    def execute(self, program) -> torch.Tensor | None:
        last_of_step = {t.step: t for t in self.schedule.orders[self.pipe_rank] if t.hop != COLLECT}
        prepare: int | None = None  # the pipelined step whose per-step work is due once the sends are posted
        i = 0
        while i < len(program):
            action, task = program[i]
            if prepare is not None and action not in (Action.SEND, Action.POST):
                with self.span(f"s{prepare} prepare", COMPUTE, step=prepare, prepare=True):
                    self.stage.prepare_step(self._cond(prepare))
                prepare = None
            if action in (Action.SEND, Action.POST):  # coalesce a task's sends with the next posts: one batch call
                send_tasks: list[Task] = []
                post_tasks: list[Task] = []
                while i < len(program) and program[i][0] in (Action.SEND, Action.POST):
                    (send_tasks if program[i][0] == Action.SEND else post_tasks).append(program[i][1])
                    i += 1
                self._exchange(send_tasks, post_tasks)
                continue
            if action == Action.WAIT_SEND and task in self.sends:
                with self.span("send wait", COMM, step=task.step, patch=task.patch):
                    for handle in self.sends.pop(task):
                        handle.wait()
            elif action == Action.COMPUTE:
                self._compute(task, self._received(task))
                self._release(task)
                if last_of_step.get(task.step) == task:
                    if self.request.on_progress is not None:
                        self.request.on_progress(task.step)
                    # the next step's first patch need not carry its per-step work: done here, after this task's
                    # sends, while the other ranks compute (pipelined steps: patch passes on the whole batch)
                    if self.cache is None and self.schedule.warmup_steps <= task.step + 1 < self.schedule.num_steps:
                        prepare = task.step + 1
            # WAIT_RECV is folded into COMPUTE: the buffers are waited for right before use.
            i += 1
        if self.patches is not None:  # the request's scheduler ends where serial diffusers' does
            self.patches.merge_into(self.request.scheduler)
        return self.latents if self.pipe_rank == self.plan.embed_rank else None

    def _label(self, task: Task) -> str:
        where = "whole" if task.patch is None else f"p{task.patch}"
        if task.part is not None:
            where += f" b{task.part}"  # batch part
        if task.hop == COLLECT:
            return f"s{task.step - 1} {where} collect"
        blocks = self.plan.route[task.hop].blocks
        return f"s{task.step} {where} blocks {blocks[0]}-{blocks[-1]}"

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
            self._write_rows(patch, tensor)
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
                rows = self._model_input_rows(step, patch, by_kind.get("latent"))
        elif "hidden" in by_kind:
            hidden = by_kind["hidden"][0][1]
            streams = {kind: by_kind[kind][0][1] for kind in plan.streams if kind in by_kind}
        else:
            hidden, streams = self.local.pop(Task(step, patch, task.hop - 1, task.part))
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
        with self.span(self._label(task), COMPUTE, step=step, patch=patch, hop=task.hop):
            cond = self._cond(step)  # the step's conditioning (timestep embedding): model work, once per step
            part = None if task.part is None else self._part(task.part)
            if part is not None:
                cond = self.stage.batch_part(cond, part)
            if task.hop == 0:  # (B_model or a part's rows, C, h, W) -> (same, tokens, D)
                model_input = self._transformer_input(task, rows)
                hidden = self.stage.embed(model_input, band)
                if self.controls is not None:
                    assert control is not None and control.compute is not None, "the embedding rank runs it"
                    residuals = control.compute(step, model_input, band, part, keep_kv)
                    self.controls.keep(key, residuals)
            assert hidden is not None  # embedded at hop 0; received, or kept by this rank, after it
            hidden = self._segment(task, hidden, cond, band, skips, keep_kv, streams, key, by_kind.get("cache"))
            stepped = self._step_model(task, hidden, cond, band) if last_hop else None
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
            next_rows = self._route_stepped(step, patch, stepped)
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

    def _model_input_rows(self, step: int, patch, latent_msgs) -> torch.Tensor:
        """Scaled model-input latent rows of (step, patch) on the embedding rank."""
        rows = self._rows(patch)
        if latent_msgs:  # linear: received from the output rank
            ((m, tensor),) = latent_msgs
            if m.patch is None and patch is not None:  # a whole latent after warm-up: keep it for the other patches
                self.inputs[(step, None)] = tensor.clone()
                return self.inputs[(step, None)][:, :, rows]
            return tensor
        if (step, patch) in self.inputs:  # this patch's own rows, or a whole-image step's whole latent
            return self.inputs.pop((step, patch))
        whole = self.inputs[(step, None)]  # a whole latent (step 0, or after warm-up) shared by the patches
        if patch == self.grid.num_patches - 1:
            self.inputs.pop((step, None))
        return whole[:, :, rows]

    def _transformer_input(self, task: Task, rows: torch.Tensor | None) -> torch.Tensor:
        """Embedding rank: the task's rows of the transformer input, from its (B, C, h, W) latent rows (a batch part
        after the first: ``None``, it takes its rows of the input the first part built)."""
        if task.part is None:
            assert rows is not None
            return self.request.model_input(rows, self._rows(task.patch))  # (B, C, h, W) -> (B_model, C, h, W)
        if task.part == 0:
            assert rows is not None
            self.part_input = self.request.model_input(rows, self._rows(task.patch))
        assert self.part_input is not None  # built by part 0, which runs first
        part_rows = self.part_input[self._part(task.part).rows]  # (B_model, ...) -> (part rows, ...)
        if self.schedule.is_last_part(task):
            self.part_input = None
        return part_rows

    def _step_model(self, task: Task, hidden: torch.Tensor, cond, band: PatchBand | None) -> torch.Tensor | None:
        """Output rank: output layer, guidance and ``scheduler.step`` on (step, patch); returns the stepped rows (the
        rows covering the patch: the scheduler is elementwise, and only the patch's own pixels are kept).

        A batch part of a whole-image step runs the output layer only; the last part joins the parts' outputs in
        batch order (the [uncond, cond] halves guidance combines) and steps the whole latent. ``None`` until then.
        """
        step, patch = task.step, task.patch
        req, rows = self.request, self._rows(patch)
        output = self.stage.head(hidden, cond, self.token_cols, band)  # (B_model or a part's rows, C_out, h, W)
        if task.part is not None:
            self.head_parts.append(output)
            if not self.schedule.is_last_part(task):
                return None
            output = torch.cat(self.head_parts)  # parts in batch order -> (B_model, C_out, H, W)
            self.head_parts = []
        noise = req.guide(output, step, patch)  # (B, C, h, W)
        # The host copy of the timestep: schedulers index their host-side tables with it (a device timestep would
        # make every step copy it to the host: a device synchronisation per patch).
        t = self.host_timesteps[step]
        # A copy, not a view of the latents this rank updates in place: a scheduler may keep the sample it steps
        # (UniPC's corrector reads ``last_sample`` at the next step), as diffusers' loop leaves it untouched.
        sample = self.own_latents[:, :, rows].clone()
        if patch is None:
            return req.scheduler.step(noise, t, sample, **req.extra_step_kwargs, return_dict=False)[0]
        if self.patches is None:  # the first pipelined step: the scheduler's state split per patch
            latents = self.own_latents
            self.patches = PatchStepping(req.scheduler, req.extra_step_kwargs, req.generator, latents.shape,
                                         list(self.grid), latents.device)  # fmt: skip
        return self.patches.step(patch, step, noise, t, sample)

    def _route_stepped(self, step: int, patch, stepped: torch.Tensor) -> torch.Tensor:
        """Output rank: store the stepped rows; return the next model-input rows (after the last step, the final
        latent rows)."""
        req, rows, latents = self.request, self._rows(patch), self.own_latents
        self._write_rows(patch, stepped)
        if req.on_step_end is not None and patch in (None, self.grid.num_patches - 1):
            req.on_step_end(step, latents)
        if step + 1 == len(req.timesteps):
            return latents[:, :, rows]
        if patch is None:
            scheduler = req.scheduler
        else:
            assert self.patches is not None  # split at the first pipelined step, before any patch stepped
            scheduler = self.patches.schedulers[patch]
        next_rows = _scale_model_input(scheduler, stepped, self.host_timesteps[step + 1])
        if self.plan.embed_rank == self.pipe_rank:  # folded: the next step's input stays here
            self.inputs[(step + 1, patch)] = next_rows
        return next_rows
