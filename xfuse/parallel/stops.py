"""Where a rank learns that a request stops: one run's cancellation, kept against the rank's program.

A request stops before a step on every rank alike (``xfuse.parallel.cancellation``: the decider decides, the others
read its answer). This file keeps, for one rank's program (``xfuse.parallel.protocol.protocol``) of one request or a
stream of them, the program indices where the decider decides and where every rank learns whether each request stops
before each step (``stop_points``, ``decision_points``), and which requests have stopped: what the executor
(``xfuse.parallel.executor``) asks before each action.
"""

from __future__ import annotations

import contextlib

from xfuse.parallel.cancellation import Cancellation
from xfuse.parallel.protocol import decision_points, stop_points
from xfuse.parallel.request_stream import RequestStream
from xfuse.parallel.schedule import Schedule
from xfuse.runtime.host_deadline import HostDeadline


def _by_index(points: dict[tuple[int, int], int]) -> dict[int, tuple[tuple[int, int], ...]]:
    """``{(request, step): program index}`` -> ``{program index: its (request, step)s, ascending}``."""
    by_index: dict[int, list[tuple[int, int]]] = {}
    for stop, index in sorted(points.items()):
        by_index.setdefault(index, []).append(stop)
    return {index: tuple(stops) for index, stops in by_index.items()}


def stop_indices(graph: Schedule | RequestStream, program, requests: int):
    """Where this rank reads (any rank) and decides (the decider) whether each request stops before each step:
    ``{program index: ((request, step), ...)}`` each (``stop_points``, ``decision_points``)."""
    reads, decides = {}, {}
    for request in range(requests):
        for stop, index in stop_points(graph, program, request).items():
            reads[(request, stop)] = index
        for stop, index in decision_points(graph, program, request).items():
            decides[(request, stop)] = index
    return _by_index(reads), _by_index(decides)


class RunStops:
    """One run's cancellation on one rank (a request alone, or each request of a stream): at which program indices
    it learns whether a request stops before a step (``reads``; ``xfuse.parallel.protocol.stop_points``), where the
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

    def runs(self, index: int, step: int, request: int = 0) -> bool:
        """Take the turn at program ``index`` (once); whether its action, which serves ``step`` of ``request``
        (``xfuse.parallel.protocol.served_step``), runs."""
        self.turn(index)
        return self.reaches(step, request)

    def reaches(self, step: int, request: int = 0) -> bool:
        """Whether ``request`` runs ``step`` (all of them, unless it stopped before this one or an earlier one)."""
        stopped = self.stopped.get(request)
        return stopped is None or step < stopped
