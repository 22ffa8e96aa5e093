"""A rank's program: the order in which it posts receives, computes, issues sends and waits, and the proof that the
programs of all ranks can neither mismatch nor deadlock, on gloo and under NCCL's rules.

A pure function of the schedule (``xfuse.parallel.schedule``), like it: no tensors, no processes. The executor
(``xfuse.parallel.executor``) carries a program out; ``check_protocol`` runs every rank's program against the
others'.

**One order of messages for every rank.** Every message has one *key*, the same on both of its ends, and every rank
issues its operations (a send, or the post of a receive) in ascending key order, computing each task once the
receives it needs are posted (``message_order``). A message's key is when its sender finished producing it in the
schedule's simulated timeline, held back, where its receiver's buffers on that channel are all taken
(``max_inflight``), until its receiver consumed the message ``max_inflight`` before it; ties go to the sending rank,
then its issue order. So the operations of any two ranks, on any number of communicators, are issued in one order:
the subsequence of the one global order that they take part in. That is what NCCL asks of operations on several
communicators of one device ("issued in the same order on all ranks"), and it makes deadlock impossible under the
strictest reading of NCCL's rules that ``check_protocol(rules="nccl")`` models: every operation of a device
completes in issue order whatever its communicator (its kernels may serialise), an operation completes only once
its peer's matching operation is running, and a launch may block the host until the peer has issued the matching
operation. (The operation with the smallest key not yet complete has every earlier operation of both its ends
complete, and both ends reach it: its sender's compute needs only receives with smaller keys.) Posting receives a
fixed number of tasks ahead, as xfuse did before, issues a receive before a send that its sender's progress depends
on: under those rules the receive holds the send behind it (FLUX.2 [klein] at degree 2 stopped that way on one H100,
``docs/performance/gpu.md``), and the NCCL check finds it on every route where a launch may block, and on the linear
routes of degree >= 3 from the streams alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from xfuse.comm.batches import in_order
from xfuse.parallel.schedule import Message, Schedule, Task, TaskGraph

Item = Task | Message  # what an action of a program acts on: a task (compute, wait for its receives), or a message


class Action(str, Enum):
    """What a rank's program does next (``protocol``); a ``str`` so programs print and compare as their names."""

    POST = "post"  # post the receive of a message
    WAIT_RECV = "wait_recv"  # wait for a task's receives (the engine folds this into COMPUTE: buffers are waited
    # for before use)
    COMPUTE = "compute"
    SEND = "send"  # issue the send of a message (consecutive POSTs and SENDs go out in one coalesced call, in order)
    WAIT_SEND = "wait_send"  # wait for a send, as late as its channel's bound allows

    def __str__(self) -> str:
        return self.value


Program = list[tuple[Action, Item]]
Key = tuple[float, ...]  # an event's place in the one order (``MessageOrder``): sorts as tuples do


@dataclass(frozen=True)
class MessageOrder:
    """The one order of a task graph's events: every message's ``keys`` (the same on both its ends) and every
    task's compute key, and who produces and consumes each message."""

    keys: dict[Message, Key]
    computes: dict[Task, Key]  # (start, 1, rank, index in the rank's order)
    producer: dict[Message, Task]
    consumer: dict[Message, Task]


def message_order(graph: TaskGraph, max_inflight: int) -> MessageOrder:
    """Every message's key: ``(time, class, rank, index, src, seq)``, where (time, class, rank, index) is the later
    of its producer's end ``(end, 0, 0, 0)`` and, when the receiver's ``max_inflight`` buffers on the message's
    channel (``(src, dst, channel)``, across a stream's requests) are taken, just after the compute of the consumer
    of the message ``max_inflight`` before it on the channel; ``src`` and ``seq`` (the sender's issue index) break
    ties. A compute's key ``(start, 1, rank, index)`` sorts after the messages that arrive by its start."""
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
    computes: dict[Task, Key] = {}
    producer: dict[Message, Task] = {}
    consumer: dict[Message, Task] = {}
    for rank, order in graph.orders.items():
        for i, task in enumerate(order):
            computes[task] = (graph.times[task][0], 1, rank, i)
            if i and graph.times[order[i - 1]][0] > graph.times[task][0]:
                raise ValueError(f"rank {rank} runs {task} before {order[i - 1]}, which starts earlier")
            for m in graph.recvs(task):
                consumer[m] = task
    keys: dict[Message, Key] = {}
    channels: dict[tuple[int, int, str], list[Message]] = {}  # each channel's messages in the sender's order
    for rank in sorted(graph.orders):
        seq = 0
        for task in graph.orders[rank]:
            for m in graph.sends(task):
                producer[m] = task
                sent = channels.setdefault((m.src, m.dst, m.channel), [])
                earliest: Key = (graph.times[task][1], 0, 0, 0)
                if len(sent) >= max_inflight:  # wait for a buffer: just after the compute that releases one
                    start, _, dst, index = computes[consumer[sent[-max_inflight]]]
                    earliest = max(earliest, (start, 1, dst, index + 0.5))
                keys[m] = (*earliest, m.src, seq)
                sent.append(m)
                seq += 1
    return MessageOrder(keys, computes, producer, consumer)


def protocol(graph: TaskGraph, rank: int, max_inflight: int, order: MessageOrder | None = None) -> Program:
    """The program of ``rank``: its sends, posts and computes in the one order (``message_order``), a task's
    ``wait_recv`` right before its ``compute``, and each send waited for (``wait_send``) as late as its channel
    allows: before the compute that produces the channel's next message past ``max_inflight`` outstanding, else at
    the end. Sends are rendezvous on gloo (and for large NCCL messages with host waits): a wait holds this rank until
    its receiver posted, which in the one order is no sooner than the send, so waiting early would tie this rank to a
    receiver running late (compiling, or on a slower device); the channel's bound is the backpressure instead.
    ``order``: ``message_order(graph, max_inflight)`` where the caller has it (``check_protocol`` makes every rank's
    program from one)."""
    if order is None:
        order = message_order(graph, max_inflight)
    tasks = graph.orders[rank]
    events: list[tuple[Key, Action, Item]] = [(order.computes[t], Action.COMPUTE, t) for t in tasks]
    for task in tasks:
        events.extend((order.keys[m], Action.SEND, m) for m in graph.sends(task))
        events.extend((order.keys[m], Action.POST, m) for m in graph.recvs(task))
    events.sort(key=lambda event: event[0])
    program: Program = []
    pending: dict[tuple[int, str], list[Message]] = {}  # (dst, channel) -> sends issued, not yet waited for
    for _, action, item in events:
        if action == Action.COMPUTE:
            assert isinstance(item, Task)
            for m in graph.sends(item):  # the outputs this task adds to its channels
                outstanding = pending.setdefault((m.dst, m.channel), [])
                if len(outstanding) >= max_inflight:
                    program.append((Action.WAIT_SEND, outstanding.pop(0)))
            program += [(Action.WAIT_RECV, item), (Action.COMPUTE, item)]
        else:
            program.append((action, item))
            if action == Action.SEND:
                assert isinstance(item, Message)
                pending.setdefault((item.dst, item.channel), []).append(item)
    left = sorted((m for sends in pending.values() for m in sends), key=lambda m: order.keys[m])
    return program + [(Action.WAIT_SEND, m) for m in left]


def served_step(item: Item) -> int:
    """The latest diffusion step an action on ``item`` serves: a task's; a message's, its receiver's."""
    return item.needed_at if isinstance(item, Message) else item.step


def _steps_of(graph: TaskGraph, request: int) -> int:
    """The steps of request ``request`` of ``graph`` (a request alone is request 0)."""
    return graph.num_steps if isinstance(graph, Schedule) else graph.requests[request].num_steps  # type: ignore[attr-defined]


def stop_points(graph: TaskGraph, program: Program, request: int = 0) -> dict[int, int]:
    """Where a rank running ``program`` must know whether its request stops before step S, for every S in
    1 … num_steps - 1: the index of its first action that serves step S or a later one (``served_step``). In a
    stream of requests (``xfuse.parallel.request_stream``) each request stops on its own: its points are among its
    own actions (``request``), and the other requests' actions run on.

    A request stopped before step S runs, on every rank, the actions of the tasks of steps < S only and sends only
    the messages those tasks receive (``Message.needed_at`` < S); the actions before every rank's stop point are
    exactly those, so each rank can switch from wherever its stop point is. Every rank receives the decision for S
    from one *decider* rank, which takes it at its own stop point for S - 1 (``decision_points``): a rank that waits
    at its stop point for S then waits only on work the decider needed before its stop point for S - 1, which
    ``check_protocol`` with ``decider`` shows cannot be circular.
    """
    points: dict[int, int] = {}
    last = _steps_of(graph, request) - 1
    for i, (_, item) in enumerate(program):
        if item.request == request:
            reached = min(served_step(item), last)
            while len(points) < reached:
                points[len(points) + 1] = i
    while len(points) < last:  # (every rank has tasks in every step; kept total for any program)
        points[len(points) + 1] = len(program)
    return points


def decision_points(graph: TaskGraph, program: Program, request: int = 0) -> dict[int, int]:
    """The decider's ``program`` index at which it decides whether the request stops before step S: its stop point
    for S - 1 (its first action of the request, for S = 1), one step ahead of every rank's need."""
    points = stop_points(graph, program, request)
    first = next((i for i, (_, item) in enumerate(program) if item.request == request), len(program))
    return {stop: first if stop == 1 else points[stop - 1] for stop in points}


class ScheduleDeadlock(RuntimeError):
    pass


Op = tuple[Message, Literal["send", "recv"]]  # one side of a message
Communicator = Callable[[Message], object]  # which communicator (NCCL process group) a message travels on


def one_communicator(m: Message) -> object:
    """Every message on one communicator (and the strictest reading of NCCL's rules: every operation of a device
    completes in issue order, whatever communicator it is on)."""
    return None


def in_order_batches(ops: Sequence[Op], communicator: Communicator = one_communicator) -> list[list[Op]]:
    """How one coalesced call's operations go out as NCCL groups: ``xfuse.comm.batches.in_order``, by each
    operation's peer and communicator."""
    return in_order(ops, lambda op: (op[0].dst if op[1] == "send" else op[0].src, communicator(op[0])))


def check_protocol(
    graph: TaskGraph,
    max_inflight: int,
    *,
    rules: Literal["gloo", "nccl"] = "gloo",
    communicator: Communicator = one_communicator,
    decider: int | None = None,
    stop_at: int | dict[int, int] | None = None,
    programs: dict[int, Program] | None = None,
    batches: Callable[[Sequence[Op], Communicator], list[list[Op]]] = in_order_batches,
    launch_blocks: bool = True,
) -> None:
    """Run every rank's ``protocol`` against each other; raise ``ScheduleDeadlock`` naming what each blocked rank
    waits for if they can get stuck, or ``AssertionError`` if a pair's messages do not match or a receive would take
    more than ``max_inflight`` buffers of its channel.

    ``rules="gloo"``: each operation goes out on its own and a send completes once its receive is posted
    (rendezvous, as on gloo and for large NCCL messages). ``rules="nccl"``, NCCL's: a program's consecutive posts
    and sends are one call, cut into NCCL groups by ``batches``; each communicator has one stream per device, on
    which the groups complete in issue order (``communicator``: which one a message travels on; by default one for
    all, the strictest reading: NCCL's kernels of several communicators may serialise on a device); an operation
    completes only while its group and its peer's group are both the oldest incomplete of their streams; and a
    launch may block the host until every peer has issued the operations that match its group. Waits block the host
    under both rules (a stream-ordered wait blocks the device, and a full launch queue then the host).

    ``programs``: the ranks' programs (default: ``protocol``'s); a ``post`` or ``send`` of a task stands for every
    message of the task (the programs of the fixed look-ahead that xfuse ran before). With a ``decider`` rank, every
    other rank also waits at each of its ``stop_points`` for the decider to reach its ``decision_points`` for that
    step (in a stream: each request's); with ``stop_at`` S (in a stream: request -> S), the decider stops the
    request before step S there, and every rank then runs only what a stopped request runs (``stop_points``), the
    other requests of a stream all of theirs."""
    ranks = sorted(graph.orders)
    requests = range(1 if isinstance(graph, Schedule) else len(graph.requests))  # type: ignore[attr-defined]
    stops = {} if stop_at is None else stop_at if isinstance(stop_at, dict) else {0: stop_at}
    limits = [stops.get(request, math.inf) for request in requests]  # per request: its steps >= it do not run
    if programs is None:
        order = message_order(graph, max_inflight)
        programs = {r: protocol(graph, r, max_inflight, order) for r in ranks}

    def runs(item: Item) -> bool:  # a stopped request runs the actions of the steps before its stop only
        return served_step(item) < limits[item.request]

    def ops_of(action: Action, item: Item) -> list[Op]:
        if action not in (Action.POST, Action.SEND):
            return []
        side: Literal["send", "recv"] = "send" if action == Action.SEND else "recv"
        if isinstance(item, Message):
            return [(item, side)] if runs(item) else []
        if item.step >= limits[item.request]:
            return []
        messages = graph.sends(item) if side == "send" else graph.recvs(item)
        return [(m, side) for m in messages if runs(m)]

    gates: dict[int, dict[int, int]] = {r: {} for r in ranks}  # rank -> {its stop point: decider's index to await}
    if decider is not None:
        for request in requests:
            decided = decision_points(graph, programs[decider], request)
            for rank in ranks:
                if rank != decider:
                    for stop, point in stop_points(graph, programs[rank], request).items():
                        if stop <= limits[request]:  # once stopped, nothing further is decided
                            gates[rank][point] = max(gates[rank].get(point, 0), decided[stop])

    # Each rank's program as host steps: ("issue", the ops of one group), ("wait", ops), ("compute", task), each
    # with the program index it starts at. A call is cut where a decider's gate falls (the executor does too). Ops
    # are integer ids: message i's receive is 2 i, its send 2 i + 1 (so an op's match is id ^ 1).
    ids: dict[Message, int] = {}
    messages: list[Message] = []

    def op_ids(ops: list[Op]) -> list[int]:
        for m, _ in ops:
            if m not in ids:
                ids[m] = len(messages)
                messages.append(m)
        return [2 * ids[m] + (side == "send") for m, side in ops]

    def issues(call: list[Op], at: int) -> list[tuple[str, Any, int]]:
        groups = batches(call, communicator) if rules == "nccl" else [[op] for op in call]
        return [("issue", op_ids(group), at) for group in groups if group]

    host: dict[int, list[tuple[str, Any, int]]] = {}
    sent: dict[tuple[int, int], list[Message]] = {}  # per (src, dst): the sender's issue order
    posted: dict[tuple[int, int], list[Message]] = {}  # and the receiver's post order
    for rank in ranks:
        out: list[tuple[str, Any, int]] = []
        call: list[Op] = []
        call_at = 0
        for i, (action, item) in enumerate(programs[rank]):
            if action in (Action.POST, Action.SEND):
                if call and i in gates[rank]:
                    out += issues(call, call_at)
                    call = []
                if not call:
                    call_at = i
                for m, side in ops_of(action, item):
                    call.append((m, side))
                    (sent if side == "send" else posted).setdefault((m.src, m.dst), []).append(m)
                continue
            out += issues(call, call_at)
            call = []
            if not runs(item):
                continue
            if action == Action.WAIT_RECV:
                out.append(("wait", op_ids([(m, "recv") for m in graph.recvs(item) if runs(m)]), i))  # type: ignore[arg-type]
            elif action == Action.WAIT_SEND:
                waited = [item] if isinstance(item, Message) else graph.sends(item)
                out.append(("wait", op_ids([(m, "send") for m in waited if runs(m)]), i))
            elif action == Action.COMPUTE:
                out.append(("compute", item, i))
        host[rank] = out + issues(call, call_at)
    for pair in set(sent) | set(posted):
        assert sent.get(pair, []) == posted.get(pair, []), f"messages {pair[0]} -> {pair[1]} disagree"

    # A gate holds the first host step at or after its program index (a gated action may have no host step).
    gate_of: dict[int, dict[int, int]] = {r: {} for r in ranks}  # rank -> {host step index: decider's index}
    for rank in ranks:
        points = sorted(gates[rank].items())
        j = 0
        for index, (_, _, at) in enumerate(host[rank]):
            while j < len(points) and points[j][0] <= at:
                gate_of[rank][index] = max(gate_of[rank].get(index, 0), points[j][1])
                j += 1

    issued = bytearray(2 * len(messages))
    complete = bytearray(2 * len(messages))
    group_of: dict[int, tuple[tuple[int, object], int]] = {}  # op -> (its stream, the host step of its group)
    streams: dict[tuple[int, object], list[int]] = {}  # nccl: (rank, communicator) -> incomplete groups, oldest first
    launched: set[tuple[int, int]] = set()  # (rank, host step) of the groups issued
    pc = dict.fromkeys(ranks, 0)
    outstanding: dict[tuple[int, int, str], int] = {}  # (dst, src, channel) -> receives posted, not yet consumed

    def blocked(rank: int) -> object:
        kind, what, _ = host[rank][pc[rank]]
        need = gate_of[rank].get(pc[rank])
        if need is not None and decider is not None and pc[decider] < len(host[decider]):
            if host[decider][pc[decider]][2] < need:
                return f"the decision of rank {decider} (at its action {need})"
        if kind == "issue" and rules == "nccl" and launch_blocks and (rank, pc[rank]) in launched:
            return next((messages[op // 2] for op in what if not issued[op ^ 1]), None)
        if kind == "wait":
            return next((messages[op // 2] for op in what if not complete[op]), None)
        return None

    def settle(dirty: set[tuple[int, object]]) -> None:
        """nccl: complete what the oldest incomplete groups allow, from the streams whose oldest group is new."""
        while dirty:
            key = dirty.pop()
            queue = streams[key]
            while queue:
                group = host[key[0]][queue[0]][1]
                for op in group:
                    if not complete[op] and issued[op ^ 1]:
                        peer_stream, peer_group = group_of[op ^ 1]
                        if streams[peer_stream][:1] == [peer_group]:
                            complete[op] = complete[op ^ 1] = 1
                            dirty.add(peer_stream)  # its oldest group may be complete now
                if not all(complete[op] for op in group):
                    break
                queue.pop(0)

    progress = True
    while progress:
        progress = False
        for rank in ranks:
            while pc[rank] < len(host[rank]) and blocked(rank) is None:
                kind, what, _ = host[rank][pc[rank]]
                if kind == "issue" and (rank, pc[rank]) not in launched:
                    launched.add((rank, pc[rank]))
                    stream = (rank, communicator(messages[what[0] // 2]))
                    for op in what:
                        m = messages[op // 2]
                        if not op & 1:  # a receive
                            channel = (m.dst, m.src, m.channel)
                            outstanding[channel] = outstanding.get(channel, 0) + 1
                            assert outstanding[channel] <= max_inflight, (
                                f"rank {m.dst} posts the receive of {m} with {max_inflight} of its channel outstanding"
                            )
                        issued[op] = 1
                        group_of[op] = (stream, pc[rank])
                        if rules == "gloo" and issued[op ^ 1]:  # rendezvous: both ends are there
                            complete[op] = complete[op ^ 1] = 1
                    if rules == "nccl":
                        streams.setdefault(stream, []).append(pc[rank])
                        settle({stream})
                        progress = True
                        continue  # the launch may wait for the peers' matching operations
                elif kind == "compute":
                    for m in graph.recvs(what):
                        if runs(m):
                            outstanding[(m.dst, m.src, m.channel)] -= 1
                pc[rank] += 1
                progress = True
    stuck = {r: (host[r][pc[r]], blocked(r)) for r in ranks if pc[r] < len(host[r])}
    unfinished = sorted({key[0] for key, queue in streams.items() if queue})
    if stuck or unfinished:
        raise ScheduleDeadlock(
            "ranks wait on each other: "
            + "; ".join(f"rank {r} at its {step[0]} (action {step[2]}) waits for {m}" for r, (step, m) in stuck.items())
            + "".join(f"; rank {r} has groups that never complete" for r in unfinished if r not in stuck)
        )
