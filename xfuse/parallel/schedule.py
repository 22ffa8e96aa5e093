"""The PipeFusion schedule: what every rank computes, in what order, and what it sends and receives.

A pure function of (plan, steps, warm-up, patches, batch parts): no torch, no processes. Each rank's program (the
order of its posts, computes, sends and waits) and the proof that the programs match and cannot deadlock are
``xfuse.parallel.protocol``'s; the engine executes them.

A *task* is one route segment run on one patch of one step (``patch=None``: the whole image, a warm-up step).
Warm-up steps run the route on the whole image, split into *batch parts* where the transformer batch allows
(``batch_parts``): the rows of a transformer batch ([uncond, cond] under classifier-free guidance) never attend to
each other, so a whole-image step streamed through the route as P batch parts is exact and a rank runs the next
part while the route carries the previous one on (instead of idling while one rank at a time runs the whole
image). Every part of a step waits for the whole previous step: guidance and ``scheduler.step`` need all parts.
Pipelined steps stream patches continuously across steps: patch p of step s+1 enters as soon as patch p of step s
left the output layer. Each rank's order of pipelined tasks comes from a list-scheduling simulation with segment
costs proportional to their block counts and to the patch's tokens (``patch_tokens``: its rows', plus the text the
step's first patch carries; equal when not given): a free rank takes, among its ready tasks, the one nearest the
start of the route (fill before drain), and a patch enters the route no sooner than the busiest rank's work on the
previous patch after that one entered (entering faster only queues work that collides further on, on routes whose
ranks have uneven outbound and return chunks). In steady state this keeps the busiest rank busy for every degree,
placement and M >= N (tested), which the half-slot staggering rule of docs/design.md §3 aims for on folded routes.
Every segment sees its patches in (step, patch) order (a step's batch parts in order), which is what the stale K/V
semantics need: patch p of step s attends to patches < p of step s and patches > p of step s-1.

ControlNet residuals (``control_ranks``): the embedding rank runs the control model with each hop-0 task and sends
each other rank that holds a controlled block, from that task, the residuals of its blocks in one ``control``
message, received by that rank's first segment of the same (step, patch) (it keeps them for its later segments).

Linear placement ends with *collect* tasks on rank 0 (``hop=-1``): receiving the final latents from the output rank.

A cross-rank long skip is received by its consumer's task and sent by its producer rank's last task before that
(``skip_send_hops``): the producer's own task, except on balanced routes, where a skip into a lower rank's return
chunk waits for the sender's return chunk and travels with its hand-off. Messages between two ranks match in issue
order (no tags), so they must all go from one sender segment to one receiver segment.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Protocol

from xfuse.parallel.stage_plan import SkipEdge, StagePlan

COLLECT = -1  # hop of the tasks that receive the final latents on the embedding rank (linear placement)


@dataclass(frozen=True, order=True)
class Task:
    step: int
    patch: int | None  # None: the whole image
    hop: int  # route segment index, or COLLECT
    part: int | None = None  # batch part of a whole-image step streamed in parts; None: the whole batch
    request: int = 0  # which request of a stream of requests (``xfuse.parallel.request_stream``); 0 alone


@dataclass(frozen=True)
class Message:
    """One tensor moving between ranks. ``channel`` names its (kind, skip edge) stream between the two ranks."""

    kind: str  # "hidden" | "skip" | "latent" | "cache" (a step's caching decision) | "control" (ControlNet
    # residuals) | a stream of the plan ("text")
    src: int
    dst: int
    step: int  # diffusion step of the task that produces it
    patch: int | None
    block: int = -1  # producer block of a skip
    part: int | None = None  # batch part of a whole-image step (``Task.part``); None: the whole batch
    request: int = 0  # the request of the tasks that send and receive it (``Task.request``)

    @property
    def channel(self) -> str:
        return f"skip:{self.block}" if self.kind == "skip" else self.kind

    @property
    def needed_at(self) -> int:
        """The diffusion step of the task that receives it: a latent is the model input of the step after."""
        return self.step + 1 if self.kind == "latent" else self.step


@dataclass(frozen=True)
class Schedule:
    plan: StagePlan
    num_steps: int
    warmup_steps: int
    num_patches: int
    orders: dict[int, tuple[Task, ...]]  # rank -> its tasks in execution order
    times: dict[Task, tuple[float, float]]  # simulated (start, end) of every task: units of one block on a mean patch
    batch_parts: int = 1  # parts a whole-image step's transformer batch is streamed in
    step_flags: bool = False  # a step's first task hands on a one-element ``cache`` message (step caching)
    control_ranks: tuple[int, ...] = ()  # ranks (not the embedding rank) sent ControlNet residuals with each hop 0

    def first_hop(self, rank: int) -> int:
        """The route segment where ``rank`` first sees a unit (its ``control`` message arrives there)."""
        return next(hop for hop, segment in enumerate(self.plan.route) if segment.rank == rank)

    @property
    def makespan(self) -> float:
        """The simulated loop's length, in units of one block on a mean patch (no communication, no overheads)."""
        return max(end for _, end in self.times.values())

    def patches_of(self, step: int) -> tuple[int | None, ...]:
        return (None,) if step < self.warmup_steps else tuple(range(self.num_patches))

    def parts_of(self, step: int) -> tuple[int | None, ...]:
        """The batch parts of ``step``'s tasks: ``0 … P-1`` for a whole-image step split in parts, else ``None``."""
        return tuple(range(self.batch_parts)) if step < self.warmup_steps and self.batch_parts > 1 else (None,)

    def is_last_part(self, task: Task) -> bool:
        """Whether ``task`` completes its unit's batch (the whole batch, or the last part)."""
        return task.part is None or task.part == self.batch_parts - 1

    def rank_of(self, task: Task) -> int:
        return self.plan.embed_rank if task.hop == COLLECT else self.plan.route[task.hop].rank

    @functools.cached_property
    def _skips_per_hop(self) -> tuple[tuple[tuple[SkipEdge, ...], tuple[SkipEdge, ...]], ...]:
        """Per route hop: the cross-rank skips its task receives and those it sends, each by producer (the canonical
        order of ``recvs`` and ``sends``); made once, not for every task's messages."""
        edges = sorted(self.plan.cross_rank_skips, key=lambda e: e.producer)
        send_hops = skip_send_hops(self.plan)
        return tuple(
            (tuple(e for e in edges if e.consumer in segment.blocks), tuple(e for e in edges if send_hops[e] == hop))
            for hop, segment in enumerate(self.plan.route)
        )

    @functools.cached_property
    def _messages(self) -> dict[Task, tuple[list[Message], list[Message]]]:
        """Every task's (receives, sends), made once: programs and their checks ask for them at every action."""
        return {task: (self._recvs(task), self._sends(task)) for order in self.orders.values() for task in order}

    def recvs(self, task: Task) -> list[Message]:
        """Messages ``task`` needs before it runs, in the canonical order (latent, skips by producer, hidden, the
        plan's streams). The list is shared: read it, do not change it."""
        made = self._messages.get(task)
        return self._recvs(task) if made is None else made[0]

    def sends(self, task: Task) -> list[Message]:
        """Messages ``task`` produces, in the same canonical order as the receiver's ``recvs`` (a shared list)."""
        made = self._messages.get(task)
        return self._sends(task) if made is None else made[1]

    def _recvs(self, task: Task) -> list[Message]:
        plan, rank = self.plan, self.rank_of(task)
        out: list[Message] = []
        if task.hop in (0, COLLECT) and plan.output_rank != plan.embed_rank:
            prev = task.step - 1  # the latent of step `step` is produced by step `step - 1`
            if prev >= 0 and (prev >= self.warmup_steps or task.patch in (None, 0)) and task.part in (None, 0):
                # Whole-image steps send one whole latent: patch 0 of the first pipelined step (or the first batch
                # part of the next whole-image step) receives it.
                patch = task.patch if prev >= self.warmup_steps else None
                out.append(Message("latent", plan.output_rank, rank, prev, patch))
        if task.hop == COLLECT:
            return _of_request(out, task.request)
        for edge in self._skips_per_hop[task.hop][0]:
            out.append(Message("skip", edge.src_rank, rank, task.step, task.patch, edge.producer, task.part))
        if task.hop > 0 and plan.route[task.hop - 1].rank != rank:
            src = plan.route[task.hop - 1].rank
            out.append(Message("hidden", src, rank, task.step, task.patch, part=task.part))
            out.extend(Message(s, src, rank, task.step, task.patch, part=task.part) for s in self.streams_of(task))
            if self.carries_flag(task):
                out.append(Message("cache", src, rank, task.step, task.patch, part=task.part))
            if rank in self.control_ranks and task.hop == self.first_hop(rank):
                out.append(Message("control", plan.embed_rank, rank, task.step, task.patch, part=task.part))
        return _of_request(out, task.request)

    def carries_flag(self, task: Task) -> bool:
        """Whether ``task``'s hand-offs carry its step's caching decision: the step's first task (patch 0, or the
        whole image), with ``step_flags``."""
        return self.step_flags and task.patch in (None, 0) and task.part in (None, 0)

    def streams_of(self, task: Task) -> tuple[str, ...]:
        """The plan's streams a hand-off of ``task`` carries: only the step's first patch (or whole image, each of
        its batch parts carrying its own rows) owns them."""
        return self.plan.streams if task.patch in (None, 0) else ()

    def _sends(self, task: Task) -> list[Message]:
        plan, rank = self.plan, self.rank_of(task)
        if task.hop == COLLECT:
            return []
        out: list[Message] = []
        last = len(plan.route) - 1
        if task.hop == last and plan.output_rank != plan.embed_rank and self.is_last_part(task):
            out.append(Message("latent", rank, plan.embed_rank, task.step, task.patch))  # once all parts are in
        for edge in self._skips_per_hop[task.hop][1]:
            out.append(Message("skip", rank, edge.dst_rank, task.step, task.patch, edge.producer, task.part))
        if task.hop < last and plan.route[task.hop + 1].rank != rank:
            dst = plan.route[task.hop + 1].rank
            out.append(Message("hidden", rank, dst, task.step, task.patch, part=task.part))
            out.extend(Message(s, rank, dst, task.step, task.patch, part=task.part) for s in self.streams_of(task))
            if self.carries_flag(task):
                out.append(Message("cache", rank, dst, task.step, task.patch, part=task.part))
        if task.hop == 0:  # after the hand-off: a pair's messages from one task keep the receiver's order
            out.extend(
                Message("control", rank, dst, task.step, task.patch, part=task.part) for dst in self.control_ranks
            )
        return _of_request(out, task.request)


def _of_request(messages: list[Message], request: int) -> list[Message]:
    """``messages`` of request ``request`` of a stream (a request alone is request 0: unchanged)."""
    return messages if request == 0 else [dataclasses.replace(m, request=request) for m in messages]


@functools.lru_cache(maxsize=64)
def skip_send_hops(plan: StagePlan) -> dict[SkipEdge, int]:
    """The hop whose task sends each cross-rank skip: its producer rank's last segment before the consumer's.

    Linear placement: the producer's own segment (a rank has one). Balanced placement: a skip from rank a's
    outbound chunk into rank b's return chunk (b < a, see ``stage_plan``) waits on rank a until a's return chunk
    and leaves with it, so between two ranks every message goes from one sender segment to one receiver segment
    (the hand-off's, where there is one) and the pair's messages are received in the order they are sent.
    """
    hops = {}
    for edge in plan.cross_rank_skips:
        consumer = next(h for h, seg in enumerate(plan.route) if edge.consumer in seg.blocks)
        hops[edge] = max(h for h, seg in enumerate(plan.route[:consumer]) if seg.rank == edge.src_rank)
    return hops


def batch_parts(model_batch: int, degree: int, cached: bool = False) -> int:
    """How many parts a whole-image step's transformer batch is streamed in: the most, up to one per rank, that
    split ``model_batch`` rows evenly (more parts than ranks only shrink the kernels; a degree-1 run has no route
    to overlap). CFG's [uncond, cond] batch of one image: 2 parts from degree 2 on. With step caching (``cached``)
    one: a whole-image step's decision is on its whole batch, as diffusers' hook decides on one batched call
    (``xfuse.parallel.step_cache``)."""
    if cached:
        return 1
    return max(p for p in range(1, min(model_batch, degree) + 1) if model_batch % p == 0)


@dataclass(frozen=True)
class StreamShape:
    """What the simulation needs of one request of a stream: steps, whole-image (warm-up) steps streamed in
    ``batch_parts`` parts, each patch's tokens through every block (``PatchGrid.cost_tokens``), and when it arrives
    (in the simulation's units; its first task starts no sooner)."""

    num_steps: int
    warmup_steps: int
    batch_parts: int
    patch_tokens: tuple[int, ...]
    arrival: float = 0.0

    @property
    def num_patches(self) -> int:
        return len(self.patch_tokens)


def _simulate(plan: StagePlan, shapes: list[StreamShape]):
    """Event-driven list scheduling of every task of the requests ``shapes`` (one request alone, or several in
    flight: request r's tasks are ``Task.request`` r); returns per-rank orders and each task's (start, end) time, in
    units of one block on a mean patch of the first request.

    A *unit* is a request's whole-image step (or one batch part of it) or one patch of a pipelined step. The first
    segment takes, among each request's next unit, the one that can start first (the earlier request on a tie):
    so a request's units enter while an earlier one's whole-image steps or its fill and drain leave the ranks idle.
    Every later segment runs the units in the order the first segment took them, and each request's units come in
    its own stream order (its stale K/V semantics are the request's alone). Messages between two ranks match in
    issue order, so on a linear route (where the output rank sends each step's latent rows back) the first segment
    also takes the units that receive latents, and the collects of final latents, in the order they were sent.
    """
    hops = len(plan.route)
    mean_tokens = sum(shapes[0].patch_tokens) / shapes[0].num_patches
    # a patch's cost relative to a mean patch of the first request; a request's mean patch's (1.0 for the first)
    weights = [[tokens / mean_tokens for tokens in shape.patch_tokens] for shape in shapes]
    scale = [1.0] + [sum(shape.patch_tokens) / shape.num_patches / mean_tokens for shape in shapes[1:]]
    whole_parts = [list(range(shape.batch_parts)) if shape.batch_parts > 1 else [None] for shape in shapes]
    # each request's units in its stream order, its final latents' collects (linear) after them
    streams: list[list[Task]] = []
    linear = plan.output_rank != plan.embed_rank
    for r, shape in enumerate(shapes):
        warmup, steps = shape.warmup_steps, shape.num_steps
        units = [Task(s, None, 0, k, r) for s in range(warmup) for k in whole_parts[r]]
        units += [Task(s, p, 0, None, r) for s in range(warmup, steps) for p in range(shape.num_patches)]
        if linear:
            units += [
                Task(steps, p, COLLECT, None, r) for p in ((None,) if warmup == steps else range(shape.num_patches))
            ]
        streams.append(units)

    def producer(task: Task) -> Task | None:  # the last segment's task whose output is this unit's model input
        if task.step == 0:
            return None
        if task.step - 1 < shapes[task.request].warmup_steps:
            return Task(task.step - 1, None, hops - 1, whole_parts[task.request][-1], task.request)
        return Task(task.step - 1, task.patch, hops - 1, None, task.request)

    def takes_latent(task: Task) -> bool:  # receives a latent message (``Schedule.recvs``): linear routes only
        prev = task.step - 1
        warmup = shapes[task.request].warmup_steps
        return linear and prev >= 0 and (prev >= warmup or task.patch in (None, 0)) and task.part in (None, 0)

    times: dict[Task, tuple[float, float]] = {}
    orders: dict[int, list[Task]] = {r: [] for r in range(plan.degree)}
    free_at = dict.fromkeys(range(plan.degree), 0.0)
    entered: list[Task] = []  # the units as the first segment took them
    next_entry = [0] * len(shapes)  # each request's next unit to enter
    next_unit = [0] * hops  # each later segment runs the entered units in order
    latents: list[Task] = []  # linear: the latents sent back, as the producing tasks, in the order they were sent
    # A patch enters no sooner than the busiest rank can take another one (its blocks per patch after the previous
    # entry): entering faster only queues work that collides later on routes with uneven chunks.
    period = max(len(plan.blocks_of(rank)) for rank in range(plan.degree))
    last_entry: list[tuple[float, float] | None] = [None] * len(shapes)  # per request: (start, weight) of its last
    collects = sum(t.hop == COLLECT for units in streams for t in units)
    expected = (sum(len(units) for units in streams) - collects) * hops + collects  # every unit at every segment
    while len(times) < expected:
        best: tuple[tuple[float, int, int], Task] | None = None
        for hop in range(hops):
            if hop == 0:
                candidates = [streams[r][next_entry[r]] for r in range(len(shapes)) if next_entry[r] < len(streams[r])]
            elif next_unit[hop] < len(entered):
                unit = entered[next_unit[hop]]
                candidates = [Task(unit.step, unit.patch, hop, unit.part, unit.request)]
            else:
                continue
            for task in candidates:
                if hop > 0:
                    dep = times.get(Task(task.step, task.patch, hop - 1, task.part, task.request))
                else:
                    made = producer(task)
                    if made is not None and takes_latent(task) and (not latents or latents[0] != made):
                        continue  # another latent comes first on the pair's stream
                    arrival = shapes[task.request].arrival
                    dep = (arrival, arrival) if made is None else times.get(made)
                    entry = last_entry[task.request]
                    if dep is not None and task.patch is not None and task.hop == 0 and entry is not None:
                        dep = (dep[0], max(dep[1], entry[0] + period * entry[1]))
                if dep is None:
                    continue
                # Earliest start; among equals the task nearest the start of the route (fill before drain; preferring
                # the furthest instead leaves bubbles on folded routes, e.g. N=3, M=3: 33 % slower per step), then
                # the earlier request.
                key = (max(dep[1], free_at[plan.route[hop].rank]), hop, task.request)
                if best is None or key < best[0]:
                    best = (key, task)
        assert best is not None  # a unit is always ready: its dependencies come earlier in the stream
        (start, _, _), task = best
        if task.hop == COLLECT:  # the final latents arrive on the embedding rank: no compute
            cost = 0.0
            rank = plan.embed_rank
        else:
            rank = plan.route[task.hop].rank
            # A whole image costs its patches; a batch part of it its share of the batch.
            weight = weights[task.request]
            whole = shapes[task.request].num_patches * scale[task.request]
            size = whole / len(whole_parts[task.request]) if task.patch is None else weight[task.patch]
            cost = len(plan.route[task.hop].blocks) * size
        times[task] = (start, start + cost)
        if task.hop in (0, COLLECT):
            next_entry[task.request] += 1
            if takes_latent(task):
                latents.pop(0)
        if task.hop == 0:
            entered.append(task)
            if task.patch is not None:
                last_entry[task.request] = (start, weights[task.request][task.patch])
        elif task.hop > 0:
            next_unit[task.hop] += 1
        if linear and task.hop == hops - 1 and task.part in (None, whole_parts[task.request][-1]):
            latents.append(task)  # its stepped rows go back to the embedding rank
        free_at[rank] = start + cost
        orders[rank].append(task)
    return orders, times


def build_schedule(
    plan: StagePlan,
    num_steps: int,
    warmup_steps: int,
    num_patches: int,
    batch_parts: int = 1,
    patch_tokens: tuple[int, ...] | None = None,
    step_flags: bool = False,
    control_ranks: tuple[int, ...] = (),
) -> Schedule:
    """The schedule of a request: per-rank task orders for ``num_steps`` steps, the first ``warmup_steps`` whole
    (each streamed as ``batch_parts`` parts of the transformer batch, see ``batch_parts``). ``patch_tokens``: each
    patch's tokens through every block (``PatchGrid.cost_tokens``), which the simulation's costs follow; ``None``:
    patches of equal cost. ``step_flags``: each step's first task hands its caching decision on
    (``xfuse.parallel.step_cache``). ``control_ranks``: the ranks the embedding rank sends ControlNet residuals to
    with each hop-0 task (``xfuse.parallel.control``)."""
    if plan.embed_rank in control_ranks or not set(control_ranks) <= set(range(plan.degree)):
        raise ValueError(f"control_ranks must be ranks of the plan other than the embedding rank (got {control_ranks})")
    if not 0 <= warmup_steps <= num_steps or num_steps < 1:
        raise ValueError(f"need 1 <= num_steps and 0 <= warmup_steps <= num_steps (got {num_steps}, {warmup_steps})")
    if batch_parts < 1:
        raise ValueError(f"need batch_parts >= 1 (got {batch_parts})")
    if patch_tokens is not None and (len(patch_tokens) != num_patches or min(patch_tokens) < 1):
        raise ValueError(f"need one positive token count per patch (got {patch_tokens} for {num_patches} patches)")
    tokens = (1,) * num_patches if patch_tokens is None else tuple(patch_tokens)
    orders, times = _simulate(plan, [StreamShape(num_steps, warmup_steps, batch_parts, tokens)])
    return Schedule(
        plan,
        num_steps,
        warmup_steps,
        num_patches,
        {r: tuple(t) for r, t in orders.items()},
        times,
        batch_parts,
        step_flags,
        tuple(sorted(control_ranks)),
    )


class TaskGraph(Protocol):
    """What ``protocol`` and ``check_protocol`` read: a ``Schedule``, or a stream of requests'
    (``xfuse.parallel.request_stream.RequestStream``)."""

    @property
    def plan(self) -> StagePlan: ...

    @property
    def orders(self) -> dict[int, tuple[Task, ...]]: ...

    @property
    def times(self) -> dict[Task, tuple[float, float]]: ...

    def recvs(self, task: Task) -> list[Message]: ...

    def sends(self, task: Task) -> list[Message]: ...
