"""One request's run on one rank: its state between tasks, and the computation of each of its tasks.

A task (``xfuse.parallel.schedule.Task``) is one segment of the route on one patch of one step; the run gathers its
inputs (the messages it received, or what this rank's previous segment left it), runs the stage on them (``embed``,
``run_segment``, ``head``; with the ControlNet residuals its blocks add, or as step caching runs or skips it), and
routes its outputs (messages to send, or this rank's next segment). It also builds the receives and sends of its
messages, which the executor (``xfuse.parallel.executor``) posts and issues in the program's order. Each request of
a stream has its own run, so requests never share latents, messages, step caching or stage state.
"""

from __future__ import annotations

from typing import Any

import torch

from xfuse.comm.p2p import PendingRecv, PendingSend, Recv, Send
from xfuse.config import CacheConfig
from xfuse.parallel.control_routing import ControlRouting
from xfuse.parallel.patch_grid import PatchGrid
from xfuse.parallel.protocol import Action
from xfuse.parallel.rank_latents import RankLatents
from xfuse.parallel.request import DenoiseRequest
from xfuse.parallel.schedule import COLLECT, Message, Schedule, Task
from xfuse.parallel.stage import Stage
from xfuse.parallel.stage_plan import StagePlan
from xfuse.parallel.step_cache import CachedSegments, StepCache, first_pipelined_step
from xfuse.parallel.trace import COMM, COMPUTE, Tracer, null_span


class RequestRun:
    """State of one request on one rank (kept off the engine so requests never share it): its latents, the messages
    its tasks receive and send, what this rank hands its own next segment, and its step caching and ControlNet share.

    ``stage``, ``plan``, ``pipe_rank``, ``group_ranks``: the engine's (``PipeFusionEngine``); ``cache``: its step
    caching, ``None`` when every step is computed; ``messages``: each of the request's tasks' (receives, sends)."""

    def __init__(
        self,
        request: DenoiseRequest,
        grid: PatchGrid,
        schedule: Schedule,
        messages: dict,
        *,
        stage: Stage,
        plan: StagePlan,
        pipe_rank: int,
        group_ranks: list[int],
        cache: CacheConfig | None,
        tracer: Tracer | None = None,
        in_stream: bool = False,
    ):
        self.request, self.grid, self.schedule = request, grid, schedule
        self.group_ranks = group_ranks  # ``group_ranks[i]``: the global rank of pipeline rank i
        self.in_stream = in_stream  # one of several requests in flight (its labels name it)
        self.recv_msgs = {t: r for t, (r, _) in messages.items()}  # task -> messages it receives, in order
        self.send_msgs = {t: s for t, (_, s) in messages.items()}  # task -> messages it sends, in order
        self.span = tracer.span if tracer is not None else null_span
        self.plan, self.stage, self.pipe_rank = plan, stage, pipe_rank
        self.latents = RankLatents(request, grid, schedule, self.plan, self.pipe_rank)
        self.token_cols = grid.token_cols
        # (hidden, streams) handed to this same rank's next segment
        self.local: dict[Task, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.skips: dict[tuple, dict[int, torch.Tensor]] = {}  # (step, patch) -> producer block -> output
        self.conds: dict[int, Any] = {}
        self.recvs: dict[Message, PendingRecv] = {}
        self.sends: dict[Message, PendingSend] = {}  # issued, not yet waited for
        # computed, not yet issued (the one order may hold a send back past later computes: each is a tensor of its own,
        # which no later compute overwrites)
        self.outgoing: dict[Message, torch.Tensor] = {}
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
        if cache is not None:
            first = first_pipelined_step(self.schedule.num_steps, self.schedule.warmup_steps, grid.num_patches)
            self.cache = StepCache(cache, grid.num_tokens, first)
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
        return Send(self.group_ranks[m.dst], m.channel, tensor, m.step, m.patch, m.part)

    def recv(self, m: Message) -> Recv:
        dtype = self.request.latents.dtype
        if m.kind != "latent":
            dtype = self.request.hidden_dtype or dtype
        return Recv(self.group_ranks[m.src], m.channel, self._shape(m), dtype, m.step, m.patch, m.part)

    def _received(self, task: Task) -> dict[Message, torch.Tensor]:
        received = {}
        for m in self.recv_msgs[task]:
            with self.span(f"recv {m.channel} from r{m.src}", COMM, step=m.step, patch=m.patch, **self.which(task)):
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
        """A host deadline's place, (action, task) or (action, message), in words (formatted only when reported)."""
        action, item = place
        if action == Action.COMPUTE:
            return self._label(item)
        producer = next(task for task, sent in self.send_msgs.items() if item in sent)  # (a report: found when asked)
        return f"the wait for the send of {item.channel} to rank {item.dst} from {self._label(producer)}"

    def which(self, item: Task | Message) -> dict[str, int]:
        """The trace arguments that name the request of ``item`` (a task or a message): in a stream, every span of a
        request says which."""
        return {"request": item.request} if self.in_stream else {}

    def _label(self, task: Task) -> str:
        where = "whole" if task.patch is None else f"p{task.patch}"
        if task.part is not None:
            where += f" b{task.part}"  # batch part
        who = f"request {task.request} " if self.in_stream else ""
        if task.hop == COLLECT:
            return f"{who}s{task.step - 1} {where} collect"
        blocks = self.plan.route[task.hop].blocks
        return f"{who}s{task.step} {where} blocks {blocks[0]}-{blocks[-1]}"

    def conditioning(self, step: int):
        """The step's conditioning (``DenoiseRequest.conditioning``): computed once per step, the last two kept."""
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
        with self.span(self._label(task), COMPUTE, step=step, patch=patch, hop=task.hop, **self.which(task)):
            cond = self.conditioning(step)  # the step's conditioning (timestep embedding): model work, once per step
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
        self.outgoing.update(outgoing)

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
