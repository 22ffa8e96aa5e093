"""A stream of requests through one pipeline: the schedule of several requests in flight, the next one's first
tasks entering the route while the last one's leave it (the first part of issue 59's continuous PipeFusion).

A pure function, like ``xfuse.parallel.schedule`` (whose simulation it runs on every request at once): each request
keeps its own steps, warm-up, batch parts and patch costs (its size), and its tasks and messages carry its index
(``Task.request``, ``Message.request``), so each keeps its own latents, stale K/V and step state. Every segment runs
the requests' units one request after another, each request's in its own stream order, so the stale K/V semantics
of each request are those of the request alone. Messages between two ranks still match in issue order across
requests; ``check_protocol`` runs the stream's programs as it runs one request's (matched, deadlock-free).

``overlap_gain``: what streaming recovers on the schedule alone (blocks of work, no communication) against running
the same requests one after another: the fill and drain of each request, and its warm-up steps with the other
ranks idle, shared with its neighbours' tasks. ``xfuse.perf.model.Prediction.overlap_gain`` is the model's bound on
the same thing with communication and the measured per-block costs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xfuse.parallel.schedule import Message, Schedule, StreamShape, Task, _simulate
from xfuse.parallel.stage_plan import StagePlan


@dataclass(frozen=True)
class RequestStream:
    """The schedule of requests streamed through one plan: ``requests[r]`` is request r's own ``Schedule`` (its
    messages and shape; its ``orders`` and ``times`` are its tasks within the stream), ``orders`` and ``times``
    every rank's tasks of all of them. Takes ``Schedule``'s place in ``protocol`` and ``check_protocol``."""

    plan: StagePlan
    requests: tuple[Schedule, ...]
    orders: dict[int, tuple[Task, ...]]
    times: dict[Task, tuple[float, float]]

    def recvs(self, task: Task) -> list[Message]:
        return self.requests[task.request].recvs(task)

    def sends(self, task: Task) -> list[Message]:
        return self.requests[task.request].sends(task)

    @property
    def makespan(self) -> float:
        return max(end for _, end in self.times.values())


def build_stream(plan: StagePlan, shapes: list[StreamShape], step_flags: bool = False) -> RequestStream:
    """The stream of requests ``shapes`` (in arrival order) through ``plan``."""
    if not shapes:
        raise ValueError("a stream needs at least one request")
    for r, shape in enumerate(shapes):
        if not 0 <= shape.warmup_steps <= shape.num_steps or shape.num_steps < 1 or shape.batch_parts < 1:
            raise ValueError(f"request {r}: need 1 <= num_steps, 0 <= warmup_steps <= num_steps, batch_parts >= 1")
        if not shape.patch_tokens or min(shape.patch_tokens) < 1:
            raise ValueError(f"request {r}: need one positive token count per patch (got {shape.patch_tokens})")
    orders, times = _simulate(plan, shapes)
    requests = []
    for r, shape in enumerate(shapes):
        own = {rank: tuple(t for t in order if t.request == r) for rank, order in orders.items()}
        own_times = {t: times[t] for tasks in own.values() for t in tasks}
        requests.append(Schedule(plan, shape.num_steps, shape.warmup_steps, shape.num_patches, own, own_times,
                                 shape.batch_parts, step_flags))  # fmt: skip
    return RequestStream(plan, tuple(requests), {r: tuple(o) for r, o in orders.items()}, times)


def overlap_gain(plan: StagePlan, shapes: list[StreamShape]) -> float:
    """How much sooner the requests are done as one stream than one at a time (each starting when it has arrived
    and the one before it is done): the second's makespan over the first's."""
    one_at_a_time = 0.0
    for shape in shapes:
        alone = build_stream(plan, [dataclasses.replace(shape, arrival=0.0)]).makespan
        one_at_a_time = max(one_at_a_time, shape.arrival) + alone
    return one_at_a_time / build_stream(plan, shapes).makespan
